"""A dofattn export in vLLM: vLLM's own model of the export's family (Llama, Mistral, Qwen2, Qwen3) for everything
but attention, dofattn's `LinearAttention` in each linearized layer; in the layers the student keeps exact, vLLM's
paged attention, or, if the student bounds them after the prompt (student.select), a fixed state of the keys they
keep (`DofattnBounded`).

    llm = vllm.LLM("exports/student")                  # the plugin registered (`dofattn.serve`), prefix caching off

vLLM builds the family's model as it builds the teacher (`Dofattn<Family>`, `student_model`); then, in each of the
student's layers, the family attention module's paged `Attention` (`self_attn.attn`) gives way to a state layer under
the same name (`swap_attention`), and a linearized layer's `LinearAttention` goes at `self_attn.dofattn`, so its
tensors load under the export's own names (`model.layers.N.self_attn.dofattn.feature_map.directions`, ...). The
family's forward runs unchanged: projections, q/k norms, RoPE, `self.attn(q, k, v)`, output projection. A state layer
(`StateLayer`, a vLLM `MambaBase`) holds one block of vLLM's state pool per sequence: that layer's cache slot.

What a slot holds is the layer's own: a `LinearStateLayer` (the state [H, M, V+1], each part's `PartState`: a
window's last W keys, values and flags, a sink's first S, a convolution's last K-1 inputs) after enough tokens that
every part's state has its steady size. `state_layout` reads it off a throwaway layer of the same config (a probe
of a few calls), so a new part serves with no change here, as long as its state has a fixed size and zeros mean
"nothing seen yet" (both hold of every part so far: an empty window is W slots flagged invalid, an empty sink S). To
vLLM every dofattn layer's state is one page of bytes of the same size (the largest layer's, `page_bytes`), so they
share one spec and one group; each layer views its own tensors in its page.

Per forward (`DofattnState.run`), in vLLM's packed batch (decodes first): the slots of sequences that start here
(context 0: vLLM recycles state blocks without zeroing them) are zeroed; the decode rows (one token each) run as one
batch of the layer's cached call (its steady decode step once the window and sink are full); each prefill row (a
prompt, or a chunk of one) runs the layer's general cached call, continuing from its slot; the slots are written
back. No per-token loops.

A bounded kept layer's slot is the `BoundedKVLayer` its `BoundedSoftmax` chooses after the prompt (the sink's keys,
each kv head's selected ones, a ring of the last W): the prompt is read with exact causal attention in one step, so
the plugin turns chunked prefill off for such a student (and a prompt that comes in chunks anyway is refused). With
every kept layer bounded, a sequence's memory in vLLM is constant, prompt included: no paged cache at all. A linear
layer that keeps some key/value heads exact (student.exact_heads, `DofattnMixed`) holds both in its page: its linear
heads' state and its exact heads' bounded slot; its heads are split and put back as HF's `HeadSplit` does.

Not served (a ValueError names each): LoRA adapters not merged (export with --merge-lora), other families (Gemma's
sliding layers and soft caps among them), prefix caching (turned off by the plugin), speculative decoding, tensor
and pipeline parallelism.
"""

from __future__ import annotations

import functools
import math
from dataclasses import fields

import torch
import torch.nn.functional as F
from torch import nn

from dofattn.model.attach import attach
from dofattn.model.bounded import BoundedSoftmax, HeadSplit
from dofattn.attention.cache import LinearStateLayer, ring_slot
from dofattn.attention.layer import LinearAttention
from dofattn.model.student import linear_layer
from dofattn.serve import FAMILIES, student_layers
from dofattn.model.exported import export_spec
from dofattn.spec import Attention, Kept, StudentSpec

OP_NAME = "dofattn_attention"
STATE = "state"        # a slot's linear state, as `LinearStateLayer.tensors` names it; a part's: "window.keys", ...
EXACT = "exact."       # a mixed layer's exact heads' bounded slot: "exact.keys", "exact.values", "exact.valid"


# --- a layer's state layout, from its parts (no vLLM) ----------------------------------------------------------

