"""Figures written next to the JSON results (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

from dofattn.dof import DofResult


def save(fig, path: str | Path) -> None:
    """Write `fig` to `path` (its folder made if missing), whole: under a staging name, then moved into place."""
    from dofattn.io import atomic_path

    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format=Path(path).suffix.lstrip(".").lower() or "png")


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
    bottom.set_xlabel("layer")
    bottom.set_ylabel("feature dimension")
    bottom.legend(loc="upper right", fontsize=8)
    save(fig, path)
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
    save(fig, path)
    plt.close(fig)


def plot_by_position(runs: dict[str, dict], path: str | Path, title: str = "") -> None:
    """Per student (`{label: evaluate.by_position(...)}`), over the context length of each bucket (log scale, at
    the bucket's geometric middle): its perplexity over the teacher's, and its KL to the teacher."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, constrained_layout=True)
    for label, rows in runs.items():
        x = [(a * b) ** 0.5 for a, b in zip(rows["context_from"], rows["context_to"])]
        top.plot(x, rows["ratio"], marker="o", ms=3, label=label)
        bottom.plot(x, rows["kl"], marker="o", ms=3, label=label)
    top.axhline(1.0, color="black", lw=1, ls="--")
    top.set_ylabel("perplexity / teacher's")
    bottom.set_ylabel("KL(teacher || student)")
    bottom.set_xlabel("tokens of context the prediction sees")
    bottom.set_xscale("log", base=2)
    top.legend(fontsize=8)
    top.set_title(title)
    save(fig, path)
    plt.close(fig)


def plot_recall(recall: dict, path: str | Path, title: str = "") -> None:
    """Heatmaps of recall accuracy (`recall.evaluate_recall` result): a row per task, a column per model (teacher,
    student); depth of the hidden fact against prompt length, each cell annotated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(c["task"] for c in recall["cells"]))
    names = [n for n in ("teacher", "student") if n in recall["cells"][0]]
    lengths = sorted({c["length"] for c in recall["cells"]})
    depths = sorted({c["depth"] for c in recall["cells"]})
    fig, axes = plt.subplots(len(tasks), len(names), figsize=(3.2 * len(names) + 1, 2.6 * len(tasks) + 0.6),
                             constrained_layout=True, squeeze=False)
    for row, task in enumerate(tasks):
        for col, name in enumerate(names):
            grid = [[float("nan")] * len(lengths) for _ in depths]
            for c in recall["cells"]:
                if c["task"] == task:
                    grid[depths.index(c["depth"])][lengths.index(c["length"])] = c[name]
            ax = axes[row, col]
            image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            for i, line in enumerate(grid):
                for j, value in enumerate(line):
                    ax.text(j, i, f"{value:.2g}", ha="center", va="center", fontsize=8)
            ax.set_xticks(range(len(lengths)), [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lengths])
            ax.set_yticks(range(len(depths)), [f"{d:.2g}" for d in depths])
            ax.set_title(f"{task}: {name}", fontsize=9)
            if col == 0:
                ax.set_ylabel("depth of the fact (0: start)")
            if row == len(tasks) - 1:
                ax.set_xlabel("prompt length (tokens)")
    fig.colorbar(image, ax=axes, shrink=0.8, label="accuracy")
    if title:
        fig.suptitle(title, fontsize=10)
    save(fig, path)
    plt.close(fig)


def plot_generation(result: dict, path: str | Path) -> None:
    """A `dofattn bench` run's generation (HF generate) against the prompt's length, teacher and student: the decode
    steps' tokens/s, and the peak memory above the loaded model while it reads the prompt and generates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["generation"] if r.get("engine", "hf") == "hf"]
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(10, 3.8), constrained_layout=True)
    for student, label in ((False, "teacher"), (True, "student")):
        mine = sorted((r for r in rows if r["student"] == student), key=lambda r: r["context"])
        x = [r["context"] for r in mine]
        speed.plot(x, [r["decode_tokens_per_s"] for r in mine], marker="o", label=label)
        peaks = [r.get("peak_above_model_bytes") for r in mine]
        if all(p is not None for p in peaks):
            memory.plot(x, [p / 2 ** 30 for p in peaks], marker="o", label=f"{label}: peak")
        memory.plot(x, [r["cache_bytes"] / 2 ** 30 for r in mine], marker="x", ls="--", label=f"{label}: cache")
    for ax in (speed, memory):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.legend(fontsize=8)
    speed.set_ylabel("decode tokens/s")
    memory.set_ylabel("GiB above the loaded model")
    hardware = result.get("hardware", {})
    fig.suptitle(f"{result.get('student', '')[:90]}\n{hardware.get('cpu', '')} {hardware.get('gpu', '')}, "
                 f"{hardware.get('torch_threads', '')} threads", fontsize=8)
    save(fig, path)
    plt.close(fig)
