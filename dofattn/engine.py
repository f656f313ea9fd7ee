"""Static greedy decoding for linear students: fixed-size buffers, and on CUDA one graph replay per token.

    tokens = StaticDecoder(student).generate(input_ids, max_new_tokens=64)      # [B, T + 64], greedy

A linear layer carries a cache of fixed shape: the state [B, H, M, V+1], updated in place (by the one-kernel decode
step on CUDA), and for a window hybrid the last W keys and values in a ring of W slots (`attention.StaticStateLayer`;
with a PRF map, one kernel a step on CUDA: `ops.triton.window.prf_ring_step`). So one decode step is the same
sequence of kernels on the same buffers every time: the next token, its position and the cache position live in
static tensors, the step writes the argmax back into the token buffer, and the whole step is captured once in a
CUDA graph and replayed, with no Python between tokens. HF `generate` instead spends host time on every layer of
every token, which at 30 layers and batch 1 dominates.

A softmax layer kept beside them (`student.keep_softmax`) gets buffers of T + max_new_tokens slots for its keys
and values (`attention.StaticKVLayer`): the prompt's at the front, each step's written in place at the cache
position, and the layer attends over the slots written so far. Each step reads every slot (the unwritten ones
masked), so its cost is the same at every token of a call. One bounded after the prompt (`student.select`) keeps its
held keys and a ring of W slots (`model.bounded.StaticBoundedLayer`): the same size at any length; so does a
model's own sliding-window layer (Gemma 2/3, Mistral), its ring the model's window with nothing held.

On CPU (or with graph=False) the same static step runs eagerly, token by token: the tokens are the same, which is
what the tests check. With compile=True (for the CPU) the step runs through `torch.compile` instead: the whole
model's step becomes a few generated C++ kernels, a fraction of eager PyTorch's several thousand small operations
per token, with the weights frozen into it (inductor's freezing: prepacked for the CPU's matrix kernels; about 1.3×
the unfrozen compiled step on a 2-core CPU), so a decoder keeps the weights it compiled with: make a new one after
changing them. The first compiled step of a decoder compiles (minutes on a small CPU; `timings["compile_s"]`); a
call with another prompt length or batch size compiles once more, with those sizes symbolic, and later calls reuse
that.

Greedy only; no padding (every prompt the same length); no stopping at EOS inside the loop (that would need a host
sync per token): `generate` cuts each row after its first `eos_token_id` instead.
"""

from __future__ import annotations

import time
from numbers import Integral

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

from dofattn.attention import LinearStateLayer, StaticKVLayer
from dofattn.attention.cache import cache_kwargs
from dofattn.model.bounded import BoundedKVLayer, StaticBoundedLayer
from dofattn.errors import UserError

WARMUP_STEPS = 2   # eager steps before the capture (allocator, Triton compilation); they are real tokens


def static_slot(slot, length: int, position: torch.Tensor):
    """The static form of a prefilled cache slot, as the slot makes it (`to_static`: a window hybrid's state and a
    ring of its W slots, a linear layer's state alone, a bounded kept layer's held keys and a ring); HF's own slot
    of a kept softmax layer becomes `length` slots (`StaticKVLayer`). `position` is the decoder's [1] tensor."""
    if isinstance(slot, (LinearStateLayer, BoundedKVLayer)):
        return slot.to_static(position)
    if isinstance(slot, DynamicSlidingWindowLayer):        # a model's own sliding-window layer: a ring of W slots
        return StaticBoundedLayer.from_window(slot, position)
    return StaticKVLayer.from_layer(slot, length, position)