def student_spec(hf_config) -> StudentSpec:
    """The student spec of an export's config (its "dofattn" entry), checked against what the plugin serves."""
    spec = export_spec(getattr(hf_config, "dofattn", None))          # a UserError if it is not a dofattn export
    base = (getattr(hf_config, "dofattn_export", None) or {}).get("base_architecture")
    if base not in FAMILIES:
        raise ValueError(f"dofattn's vLLM plugin serves students of {', '.join(FAMILIES)}; this one's base is {base}")
    if spec.lora_rank:
        raise ValueError("dofattn's vLLM plugin serves students without LoRA adapters: export with --merge-lora")
    return spec


def head_layout(hf_config) -> tuple[int, int, int]:
    """(query heads, kv heads, head size) of a Llama-family config."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return heads, kv_heads, head_dim


def slot_from(tensors: dict[str, torch.Tensor]) -> LinearStateLayer:
    """A cache slot holding these tensors, named as `LinearStateLayer.tensors` names them ("state", "window.keys")."""
    slot = LinearStateLayer()
    for name, tensor in tensors.items():
        if name == STATE:
            slot.state = tensor
        else:
            part, attr = name.split(".")
            setattr(slot.part(part), attr, tensor)
    return slot


def packed(entries) -> tuple[tuple[str, tuple[int, ...], torch.dtype], ...]:
    """A slot's (name, shape, dtype) entries in page order: fp32 first, then 16-bit, then flags (vLLM views each
    tensor at its byte offset in a page as its dtype, so none needs padding)."""
    return tuple(sorted(entries, key=lambda e: -e[2].itemsize))


@functools.cache
def state_layout(attention: Attention, heads: int, kv_heads: int, head_dim: int, dim: int, scaling: float,
                 dtype: torch.dtype,
                 exact: tuple[int, ...] = ()) -> tuple[tuple[str, tuple[int, ...], torch.dtype], ...]:
    """What a cache slot of this layer's `LinearAttention` holds per sequence once every part's state has its steady
    size: (name, shape without the batch, dtype) of each tensor, read off a throwaway layer (`linear_layer`: with
    `exact` heads, of the others) called on random q, k, v in `dtype`: a prompt longer than every width in the
    config, then a step and a chunk, which must leave every shape as it was (a ValueError otherwise: a part whose
    state grows cannot be served in fixed blocks)."""
    layer = linear_layer(attention, heads, kv_heads, head_dim, dim, scaling, seed=0, exact=exact).float().eval()
    heads, kv_heads = layer.num_heads, layer.num_kv_heads
    widths = sum(getattr(attention, f.name) for f in fields(attention)
                 if isinstance(getattr(attention, f.name), int) and not isinstance(getattr(attention, f.name), bool))
    g = torch.Generator().manual_seed(0)
    slot = LinearStateLayer()
    seen = []
    with torch.no_grad():
        for length in (2 * widths + 4, 1, 3):
            q = torch.randn(1, length, heads, head_dim, generator=g).to(dtype)
            k, v = (torch.randn(1, length, kv_heads, head_dim, generator=g).to(dtype) for _ in range(2))
            layer(q, k, v, cache=slot)
            seen.append({name: (tuple(t.shape[1:]), t.dtype) for name, t in slot.tensors().items()})
    if seen[0] != seen[1] or seen[1] != seen[2]:
        raise ValueError(f"a dofattn layer's cache slot changes shape from call to call ({seen}): vLLM serves "
                         f"states of a fixed size only")
    return packed((n, s, d) for n, (s, d) in seen[0].items())


def exact_of(spec: StudentSpec, layer: int) -> tuple[int, ...]:
    """The key/value heads linear layer `layer` keeps exact (student.exact_heads), () for none."""
    return tuple(spec.exact_heads[layer]) if spec.exact_heads else ()


def layer_layout(spec: StudentSpec, layer: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    """A linear layer's slot: its `LinearAttention`'s `state_layout`, and, if it keeps heads exact, their bounded
    slot beside it (`bounded_layout` of those heads, named "exact.keys", "exact.values", "exact.valid")."""
    exact = exact_of(spec, layer)
    own = state_layout(spec.attention, heads, kv_heads, head_dim, spec.dims[layer], head_dim ** -0.5, dtype,
                       exact)
    if not exact:
        return own
    group = heads // kv_heads
    held = _bounded_layout(spec.kept, spec.attention, group * len(exact), len(exact), head_dim, dtype)
    return packed(own + tuple((EXACT + name, shape, d) for name, shape, d in held))


def layer_layouts(hf_config, dtype: torch.dtype) -> dict[int, tuple]:
    """{linear layer: its `layer_layout`} of an export's config, for a model in `dtype`."""
    spec = student_spec(hf_config)
    return {i: layer_layout(spec, i, *head_layout(hf_config), dtype) for i in spec.layers}


