"""Serving dofattn's exported students with vLLM: the `vllm.general_plugins` entry point.

    [project.entry-points."vllm.general_plugins"]
    dofattn = "dofattn.serve:register"

vLLM calls `register()` once in every process it starts (the front end, the engine core, each worker, the process
that inspects a model class), before it reads a model's config. It registers, without importing torch work:
    the architectures `Dofattn<Family>` of each family served (`FAMILIES`), lazily: the classes are in
                      `dofattn.serve.vllm_model` (vLLM's own model of the family with dofattn's attention in the
                      student's layers), imported only where vLLM builds or inspects the model
    the config        model_type "dofattn" with transformers' `AutoConfig`, so that an export loads with no
                      `trust_remote_code` (the folder's own modeling code never runs): `DofattnConfig`, which reads an
                      export's config.json as its base family's config class (`dofattn_export.base_architecture`:
                      LlamaForCausalLM -> LlamaConfig) under model_type "dofattn" (`dispatch_config`)

Importing this package imports neither vllm nor transformers (dofattn works without them). The family config classes
are module attributes (`DofattnLlamaConfig`, ...), made on first use, so that a config pickles by reference into
vLLM's spawned processes, where this plugin is loaded too.
"""

from __future__ import annotations

import functools

from dofattn.spec import MODEL_TYPE

FAMILIES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")   # served bases
MODULE = "dofattn.serve.vllm_model"


def architecture(base: str) -> str:
    """The architecture vLLM builds for an export of `base` (LlamaForCausalLM -> DofattnLlamaForCausalLM)."""
    return f"Dofattn{base}"

_registered = False


def register() -> None:
    """The vLLM plugin: the architecture and the config class, once per process (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AutoConfig
    from vllm import ModelRegistry

    for base in FAMILIES:
        if architecture(base) not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(architecture(base), f"{MODULE}:{architecture(base)}")
    AutoConfig.register(MODEL_TYPE, dispatch_config(), exist_ok=True)
    _without_prefix_caching()
    _registered = True


def _without_prefix_caching() -> None:
    """vLLM turns prefix caching on for a hybrid model by default; a dofattn state is not kept per block of the prompt
    (vLLM's "align" mode), so for a dofattn student the plugin turns it off, with a warning, before vLLM sets
    up the cache (its per-architecture config hook, `MODELS_CONFIG_MAP`). A student whose kept layers are bounded
    after the prompt (student.select) reads each prompt in one step: chunked prefill off, as vLLM does on a CPU for
    a model it cannot chunk."""
    import logging

    from vllm.model_executor.models.config import MODELS_CONFIG_MAP, VerifyAndUpdateConfig

    class DofattnModelConfig(VerifyAndUpdateConfig):
        @staticmethod
        def verify_and_update_config(vllm_config) -> None:
            cache = vllm_config.cache_config
            if cache.enable_prefix_caching:
                logging.getLogger("vllm").warning("dofattn: prefix caching is turned off (a linear layer's state is "
                                                  "not kept per block of the prompt)")
                cache.enable_prefix_caching = False
            kept = (getattr(vllm_config.model_config.hf_config, "dofattn", None) or {}).get("kept") or {}
            scheduler = vllm_config.scheduler_config
            if kept.get("select") and (scheduler.enable_chunked_prefill or scheduler.long_prefill_token_threshold):
                longest = vllm_config.model_config.max_model_len
                logging.getLogger("vllm").warning(
                    "dofattn: chunked prefill is turned off and max_num_batched_tokens raised to max_model_len "
                    f"({longest}): the bounded kept layers (student.select) choose their keys from the whole prompt")
                scheduler.enable_chunked_prefill, scheduler.long_prefill_token_threshold = False, 0
                scheduler.max_num_batched_tokens = max(scheduler.max_num_batched_tokens, longest)

    for base in FAMILIES:
        MODELS_CONFIG_MAP.setdefault(architecture(base), DofattnModelConfig)


@functools.cache
def family_config(base_config_name: str) -> type:
    """`Dofattn<Family>Config`: transformers' `base_config_name` (LlamaConfig, ...) under model_type "dofattn",
    bound here under its own name (pickled by reference)."""
    import transformers

    base = getattr(transformers, base_config_name)
    name = f"Dofattn{base_config_name}"
    cls = type(name, (base,), {"model_type": MODEL_TYPE, "__module__": __name__, "__qualname__": name})
    globals()[name] = cls
    return cls


@functools.cache
def dispatch_config() -> type:
    """`DofattnConfig`, the class `AutoConfig` maps model_type "dofattn" to: its `from_dict` reads the export's base
    family (`dofattn_export.base_architecture`) and returns that family's `Dofattn<Family>Config`."""
    import transformers

    base = getattr(transformers, "PreTrainedConfig", None) or transformers.PretrainedConfig

    class DofattnConfig(base):
        model_type = MODEL_TYPE

        @classmethod
        def from_dict(cls, config_dict, **kwargs):
            architecture = (config_dict.get("dofattn_export") or {}).get("base_architecture")
            model = getattr(transformers, architecture or "", None)
            if model is None:
                raise ValueError(f"this config.json (model_type {MODEL_TYPE!r}) names no base architecture that "
                                 f"transformers {transformers.__version__} has ({architecture!r} in dofattn_export): "
                                 f"not a dofattn export, or one of a newer transformers")
            config = family_config(model.config_class.__name__).from_dict(config_dict, **kwargs)
            return for_vllm(config, architecture)

    DofattnConfig.__module__, DofattnConfig.__qualname__ = __name__, "DofattnConfig"
    globals()["DofattnConfig"] = DofattnConfig
    return DofattnConfig


def student_layers(config) -> tuple[list[int], list[int]]:
    """(the layers linearized, the kept ones bounded after the prompt) of an export's config: the layers whose
    attention the plugin serves; the others stay vLLM's paged attention."""
    from dofattn.model.exported import export_spec
    from dofattn.model.student import bounded_layers

    spec = export_spec(getattr(config, "dofattn", None))
    text = config.get_text_config(decoder=True)
    return list(spec.layers), bounded_layers(config, text.num_hidden_layers, list(spec.layers), spec.kept)


def for_vllm(config, base: str):
    """An export's config as vLLM reads it: the architecture its plugin builds for the base family
    (`architecture`), and, where the family lists its layers' types, the student's own layers marked
    "linear_attention" (vLLM takes a model whose types are all "full_attention" for one without state layers;
    Qwen2 then asks for max_window_layers = num_hidden_layers, a sliding-window rule that no window here breaks)."""
    if base not in FAMILIES:
        raise ValueError(f"dofattn's vLLM plugin serves students of {', '.join(FAMILIES)}; this export's base is "
                         f"{base}")
    config.architectures = [architecture(base)]
    types = getattr(config, "layer_types", None)
    if types and all(t == "full_attention" for t in types):
        ours = set().union(*student_layers(config))
        config.layer_types = ["linear_attention" if i in ours else t for i, t in enumerate(types)]
        if getattr(config, "max_window_layers", None) is not None and not getattr(config, "use_sliding_window", False):
            config.max_window_layers = config.num_hidden_layers
    return config


def __getattr__(name: str):
    """`DofattnLlamaConfig` & co. (what a pickled config names): made on first use."""
    if name == "DofattnConfig":
        return dispatch_config()
    if name.startswith("Dofattn") and name.endswith("Config"):
        try:
            return family_config(name[len("Dofattn"):])
        except AttributeError:
            pass
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
