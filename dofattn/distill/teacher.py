"""The teacher's q/k/v on the training blocks, one float32 file per layer, which the layerwise stage reads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from dofattn.capture import AttentionInputs, capture, run_forward
from dofattn.evaluate import teacher_mode


class TeacherCache:
    """q/k/v of every layer on the training blocks, one float32 file per layer: [N, T, H + 2·Hkv, D].

    One teacher forward per batch streams each layer's q/k/v to its own file (`folder/layer_XX.npy`), so memory holds
    one batch, never all layers. `done` marks a complete cache; the run deletes it at its end.
    """

    def __init__(self, folder: Path, num_layers: int, shape: tuple[int, int], heads: tuple[int, int, int]):
        self.folder, self.num_layers = folder, num_layers
        (self.N, self.T), (self.H, self.Hkv, self.D) = shape, heads

    def path(self, layer: int) -> Path:
        return self.folder / f"layer_{layer:02d}.npy"

    @property
    def done(self) -> bool:
        return (self.folder / "done").is_file()

    def build(self, model, blocks: torch.Tensor, batch_size: int, progress: bool = True) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        width = self.H + 2 * self.Hkv
        files = [np.lib.format.open_memmap(self.path(i), mode="w+", dtype=np.float32,
                                           shape=(self.N, self.T, width, self.D)) for i in range(self.num_layers)]
        offset = 0

        def sink(a: AttentionInputs) -> None:
            qkv = torch.cat([a.query, a.key, a.value], dim=2).float().cpu().numpy()  # [B, T, H+2Hkv, D]
            files[a.layer][offset:offset + qkv.shape[0]] = qkv

        device = next(model.parameters()).device
        with teacher_mode(model), capture(model, sink):
            for offset in tqdm(range(0, self.N, batch_size), desc="teacher q/k/v", unit="batch",
                               disable=not progress):
                run_forward(model, blocks[offset:offset + batch_size].to(device))
        for f in files:
            f.flush()
        (self.folder / "done").write_text("ok")

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [N, T, H, D], k and v [N, T, Hkv, D] of `layer` (read from disk)."""
        qkv = torch.from_numpy(np.load(self.path(layer)))
        return qkv[:, :, :self.H], qkv[:, :, self.H:self.H + self.Hkv], qkv[:, :, self.H + self.Hkv:]