@functools.cache
def _bounded_layout(kept: Kept, attention: Attention, heads: int, kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> tuple[tuple[str, tuple[int, ...], torch.dtype], ...]:
    """What a bounded kept layer's slot holds per sequence after a prompt: the `BoundedKVLayer` it chooses, read off
    a throwaway prompt longer than its sink, selection and window together: keys and values [Hkv, L + W, D] (L held,
    then a ring of W) and which slots hold a real key [L + W] (a shorter prompt leaves some invalid)."""
    bounded = BoundedSoftmax(kept, attention, head_dim ** -0.5)
    T = 2 * (attention.sink + kept.select + attention.window) + 4
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, kept.select_observe, heads, head_dim, generator=g).to(dtype)
    k, v = (torch.randn(1, kv_heads, T, head_dim, generator=g).to(dtype) for _ in range(2))
    slot = bounded.choose(q, k, v, torch.ones(1, T, dtype=torch.bool))
    return (("keys", tuple(slot.keys.shape[1:]), slot.keys.dtype),
            ("values", tuple(slot.values.shape[1:]), slot.values.dtype),
            ("valid", tuple(slot.valid.shape[1:]), slot.valid.dtype))


def bounded_layout(hf_config, dtype: torch.dtype) -> tuple[tuple[str, tuple[int, ...], torch.dtype], ...] | None:
    """A bounded kept layer's slot layout in a model of `dtype` (every kept layer's: one `Kept` config), or None."""
    spec = student_spec(hf_config)
    return _bounded_layout(spec.kept, spec.attention, *head_layout(hf_config), dtype) if spec.kept.select else None


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def packed_bytes(layout: tuple) -> int:
    """The bytes a page needs for `layout` packed by `offsets`."""
    return offsets(layout)[-1] + nbytes(*layout[-1][1:])


def offsets(layout: tuple) -> list[int]:
    """Each tensor's byte offset in a page that packs `layout` in order, each at a multiple of its dtype's size (the
    layouts run from the widest dtype to the narrowest, so none is padded)."""
    at, out = 0, []
    for _, shape, dtype in layout:
        at += -at % dtype.itemsize
        out.append(at)
        at += nbytes(shape, dtype)
    return out


def page_bytes(hf_config, dtype: torch.dtype) -> int:
    """One state page of an export in vLLM, the same for every dofattn layer (so vLLM keeps them all in one group of
    identical specs, with no padding layers): the largest layer's packed layout, rounded up to 8 bytes (vLLM views
    the pool at this stride as each dtype)."""
    layouts = list(layer_layouts(hf_config, dtype).values())
    bounded = bounded_layout(hf_config, dtype)
    layouts += [bounded] if bounded else []
    size = max(packed_bytes(layout) for layout in layouts)
    return size + -size % 8


def model_dtype(vllm_config) -> torch.dtype:
    return vllm_config.model_config.dtype


# --- vLLM ------------------------------------------------------------------------------------------------------

from vllm.config import VllmConfig, get_current_vllm_config                          # noqa: E402
from vllm.forward_context import get_forward_context                                 # noqa: E402
from vllm.model_executor.layers.mamba.abstract import MambaBase                      # noqa: E402
from vllm.model_executor.layers.mamba.mamba_utils import get_temporal_copy_spec      # noqa: E402
from vllm.model_executor.layers.attention import Attention                         # noqa: E402
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid            # noqa: E402
from vllm.model_executor.models.llama import LlamaForCausalLM                       # noqa: E402
from vllm.model_executor.models.mistral import MistralForCausalLM                   # noqa: E402
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM                       # noqa: E402
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM                       # noqa: E402
from vllm.model_executor.models.utils import extract_layer_index                     # noqa: E402
from vllm.utils.torch_utils import direct_register_custom_op                         # noqa: E402
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum            # noqa: E402


