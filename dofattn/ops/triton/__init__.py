"""dofattn's Triton kernels (CUDA), one module per op; each agrees with its PyTorch spec (`ops/naive.py`,
`ops/window.py`, `features.py`) and is tested against it.

    common   what the kernels share: dot precisions and dtypes, the scan's block plan, tile sizes, interpreting()
    scan     causal linear attention for prefill and training (forward and backward, decay or gate) and its
             decode step: `triton_linear_attention`, `triton_decode_step`
    prf      the PRF feature map and a PRF layer's decode step in one kernel: `prf_features`, `prf_decode_step`
    window   the sliding-window hybrid's prefill (forward and backward, attention sink) and its static decode step
             on a ring of W keys: `window_forward`, `prf_ring_step`

Triton is imported here, and this package is imported only on first use (`ops.load_triton`), so importing dofattn
never needs Triton. Callers reach the ops through their modules (`load_triton()[0].window.window_forward`).
"""

from dofattn.ops.triton import common, prf, scan, window  # noqa: F401