class Clock:
    """The host clock once the device's queued work is finished: `now()`, and `lap()`, the seconds since the last
    lap (or since the clock was made)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.last = self.now()

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def lap(self) -> float:
        now = self.now()
        lap, self.last = now - self.last, now
        return lap


def check_ids(input_ids, vocab: int) -> None:
    """A UserError unless `input_ids` is a non-empty [B, T] tensor of integer token ids below `vocab`."""
    if not isinstance(input_ids, torch.Tensor):
        raise UserError(f"input_ids must be a tensor of token ids [batch, length] (tok(text, return_tensors='pt')"
                        f".input_ids), got {type(input_ids).__name__}")
    if input_ids.dim() != 2 or input_ids.numel() == 0:
        raise UserError(f"input_ids must be [batch, length] with at least one token, got shape "
                        f"{list(input_ids.shape)}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise UserError(f"input_ids must hold integer token ids, got {input_ids.dtype}")
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab:
        raise UserError(f"input_ids must lie in [0, {vocab}) (the model's vocabulary), got ids from {low} to {high}")


class StaticDecoder:
    """Greedy decoding of a linear student on static buffers; `graph` (default: on CUDA) replays a CUDA graph.
    `softmax_only`: a model with no linear layer (a teacher, timed as its student is) is taken too; its attention
    must run through dofattn (`model.install`), which reads the static slots."""

    def __init__(self, model, graph: bool | None = None, compile: bool = False, softmax_only: bool = False):
        # after generate: prefill_s, decode_steps, decode_s; graphed: capture_s, replays, replay_s; compiled: the first
        # compiled step's compile_s (that step is then not among decode_steps)
        self.timings: dict = {}
        from dofattn.model.attach import bounded_of
        from dofattn.model.student import attention_modules, linear_parts

        linear = set(linear_parts(model))
        bounded = any(bounded_of(m) is not None for m in attention_modules(model))    # a student linearizing none
        if not linear and not bounded and not softmax_only:
            raise UserError("static decoding is for students, but every layer of this model is softmax attention "
                            "with a cache that grows; use HF generate (model.generate(), or drop --static)")
        self.model = model
        self.device = next(model.parameters()).device
        if compile and graph:
            raise UserError("compile and graph do not combine: a CUDA graph already replays the step; pick one")
        self.graph = (self.device.type == "cuda" and not compile) if graph is None else graph
        if self.graph and self.device.type != "cuda":
            raise UserError(f"CUDA graphs need the model on a CUDA device, not {self.device}; pass graph=False")
        self.compiled = torch.compile(self.step, options={"freezing": True}) if compile else None
        self.compiled_once = False

    def step(self, token: torch.Tensor, position: torch.Tensor, cache_position: torch.Tensor, cache) -> None:
        """One static decode step: the next token into `token` [B, 1]; `position` [B, 1] and `cache_position` [1]
        move on by one, in place."""
        out = self.model(input_ids=token, position_ids=position, cache_position=cache_position, use_cache=True,
                         **cache_kwargs(self.model, cache))
        token.copy_(out.logits[:, -1].argmax(-1, keepdim=True))
        position.add_(1)
        cache_position.add_(1)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = None) -> torch.Tensor:
        """input_ids [B, T] -> [B, T + max_new_tokens] (rows after their first EOS filled with EOS)."""
        check_ids(input_ids, self.model.get_input_embeddings().num_embeddings)
        if not isinstance(max_new_tokens, Integral) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be a whole number of at least 1, got {max_new_tokens!r}")
        B, T = input_ids.shape
        input_ids = input_ids.to(self.device)
        clock = Clock(self.device)
        cache = DynamicCache(config=self.model.config)
        # the prompt's last logits only: all T of them would be [B, T, vocab] (3.2 GB at 32K tokens of SmolLM2)
        logits = self.model(input_ids=input_ids, use_cache=True, logits_to_keep=1,
                            **cache_kwargs(self.model, cache)).logits[:, -1]
        token = logits.argmax(-1, keepdim=True)                                        # [B, 1], static from here on
        prefill_s = clock.lap()
        position = torch.full((B, 1), T, dtype=torch.long, device=self.device)        # [B, 1]
        cache_position = torch.full((1,), T, dtype=torch.long, device=self.device)    # [1]
        new = [token.clone()]
        for i, layer in enumerate(cache.layers):
            cache.layers[i] = static_slot(layer, T + max_new_tokens, cache_position)

        def step() -> None:
            (self.compiled or self.step)(token, position, cache_position, cache)

        remaining = max_new_tokens - 1
        timings = {"prefill_s": prefill_s, "decode_steps": remaining, "decode_s": 0.0}
        if self.compiled is not None and not self.compiled_once and remaining:
            step()                                # compiles, then runs: a real token, timed apart
            new.append(token.clone())
            self.compiled_once = True
            remaining -= 1
            timings.update(compile_s=clock.lap(), decode_steps=remaining)
        if not self.graph:
            for _ in range(remaining):
                step()
                new.append(token.clone())
            timings["decode_s"] = clock.lap()
        elif remaining:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(min(WARMUP_STEPS, remaining)):
                    step()
                    new.append(token.clone())
            torch.cuda.current_stream(self.device).wait_stream(side)
            remaining -= min(WARMUP_STEPS, remaining)
            timings["decode_s"] = clock.lap()     # the warm-up steps, run eagerly
            if remaining:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()                        # recorded, not run: the replays below are the tokens
                timings["capture_s"] = clock.lap()
                for _ in range(remaining):
                    graph.replay()
                    new.append(token.clone())
                timings.update(replays=remaining, replay_s=clock.lap())
                timings["decode_s"] += timings["replay_s"]
        self.timings = timings
        for layer in cache.layers:                # the captured step ran its Python bookkeeping once
            layer.seen = T + max_new_tokens - 1
        self.cache = cache
        tokens = torch.cat([input_ids, *new], dim=1)
        if eos_token_id is not None:
            generated = tokens[:, T:]
            is_eos = (generated == eos_token_id).int()
            after = is_eos.cumsum(1) - is_eos > 0                     # past the row's first EOS
            tokens[:, T:] = generated.masked_fill(after, eos_token_id)
        return tokens
