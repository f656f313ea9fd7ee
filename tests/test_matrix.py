"""experiments/matrix.py at toy scale: every cell runs, skipped cells say why, JSON, table and figures are written."""

import json
import os
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def test_matrix_toy_scale(tmp_path, model_dirs, corpus):
    out, table = tmp_path / "matrix.json", tmp_path / "matrix.md"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "matrix.py"), "--scale", "toy", "--model",
                           str(model_dirs["llama"]), "--data", str(corpus), "--runs", str(tmp_path / "runs"),
                           "--out", str(out), "--markdown", str(table),
                           "--figures", str(tmp_path / "fig")], capture_output=True, text=True, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    cells = {(c["row"], c["loss"]): c for c in result["cells"]}
    assert len(cells) == 15
    skipped = sorted(key for key, c in cells.items() if "skipped" in c)
    assert skipped == [("dijiang", "l2"), ("performer", "direct"), ("performer", "l2")]
    for key, cell in cells.items():
        if "skipped" not in cell:
            assert cell["teacher_ppl"] == result["teacher_ppl"] and cell["ppl"] > 1 and cell["kl"] >= 0, key
    assert cells[("dof", "softmax")]["dims"] != [] and sum(cells[("fix", "l2")]["dims"]) == 3 * 16
    assert table.read_text().startswith("| student | l2 | softmax | direct |")
    for name in ("dof", "layer-errors", "ppl"):
        assert (tmp_path / f"fig-{name}.png").stat().st_size > 1000, name
    errors = result["layer_errors"]
    assert sorted(errors) == ["dof", "dof+clip", "fix"]
    assert all(v is not None and v >= 0 for e in errors.values() for v in e["kernel_error"] + e["output_error"])
