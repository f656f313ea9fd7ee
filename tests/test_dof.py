"""The DoF estimator against a high-precision reference, the point sampler, and the allocation."""

import json
import math
from dataclasses import dataclass

import mpmath
import pytest
import torch

from dofattn.spec import Attention
from dofattn.model.capture import AttentionInputs
from dofattn.dof import (DofResult, HeldoutAttentionError, LayerDof, PointSample, PointSampler, allocate,
                         allocate_dims, allocate_dims_auto, attention_dof, attention_dofs, head_dof, sample_points)
from dofattn.errors import UserError
from tests.conftest import tiny_model


def reference_dof(points: torch.Tensor, scaling: float, lam: float, lam_scale: str) -> float:
    """tr G (G + λ'I)⁻¹ in 80-digit arithmetic on the raw Gram matrix."""
    mpmath.mp.dps = 80
    x = points.double().tolist()
    J = len(x)
    G = mpmath.matrix(J, J)
    for i in range(J):
        for j in range(J):
            G[i, j] = mpmath.exp(mpmath.mpf(scaling) * mpmath.fsum(a * b for a, b in zip(x[i], x[j])))
    trace = mpmath.fsum(G[i, i] for i in range(J))
    shift = mpmath.mpf(lam) * trace if lam_scale == "trace" else mpmath.mpf(lam)
    inv = (G + shift * mpmath.eye(J)) ** -1
    return float(mpmath.fsum((G * inv)[i, i] for i in range(J)))


