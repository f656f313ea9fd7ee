"""benchmarks/hidden_error.py on a tiny student linearized in one layer: the layers before it match the teacher."""

import importlib.util
import json
import sys
from pathlib import Path

from dofattn.student import StudentConfig, fingerprint, linearize, save_student

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("hidden_error", ROOT / "benchmarks" / "hidden_error.py")
hidden_error = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hidden_error)


def test_error_starts_at_the_linearized_layer(tmp_path, model_dirs, corpus, monkeypatch, capsys):
    from dofattn.hf import load_model

    model, _ = load_model(str(model_dirs["llama"]))
    linearize(model, dims=[6, 6, 6], seed=0, layers=[1])
    config = StudentConfig(str(model_dirs["llama"]), "prf", [6, 6, 6], [1], 0, fingerprint(model))
    folder = save_student(model, tmp_path / "student", config)
    out = tmp_path / "hidden.json"
    monkeypatch.setattr(sys, "argv", ["hidden_error", str(folder), "--data", str(corpus), "--blocks", "2",
                                      "--seq-len", "16", "--dtype", "float32", "--out", str(out)])
    hidden_error.main()
    (row,) = json.loads(out.read_text())["students"]
    assert row["per_layer"][0] == 0.0                       # layer 0 is the teacher's own
    assert all(e > 1e-4 for e in row["per_layer"][1:]) and row["kl"] > 0
    assert abs(row["hidden_error"] - sum(row["per_layer"]) / 3) < 1e-9
    assert "wrote" in capsys.readouterr().out