class StateLayer(nn.Module, MambaBase):
    """A dofattn layer's per-sequence state in vLLM's pool (`MambaBase`: one block per sequence) and the layer's
    forward on it (`run`; what the layer attends with is the subclass's `attend`). vLLM sees one byte tensor of `page`
    bytes per sequence, the same for every dofattn layer (`page_bytes`); the layer views its own tensors in it
    (`layout`: name, shape, dtype, packed by `offsets`). It has no parameters."""

    def __init__(self, layout: tuple, page: int, prefix: str, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.layout, self.page, self.prefix = layout, page, prefix
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        if packed_bytes(layout) > page:
            raise ValueError(f"{prefix}: its state ({layout}) does not fit a page of {page} bytes")
        config = get_current_vllm_config()
        if config.cache_config.mamba_cache_mode != "none":
            raise ValueError(f"dofattn's vLLM plugin serves without prefix caching (mamba cache mode "
                             f"{config.cache_config.mamba_cache_mode!r}): pass enable_prefix_caching=False")
        if config.num_speculative_tokens:
            raise ValueError("dofattn's vLLM plugin does not serve speculative decoding")
        context = config.compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        context[prefix] = self
        self.kv_cache = (torch.tensor([]),)

    # MambaBase
    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return ((self.page,),)

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return (torch.uint8,)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.LINEAR

    def views(self) -> dict[str, torch.Tensor]:
        """This layer's tensors over every block: [blocks, *shape] views of the pool's pages."""
        pages = self.kv_cache[0]                                                  # [blocks, page] bytes
        return {name: pages[:, at:at + nbytes(shape, dtype)].view(dtype).view(-1, *shape)
                for (name, shape, dtype), at in zip(self.layout, offsets(self.layout))}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The family attention's `self.attn(q, k, v)`: q [T, H·D], k and v [T, Hkv·D] after RoPE -> [T, H·D]."""
        output = torch.empty_like(q)
        torch.ops.vllm.dofattn_attention(q.contiguous(), k.contiguous(), v.contiguous(), output, self.prefix)
        return output

    def batch(self):
        """This forward's rows (vLLM's packed batch, decodes first): (starts [rows + 1], lengths so far including
        this call's tokens [rows], each row's block [rows], decode rows), or None in a profile or dummy run."""
        metadata = get_forward_context().attn_metadata
        meta = metadata.get(self.prefix) if isinstance(metadata, dict) else None
        if meta is None:
            return None
        if meta.num_decode_tokens != meta.num_decodes:
            raise ValueError("dofattn's vLLM plugin takes one token per decode row (no speculative decoding)")
        rows = meta.num_decodes + meta.num_prefills
        return (meta.query_start_loc[:rows + 1].tolist(), meta.seq_lens[:rows].tolist(),
                meta.state_indices_tensor[:rows].long(), meta.num_decodes)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, output: torch.Tensor) -> None:
        """output[:n] = the layer's attention of the batch's n real tokens: q [T, H·D], k and v [T, Hkv·D] after
        RoPE, continuing each sequence from its block and writing its block back. The blocks of sequences that
        start here (context 0: vLLM recycles state blocks without zeroing them) are zeroed first."""
        batch = self.batch()
        if batch is None:                                            # a profile or dummy run: any numbers do
            output.zero_()
            return
        starts, seq_lens, blocks, _ = batch
        fresh = [r for r in range(len(seq_lens)) if seq_lens[r] == starts[r + 1] - starts[r]]
        if fresh:
            self.kv_cache[0][blocks[fresh]] = 0
        n, H, Hkv, D = starts[-1], self.heads, self.kv_heads, self.head_dim
        with torch.no_grad():
            self.attend(q[:n].view(n, H, D), k[:n].view(n, Hkv, D), v[:n].view(n, Hkv, D), output[:n].view(n, H, D),
                        self.views(), batch)


