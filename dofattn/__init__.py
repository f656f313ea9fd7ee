"""dofattn: turn a pretrained softmax-attention language model into a linear-attention one.

Stages, one module each: `hf` (load models), `data` (text -> token blocks), `capture` (the attention's real
queries, keys and values), `dof` (degrees of freedom per layer and the feature-dimension allocation), `cli`.
"""

__version__ = "0.1.0"
