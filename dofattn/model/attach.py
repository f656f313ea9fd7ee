"""Where a student's modules sit in a Hugging Face attention module, in one place: a linearized layer's
`LinearAttention` and a kept layer's `BoundedSoftmax` are children under fixed names (their tensors are saved and
exported under them: `model.layers.N.self_attn.dofattn.feature_map.directions`). Everything else finds them here.

    attach(module, linear=LinearAttention(...))        # the layer is linear from now on
    linear_of(module)                                  # its LinearAttention, or None: a softmax layer
    detach(module)                                     # softmax again (the teacher's layer)
"""

from __future__ import annotations

from torch import nn

LINEAR = "dofattn"              # a linearized layer's `LinearAttention`
BOUNDED = "dofattn_bounded"     # a kept softmax layer's `BoundedSoftmax`: its cache bounded after the prompt


def linear_of(module: nn.Module) -> nn.Module | None:
    """The `LinearAttention` of an attention module, or None: a softmax layer (kept, or a teacher's)."""
    return module._modules.get(LINEAR)


def bounded_of(module: nn.Module) -> nn.Module | None:
    """The `BoundedSoftmax` of a kept softmax layer whose cache is bounded after the prompt, or None."""
    return module._modules.get(BOUNDED)


def attach(module: nn.Module, linear: nn.Module | None = None, bounded: nn.Module | None = None) -> None:
    """Give an attention module its linear attention or its bounded cache (a child module each)."""
    if linear is not None:
        module.add_module(LINEAR, linear)
    if bounded is not None:
        module.add_module(BOUNDED, bounded)


def detach(module: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """Take the student's modules off an attention module (its softmax attention runs again): (linear, bounded)."""
    return module._modules.pop(LINEAR, None), module._modules.pop(BOUNDED, None)