def attend_linear(linear: LinearAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  views: dict[str, torch.Tensor], batch) -> None:
    """out = `linear`'s attention of a batch (q [n, H, D], k and v [n, Hkv, D], its heads), each sequence continued
    from its slot in `views` and written back: the decode rows (one token each) as one batch of the layer's cached
    call (its steady decode step once the window and sink are full), then each prefill row (a prompt, or a chunk of
    one) by the layer's general cached call. No per-token loops."""
    starts, _, blocks, decodes = batch
    if decodes:
        at = blocks[:decodes]
        slot = slot_from({name: view[at] for name, view in views.items()})
        o = linear(q[:decodes, None], k[:decodes, None], v[:decodes, None], cache=slot)
        out[:decodes] = o[:, 0].to(out.dtype)
        for name, tensor in slot.tensors().items():
            views[name][at] = tensor
    for r in range(decodes, len(starts) - 1):
        s, e = starts[r], starts[r + 1]
        at = blocks[r:r + 1]
        slot = slot_from({name: view[at] for name, view in views.items()})
        o = linear(q[s:e][None], k[s:e][None], v[s:e][None], cache=slot)
        out[s:e] = o[0].to(out.dtype)
        for name, tensor in slot.tensors().items():
            views[name][at] = tensor


ONE_STEP = ("dofattn's bounded kept layers and exact heads (student.select) read a prompt in one step: serve with "
            "enable_chunked_prefill=False and max_num_batched_tokens >= max_model_len")


def check_one_step() -> None:
    """A ValueError unless vLLM reads every prompt in one step (what bounding after the prompt needs)."""
    config = get_current_vllm_config().scheduler_config
    if config.enable_chunked_prefill or config.long_prefill_token_threshold:
        raise ValueError(ONE_STEP)


def attend_bounded(bounded: BoundedSoftmax, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   views: dict[str, torch.Tensor], batch) -> None:
    """out = softmax attention bounded after the prompt (`bounded`) of a batch (q [n, H, D], k and v [n, Hkv, D]):
    a prompt with exact causal attention over itself, in one step, then the slot its `choose` keeps (`views`: keys
    and values [blocks, Hkv, L + W, D], L held then a ring of the last W, and which slots hold a real key); a decode
    step writes its key into its ring slot and attends over the valid slots, as `BoundedKVLayer` does in HF. A prompt
    that arrives in chunks is refused, never bounded early."""
    starts, seq_lens, blocks, _ = batch
    keys, values, valid = views["keys"], views["values"], views["valid"]
    H, Hkv, D = q.shape[1], k.shape[1], q.shape[2]
    W = bounded.attention.window
    L = valid.shape[1] - W
    steps, prompts = [], []
    for r in range(len(seq_lens)):
        length = starts[r + 1] - starts[r]
        if seq_lens[r] == length:                        # context 0: a prompt (a one-token one is a "decode")
            prompts.append(r)
        elif length == 1:
            steps.append(r)
        else:
            raise ValueError(f"a prompt came in chunks: {ONE_STEP}")
    gqa, scale = H != Hkv, bounded.scaling
    if steps:
        at = blocks[steps]
        tokens = torch.tensor([starts[r] for r in steps])
        slot = ring_slot(torch.tensor([seq_lens[r] - 1 for r in steps]), W, L)     # [n]: each one's ring slot
        keys[at, :, slot] = k[tokens].to(keys.dtype)
        values[at, :, slot] = v[tokens].to(values.dtype)
        valid[at, slot] = True
        o = F.scaled_dot_product_attention(q[tokens][:, :, None].to(keys.dtype), keys[at], values[at],
                                           attn_mask=valid[at][:, None, None], scale=scale, enable_gqa=gqa)
        out[tokens] = o[:, :, 0].to(out.dtype)
    for r in prompts:
        s, e = starts[r], starts[r + 1]
        qr, kr, vr = (x[s:e][None].transpose(1, 2).to(keys.dtype) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True, scale=scale, enable_gqa=gqa)
        out[s:e] = o[0].transpose(0, 1).to(out.dtype)
        observed = qr.transpose(1, 2)[:, -bounded.kept.select_observe:]
        chosen = bounded.choose(observed, kr, vr, torch.ones(1, e - s, dtype=torch.bool))
        held = chosen.lead                           # ≤ L: a prompt shorter than the sink holds fewer
        block = blocks[r]
        for pool, new in ((keys, chosen.keys[0]), (values, chosen.values[0])):
            pool[block] = 0
            pool[block, :, :held], pool[block, :, L:] = new[:, :held], new[:, held:]
        valid[block] = False
        valid[block, :held], valid[block, L:] = chosen.valid[0, :held], chosen.valid[0, held:]


