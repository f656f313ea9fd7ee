"""experiments/feature_curves.py on hand-written logs: interpolation in log M, the greedy allocation, refusals."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("feature_curves", ROOT / "experiments" / "feature_curves.py")
feature_curves = importlib.util.module_from_spec(spec)
spec.loader.exec_module(feature_curves)


def fake_log(path: Path, dims: list[int], losses: list[float], seed: int = 0) -> Path:
    args = {"model": "m", "data": "d", "seed": seed, "window": 64, "sink": 4, "feature": "prf", "loss": "softmax"}
    layers = {str(i): {"fixed_batch_loss": x} for i, x in enumerate(losses)}
    path.write_text(json.dumps({"args": args, "dims": dims, "layers": layers}))
    return path


def test_interpolation_is_linear_in_log_m_and_flat_outside():
    counts, losses = [16, 64], [1.0, 0.5]
    assert feature_curves.interpolate(counts, losses, 32) == pytest.approx(0.75)   # halfway in log2
    assert feature_curves.interpolate(counts, losses, 8) == 1.0
    assert feature_curves.interpolate(counts, losses, 256) == 0.5


def test_greedy_feeds_the_layer_whose_loss_falls_most():
    steep = ([16, 64], [1.0, 0.2])      # falls 0.8 over two doublings
    flat = ([16, 64], [0.3, 0.29])
    dims = feature_curves.greedy([steep, flat], 80, step=4)
    assert dims == [64, 16]             # the flat layer keeps the minimum until the steep one is saturated
    assert sum(feature_curves.greedy([steep, flat], 150, step=4)) == 150
    with pytest.raises(SystemExit, match="below the smallest"):
        feature_curves.greedy([steep, flat], 20, step=4)


def test_script_predicts_a_compared_run_and_writes_dims(tmp_path, capsys):
    a = fake_log(tmp_path / "a.json", [16, 16], [1.0, 0.3])
    b = fake_log(tmp_path / "b.json", [64, 64], [0.2, 0.29])
    c = fake_log(tmp_path / "c.json", [48, 32], [0.15, 0.3])
    out, dims = tmp_path / "curves.json", tmp_path / "dims.json"
    assert feature_curves.main([str(a), str(b), "--compare", str(c), "--out", str(out), "--dims-out", str(dims)]) == 0
    result = json.loads(out.read_text())
    between = 1.0 - 0.8 * math.log2(48 / 16) / 2   # layer 0 at 48: log2(3) of the 2 doublings from 16 to 64
    assert result["compare"][0]["predicted"] == pytest.approx(between + 0.295)
    assert result["compare"][0]["measured"] == pytest.approx(0.45)
    greedy = {g["total"]: g["dims"] for g in result["greedy"]}
    assert set(greedy) == {80} and greedy[80] == [64, 16]                # the range's ends (32, 128) are not
    from dofattn.dof import DofResult

    assert DofResult.from_json(dims.read_text()).dims == greedy[80]     # at the compared run's total


def test_script_refuses_runs_it_cannot_compare(tmp_path):
    a = fake_log(tmp_path / "a.json", [16, 16], [1.0, 0.3])
    b = fake_log(tmp_path / "b.json", [64, 64], [0.2, 0.29], seed=1)
    mixed = fake_log(tmp_path / "m.json", [16, 64], [1.0, 0.3])
    with pytest.raises(SystemExit, match="differs in seed"):
        feature_curves.main([str(a), str(b)])
    with pytest.raises(SystemExit, match="fix:M"):
        feature_curves.main([str(a), str(mixed)])
    with pytest.raises(SystemExit, match="different feature counts"):
        feature_curves.main([str(a), str(a)])
    with pytest.raises(SystemExit, match="no log.json"):
        feature_curves.main([str(a), str(tmp_path / "missing")])
