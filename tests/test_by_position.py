"""benchmarks/by_position.py: the buckets of an eval JSON and of a run's log.json side by side, a clear stop without
them."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from dofattn.evaluate import by_position

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("by_position_script", ROOT / "benchmarks" / "by_position.py")
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)


def test_collects_eval_and_run_logs(tmp_path, capsys):
    sums = torch.tensor([[2.0] * 9, [1.0] * 9, [0.5] * 9], dtype=torch.float64)   # 10-token blocks, one block
    rows = by_position(sums, 1)
    (tmp_path / "eval.json").write_text(json.dumps({"ppl": 4.0, "teacher_ppl": 2.0, "kl": 0.5, "tokens": 9,
                                                    "seq_len": 10, "by_position": rows}))
    run = tmp_path / "run"
    run.mkdir()
    (run / "log.json").write_text(json.dumps({"evaluation": {"student_vs_teacher": 3.0, "kl": 0.4, "tokens": 9,
                                                             "seq_len": 10, "by_position": rows}}))
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    script.main([str(tmp_path / "eval.json"), str(run), "--labels", "a", "b", "--out", str(out), "--plot", str(png)])
    result = json.loads(out.read_text())
    assert result["a"]["ratio"] == 2.0 and result["b"]["ratio"] == 3.0
    assert result["b"]["by_position"]["context_to"] == [1, 3, 7, 9]
    assert result["a"]["by_position"]["ratio"] == pytest.approx([2.718281828] * 4)     # e^(2 − 1) in every bucket
    assert png.stat().st_size > 1000 and "8-9" in capsys.readouterr().out
    (tmp_path / "old.json").write_text(json.dumps({"ppl": 4.0, "teacher_ppl": 2.0, "kl": 0.5, "tokens": 9}))
    with pytest.raises(SystemExit, match="no by_position"):
        script.main([str(tmp_path / "old.json")])
    with pytest.raises(SystemExit, match="one label per input"):
        script.main([str(tmp_path / "eval.json"), "--labels", "a", "b"])