class DofattnState(StateLayer):
    """A linear layer's state: its `LinearStateLayer`'s tensors (`state_layout`). The `LinearAttention` it runs is
    its attention module's (`linear`, not a child: its tensors load there)."""

    def __init__(self, linear: LinearAttention, layout: tuple, page: int, prefix: str, head_dim: int):
        super().__init__(layout, page, prefix, linear.num_heads, linear.num_kv_heads, head_dim)
        object.__setattr__(self, "linear", linear)

    def attend(self, q, k, v, out, views, batch) -> None:
        attend_linear(self.linear, q, k, v, out, views, batch)


class DofattnBounded(StateLayer):
    """A kept softmax layer bounded after the prompt (student.select): its state is the `BoundedKVLayer` its
    `BoundedSoftmax` chooses at the prompt's end (`bounded_layout`: L held keys, the sink's and each kv head's
    selected, then a ring of the last W), read and served by `attend_bounded`. The plugin turns chunked prefill off:
    the choice needs the whole prompt."""

    def __init__(self, bounded: BoundedSoftmax, heads: int, kv_heads: int, head_dim: int, layout: tuple, page: int,
                 prefix: str):
        super().__init__(layout, page, prefix, heads, kv_heads, head_dim)
        self.bounded = bounded
        check_one_step()

    def attend(self, q, k, v, out, views, batch) -> None:
        attend_bounded(self.bounded, q, k, v, out, views, batch)


class DofattnMixed(StateLayer):
    """A linear layer that keeps some key/value heads exact (student.exact_heads): those heads and their query heads
    bounded after the prompt (`attend_bounded`, their slot's tensors named "exact.keys", ...), the others its
    `LinearAttention`'s (`attend_linear`), split and put back by the layer's `HeadSplit` as in HF; one page holds
    both slots (`layer_layout`)."""

    def __init__(self, linear: LinearAttention, bounded: BoundedSoftmax, heads: int, kv_heads: int, head_dim: int,
                 layout: tuple, page: int, prefix: str):
        super().__init__(layout, page, prefix, heads, kv_heads, head_dim)
        object.__setattr__(self, "linear", linear)
        self.bounded = bounded
        check_one_step()

    def attend(self, q, k, v, out, views, batch) -> None:
        split = self.bounded.heads
        (qe, ke, ve), (ql, kl, vl) = split.split(q, k, v, dim=1)
        own = {name: view for name, view in views.items() if not name.startswith(EXACT)}
        held = {name[len(EXACT):]: view for name, view in views.items() if name.startswith(EXACT)}
        linear_out, exact_out = torch.empty_like(ql), torch.empty_like(qe)
        attend_linear(self.linear, ql, kl, vl, linear_out, own, batch)
        attend_bounded(self.bounded, qe, ke, ve, exact_out, held, batch)
        out.copy_(split.merge(exact_out, linear_out, dim=1))


def dofattn_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, output: torch.Tensor,
                      layer_name: str) -> None:
    get_forward_context().no_compile_layers[layer_name].run(q, k, v, output)


def dofattn_attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, output: torch.Tensor,
                           layer_name: str) -> None:
    return None


direct_register_custom_op(op_name=OP_NAME, op_func=dofattn_attention, mutates_args=["output"],
                          fake_impl=dofattn_attention_fake)


