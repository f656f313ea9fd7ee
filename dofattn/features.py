"""Feature maps φ for linear attention: queries/keys [B, T, H, D] -> nonnegative features [B, T, H, M].

    fmap = make_feature_map("prf", num_heads=9, head_dim=64, dim=203, scaling=0.125, seed=0)
    phi_q, phi_k = fmap(q, "query"), fmap(k, "key")                 # [B, T, H, M] each, float32

Every map has its own parameters per head (directions, projections, weights: leading dim H); the feature dimension
M is one per layer. Kinds:

- `prf`: the paper's learned positive random features. With u = √s·x (s the layer's softmax scaling),
  φ_m(x) = exp(z_mᵀu − ‖u‖²/2 + ½·log α_m), so that φ(q)·φ(k)/M = (1/M)Σ_m α_m e^{z_mᵀu_q − ‖u_q‖²/2}
  e^{z_mᵀu_k − ‖u_k‖²/2}, an unbiased estimate of exp(s·qᵀk) when α = 1 and z ~ N(0, I). The directions z
  (init i.i.d. N(0, I), no orthogonal blocks) and log-weights log α (init 0) are trained.
- `performer`: FAVOR+: the same map with fixed orthogonal random directions (blocks of D orthonormal rows rescaled
  by chi-distributed norms) and α = 1; nothing is trained.
- `hedgehog`: φ(x) = [softmax(xW + b), softmax(−(xW + b))] with W [D, ⌈M/2⌉] (init orthogonal) and b learned;
  the second half keeps ⌊M/2⌋ entries so any M works.
- `dijiang`: φ(x) = softmax(√s·x P) with P = C·Z, C the orthonormal DCT-II matrix and Z [D, M] Gaussian
  quasi-Monte-Carlo samples (scrambled Sobol points through the normal inverse CDF). P is trainable.

Numerics (prf, performer): exponents reach ~195 on SmolLM2. Query features are shifted by their own max over m
(cancels exactly in the attention ratio, largest feature = 1). Key features are shifted by `key_shift`, one
constant per head, so the parallel and the streaming form use the same shift: it is calibrated on the first keys
seen and, in training mode, raised to the running max. A key whose exponent exceeds the shift by more than
`MAX_KEY_EXCESS` nats is capped there (only far outside the calibration range) so nothing overflows in fp32/bf16.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dofattn.errors import UserError
from dofattn.ops.prf import PRFMap
from dofattn.spec import FEATURES, estimates_kernel   # noqa: F401 (the kinds, and which estimate the kernel)

MAX_KEY_EXCESS = 30.0  # e^30 · 1e6 tokens stays far inside float32


def in_model_dtype(phi: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Features φ as a model of `dtype` hands them to the ops: 16-bit in a 16-bit model (the ops sum in float32),
    unchanged otherwise."""
    return phi.to(dtype) if dtype in (torch.bfloat16, torch.float16) else phi


