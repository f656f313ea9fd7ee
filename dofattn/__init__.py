"""dofattn: turn a pretrained softmax-attention language model into a linear-attention one.

    from dofattn import Attention, Kept, linearize, load
    model, tokenizer, spec = load("runs/long-context")           # a run folder or an export: the trained student
    linearize(base_model, [64] * 30, Attention(window=64, sink=4))  # a loaded HF model made a student, in place

The pipeline, a layer each: `ops` (kernels and their naive references) -> `features` (feature maps) -> `attention`
(the layer in parts) -> `spec` (the student's config) -> `model` (the swap into a Hugging Face model) ->
`distill` (the stages) -> the jobs (`jobs.dof`, `distill.run`, `jobs.eval`, `jobs.generate`, `jobs.bench`,
`jobs.sample`, `export`) -> `commands` (the CLI). The names below load their modules when first used, so `dofattn --help` stays quick.
"""

__version__ = "0.1.0"

_PUBLIC = {"Attention": "dofattn.spec", "Kept": "dofattn.spec", "StudentSpec": "dofattn.spec",
           "linearize": "dofattn.model.student", "load_student": "dofattn.model.student",
           "save_student": "dofattn.model.student",
           "load": ("dofattn.model.exported", "load_any"), "export": "dofattn.jobs.export",
           "StaticDecoder": "dofattn.engine", "load_recipe": ("dofattn.recipe", "load"),
           "set_prompt_chunk": "dofattn.model.prompt"}
__all__ = sorted(_PUBLIC)


def __dir__() -> list[str]:
    """The API names beside the module's own, so that `dir(dofattn)` lists them before they are loaded."""
    return sorted(set(globals()) | set(_PUBLIC))


def __getattr__(name: str):
    """`dofattn.linearize` and the rest of `_PUBLIC`, imported on first use."""
    import importlib

    if name not in _PUBLIC:
        raise AttributeError(f"module 'dofattn' has no attribute {name!r}")
    module, attr = _PUBLIC[name] if isinstance(_PUBLIC[name], tuple) else (_PUBLIC[name], name)
    return getattr(importlib.import_module(module), attr)