def swap_attention(model: nn.Module, hf_config, vllm_config: VllmConfig) -> None:
    """Give the student's layers dofattn's attention in a family model vLLM has built: in each layer the student
    linearized, and in each kept layer it bounds after the prompt, the family attention module's paged `Attention`
    (at `.attn`, registered under its layer name) gives way to a state layer under the same name; a linearized layer's
    `LinearAttention` goes beside it, at `.dofattn` (its tensors load under the export's names,
    `model.layers.N.self_attn.dofattn.feature_map.directions`, ...). The family's own forward runs unchanged: its
    projections, q/k norms and RoPE, then `self.attn(q, k, v)`, then its output projection."""
    spec = student_spec(hf_config)
    heads, kv_heads, head_dim = head_layout(hf_config)
    dtype = model_dtype(vllm_config)
    page, layouts = page_bytes(hf_config, dtype), layer_layouts(hf_config, dtype)
    context = vllm_config.compilation_config.static_forward_context
    linear, bounded = student_layers(hf_config)
    for name, module in list(model.named_modules()):
        paged = getattr(module, "attn", None)
        if not isinstance(paged, Attention):
            continue
        layer = extract_layer_index(name)
        if layer not in linear and layer not in bounded:
            continue                                # a kept layer on vLLM's paged cache (or the model's own window)
        prefix = paged.layer_name
        del context[prefix]
        if layer in linear:
            exact = exact_of(spec, layer)
            with torch.device("cpu"):
                own = linear_layer(spec.attention, heads, kv_heads, head_dim, spec.dims[layer], module.scaling,
                                   spec.seed * 1000 + layer, exact=exact).float().eval()
            attach(module, linear=own)                  # where the export's tensors name it (`model.attach`)
            if exact:
                split = HeadSplit(exact, kv_heads, heads)
                split = BoundedSoftmax(spec.kept, spec.attention, module.scaling, heads=split)
                module.attn = DofattnMixed(own, split, heads, kv_heads, head_dim, layouts[layer], page, prefix)
            else:
                module.attn = DofattnState(own, layouts[layer], page, prefix, head_dim)
        else:
            module.attn = DofattnBounded(BoundedSoftmax(spec.kept, spec.attention, module.scaling), heads, kv_heads,
                                         head_dim, bounded_layout(hf_config, dtype), page, prefix)


class DofattnStates(HasInnerState, IsHybrid):
    """What vLLM asks of a model whose layers keep a state per sequence: one page of bytes a layer (`page_bytes`)."""

    is_hybrid = True
    has_inner_state = True

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> tuple[tuple[int, ...], ...]:
        return ((page_bytes(vllm_config.model_config.hf_config, model_dtype(vllm_config)),),)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, ...]:
        return (torch.uint8,)

    @classmethod
    def get_mamba_state_copy_func(cls) -> tuple:
        # only align mode (prefix caching) copies states, which the plugin does not serve; one per state is valid
        return (get_temporal_copy_spec,)


def student_model(family: type) -> type:
    """`Dofattn<Family>`: vLLM's model of an export's family (LlamaForCausalLM, Qwen2ForCausalLM, ...) built as it
    builds it, then given dofattn's attention (`swap_attention`)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_world_size

        student_spec(vllm_config.model_config.hf_config)
        if get_tensor_model_parallel_world_size() != 1 or get_pp_group().world_size != 1:
            raise ValueError("dofattn's vLLM plugin serves on one device (tensor_parallel_size=1, "
                             "pipeline_parallel_size=1)")
        family.__init__(self, vllm_config=vllm_config, prefix=prefix)
        swap_attention(self, vllm_config.model_config.hf_config, vllm_config)

    name = f"Dofattn{family.__name__}"
    return type(name, (DofattnStates, family), {"__init__": __init__, "__module__": __name__, "__qualname__": name,
                                                "__doc__": f"A dofattn export of a {family.__name__} in vLLM."})


DofattnLlamaForCausalLM = student_model(LlamaForCausalLM)
DofattnMistralForCausalLM = student_model(MistralForCausalLM)
DofattnQwen2ForCausalLM = student_model(Qwen2ForCausalLM)
DofattnQwen3ForCausalLM = student_model(Qwen3ForCausalLM)
