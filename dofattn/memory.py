"""Bytes of tensors alive at once, followed storage by storage: real tensors, or fake ones that hold no memory.

    live = LiveBytes(existing=[*model.parameters(), *model.buffers(), ids])
    with live:
        loss(model, ids, kd_weight).backward()
    live.peak, live.now          # the most bytes alive at once since it began, and what is alive at the end

`LiveBytes` is a dispatch mode: every storage an operator makes is counted when it appears and uncounted when it is
freed (a finalizer on the storage), views and in-place results once. Storages that exist before it begins
(`existing`: weights, inputs) never count, even through views. It counts the same way over `FakeTensorMode`'s
tensors, which have shapes, dtypes and storages but no memory: the dry run's plan (`distill.plan`) runs one step of
a student built from its config alone under it, and the tests and `benchmarks/plan_memory.py` run the real step.
`reset_peak()` splits a run into phases (the peak of each).

A fake tensor has no values: an operator whose result depends on them (`nonzero`, `int(t)`) fails under
`FakeTensorMode`, and code that tells fake tensors apart takes another path. `RealConstants`, entered after it,
keeps the small tensors made without the weights real (token ids, positions, masks): the sink's mask of the window
op, say, whose width sizes a tensor, and the causal mask that transformers skips for real positions.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensor,
                                           unset_fake_temporarily)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakTensorKeyDictionary


METADATA = (torch.ops.prim.device.default,)      # operators that make no tensor: a fake tensor's `.device`


def _tensors(x):
    """The tensors in an operator's arguments or result (nested tuples, lists and dicts)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def storage_key(t: torch.Tensor) -> int:
    """An id of `t`'s storage, the same for every view of it, for real and fake tensors alike (a fake tensor's
    storage has no data pointer)."""
    return t.untyped_storage()._cdata


class LiveBytes(TorchDispatchMode):
    """While active: bytes of the storages made by operators since it began and still alive (`now`), and their most
    (`peak`). Storages that exist before (`existing`) never count, even through views."""

    def __init__(self, existing=()):
        super().__init__()
        self.now = self.peak = 0
        self.seen = {storage_key(t) for t in existing}

    def reset_peak(self) -> int:
        """The peak so far; from here on the peak is counted again from what is alive now."""
        peak, self.peak = self.peak, self.now
        return peak

    def _free(self, key, size):
        self.seen.discard(key)
        self.now -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in METADATA:
            return out
        for t in _tensors(out):
            storage = t.untyped_storage()
            key = storage._cdata
            if key not in self.seen:
                self.seen.add(key)
                size = storage.nbytes()
                self.now += size
                self.peak = max(self.peak, self.now)
                weakref.finalize(storage, self._free, key, size)
        return out


class Flops(TorchDispatchMode):
    """While active: the FLOPs of the operators that run (`total`), as torch's FlopCounterMode counts them (its
    registry: matrix products and attention). Unlike FlopCounterMode it follows no modules and holds nothing, so the
    step whose memory `LiveBytes` counts can count its FLOPs too."""

    def __init__(self):
        super().__init__()
        from torch.utils.flop_counter import flop_registry

        self.registry, self.total = flop_registry, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        count = self.registry.get(func._overloadpacket)
        if count is not None:
            self.total += count(*args, **kwargs, out_val=out)
        return out


class RealConstants(TorchDispatchMode):
    """Under `fake_mode` (entered after it): an operator on real tensors alone (token ids, positions, masks made
    from them: nothing of the weights) runs for real, where its result stays under `limit` bytes. What depends on
    their values then goes as in a real run: operators with data-dependent results (`nonzero`, `int(t)`,
    `if t.all()`), and the checks by which a model skips work for real tensors alone (transformers builds an
    explicit causal mask for fake positions, to be safe under tracing). Every other operator runs fake, its real
    inputs made fake once each (`live`, the `LiveBytes` above, counts the real one only)."""

    LIMIT = 1 << 28          # bytes: a [1, 1, T, T] float32 mask at T = 8192

    def __init__(self, fake_mode, live: LiveBytes | None = None, limit: int = LIMIT):
        super().__init__()
        self.fake_mode, self.live, self.limit = fake_mode, live, limit
        self.fakes = WeakTensorKeyDictionary()

    def _fake(self, x):
        if not isinstance(x, torch.Tensor) or isinstance(x, FakeTensor):
            return x
        made = self.fakes.get(x)
        if made is None:
            with unset_fake_temporarily():
                meta = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
            made = self.fake_mode.fake_tensor_converter.from_meta_and_device(self.fake_mode, meta, x.device)
            self.fakes[x] = made
            if self.live is not None:            # views of it are views of the real tensor, counted already
                storage = made.untyped_storage()
                self.live.seen.add(storage._cdata)
                weakref.finalize(storage, self.live.seen.discard, storage._cdata)
        return made

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in METADATA:
            return func(*args, **kwargs)
        fakes = [isinstance(t, FakeTensor) for t in _tensors((args, kwargs))]
        if fakes and all(fakes):                        # fake inputs alone (a factory has none)
            return func(*args, **kwargs)
        real = not any(fakes)
        fake_args, fake_kwargs = tree_map(self._fake, (args, kwargs))
        try:
            out = func(*fake_args, **fake_kwargs)       # real inputs alone: fake first, to see how large it is
        except (DataDependentOutputException, DynamicOutputShapeException):
            if not real:
                raise
            out = None
        if real and (out is None or sum(t.untyped_storage().nbytes() for t in _tensors(out)) <= self.limit):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return out


# --- the process as the operating system sees it ---------------------------------------------------------------------

def resident_peak() -> int | None:
    """The process's peak resident memory in bytes since it began or since `reset_resident_peak` (Linux's VmHWM);
    None where /proc cannot tell."""
    try:
        with open("/proc/self/status") as status:
            line = next(x for x in status if x.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) * 1024


def reset_resident_peak() -> bool:
    """Start `resident_peak` again from the memory resident now (Linux: 5 to /proc/self/clear_refs); False where
    the system does not allow it (then the peak runs on from the process's start)."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def resident_now() -> int:
    """This process's resident bytes now (Linux), or 0 where /proc cannot tell."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * 4096
    except OSError:
        return 0


@functools.cache
def _malloc_trim():
    """glibc's `malloc_trim`, or None where the C library has no such call."""
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's `malloc_trim`). A prompt read in chunks makes and
    frees tensors of many sizes each chunk, and glibc keeps what was freed for reuse, so the resident set grows well
    past what is alive (a 32 K read at 10% exact heads, `benchmarks/bounded_memory.py`: 515 MiB above the model
    untrimmed, 399 MiB trimmed after each chunk, 110 and 116 s; docs/log, 2026-12-07). The prompt reader calls it
    after each chunk on a CPU; nothing where the C library has no such call."""
    if (trim := _malloc_trim()) is not None:
        trim(0)


def available_memory() -> int | None:
    """Bytes this process could hold: its resident memory and the system's MemAvailable (Linux), or None."""
    try:
        with open("/proc/meminfo") as info:
            line = next(x for x in info if x.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) * 1024 + resident_now()
