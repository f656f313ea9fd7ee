"""A PRF feature map's numbers as its fused forms take them: the Triton kernels (`ops.triton.prf`,
`ops.triton.window.prf_ring_step`) and the CPU decode step's constants (`ops.window.prf_step_constants`).

    prf = feature_map.prf()          # a `PRFMap`, or None for a map that is not PRF (`features.FeatureMap.prf`)
    phi, q_scale = load_triton()[0].prf.prf_features(prf, q, "query", MAX_KEY_EXCESS)

The map makes it (and keeps it while its parameters do not change), so that an op never reads a module and nothing
is stored on the map from outside.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class PRFMap(NamedTuple):
    """φ_m(x) = exp(z_mᵀu − ‖u‖²/2 + ½ log α_m), u = √s·x, keys shifted by `key_shift` (`features`)."""

    directions: torch.Tensor    # [H, M, D] float32, contiguous: z
    log_weights: torch.Tensor   # [H, M] float32, contiguous: log α
    counts: torch.Tensor        # [H] int32: M per head
    key_shift: torch.Tensor     # [H]: the keys' calibrated shift (the map's buffer, read in place)
    scaling: float              # s, the layer's softmax scaling
    dim: int                    # M
