"""Figures written next to the JSON results (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

from dofattn.dof import DofResult


def plot_dof(result: DofResult, path: str | Path) -> None:
    """Two panels over layers: DoF (heads as points, layer max as a line) and the allocated dims (bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = [layer.layer for layer in result.layers]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, constrained_layout=True)
    for layer in result.layers:
        top.scatter([layer.layer] * len(layer.head_dof), layer.head_dof, s=12, color="tab:blue", alpha=0.5,
                    label="head" if layer.layer == 0 else None)
    top.plot(layers, [layer.dof for layer in result.layers], color="tab:red", marker="o", ms=3,
             label="layer (max over heads)")
    top.set_ylabel("degrees of freedom")
    top.set_title(f"{result.model}: DoF at λ={result.lam:g} ({result.lam_scale}), J={result.samples}")
    top.legend(loc="upper right", fontsize=8)

    bottom.bar(layers, result.dims, color="tab:green", label="layer dim")
    bottom.axhline(result.budget, color="black", lw=1, ls="--", label=f"uniform budget {result.budget}")
    for layer in result.layers:
        bottom.scatter([layer.layer] * len(layer.head_dims), layer.head_dims, s=8, color="black", alpha=0.4,
                       label="per-head dims" if layer.layer == 0 else None)
    bottom.set_xlabel("layer")
    bottom.set_ylabel("feature dimension")
    bottom.legend(loc="upper right", fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_layer_errors(errors: dict, path: str | Path, title: str = "") -> None:
    """Per-layer attention-output error and L2 kernel error (layers without a value are left empty)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in ("output_error", "kernel_error") if any(v is not None for v in errors.get(k, []))]
    fig, axes = plt.subplots(len(keys) or 1, 1, figsize=(9, 3 * max(len(keys), 1)), sharex=True,
                             constrained_layout=True, squeeze=False)
    labels = {"output_error": "attention output error (relative)", "kernel_error": "L2 kernel error (row-scaled)"}
    for ax, key in zip(axes[:, 0], keys):
        values = errors[key]
        ax.bar([i for i, v in enumerate(values) if v is not None], [v for v in values if v is not None])
        ax.set_ylabel(labels[key])
    axes[-1, 0].set_xlabel("layer")
    axes[0, 0].set_title(title)
    fig.savefig(path, dpi=120)
    plt.close(fig)
