"""Estimate the degrees of freedom of every attention head's softmax kernel and allocate feature dims.

Runs the model over a data sample, keeps J query/key points per head, and computes
DoF(λ) = tr G(G+λI)⁻¹ of the kernel exp(qᵀk/√d) on them. Each layer's DoF is the max over its heads; layers
get feature dimensions proportional to their DoF, with mean --budget. Writes a JSON file (input to
`distill --set student.dims=dof.json`, `generate --dims`) and optionally a plot, and prints a per-layer table.
"""

from __future__ import annotations

from dofattn.commands import add_verb, config


def options() -> list[type]:
    """`jobs.dof.DofConfig`'s fields."""
    from dofattn.jobs.dof import DofConfig

    return [DofConfig]


def add_parser(verbs):
    return add_verb(verbs, "dof", __doc__, options())


def run(ns) -> int:
    """The `dof` verb: `jobs.dof.run`, its tables printed as they are ready."""
    from dofattn.jobs import dof as dof_job

    dof_job.run(config(dof_job.DofConfig, ns), progress=print)
    return 0
