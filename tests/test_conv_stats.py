"""experiments/conv_stats.py on a tiny student with set filters: taps and shares per layer and stream."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from dofattn.spec import StudentSpec
from dofattn.model.student import attention_modules, fingerprint, linearize, save_student
from dofattn.spec import Attention

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("conv_stats", ROOT / "experiments" / "conv_stats.py")
conv_stats = importlib.util.module_from_spec(spec)
spec.loader.exec_module(conv_stats)


def student(tmp_path, model_dirs, conv=3) -> Path:
    from dofattn.model.hf import load_model

    model, _ = load_model(str(model_dirs["llama"]))
    linearize(model, [5, 12, 7], Attention(window=0, sink=0, conv=conv), seed=2, layers=[0, 2])
    if conv:
        with torch.no_grad():     # layer 2's keys: half on the token itself, a quarter on each of the two before
            attention_modules(model)[2].dofattn.conv.conv_k.copy_(torch.tensor([0.5, -0.25, 0.25])[:, None, None])
            conv_v = attention_modules(model)[2].dofattn.conv.conv_v     # the tap before: +0.2 and -0.2 in turn
            conv_v[1] = 0.2 * (1 - 2 * (torch.arange(conv_v.shape[-1]) % 2))
    config = StudentSpec(base_model=str(model_dirs["llama"]), dims=[5, 12, 7], layers=[0, 2], seed=2,
                         base=fingerprint(model), attention=Attention(feature="prf", window=0, sink=0, conv=conv))
    return save_student(model, tmp_path / "student", config)


def test_taps_and_shares(tmp_path, model_dirs, monkeypatch, capsys):
    folder = student(tmp_path, model_dirs)
    out = tmp_path / "stats.json"
    monkeypatch.setattr(sys, "argv", ["conv_stats", str(folder), "--out", str(out), "--plot",
                                      str(tmp_path / "p.png")])
    conv_stats.main()
    rows = json.loads(out.read_text())["layers"]
    assert [r["layer"] for r in rows] == [0, 2]
    assert rows[0]["q"] == rows[0]["k"] == {"taps": [1.0, 0.0, 0.0], "earlier": 0.0, "signed": [1.0, 0.0, 0.0]}
    assert rows[1]["v"] == {"taps": [1.0, 0.2, 0.0], "earlier": 0.1667, "signed": [1.0, 0.0, 0.0]}   # no shared shape
    assert rows[1]["k"] == {"taps": [0.5, 0.25, 0.25], "earlier": 0.5, "signed": [0.5, -0.25, 0.25]}
    assert (tmp_path / "p.png").stat().st_size > 0
    assert "layer  2" in capsys.readouterr().out


def test_a_student_without_filters_is_refused(tmp_path, model_dirs, monkeypatch):
    folder = student(tmp_path, model_dirs, conv=0)
    monkeypatch.setattr(sys, "argv", ["conv_stats", str(folder)])
    with pytest.raises(SystemExit, match="has no convolutions"):
        conv_stats.main()