def clustered_points(J: int, D: int, seed: int, radius=(8.0, 14.0)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    centers = torch.nn.functional.normalize(torch.randn(3, D, generator=g, dtype=torch.float64), dim=-1)
    u = centers[torch.arange(J) % 3] + 0.3 * torch.randn(J, D, generator=g, dtype=torch.float64)
    r = radius[0] + (radius[1] - radius[0]) * torch.rand(J, 1, generator=g, dtype=torch.float64)
    return torch.nn.functional.normalize(u, dim=-1) * r


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("lam", [2.0 ** -4, 2.0 ** -8, 1e-3])
def test_trace_dof_matches_high_precision_reference(seed, lam):
    points = clustered_points(J=14, D=4, seed=seed)
    scaling = 0.5
    assert scaling * points.norm(dim=-1).max() ** 2 > 88  # beyond float32's exp range
    got = head_dof(points, scaling, lam, "trace").item()
    assert got == pytest.approx(reference_dof(points, scaling, lam, "trace"), rel=1e-8)


def test_raw_dof_matches_reference_at_huge_trace():
    points = clustered_points(J=12, D=4, seed=3, radius=(20.0, 28.0))
    scaling = 0.5
    log_trace = torch.logsumexp(scaling * points.square().sum(-1), 0).item()
    assert log_trace > 300  # tr G ~ e^300: far beyond float32, and its square beyond float64
    lam = math.exp(log_trace + math.log(1e-3))  # an absolute λ at 1e-3 of the trace
    got = head_dof(points, scaling, lam, "raw").item()
    assert got == pytest.approx(reference_dof(points, scaling, lam, "raw"), rel=1e-8)


def test_identical_points_have_one_degree_of_freedom_even_at_exponent_195():
    x = torch.full((32, 64), math.sqrt(195 * 8 / 64))  # s·‖x‖² = 195 with s = 1/8
    lam = 2.0 ** -8
    assert head_dof(x, 1 / 8, lam).item() == pytest.approx(1 / (1 + lam), rel=1e-12)
    x32 = x.float()
    assert torch.isfinite(head_dof(x32, 1 / 8, lam)).all()


def test_dof_bounded_by_J_and_monotone_in_lambda():
    points = torch.randn(64, 16, generator=torch.Generator().manual_seed(0)) * 6
    values = [head_dof(points, 0.25, lam).item() for lam in (1e-12, 1e-6, 2.0 ** -8, 2.0 ** -4, 1.0)]
    assert all(0 < v <= 64 for v in values)
    assert values == sorted(values, reverse=True)


def test_raw_lambda_saturates_where_trace_lambda_does_not():
    points = clustered_points(J=64, D=8, seed=5, radius=(10.0, 18.0))
    raw = head_dof(points, 8 ** -0.5, 2.0 ** -4, "raw").item()
    trace = head_dof(points, 8 ** -0.5, 2.0 ** -4, "trace").item()
    assert raw > 0.95 * 64 and trace < 0.5 * 64


def test_bad_lambda():
    with pytest.raises(UserError, match="positive"):
        head_dof(torch.randn(4, 2), 1.0, 0.0)
    with pytest.raises(UserError, match="lam scale"):
        head_dof(torch.randn(4, 2), 1.0, 0.1, "absolute")


# --- sampler ----------------------------------------------------------------------------------------------------

def coded_inputs(layer: int, offset: int, batch: int, T: int, H: int, Hkv: int) -> AttentionInputs:
    """Activations whose features name their origin: (is_key, block, position, head)."""
    b = torch.arange(offset, offset + batch)[:, None, None]
    t = torch.arange(T)[None, :, None]

    def code(kind, heads):
        h = torch.arange(heads)[None, None, :]
        parts = [torch.full((batch, T, heads), kind), b.expand(batch, T, heads), t.expand(batch, T, heads),
                 h.expand(batch, T, heads)]
        return torch.stack(parts, -1).float()

    return AttentionInputs(layer, code(0, H), code(1, Hkv), code(1, Hkv), 0.5)


def test_sampler_draws_union_of_queries_and_keys_without_position_zero():
    N, T, H, Hkv, J = 5, 9, 6, 2, 60
    sampler = PointSampler(num_blocks=N, seq_len=T, samples=J, seed=0)
    for start in (0, 3):  # two batches: 3 blocks, then 2
        sampler.offset = start
        sampler(coded_inputs(0, start, min(3, N - start), T, H, Hkv))
    points = sampler.points[0]  # [H, J, 4]
    for h in range(H):
        rows = {tuple(r) for r in points[h].long().tolist()}
        assert len(rows) == J  # without replacement
        assert all(pos >= 1 for _, _, pos, _ in rows)
        assert {kind for kind, *_ in rows} == {0, 1}
        assert all(head == (h if kind == 0 else h // (H // Hkv)) for kind, _, _, head in rows)
        assert {block for _, block, _, _ in rows} == set(range(N))


def test_sampler_rejects_more_points_than_data():
    with pytest.raises(UserError, match="more than the 16 query/key points"):
        PointSampler(num_blocks=2, seq_len=5, samples=17)


def test_sample_points_on_tiny_model_does_not_depend_on_batching():
    model = tiny_model("llama")
    blocks = torch.randint(0, 300, (4, 12), generator=torch.Generator().manual_seed(0))
    a = sample_points(model, blocks, samples=40, batch_size=3, progress=False)
    b = sample_points(model, blocks, samples=40, batch_size=2, progress=False)
    assert len(a.points) == 3 and a.points[0].shape == (4, 40, 16) and a.scaling == [0.25] * 3
    for x, y in zip(a.points, b.points):
        torch.testing.assert_close(x, y)
    dof = a.head_dof(2.0 ** -8)
    assert len(dof) == 3 and all(0 < d <= 40 for heads in dof for d in heads)


# --- the DoF of the attention matrices --------------------------------------------------------------------------

def test_attention_dof_at_its_limits():
    """A sink (every query on key 0) has 1/(1 + λ) degrees of freedom, attention to itself only T/(1 + λT); exponents
    near 200 stay finite."""
    T, D, lam = 40, 8, 2.0 ** -8
    sink_k = torch.zeros(1, T, 1, D)
    sink_k[0, 0, 0, 0] = 20.0                                            # q·k_0 = 200, every other logit 0
    q = torch.zeros(1, T, 1, D)
    q[..., 0] = 10.0
    torch.testing.assert_close(attention_dof(q, sink_k, 1.0, lam), torch.full((1, 1), 1 / (1 + lam),
                                                                               dtype=torch.float64))
    x = (14.0 * torch.nn.functional.normalize(torch.randn(1, T, 1, D, generator=torch.Generator().manual_seed(1)),
                                              dim=-1))
    own = attention_dof(x, x, 1.0, lam)                                  # q_t·k_t = 196, q_t·k_s < 196 for s ≠ t
    assert torch.isfinite(own).all() and 0.9 * T / (1 + lam * T) < own.item() <= T / (1 + lam * T) + 1e-9


def test_attention_dof_matches_the_singular_values_by_hand():
    g = torch.Generator().manual_seed(2)
    q, k = (torch.randn(2, 9, 3, 4, generator=g, dtype=torch.float64) for _ in range(2))
    dof = attention_dof(q, k, 0.5, 0.1)
    for b in range(2):
        for h in range(3):
            logits = 0.5 * q[b, :, h] @ k[b, :, h].T
            A = torch.softmax(logits.masked_fill(torch.ones(9, 9).triu(1).bool(), -torch.inf), -1)
            e = torch.linalg.svdvals(A) ** 2
            assert abs(dof[b, h].item() - (e / (e + 0.1 * e.sum())).sum().item()) < 1e-12
    assert (dof > 0).all() and (dof <= 9).all()
    with pytest.raises(UserError, match="λ must be positive"):
        attention_dof(q, k, 0.5, 0.0)


def test_attention_dof_beyond_a_window():
    """window = W counts only A[t, s] for s <= t - W, the linear part's share of a window hybrid, against λ times the
    whole matrix's energy: a sink keeps nearly 1/(1 + λ) (it loses only the first W rows), attention to the previous
    token has none beyond a window of 2, and nothing is left past W >= T; otherwise by hand."""
    T, D, lam = 40, 8, 2.0 ** -8
    sink_k = torch.zeros(1, T, 1, D)
    sink_k[0, 0, 0, 0] = 20.0
    q = torch.zeros(1, T, 1, D)
    q[..., 0] = 10.0
    far_energy = (T - 16) / T                                            # rows 16.. keep their one 1 of T
    assert attention_dof(q, sink_k, 1.0, lam, attention=Attention(window=16,
                         sink=0)).item() == pytest.approx(far_energy / (far_energy + lam))
    pos = torch.zeros(1, T, 1, T + 1)                                    # one-hot positions: q_t on k_(t-1)
    keys, queries = pos.clone(), pos.clone()
    keys[0, torch.arange(T), 0, torch.arange(T)] = 15.0
    queries[0, torch.arange(T), 0, (torch.arange(T) - 1).clamp_min(0)] = 15.0
    prev = [attention_dof(queries, keys, 1.0, lam, attention=Attention(window=w, sink=0)).item() for w in (0, 1, 2)]
    assert prev[0] > 0.9 * T / (1 + lam * T) and abs(prev[1] - prev[0]) < 1 and prev[2] < 1e-9   # row 0: itself
    assert attention_dof(q, sink_k, 1.0, lam, attention=Attention(window=T, sink=0)).item() == 0.0

    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(2, 11, 3, 4, generator=g, dtype=torch.float64) for _ in range(2))
    dof = attention_dof(q, k, 0.5, 0.1, attention=Attention(window=3, sink=0))
    for b in range(2):
        for h in range(3):
            A = torch.softmax((0.5 * q[b, :, h] @ k[b, :, h].T).masked_fill(torch.ones(11, 11).triu(1).bool(),
                                                                            -torch.inf), -1)
            far = torch.tensor([[float(s <= t - 3) for s in range(11)] for t in range(11)], dtype=torch.float64)
            e = torch.linalg.svdvals(A * far) ** 2
            assert abs(dof[b, h].item() - (e / (e + 0.1 * A.square().sum())).sum().item()) < 1e-12
    assert (dof < attention_dof(q, k, 0.5, 0.1)).all()
    with pytest.raises(UserError, match="student.window = -1: give >= 0"):
        attention_dof(q, k, 0.5, 0.1, attention=Attention(window=-1, sink=0))


def test_attention_dof_beyond_a_window_and_a_sink():
    """sink = S also leaves out the first S keys: a head on key 0 has nothing left for the linear part; otherwise
    by hand; a sink needs a window."""
    T, D, lam = 40, 8, 2.0 ** -8
    sink_k = torch.zeros(1, T, 1, D)
    sink_k[0, 0, 0, 0] = 20.0
    q = torch.zeros(1, T, 1, D)
    q[..., 0] = 10.0
    assert attention_dof(q, sink_k, 1.0, lam, attention=Attention(window=16, sink=0)).item() > 0.9
    assert attention_dof(q, sink_k, 1.0, lam, attention=Attention(window=16, sink=1)).item() < 1e-9
    g = torch.Generator().manual_seed(4)
    q, k = (torch.randn(2, 13, 3, 4, generator=g, dtype=torch.float64) for _ in range(2))
    dof = attention_dof(q, k, 0.5, 0.1, attention=Attention(window=3, sink=2))
    for b in range(2):
        for h in range(3):
            A = torch.softmax((0.5 * q[b, :, h] @ k[b, :, h].T).masked_fill(torch.ones(13, 13).triu(1).bool(),
                                                                            -torch.inf), -1)
            left = torch.tensor([[float(2 <= s <= t - 3) for s in range(13)] for t in range(13)], dtype=torch.float64)
            e = torch.linalg.svdvals(A * left) ** 2
            assert abs(dof[b, h].item() - (e / (e + 0.1 * A.square().sum())).sum().item()) < 1e-12
    assert (dof < attention_dof(q, k, 0.5, 0.1, attention=Attention(window=3, sink=0))).all()
    with pytest.raises(UserError, match="sits beside a softmax window"):
        attention_dof(q, k, 0.5, 0.1, attention=Attention(window=0, sink=2))


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox"])
def test_attention_dofs_of_a_tiny_model_per_layer_and_head(family):
    """Every layer and every query head (GQA: the kv heads repeated), the mean over the blocks."""
    model = tiny_model(family)
    blocks = torch.randint(0, 300, (3, 12), generator=torch.Generator().manual_seed(0))
    dofs = attention_dofs(model, blocks, progress=False)
    assert len(dofs) == 3 and all(len(heads) == model.config.num_attention_heads for heads in dofs)
    assert all(1 / (1 + 2.0 ** -8) - 1e-9 <= d <= 12 for heads in dofs for d in heads)
    one = attention_dofs(model, blocks[:1], progress=False)
    two = attention_dofs(model, blocks[1:], progress=False)
    torch.testing.assert_close(torch.tensor(dofs), (torch.tensor(one) + 2 * torch.tensor(two)) / 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sample_points_on_cuda_equal_cpu():
    """The model on the GPU, the sample's bookkeeping on the CPU: same points as an all-CPU run."""
    blocks = torch.randint(0, 300, (4, 12), generator=torch.Generator().manual_seed(0))
    cpu = sample_points(tiny_model("llama"), blocks, samples=40, batch_size=3, progress=False)
    gpu = sample_points(tiny_model("llama").cuda(), blocks.cuda(), samples=40, batch_size=3, progress=False)
    for x, y in zip(cpu.points, gpu.points):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


# --- allocation -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("weights,total", [([1.0, 2.0, 3.0], 64 * 3), ([5.0, 0.01, 0.01, 9.0], 10),
                                           ([1.0] * 7, 50), ([3.3, 1.1, 7.7, 2.2, 0.5], 321)])
def test_allocate_preserves_total_and_floor(weights, total):
    dims = allocate(weights, total)
    assert sum(dims) == total and min(dims) >= 1


def test_allocate_is_proportional_with_largest_remainder():
    assert allocate([1.0, 1.0, 2.0], 10) == [3, 2, 5]  # ideal 2.5, 2.5, 5: the tie goes to the first
    assert allocate([10.0, 20.0, 30.0], 6) == [1, 2, 3]
    assert allocate([1000.0, 1.0], 10) == [9, 1]  # the small one is pinned at 1, not 0


def test_allocate_rejects_budget_below_one_per_item():
    with pytest.raises(UserError, match="raise --budget"):
        allocate([1.0, 2.0, 3.0], 2)


@dataclass
class PresetSample:
    """Stands in for a PointSample whose head DoF are known."""

    dofs: list[list[float]]
    samples: int = 32
    head_dim: int = 8

    def head_dof(self, lam, lam_scale="trace", progress=False):
        return self.dofs


def preset(dofs_per_layer):
    return PresetSample([[float(d) for d in heads] for heads in dofs_per_layer])


def test_allocate_dims_uses_max_over_heads_and_keeps_budget():
    sample = preset([[1, 4], [2, 2], [8, 1]])
    result = allocate_dims(sample, lam=1e-9, budget=8, model="m")
    assert [layer.dof for layer in result.layers] == [4, 2, 8]
    assert result.dims == [7, 3, 14] and sum(result.dims) == 24
    clipped = allocate_dims(sample, lam=1e-9, budget=8, clip=True)
    assert clipped.dims == [7, 3, 8]


def test_result_json_schema_and_warnings():
    result = allocate_dims(preset([[32, 31], [32, 32]]), lam=1e-9, budget=4, model="m")
    raw = json.loads(result.to_json())
    assert {"model", "lam", "samples", "budget", "clip", "layers"} <= set(raw)
    assert set(raw["layers"][0]) == {"layer", "dof", "head_dof", "dim", "dof_std", "attention_dof"}
    assert raw["layers"][0]["attention_dof"] is None                        # only `dofattn dof --attention` fills it
    assert DofResult.from_json(result.to_json()) == result
    for layer in raw["layers"]:                                            # a file from before the field loads
        del layer["attention_dof"]
    assert DofResult.from_json(json.dumps(raw)) == result
    text = " ".join(result.warnings())
    assert "saturates" in text and "flat" in text
    spread = allocate_dims(preset([[2, 1], [16, 3]]), lam=1e-9, budget=4)
    assert spread.warnings() == []


def test_layer_dof_record():
    layer = LayerDof(0, 2.0, [1.0, 2.0], 3, [1, 2])
    assert layer.dim == 3


def test_repeats_pool_disjoint_point_sets():
    g = torch.Generator().manual_seed(0)
    points = [torch.randn(2, 24, 4, generator=g) * torch.tensor([0.3, 2.0])[:, None, None] for _ in range(3)]
    sample = PointSample(points, [0.5] * 3, 24, 4)
    pooled = allocate_dims(sample, lam=1e-3, budget=8, repeats=3)
    parts = [PointSample([p[:, 8 * r:8 * (r + 1)] for p in points], [0.5] * 3, 8, 4).head_dof(1e-3) for r in range(3)]
    per_run = torch.tensor(parts, dtype=torch.float64)                                   # [R, L, H]
    expected = per_run.mean(0).amax(-1)
    assert torch.allclose(torch.tensor([layer.dof for layer in pooled.layers], dtype=torch.float64), expected)
    assert torch.allclose(torch.tensor([layer.dof_std for layer in pooled.layers], dtype=torch.float64),
                          per_run.amax(-1).std(0))
    assert pooled.samples == 8 and pooled.repeats == 3 and sum(pooled.dims) == 24
    with pytest.raises(UserError, match="--repeats 5"):
        allocate_dims(sample, lam=1e-3, budget=8, repeats=5)


def spread_sample(J=96, seed=0):
    """Three layers of 2 heads whose point norms (and so kernel difficulty) grow with the layer."""
    g = torch.Generator().manual_seed(seed)
    return PointSample([torch.randn(2, J, 8, generator=g) * scale for scale in (0.4, 1.0, 1.6)], [8 ** -0.5] * 3,
                       J, 8)


def test_heldout_attention_error_falls_with_dims_and_grows_with_peakedness():
    error = HeldoutAttentionError(spread_sample())
    for layer in range(3):
        values = [error.layer(layer, d) for d in (4, 32, 256)]
        assert values[0] > values[1] > values[2] > 0, (layer, values)
    assert error.layer(0, 32) < error.layer(1, 32) < error.layer(2, 32) <= 2  # 2 heads, each a TV distance <= 1
    assert error([4, 4, 4]) == sum(error.layer(i, 4) for i in range(3))
    same = PointSample([torch.ones(1, 16, 4)], [0.5], 16, 4)   # identical points: every row is uniform, exactly
    assert HeldoutAttentionError(same).layer(0, 3) < 1e-12


def test_lam_auto_picks_the_least_error_and_reports_uniform():
    train, held = spread_sample(seed=1), spread_sample(seed=2)
    result = allocate_dims_auto(train, held, budget=16, grid=(2.0 ** -2, 2.0 ** -6, 2.0 ** -10))
    tried = [row for row in result.lam_search if row["lam"] is not None]
    assert [row["lam"] for row in tried] == [2.0 ** -2, 2.0 ** -6, 2.0 ** -10]
    best = min(tried, key=lambda row: row["attention_error"])
    assert result.lam == best["lam"] and result.dims == best["dims"] and sum(result.dims) == 48
    assert result.lam_search[-1]["lam"] is None and result.lam_search[-1]["dims"] == [16, 16, 16]
    assert DofResult.from_json(result.to_json()) == result


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox"])
def test_attention_dofs_equal_those_of_the_models_own_attention_weights(family):
    """The captured queries and keys (rotary, scaling, GQA) rebuild the attention the model itself computes: the DoF
    of the eager attention weights HF returns is the same."""
    model = tiny_model(family)
    model.set_attn_implementation("eager")
    blocks = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        weights = model(input_ids=blocks, output_attentions=True).attentions     # per layer [B, H, T, T]
    lam = 2.0 ** -6
    expected = []
    for A in weights:
        energy = torch.linalg.svdvals(A.to(torch.float64)) ** 2
        expected.append((energy / (energy + lam * energy.sum(-1, keepdim=True))).sum(-1).mean(0).tolist())
    torch.testing.assert_close(torch.tensor(attention_dofs(model, blocks, lam, progress=False)),
                               torch.tensor(expected), rtol=1e-4, atol=1e-4)
