"""experiments/gate_stats.py on a tiny gated student: one row per gated layer, half-lives as the gates set them."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from dofattn.spec import StudentSpec
from dofattn.model.student import attention_modules, fingerprint, linearize, save_student
from dofattn.spec import Attention

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gate_stats", ROOT / "experiments" / "gate_stats.py")
gate_stats = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gate_stats)


def gated_student(tmp_path, model_dirs, gate=True) -> Path:
    from dofattn.model.hf import load_model

    model, _ = load_model(str(model_dirs["llama"]))
    linearize(model, [5, 12, 7], Attention(window=0, sink=0,
              decay="gate" if gate else "head" if not gate else "none"), seed=2, layers=[0, 2])
    if gate:
        with torch.no_grad():   # layer 2: every token clears the state (the floor); layer 0: the decay alone
            attention_modules(model)[2].dofattn.decay.decay_rate.fill_(10.0)
    config = StudentSpec(base_model=str(model_dirs["llama"]), dims=[5, 12, 7], layers=[0, 2], seed=2,
                         base=fingerprint(model), attention=Attention(feature="prf", window=0, sink=0,
                                                                      decay="gate" if gate else "head"))
    return save_student(model, tmp_path / "student", config)


def test_rows_per_gated_layer(tmp_path, model_dirs, corpus, monkeypatch, capsys):
    folder = gated_student(tmp_path, model_dirs)
    out = tmp_path / "stats.json"
    monkeypatch.setattr(sys, "argv", ["gate_stats", str(folder), "--data", str(corpus), "--blocks", "2",
                                      "--seq-len", "16", "--dtype", "float32", "--out", str(out)])
    gate_stats.main()
    rows = json.loads(out.read_text())["layers"]
    assert [r["layer"] for r in rows] == [0, 2]
    for r in rows:
        q = list(r["quantiles"].values())
        assert q == sorted(q)
    # layer 0 at its start: each head's half-life is its decay rate's, the same for every token
    start = rows[0]["rates_alone"]
    assert min(start) == pytest.approx(math.log(2) * 2 ** 8, rel=1e-3) and rows[0]["below_1"] == 0
    assert rows[0]["quantiles"]["0.05"] == pytest.approx(min(start), rel=1e-3)
    # layer 2: log g at the floor, -30, for every token: a half-life of ln 2 / 30
    assert rows[1]["below_1"] == 1 and rows[1]["quantiles"]["0.5"] == pytest.approx(math.log(2) / 30, rel=1e-4)
    assert "wrote" in capsys.readouterr().out


def test_refuses_a_student_without_gates(tmp_path, model_dirs, corpus, monkeypatch):
    folder = gated_student(tmp_path, model_dirs, gate=False)
    monkeypatch.setattr(sys, "argv", ["gate_stats", str(folder), "--data", str(corpus), "--blocks", "1",
                                      "--seq-len", "16", "--dtype", "float32"])
    with pytest.raises(SystemExit, match="no gated layers"):
        gate_stats.main()
