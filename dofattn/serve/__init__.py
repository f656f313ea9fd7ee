"""Serving dofattn's exported students with vLLM: the `vllm.general_plugins` entry point.

    [project.entry-points."vllm.general_plugins"]
    dofattn = "dofattn.serve:register"

vLLM calls `register()` once in every process it starts (the front end, the engine core, each worker, the process
that inspects a model class), before it reads a model's config. It registers, without importing torch work:
    the architecture  `DofattnForCausalLM` (an export's config.json `architectures`), lazily: the class is in
                      `dofattn.serve.vllm_model` (vLLM's own Llama with dofattn's linear attention in the linearized
                      layers), imported only where vLLM builds or inspects the model
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

ARCHITECTURE = "DofattnForCausalLM"
MODEL_CLASS = "dofattn.serve.vllm_model:DofattnForCausalLM"
MODEL_TYPE = "dofattn"        # = dofattn.exported.MODEL_TYPE (not imported here: that module imports torch)

_registered = False


def register() -> None:
    """The vLLM plugin: the architecture and the config class, once per process (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AutoConfig
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    AutoConfig.register(MODEL_TYPE, dispatch_config(), exist_ok=True)
    _without_prefix_caching()
    _registered = True


def _without_prefix_caching() -> None:
    """vLLM turns prefix caching on for a hybrid model by default; a dofattn state is not kept per block of the prompt
    (vLLM's "align" mode), so for a `DofattnForCausalLM` the plugin turns it off, with a warning, before vLLM sets
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

    MODELS_CONFIG_MAP.setdefault(ARCHITECTURE, DofattnModelConfig)


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
            return family_config(model.config_class.__name__).from_dict(config_dict, **kwargs)

    DofattnConfig.__module__, DofattnConfig.__qualname__ = __name__, "DofattnConfig"
    globals()["DofattnConfig"] = DofattnConfig
    return DofattnConfig


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
