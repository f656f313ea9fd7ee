"""The teacher's q/k/v on the layerwise stage's blocks, one layer at a time, made as that layer trains.

    stream = TeacherStream(model, blocks, batch_size)
    for layer, (q, k, v) in stream.walk(wanted=[0, 2, 5]):     # q [N, T, H, D], k and v [N, T, Hkv, D], float32
        train(layer, q, k, v)

The stream holds the hidden states of every block entering one decoder layer ([N, T, hidden], in the model's
dtype). At each layer it runs the teacher's own decoder layer on them (softmax attention, LoRA off: `teacher_mode`),
batch by batch, in place: the attention's inputs are captured on the way (`capture`) when the layer is wanted, and
the output is the next layer's input. Memory holds the blocks' hidden states and one layer's q/k/v, whatever the
model's depth; nothing goes to disk; each layer of the teacher runs once per block, as in one full forward, and none
past the last wanted layer. A resumed run walks the same way and trains only what is missing.

Each decoder layer is called with the arguments the model's own forward gives it (the mask, the position
embeddings, ...), recorded once per stream from a forward of the first block: whatever a family passes its layers,
they receive it. `tests/test_distill.py` checks the stream against the captures of a full forward in every family.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from dofattn.model.capture import AttentionInputs, capture
from dofattn.evaluate import teacher_mode


class _Recorded(Exception):
    """Stops the recording forward once the last decoder layer has been called."""


def layer_calls(model, layers: list[torch.nn.Module], ids: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
    """(the hidden states entering `layers[0]`, [(args after the hidden states, kwargs)] per layer in `layers`) of the
    model's forward on `ids`: each layer's call recorded by a hook as the forward reaches it, the forward stopped
    before the last of `layers` runs (so neither it, the final norm nor the LM head computes; the layers before it
    do, once, on these ids)."""
    calls, first = [], []

    def record(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        if not first:
            first.append(hidden)
        calls.append((tuple(args[1:]), {k: v for k, v in kwargs.items() if k != "hidden_states"}))
        if module is layers[-1]:
            raise _Recorded
        return None

    hooks = [layer.register_forward_pre_hook(record, with_kwargs=True) for layer in layers]
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    except _Recorded:
        pass
    finally:
        for hook in hooks:
            hook.remove()
    return first[0], calls


class TeacherStream:
    """The teacher's q/k/v of the layerwise blocks, layer after layer (module docstring)."""

    def __init__(self, model, blocks: torch.Tensor, batch_size: int, progress: bool = True):
        from dofattn.model.hf import decoder_layers
        from dofattn.model.student import attention_modules, head_layout

        self.model, self.blocks, self.batch_size, self.progress = model, blocks, batch_size, progress
        self.layers = decoder_layers(model)
        attention = attention_modules(model)
        # decoder layer i holds attention layer i (checked: a family whose layers nest otherwise is refused here)
        if len(self.layers) != len(attention) or any(not any(m is a for m in layer.modules())
                                                     for layer, a in zip(self.layers, attention)):
            raise ValueError(f"{type(model).__name__}: its decoder layers do not each hold one attention layer")
        self.heads = head_layout(model)

    def walk(self, wanted: list[int]):
        """Yields (layer, (q, k, v)) for each layer in `wanted`, in order; runs the teacher up to the last one."""
        wanted = sorted(set(wanted))
        if not wanted:
            return
        N, device = len(self.blocks), next(self.model.parameters()).device
        H, Hkv, D = self.heads
        with teacher_mode(self.model), capture(self.model, lambda a: None):
            hidden, calls = self._start(device)
        self.hidden = hidden                                   # what the plan counts (`distill.plan`)
        for layer in range(wanted[-1] + 1):
            args, kwargs = calls[layer]
            qkv = (torch.empty(N, self.blocks.shape[1], H + 2 * Hkv, D) if layer in wanted else None)
            offset = 0

            def sink(a: AttentionInputs) -> None:
                rows = a.query.shape[0]
                qkv[offset:offset + rows] = torch.cat([a.query, a.key, a.value], dim=2).float().cpu()

            bar = tqdm(range(0, N, self.batch_size), desc=f"teacher layer {layer}", unit="batch", leave=False,
                       disable=not self.progress)
            with torch.no_grad(), teacher_mode(self.model), capture(self.model,
                                                                    sink if qkv is not None else lambda a: None):
                for offset in bar:
                    part = slice(offset, offset + self.batch_size)
                    out = self.layers[layer](hidden[part], *args, **kwargs)
                    hidden[part] = out[0] if isinstance(out, tuple) else out
            if qkv is not None:
                yield layer, (qkv[:, :, :H], qkv[:, :, H:H + Hkv], qkv[:, :, H + Hkv:])
                del qkv
        self.hidden = None

    def _start(self, device) -> tuple[torch.Tensor, list[tuple]]:
        """The hidden states of every block entering layer 0 ([N, T, hidden], one tensor) and each layer's call
        arguments (from the first block: the arguments depend on the length, not on the tokens)."""
        first, calls = layer_calls(self.model, self.layers, self.blocks[:1].to(device))
        hidden = torch.empty(len(self.blocks), *first.shape[1:], dtype=first.dtype, device=device)
        hidden[:1] = first
        for offset in range(1, len(self.blocks), self.batch_size):
            part = self.blocks[offset:offset + self.batch_size].to(device)
            hidden[offset:offset + len(part)] = layer_calls(self.model, self.layers[:1], part)[0]
        return hidden, calls

