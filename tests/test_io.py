"""Files written whole (`dofattn.io`): text, bytes and JSON land complete, and a failed write leaves nothing behind."""

import json

import pytest
import torch

from dofattn.io import atomic_path, staging, write_atomic, write_json


def test_text_bytes_and_json_replace_the_file_whole(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text("old")
    assert write_atomic(path, "nouveau ✓") == path and path.read_text(encoding="utf-8") == "nouveau ✓"
    write_atomic(path, b"\x00\xffbytes")
    assert path.read_bytes() == b"\x00\xffbytes"
    write_json(tmp_path / "a.json", {"x": [1, 2]}, indent=2)
    assert json.loads((tmp_path / "a.json").read_text()) == {"x": [1, 2]}
    assert (tmp_path / "a.json").read_text().startswith("{\n  ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "out.txt"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_staging(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError, match="disk full"), atomic_path(path) as tmp:
        assert tmp == staging(path) and tmp.parent == tmp_path and tmp.name.endswith(".partial")
        tmp.write_text("half")
        raise RuntimeError("disk full")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]


def test_safetensors_read_whole_or_refused_in_one_line(tmp_path):
    import torch
    from safetensors.torch import save_file

    from dofattn.errors import UserError
    from dofattn.io import read_safetensors

    path = tmp_path / "w.safetensors"
    save_file({"a": torch.arange(6.0)}, str(path), metadata={"log": "{}"})
    tensors, metadata = read_safetensors(path)
    assert torch.equal(tensors["a"], torch.arange(6.0)) and metadata == {"log": "{}"}
    data = path.read_bytes()
    for damaged in (data[:len(data) - 5], data[:6], b"not safetensors at all"):
        path.write_bytes(damaged)
        with pytest.raises(UserError, match=f"{path} is damaged .*Copy it again"):
            read_safetensors(path)
    with pytest.raises(UserError, match="missing.safetensors is missing"):
        read_safetensors(tmp_path / "missing.safetensors")


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_files_get_the_mode_of_the_users_umask(tmp_path, mask):
    """Written whole, text and safetensors alike, with the mode a new file gets under the umask (the safetensors
    writer's own is 0600, whatever the umask)."""
    import os

    from dofattn.io import save_tensors, write_atomic

    old = os.umask(mask)
    try:
        write_atomic(tmp_path / "a.json", "{}")
        save_tensors({"x": torch.zeros(2)}, tmp_path / "b.safetensors")
    finally:
        os.umask(old)
    for name in ("a.json", "b.safetensors"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~mask, name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.safetensors"]
