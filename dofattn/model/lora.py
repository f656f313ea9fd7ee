"""LoRA adapters on the attention projections (q, k, v, o) of a linearized student, and optionally on its MLPs,
through peft.

    add_lora(model, rank=8)          # in place: the projections gain lora_A/lora_B (B = 0, so nothing changes yet)
    add_lora(model, rank=8, targets="all")   # the MLP projections as well
    lora_parameters(model)           # what the end-to-end phase trains beside the feature maps
    merge_lora(model)                # fold B·A into the projection weights for inference

The adapters are injected into the HF modules where they are (`peft.inject_adapter_in_model`), not by wrapping the
model, so parameter names keep their place (`...self_attn.q_proj.lora_A.default.weight`) and a student folder saves
them with the feature maps. The targets of every layer, by family:

                            attention                                   mlp (targets="all" only)
    llama, mistral, qwen2,  self_attn.{q,k,v,o}_proj                    mlp.{gate,up,down}_proj
    qwen3, gemma2,
    gemma3_text, olmo2
    phi3                    self_attn.qkv_proj (q, k and v in one)      mlp.gate_up_proj and mlp.down_proj
                            and self_attn.o_proj
    gpt2                    attn.c_attn (q, k and v in one matrix)      mlp.c_fc and mlp.c_proj
                            and attn.c_proj
    gpt_neox                attention.query_key_value and               mlp.dense_h_to_4h and mlp.dense_4h_to_h
                            attention.dense

On a 16-bit model the adapters are float32 all the same: Adam's small updates would round away in bfloat16, and the
rank-R products cost nothing beside the frozen 16-bit projections (peft casts their input to the adapters' dtype
and the sum back to the projection's).

`teacher_mode` (evaluate.py) switches the adapters off, so the teacher inside a LoRA student is the base model.
A merged student has no adapters left to switch off: it cannot serve as its own teacher.
"""

from __future__ import annotations

from torch import nn

from dofattn.errors import UserError

_QKVO = r".*\.self_attn\.(q_proj|k_proj|v_proj|o_proj)"
_GATED_MLP = r".*\.mlp\.(gate_proj|up_proj|down_proj)"
TARGETS = {
    **dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "olmo2"), _QKVO),
    "phi3": r".*\.self_attn\.(qkv_proj|o_proj)",
    "gpt2": r".*\.attn\.(c_attn|c_proj)",
    "gpt_neox": r".*\.attention\.(query_key_value|dense)",
}
MLP_TARGETS = {
    **dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "olmo2"), _GATED_MLP),
    "phi3": r".*\.mlp\.(gate_up_proj|down_proj)",
    "gpt2": r".*\.mlp\.(c_fc|c_proj)",
    "gpt_neox": r".*\.mlp\.(dense_h_to_4h|dense_4h_to_h)",
}
LORA_TARGETS = ("attention", "all")   # what --lora-targets names: the attention projections, or those and the MLPs
MARK = ".lora_"


def require_peft():
    """peft, or a UserError that says how to install it (called before any training that will need it)."""
    try:
        import peft
    except ImportError:
        raise UserError("LoRA needs peft, dofattn's [lora] extra: pip install -e '.[lora]' in a checkout, or pip "
                        "install 'peft>=0.13'") from None
    return peft


def add_lora(model: nn.Module, rank: int, alpha: float | None = None, seed: int = 0,
             targets: str = "attention") -> nn.Module:
    """Inject rank-`rank` LoRA adapters (scale alpha/rank, alpha = rank by default) into the attention projections,
    and with `targets` = "all" into the MLP projections too."""
    import torch

    if rank < 1:
        raise UserError(f"LoRA rank must be >= 1, got {rank}")
    if targets not in LORA_TARGETS:
        raise UserError(f"unknown LoRA targets {targets!r}; use one of {', '.join(LORA_TARGETS)}")
    model_type = model.config.model_type
    if model_type not in TARGETS:
        raise UserError(f"no LoRA targets known for model type {model_type!r}; supported: {', '.join(TARGETS)}")
    peft = require_peft()
    pattern = TARGETS[model_type]
    if targets == "all":
        pattern = f"(?:{pattern})|(?:{MLP_TARGETS[model_type]})"
    config = peft.LoraConfig(r=rank, lora_alpha=alpha or rank, lora_dropout=0.0, target_modules=pattern,
                             fan_in_fan_out=model_type == "gpt2")  # GPT-2's Conv1D stores weights transposed
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft.inject_adapter_in_model(config, model)
    for _, p in lora_parameters(model):          # float32 master weights, also on a 16-bit base
        p.data = p.data.float()
    return model


def lora_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if MARK in n]


def lora_layers(model: nn.Module) -> list[nn.Module]:
    """The projections carrying adapters (none, without importing peft, for a model that has no LoRA)."""
    if not any(MARK in n for n, _ in model.named_parameters()):
        return []
    require_peft()
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def merge_lora(model: nn.Module) -> int:
    """Fold every adapter into its projection weight (in place); returns how many projections were merged."""
    layers = lora_layers(model)
    for layer in layers:
        layer.merge()
    return len(layers)


def set_lora_enabled(model: nn.Module, enabled: bool) -> bool:
    """Switch every adapter on or off; returns whether any adapter exists. Merged adapters cannot be switched off."""
    layers = lora_layers(model)
    for layer in layers:
        if layer.merged and not enabled:
            raise UserError("this student's LoRA adapters are merged into the weights, so its base model (the "
                            "teacher) is gone; load the student without merging to compare with the teacher")
        layer.enable_adapters(enabled)
    return bool(layers)
