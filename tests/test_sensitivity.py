"""experiments/layer_sensitivity.py's measurements: where attention goes, and the rank correlation."""

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_model

spec = importlib.util.spec_from_file_location(
    "layer_sensitivity", Path(__file__).resolve().parents[1] / "experiments" / "layer_sensitivity.py")
sensitivity = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sensitivity)


def test_spearman_of_monotone_and_reversed_orders():
    a = [0.3, 1.0, -2.0, 5.0, 4.0]
    assert sensitivity.spearman(a, [x ** 3 for x in a]) == pytest.approx(1.0)
    assert sensitivity.spearman(a, [-x for x in a]) == pytest.approx(-1.0)
    assert sensitivity.top(a, 2) == [3, 4]


def test_uniform_attention_profile_is_the_share_of_keys():
    """With the query projection at zero every row is uniform over its t + 1 keys: the mass on token 0, the last 4
    and the last 64 keys is 1/(t+1), min(4, t+1)/(t+1) and min(64, t+1)/(t+1), averaged over t >= start."""
    model = tiny_model("llama")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.zero_()
    T, start = 90, 10
    ids = torch.randint(3, 300, (2, T), generator=torch.Generator().manual_seed(0))
    rows = sensitivity.attention_profile(model, ids, start=start)
    t = torch.arange(start, T, dtype=torch.float64)
    expected = {"sink": (1 / (t + 1)).mean().item(), "last_4": (t.clamp(max=3) + 1).div(t + 1).mean().item(),
                "last_64": (t.clamp(max=63) + 1).div(t + 1).mean().item()}
    assert len(rows) == len(model.model.layers)
    for row in rows:
        for key, value in expected.items():
            assert row[key] == pytest.approx(value, rel=1e-5)


def test_replot_draws_the_figure_from_a_kept_json(tmp_path):
    import json
    import subprocess
    import sys

    result = {"run": "runs/fix", "restore_gain": [0.1, 0.3, 0.0], "alone": [{"kl": 0.2}, {"kl": 0.1}, {"kl": 0.0}],
              "dof": [4.0, 9.0, 2.0], "spearman": {"dof vs restore gain": 0.5}}
    (tmp_path / "s.json").write_text(json.dumps(result))
    script = Path(__file__).resolve().parents[1] / "experiments" / "layer_sensitivity.py"
    proc = subprocess.run([sys.executable, str(script), "--replot", str(tmp_path / "s.json"), "--plot",
                           str(tmp_path / "s.png")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    proc = subprocess.run([sys.executable, str(script), "--replot", str(tmp_path / "s.json")], capture_output=True,
                          text=True)
    assert proc.returncode == 2 and "--replot draws a figure: give --plot" in proc.stderr


def test_attention_dof_seeds_compares_every_pair(tmp_path):
    import json
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "experiments" / "attention_dof_seeds.py"
    layers = {"a": [10.0, 40.0, 20.0, 30.0], "b": [10.0, 40.0, 20.0, 30.0], "c": [40.0, 10.0, 30.0, 20.0]}
    for name, values in layers.items():
        (tmp_path / f"{name}.json").write_text(json.dumps({"layers": values}))
    proc = subprocess.run([sys.executable, str(script), *(str(tmp_path / f"{n}.json") for n in "abc"), "--budget", "25",
                           "--keep", "2", "--out", str(tmp_path / "out.json")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "out.json").read_text())
    same, other = result["pairs"][0], result["pairs"][1]                    # a vs b, a vs c
    assert same["dof_pearson"] == pytest.approx(1.0) and same["dims_max_abs_diff"] == 0
    assert other["dof_pearson"] == pytest.approx(-1.0) and other["dims_max_abs_diff"] == 30
    assert result["dims"][str(tmp_path / "a.json")] == [10, 40, 20, 30]
    assert result["top"][str(tmp_path / "c.json")] == [0, 2]
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "a.json")], capture_output=True, text=True)
    assert proc.returncode == 2 and "at least two" in proc.stderr