class FeatureMap(nn.Module):
    """Base: one layer's map with `num_heads` heads of size `head_dim` to `dim` features."""

    kind = ""

    def __init__(self, num_heads: int, head_dim: int, dim: int, scaling: float):
        super().__init__()
        if dim < 1:
            raise UserError(f"feature dimension must be >= 1, got {dim}")
        self.num_heads, self.head_dim, self.dim, self.scaling = num_heads, head_dim, dim, float(scaling)

    @property
    def estimates_kernel(self) -> bool:
        """φ(q)·φ(k)·exp(scales) estimates exp(s·qᵀk) itself, not only the softmax's shape (`estimates_kernel`)."""
        return estimates_kernel(self.kind)

    def settled(self) -> bool:
        """Whether the map no longer moves with the keys it reads (eval mode; a PRF map's key shift calibrated): what
        a cached decode form that folds one key at a time needs."""
        return not self.training

    def prf(self) -> PRFMap | None:
        """This map's numbers for the PRF fused forms (`ops.prf.PRFMap`), or None: not a PRF map."""
        return None

    def fused_ok(self, x: torch.Tensor, role: str) -> bool:
        """Whether the one-kernel Triton features (`ops.triton.prf.prf_features`) give this call's result: never,
        but for a PRF map."""
        return False

    def forward(self, x: torch.Tensor, role: str) -> torch.Tensor:  # [B, T, H, D] -> [B, T, H, M]
        raise NotImplementedError

    def features(self, x: torch.Tensor, role: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(φ [B, T, H, M], log-scale): φ(q)·φ(k)·exp(scale_q + scale_k) is this map's kernel estimate.

        The scale is [B, T, H] for queries and [H] for keys (one constant per head, so states can be summed).
        For `prf`/`performer` the estimate is of exp(s·qᵀk) itself (the shifts and 1/M are undone); for maps
        that only approximate the softmax's shape (hedgehog, dijiang) the scale is 0 and a window hybrid learns
        a per-head gain instead.
        """
        phi = self(x, role)
        shape = phi.shape[:3] if role == "query" else phi.shape[2:3]
        return phi, phi.new_zeros(shape)

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, head_dim={self.head_dim}, dim={self.dim}, scaling={self.scaling:g}"


def _orthogonal_rows(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """[rows, cols]: stacked blocks of `cols` orthonormal rows (QR of Gaussian matrices)."""
    blocks = []
    for _ in range(math.ceil(rows / cols)):
        q, _ = torch.linalg.qr(torch.randn(cols, cols, generator=generator, dtype=torch.float64))
        blocks.append(q.T)
    return torch.cat(blocks)[:rows].float()


class PositiveRandomFeatures(FeatureMap):
    """`prf` (learned) and `performer` (fixed orthogonal FAVOR+) positive random features."""

    def __init__(self, num_heads: int, head_dim: int, dim: int, scaling: float, learned: bool = True,
                 generator: torch.Generator | None = None):
        super().__init__(num_heads, head_dim, dim, scaling)
        self.kind = "prf" if learned else "performer"
        g = generator or torch.Generator().manual_seed(0)
        if learned:
            z = torch.randn(num_heads, dim, head_dim, generator=g)
            self.directions = nn.Parameter(z)                                        # [H, M, D]
            self.log_weights = nn.Parameter(torch.zeros(num_heads, dim))             # [H, M]
        else:
            z = torch.stack([_orthogonal_rows(dim, head_dim, g) for _ in range(num_heads)])
            norms = torch.randn(num_heads, dim, head_dim, generator=g).norm(dim=-1, keepdim=True)
            self.register_buffer("directions", z * norms)                            # [H, M, D]
            self.register_buffer("log_weights", torch.zeros(num_heads, dim))         # [H, M]
        self.register_buffer("key_shift", torch.full((num_heads,), -math.inf))       # [H]
        self._calibrated: tuple | None = None      # (the key shift's storage and version, whether it is finite)
        self._prf: tuple | None = None             # (the parameters' storage and versions, their `PRFMap`)

    def exponent(self, x: torch.Tensor) -> torch.Tensor:
        """log φ before any shift: [B, T, H, D] -> [B, T, H, M], float32."""
        u = x.float() * math.sqrt(self.scaling)                                      # [B, T, H, D]
        proj = torch.einsum("bthd,hmd->bthm", u, self.directions.float())
        return proj - 0.5 * u.square().sum(-1, keepdim=True) + 0.5 * self.log_weights.float()

    def shift_calibrated(self) -> bool:
        """True if every head's key shift is finite. Read from the GPU once per change of the buffer (its version
        counter moves on every in-place write, loading included), not on every decode step: no sync per token."""
        key = (self.key_shift.data_ptr(), self.key_shift._version)
        if self._calibrated is None or self._calibrated[0] != key:
            self._calibrated = (key, bool(torch.isfinite(self.key_shift).all()))
        return self._calibrated[1]

    def settled(self) -> bool:
        return not self.training and self.shift_calibrated()

    def prf(self) -> PRFMap:
        """Directions and log-weights in float32, contiguous, and the per-head counts (M each), made again only when the
        parameters change (their version counter moves on every in-place update) or move: a decode step is
        launch-bound, so nothing is converted per token."""
        w, lw = self.directions, self.log_weights
        key = (w.data_ptr(), w._version, lw.data_ptr(), lw._version, w.dtype, lw.dtype)
        if self._prf is None or self._prf[0] != key:
            counts = torch.full((self.num_heads,), self.dim, dtype=torch.int32, device=w.device)
            self._prf = key, (w.detach().float().contiguous(), lw.detach().float().contiguous(), counts)
        return PRFMap(*self._prf[1], self.key_shift, self.scaling, self.dim)

    @torch.no_grad()
    def _update_key_shift(self, exponent: torch.Tensor) -> None:
        if torch.compiler.is_compiling() and not self.training:   # the same rule without reading a value back
            seen = exponent.amax(dim=(0, 1, 3))
            self.key_shift.copy_(torch.where(torch.isfinite(self.key_shift), self.key_shift, seen))
            return
        if self.training or not self.shift_calibrated():
            seen = exponent.amax(dim=(0, 1, 3))                                      # [H]
            self.key_shift.copy_(torch.maximum(self.key_shift, seen))

    def forward(self, x: torch.Tensor, role: str) -> torch.Tensor:
        return self.features(x, role)[0]

    def fused_ok(self, x: torch.Tensor, role: str) -> bool:
        """True when the one-kernel Triton path (`ops.triton.prf.prf_features`) gives this call's result: CUDA, no
        autograd, and for keys a calibrated key shift that this call would not move (eval mode)."""
        if not x.is_cuda or (torch.is_grad_enabled() and (x.requires_grad or self.directions.requires_grad)):
            return False
        if role != "query" and (self.training or not self.shift_calibrated()):
            return False
        from dofattn.ops import triton_available
        return triton_available()

    def features(self, x: torch.Tensor, role: str) -> tuple[torch.Tensor, torch.Tensor]:
        half_log_m = 0.5 * math.log(self.dim)
        if self.fused_ok(x, role):
            from dofattn.ops import load_triton
            phi, q_scale = load_triton()[0].prf.prf_features(self.prf(), x, role, MAX_KEY_EXCESS)
            return phi, (q_scale if role == "query" else self.key_shift - half_log_m)
        e = self.exponent(x)
        if role == "query":
            shift = e.amax(-1, keepdim=True).detach()
            return torch.exp(e - shift), shift[..., 0] - half_log_m
        self._update_key_shift(e)
        return torch.exp((e - self.key_shift[:, None]).clamp(max=MAX_KEY_EXCESS)), self.key_shift - half_log_m


class HedgehogFeatures(FeatureMap):
    """`hedgehog`: softmax of a learned projection and of its negation."""

    kind = "hedgehog"

    def __init__(self, num_heads: int, head_dim: int, dim: int, scaling: float,
                 generator: torch.Generator | None = None):
        super().__init__(num_heads, head_dim, dim, scaling)
        if dim < 2:
            raise UserError(f"hedgehog features need a dimension of at least 2, got {dim}")
        g = generator or torch.Generator().manual_seed(0)
        half = math.ceil(dim / 2)
        w = torch.stack([_orthogonal_rows(half, head_dim, g).T for _ in range(num_heads)])
        self.weight = nn.Parameter(w)                                                # [H, D, ⌈M/2⌉]
        self.bias = nn.Parameter(torch.zeros(num_heads, half))                       # [H, ⌈M/2⌉]

    def forward(self, x: torch.Tensor, role: str) -> torch.Tensor:
        u = torch.einsum("bthd,hdm->bthm", x.float(), self.weight.float()) + self.bias.float()
        rest = self.dim - u.shape[-1]
        return torch.cat([torch.softmax(u, -1), torch.softmax(-u, -1)[..., :rest]], -1)


def dct_matrix(n: int) -> torch.Tensor:
    """Orthonormal DCT-II matrix [n, n] (rows are frequencies)."""
    k = torch.arange(n, dtype=torch.float64)[:, None]
    i = torch.arange(n, dtype=torch.float64)[None, :]
    c = math.sqrt(2.0 / n) * torch.cos(math.pi * (i + 0.5) * k / n)
    c[0] /= math.sqrt(2.0)
    return c


def qmc_gaussian(dim: int, count: int, seed: int) -> torch.Tensor:
    """[dim, count] standard-normal quasi-Monte-Carlo samples (scrambled Sobol, inverse normal CDF)."""
    u = torch.quasirandom.SobolEngine(dim, scramble=True, seed=seed).draw(count, dtype=torch.float64)
    u = u.clamp(1e-6, 1 - 1e-6)
    return (math.sqrt(2.0) * torch.erfinv(2 * u - 1)).T


class DiJiangFeatures(FeatureMap):
    """`dijiang`: softmax over a DCT-rotated Gaussian quasi-Monte-Carlo projection."""

    kind = "dijiang"

    def __init__(self, num_heads: int, head_dim: int, dim: int, scaling: float, seed: int = 0):
        super().__init__(num_heads, head_dim, dim, scaling)
        c = dct_matrix(head_dim)
        p = torch.stack([c.T @ qmc_gaussian(head_dim, dim, seed * 7919 + h) for h in range(num_heads)])
        self.projection = nn.Parameter(p.float())                                    # [H, D, M]

    def forward(self, x: torch.Tensor, role: str) -> torch.Tensor:
        u = x.float() * math.sqrt(self.scaling)
        return torch.softmax(torch.einsum("bthd,hdm->bthm", u, self.projection.float()), -1)


def make_feature_map(kind: str, num_heads: int, head_dim: int, dim: int, scaling: float,
                     seed: int = 0) -> FeatureMap:
    """A fresh feature map of `kind` (one of FEATURES) for one layer."""
    g = torch.Generator().manual_seed(seed)
    if kind in ("prf", "performer"):
        return PositiveRandomFeatures(num_heads, head_dim, dim, scaling, learned=kind == "prf", generator=g)
    if kind == "hedgehog":
        return HedgehogFeatures(num_heads, head_dim, dim, scaling, generator=g)
    if kind == "dijiang":
        return DiJiangFeatures(num_heads, head_dim, dim, scaling, seed=seed)
    raise UserError(f"unknown feature map {kind!r}; use one of {', '.join(FEATURES)}")
