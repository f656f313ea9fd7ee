"""Degrees of freedom of each attention head's softmax kernel, and the feature-dimension allocation (Algorithm 1).

    sample = sample_points(model, blocks, samples=1024)        # one pass over the data, J points per head
    result = allocate_dims(sample, lam=2**-8, budget=64)       # DoF per head/layer -> dims per layer and head
    result.to_json()

The kernel of head h in layer l is K(x, y) = exp(s·xᵀy), s the layer's softmax scaling (1/√d). Its degrees of
freedom are estimated from J points drawn from the union of the head's queries and its kv head's keys (position
0 skipped): N(λ) = tr G(G + λI)⁻¹ with G the J×J Gram matrix.

Scale-aware λ (the default, `lam_scale="trace"`): λ is taken relative to the trace, N(λ) = tr G(G + λ·tr G·I)⁻¹,
i.e. N(λ) = Σ μᵢ/(μᵢ + λ) over the eigenvalues μ of G/tr G. Why: N depends on G and λ only through G/λ, so an
absolute λ means something different in every head. On SmolLM2 diagonal entries reach e⁵⁰, every absolute λ of
order 1 sits far below the spectrum and N(λ) = J in every head: the allocation silently becomes uniform.
Relative to the trace (J times the kernel's mean diagonal, the operator's total variance), λ is the fraction of
that variance below which a direction stops counting: a number with the same meaning in every head and model.
`lam_scale="raw"` keeps the paper's literal absolute λ for comparison.

Numerics: exponents s·xᵀy reach ~195 (float32's exp overflows at 88.7), and the raw Gram matrix spans so many
orders of magnitude that its float64 eigendecomposition returns negative eigenvalues and N > J. It is never
formed. With aᵢ = s‖xᵢ‖², G = diag(e^{a/2}) K diag(e^{a/2}) where K = exp(−s‖xᵢ − xⱼ‖²/2) is a Gaussian kernel with
unit diagonal, so N(λ) = tr K(K + Λ)⁻¹ with the diagonal Λᵢ = λ'·e^{−aᵢ} (λ' = λ·tr G or λ) computed in log
space; one float64 Cholesky factorisation of K + Λ per head gives it. Λ is floored at 1e-10 (float64 cannot
resolve the unit-diagonal K's eigenvalues below that), so 0 ≤ N ≤ J always.

Allocation: layer DoF = max over heads (a layer's heads share one feature dimension); M_l ∝ layer DoF with mean
`budget` (the total budget·L preserved exactly by largest-remainder rounding, every M_l ≥ 1); `clip` caps each M_l
at the head size (the paper's DoF+clip, which lowers the total).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm

from dofattn.errors import UserError
from dofattn.ops.softmax import attention_logits, expand_kv
from dofattn.spec import Attention

LAM_SCALES = ("trace", "raw")
RESOLUTION = 1e-10  # smallest shift on the unit-diagonal kernel: float64 cannot resolve eigenvalues below it
MAX_LOG_SHIFT = 690.0  # e^690 is finite in float64; rows shifted that far contribute exactly 0
SATURATION = 0.95   # a head whose DoF reaches this fraction of J cannot be told apart from any other
FLAT_SPREAD = 1.25  # layer DoF max/min below this: the allocation is close to uniform


# --- the estimator --------------------------------------------------------------------------------------------

def head_dof(points: torch.Tensor, scaling: float, lam: float, lam_scale: str = "trace") -> torch.Tensor:
    """DoF [...] of the kernel exp(scaling·xᵀy) on points [..., J, D], in float64.

    With a = scaling·‖x‖², G = diag(e^{a/2}) K diag(e^{a/2}), K = exp(−scaling·‖xᵢ−xⱼ‖²/2) a Gaussian kernel
    with unit diagonal, so tr G(G+λ'I)⁻¹ = tr K(K+Λ)⁻¹ with Λ = diag(λ'·e^{−a}) computed in log space.
    """
    if lam <= 0:
        raise UserError(f"--lam must be positive, got {lam}")
    if lam_scale not in LAM_SCALES:
        raise UserError(f"unknown lam scale {lam_scale!r}; use one of {', '.join(LAM_SCALES)}")
    x = points.to(torch.float64)
    sq = (x * x).sum(-1)                                                   # [..., J]
    dist2 = (sq[..., :, None] + sq[..., None, :] - 2 * x @ x.transpose(-1, -2)).clamp_min(0)
    kernel = torch.exp(-0.5 * scaling * dist2)                             # [..., J, J], unit diagonal
    log_diag = scaling * sq                                                # log G_ii
    log_lam = math.log(lam) + (torch.logsumexp(log_diag, -1, keepdim=True) if lam_scale == "trace" else 0.0)
    shift = torch.exp((log_lam - log_diag).clamp(math.log(RESOLUTION), MAX_LOG_SHIFT))  # [..., J]
    factor = torch.linalg.cholesky(kernel + torch.diag_embed(shift))
    return torch.cholesky_solve(kernel, factor).diagonal(dim1=-2, dim2=-1).sum(-1)


# --- sampling points from a model -----------------------------------------------------------------------------

def check_sample_size(samples: int, num_blocks: int, seq_len: int) -> int:
    """The number of query/key points in the data (position 0 excluded); UserError if `samples` exceeds it."""
    if num_blocks < 1 or seq_len < 2:
        raise UserError(f"--num-blocks {num_blocks} and --seq-len {seq_len}: give at least 1 block of at least 2 "
                        f"tokens (the DoF reads query/key points after the first)")
    pool = 2 * num_blocks * (seq_len - 1)
    if samples > pool:
        raise UserError(f"--points {samples} is more than the {pool} query/key points in {num_blocks} "
                        f"blocks of {seq_len} tokens; lower --points or raise --num-blocks/--seq-len")
    return pool


class PointSampler:
    """Sink for `capture`: keeps, per (layer, head), `samples` points drawn uniformly without replacement from
    the head's queries and its kv head's keys over all blocks, position 0 excluded.

    Set `offset` to the index of the first block of each batch before its forward pass.
    """

    def __init__(self, num_blocks: int, seq_len: int, samples: int, seed: int = 0):
        self.num_blocks, self.seq_len, self.samples, self.seed = num_blocks, seq_len, samples, seed
        self.pool = check_sample_size(samples, num_blocks, seq_len)  # queries and keys at positions 1..T-1
        self.offset = 0
        self.points: dict[int, torch.Tensor] = {}     # layer -> [H, J, D] float32
        self.scaling: dict[int, float] = {}
        self._where: dict[int, torch.Tensor] = {}     # layer -> [H, J, 3] (is_key, block, position)

    def _draw(self, layer: int, num_heads: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 100_003 + layer)
        idx = torch.stack([torch.randperm(self.pool, generator=gen)[: self.samples] for _ in range(num_heads)])
        per_kind = self.num_blocks * (self.seq_len - 1)
        rest = idx % per_kind
        return torch.stack([idx // per_kind, rest // (self.seq_len - 1), rest % (self.seq_len - 1) + 1], dim=-1)

    def __call__(self, inputs) -> None:                     # a `capture.AttentionInputs`
        layer, (batch, _, num_heads, head_dim) = inputs.layer, inputs.query.shape
        if layer not in self._where:
            self._where[layer] = self._draw(layer, num_heads)
            self.points[layer] = torch.zeros(num_heads, self.samples, head_dim)
            self.scaling[layer] = inputs.scaling
        where = self._where[layer]
        for h in range(num_heads):
            is_key, block, pos = where[h].unbind(-1)
            mine = (block >= self.offset) & (block < self.offset + batch)
            if not mine.any():
                continue
            b, t = block[mine] - self.offset, pos[mine]
            q = inputs.query[b, t, h]                                  # [n, D]
            k = inputs.key[b, t, inputs.kv_head(h)]                    # [n, D]
            self.points[layer][h, mine] = torch.where(is_key[mine, None].to(k.device) == 1, k, q).float().cpu()


@dataclass
class PointSample:
    """J query/key points per head of one model on one data sample; DoF for any λ without new passes."""

    points: list[torch.Tensor]   # per layer [H, J, D], float32
    scaling: list[float]         # per layer
    samples: int
    head_dim: int

    def split(self, first: int) -> tuple[PointSample, PointSample]:
        """The first `first` points per head and the rest: two disjoint uniform samples."""
        return (PointSample([p[:, :first] for p in self.points], self.scaling, first, self.head_dim),
                PointSample([p[:, first:] for p in self.points], self.scaling, self.samples - first, self.head_dim))

    def head_dof(self, lam: float, lam_scale: str = "trace", progress: bool = False) -> list[list[float]]:
        """DoF per layer and head [L][H]."""
        layers = zip(self.points, self.scaling)
        return [head_dof(p, s, lam, lam_scale).tolist()
                for p, s in tqdm(layers, total=len(self.points), desc=f"DoF at lam={lam:g}", unit="layer",
                                 disable=not progress)]


def sample_points(model, blocks: torch.Tensor, samples: int = 1024, batch_size: int = 4, seed: int = 0,
                  progress: bool = True) -> PointSample:
    """Capture queries and keys of every layer on `blocks` [N, T], keeping `samples` points per head."""
    from dofattn.model.capture import capture, run_forward

    num_blocks, seq_len = blocks.shape
    sampler = PointSampler(num_blocks, seq_len, samples, seed)
    device = next(model.parameters()).device
    with capture(model, sampler):
        for start in tqdm(range(0, num_blocks, batch_size), desc="capturing q/k", unit="batch",
                          disable=not progress):
            sampler.offset = start
            run_forward(model, blocks[start:start + batch_size].to(device))
    layers = sorted(sampler.points)
    return PointSample([sampler.points[i] for i in layers], [sampler.scaling[i] for i in layers], samples,
                       sampler.points[layers[0]].shape[-1])


# --- the DoF of the attention matrices ----------------------------------------------------------------------

def attention_dof(query: torch.Tensor, key: torch.Tensor, scaling: float, lam: float = 2.0 ** -8,
                  attention: Attention | None = None) -> torch.Tensor:
    """DoF [B, H] of each head's causal softmax attention matrix A [T, T], from queries and keys [B, T, H, D] (keys
    on the query heads), in float64. With an `attention` config (`spec.Attention`), of the part of A that its linear
    branch has to produce (`Attention.linear_pairs`: beside a window W, A[t, s] for s ≤ t − W, and not the sink's
    first S keys; the rest set to 0; rows keep their full softmax normalisation), its directions counted against
    λ·‖A‖²_F of the whole matrix, so a head with little mass beyond the window counts little (0 with none).

    The estimator above applied to A Aᵀ in place of the kernel's Gram matrix, λ trace-relative as there:
    N(λ) = Σ σᵢ² / (σᵢ² + λ·‖A‖²_F) over A's singular values σ. It counts the directions the attention pattern
    itself spans: 1/(1 + λ) for a head that puts all its mass on one key (an attention sink), T/(1 + λT) for one
    that attends each token to itself only. Where the kernel's DoF looks at the (q, k) points alone, this one sees
    where in the sequence the mass goes, so sharp, position-bound patterns (the previous token) count high.
    """
    if lam <= 0:
        raise UserError(f"λ must be positive, got {lam}")
    A = torch.softmax(attention_logits(query, key, scaling, torch.float64), -1)       # [B, H, T, T]
    T = A.shape[-1]
    total = A.square().sum((-2, -1))[..., None]                            # ‖A‖²_F [B, H, 1]: λ's scale
    if attention is not None:
        A = A.masked_fill(~attention.linear_pairs(T, A.device), 0)
    energy = torch.linalg.svdvals(A) ** 2                                  # [B, H, T]
    return (energy / (energy + lam * total)).sum(-1)


def attention_dofs(model, blocks: torch.Tensor, lam: float = 2.0 ** -8, progress: bool = True,
                   attention: Attention | None = None) -> list[list[float]]:
    """Per layer and head [L][H], the mean `attention_dof` of the model's attention over `blocks` [N, T], one block
    at a time (memory: H·T² float64 per layer); `attention` as there."""
    from dofattn.model.capture import capture, run_forward

    sums: dict[int, torch.Tensor] = {}

    def record(x) -> None:                                  # a `capture.AttentionInputs`
        key = expand_kv(x.key, x.num_heads)
        dof = attention_dof(x.query, key, x.scaling, lam, attention).sum(0).cpu()   # [H]
        sums[x.layer] = sums.get(x.layer, 0) + dof

    device = next(model.parameters()).device
    with capture(model, record):
        for block in tqdm(blocks, desc="attention DoF", unit="block", disable=not progress):
            run_forward(model, block[None].to(device))
    return [(sums[i] / len(blocks)).tolist() for i in sorted(sums)]


# --- allocation -----------------------------------------------------------------------------------------------

def allocate(weights: list[float], total: int, minimum: int = 1) -> list[int]:
    """Integers ∝ `weights` summing exactly to `total`, each ≥ `minimum` (water-filling + largest remainder)."""
    n = len(weights)
    if total < n * minimum:
        raise UserError(f"a feature budget of {total} cannot give {n} layers/heads at least {minimum} "
                        f"feature{'s' if minimum > 1 else ''} each; raise --budget")
    w = torch.tensor(weights, dtype=torch.float64).clamp_min(0)
    if w.sum() <= 0:
        w = torch.ones(n, dtype=torch.float64)
    pinned = torch.zeros(n, dtype=torch.bool)
    while True:
        free = ~pinned
        ideal = torch.full((n,), float(minimum), dtype=torch.float64)
        ideal[free] = (total - minimum * int(pinned.sum())) * w[free] / w[free].sum()
        low = free & (ideal < minimum)
        if not low.any():
            break
        pinned |= low
    dims = ideal.floor().long()
    left = total - int(dims.sum())
    order = sorted(range(n), key=lambda i: (-(ideal[i] - dims[i]).item(), i))
    for i in order[:left]:
        dims[i] += 1
    return dims.tolist()


@dataclass
class LayerDof:
    layer: int
    dof: float
    head_dof: list[float]
    dim: int
    dof_std: float = 0.0   # spread of the layer DoF over the `repeats` disjoint point sets (0 for one set)
    attention_dof: float | None = None   # `dofattn dof --attention`: the mean DoF of its attention matrices


@dataclass
class DofResult:
    """What `dofattn dof` writes to dof.json."""

    model: str = ""
    lam: float = 2**-8
    samples: int = 0
    budget: int = 0
    clip: bool = False
    lam_scale: str = "trace"
    head_dim: int = 0
    data: str = ""
    num_blocks: int = 0
    seq_len: int = 0
    repeats: int = 1
    layers: list[LayerDof] = field(default_factory=list)
    lam_search: list[dict] = field(default_factory=list)   # --lam-auto: every λ tried and its predicted error

    @property
    def dims(self) -> list[int]:
        return [layer.dim for layer in self.layers]

    def warnings(self) -> list[str]:
        """Loud conditions under which the allocation does not mean what it should."""
        out = []
        dofs = [layer.dof for layer in self.layers]
        saturated = [layer.layer for layer in self.layers if layer.dof >= SATURATION * self.samples]
        if saturated:
            out.append(f"DoF saturates (>= {SATURATION:.0%} of J = {self.samples}) in {len(saturated)} of "
                       f"{len(dofs)} layers ({spans(saturated)}): lam={self.lam:g} ({self.lam_scale}) is below "
                       f"the kernel's spectrum, so DoF only counts J; raise --lam (or use --lam-scale trace)")
        if dofs and min(dofs) > 0 and max(dofs) / min(dofs) < FLAT_SPREAD:
            out.append(f"layer DoF is flat (max/min = {max(dofs) / min(dofs):.2f}): the allocation is close to "
                       f"uniform and DoF adds nothing over fixed dims at this lam")
        return out

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "DofResult":
        raw = json.loads(text)
        # head_dims: per-head dims, in every dof.json before 2026-12-03 (that option measured flat and left)
        raw["layers"] = [LayerDof(**{k: v for k, v in layer.items() if k != "head_dims"})
                         for layer in raw.get("layers", [])]
        return cls(**raw)


def spans(items: list[int]) -> str:
    """Sorted integers as runs: [0, 1, 2, 5] -> "0-2, 5"."""
    spans, start = [], None
    for i, x in enumerate(items):
        if start is None:
            start = x
        if i + 1 == len(items) or items[i + 1] != x + 1:
            spans.append(f"{start}" if start == x else f"{start}-{x}")
            start = None
    return ", ".join(spans)


def allocate_dims(sample: PointSample, lam: float, budget: int, clip: bool = False, lam_scale: str = "trace",
                  progress: bool = False, repeats: int = 1, **meta) -> DofResult:
    """Algorithm 1: head DoF -> layer DoF (max over heads) -> dims with mean `budget` (capped if `clip`).

    repeats = R > 1 pools R estimates: the sample's points are split into R disjoint sets of J/R points (a uniform
    sample split at random is R independent uniform samples), DoF is computed on each, and the allocation uses
    the mean head DoF; each layer records the standard deviation of its DoF over the R sets.
    """
    if budget < 1:
        raise UserError(f"--budget is the mean feature dimension per layer and must be >= 1, got {budget}")
    if repeats < 1 or sample.samples % repeats or sample.samples // repeats < 2:
        raise UserError(f"--repeats {repeats} must divide the {sample.samples} points per head into sets of >= 2")
    J = sample.samples // repeats
    parts = [sample] if repeats == 1 else [
        PointSample([p[:, r * J:(r + 1) * J] for p in sample.points], sample.scaling, J, sample.head_dim)
        for r in range(repeats)]
    runs = [torch.tensor(part.head_dof(lam, lam_scale, progress), dtype=torch.float64) for part in parts]  # [L, H]
    per_run = torch.stack(runs)                                                    # [R, L, H]
    head_dof = per_run.mean(0).tolist()
    layer_std = per_run.amax(-1).std(0).tolist() if repeats > 1 else [0.0] * per_run.shape[1]
    layer_dof = [max(h) for h in head_dof]
    dims = allocate(layer_dof, budget * len(layer_dof))
    if clip:
        dims = [min(d, sample.head_dim) for d in dims]
    layers = [LayerDof(layer, layer_dof[layer], heads, dims[layer], layer_std[layer])
              for layer, heads in enumerate(head_dof)]
    return DofResult(lam=lam, samples=J, budget=budget, clip=clip, lam_scale=lam_scale, head_dim=sample.head_dim,
                     repeats=repeats, layers=layers, **meta)


# --- choosing λ --------------------------------------------------------------------------------------------------

LAM_GRID = tuple(2.0 ** -k for k in range(2, 15, 2))   # 2⁻² ... 2⁻¹⁴, trace-relative
FEATURE_POOL = 4096    # random features drawn per head and draw; larger dims draw more
HELDOUT_POINTS = 512   # points per head kept out of the DoF estimate to measure kernel error


class HeldoutAttentionError:
    """Attention error of untrained positive random features on held-out points, for any dims per layer.

    error(l, M): each held-out point attends to all of layer l's other held-out points (as keys; never to itself,
    whose exp(s·‖x‖²) would make every row one-hot) with the exact kernel and with M random features; the error is
    the total-variation distance between the two normalised rows,
    ½ Σⱼ |p̂ᵢⱼ − pᵢⱼ| ∈ [0, 1], averaged over rows, summed over heads, averaged over `draws` feature draws.
    Rows, not raw kernel values: the PRF estimate of a peaked kernel has heavy tails, so its squared error on
    kernel values is dominated by rare draws and is not even monotone in M on SmolLM2-like points. The features
    for dimension M are the first M of one fixed pool per draw (common random numbers), so dims are compared on
    the same randomness. Computed in float64 with exponents shifted per row (they reach ~195).
    """

    def __init__(self, heldout: PointSample, draws: int = 4, seed: int = 0):
        self.sample, self.draws, self.seed = heldout, draws, seed
        self._cache: dict[tuple[int, int], float] = {}

    def layer(self, layer: int, dim: int) -> float:
        key = (layer, dim)
        if key not in self._cache:
            u = self.sample.points[layer].to(torch.float64) * math.sqrt(self.sample.scaling[layer])   # [H, J, D]
            J = u.shape[1]
            self_pair = torch.eye(J, dtype=torch.bool)                             # a point never attends to itself
            exact = torch.softmax((u @ u.transpose(-1, -2)).masked_fill(self_pair, -torch.inf), -1)   # [H, J, J]
            g = torch.Generator().manual_seed(self.seed * 1009 + layer)
            total = 0.0
            for _ in range(self.draws):
                pool = max(FEATURE_POOL, dim)   # every dim up to the pool reads the same first features
                z = torch.randn(u.shape[0], pool, u.shape[-1], generator=g, dtype=torch.float64)[:, :dim]
                log_phi = u @ z.transpose(-1, -2) - 0.5 * (u * u).sum(-1, keepdim=True)   # [H, J, M]
                phi_q = torch.exp(log_phi - log_phi.amax(-1, keepdim=True))        # per-row shift: cancels
                phi_k = torch.exp(log_phi - log_phi.amax((-1, -2), keepdim=True))  # one shift for all keys
                scores = (phi_q @ phi_k.transpose(-1, -2)).masked_fill(self_pair, 0)   # [H, J, J]
                rows = scores / scores.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
                total += 0.5 * (rows - exact).abs().sum(-1).mean(-1).sum().item()
            self._cache[key] = total / self.draws
        return self._cache[key]

    def __call__(self, dims: list[int]) -> float:
        return sum(self.layer(layer, dim) for layer, dim in enumerate(dims))


def allocate_dims_auto(sample: PointSample, heldout: PointSample, budget: int, clip: bool = False,
                       repeats: int = 1, grid: tuple[float, ...] = LAM_GRID, progress: bool = False,
                       **meta) -> DofResult:
    """`allocate_dims` at the trace-relative λ from `grid` whose dims give the least held-out attention error of
    untrained random features (`HeldoutAttentionError` on `heldout`, points disjoint from `sample`). Every λ tried,
    and uniform dims for comparison, are recorded in `lam_search`."""
    error = HeldoutAttentionError(heldout)
    best, best_error, table = None, math.inf, []
    for lam in tqdm(grid, desc="λ search", unit="λ", disable=not progress):
        result = allocate_dims(sample, lam, budget, clip, "trace", False, repeats, **meta)
        value = error(result.dims)
        table.append({"lam": lam, "attention_error": value, "dims": result.dims,
                      "dof_spread": max(x.dof for x in result.layers) / min(x.dof for x in result.layers)})
        if value < best_error:
            best, best_error = result, value
    uniform = [budget] * len(sample.points)
    best.lam_search = table + [{"lam": None, "attention_error": error(uniform), "dims": uniform, "dof_spread": 1.0}]
    return best
