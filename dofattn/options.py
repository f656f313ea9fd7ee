"""One way to declare a documented config field, for every config of the package: the student's `spec.Attention`,
the recipe's tables (`recipe`), and the library configs that the commands turn into options (`jobs.bench.BenchConfig`,
`jobs.eval.EvalConfig`, `jobs.sample.SampleSpec`; `dofattn.commands`).

    window: int = option(64, "exact softmax attention over the last W tokens (0: pure linear)")
    decay: str = option("none", "decay of the linear state", choices=("none", "head", "gate"))

The metadata holds `help` (a recipe key's meaning, an option's help line), `choices` (None: any value) and whatever
else a command's option takes (`dofattn.commands`: metavar, action, positional, none). Importing this module
imports nothing heavy, so `dofattn --help` stays fast.
"""

from __future__ import annotations

import dataclasses

from dofattn.errors import UserError

BUSY_LOAD = 1.0     # the 1-minute load average from which other work is taken to share the cores (cli, plan timings)

DATA_HELP = ("wiki-sample, a .txt/.jsonl/.parquet file or folder, hf:NAME[:CONFIG[:SPLIT]], or several of these "
             "joined by + (pooled)")


def option(default, help: str, **extra):
    """A config field: its default (a list is copied for each instance), its help and any of the keys above."""
    metadata = {"help": help, "choices": extra.pop("choices", None), **extra}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass
class Device:
    """Where a job runs: the options of every command that runs a model, declared once (a job's config inherits
    them; `distill` takes its dtype from the recipe)."""

    device: str = option("auto", "cpu, cuda, cuda:N, or auto (cuda if available)")
    threads: int | None = option(None, "CPU threads for torch (auto: one per core; on a busy CPU 1 can decode "
                                       "faster)", none="auto")

    def check_machine(self) -> None:
        """The rules on these options that need no torch: answered before anything heavy loads."""
        if self.threads is not None and self.threads < 1:
            raise UserError(f"--threads must be at least 1, got {self.threads}")
        import os

        cores = os.cpu_count() or 1
        if self.threads is not None and self.threads > 4 * cores:
            raise UserError(f"--threads {self.threads} is more than 4 per core of this machine's {cores}: give at most "
                            f"{cores} (or auto)")
        if self.device not in ("auto", "cpu", "cuda") and not (
                self.device.startswith("cuda:") and self.device[5:].isdigit()):
            raise UserError(f"unknown device {self.device!r}; use cpu, cuda, cuda:N or auto")


@dataclasses.dataclass
class Machine(Device):
    """Where a job runs its model and in what dtype: the options of every command that loads one."""

    dtype: str = option("float32", "the model's dtype; auto: bfloat16 where the device computes it fast (CUDA; "
                                   "CPUs with avx512_bf16 or AMX), else float32, as a recipe's run.dtype auto",
                        choices=("float32", "bfloat16", "auto"))


def check_extend_to(length: int | None) -> None:
    """--extend-to's own rule, before a model loads (None: not asked for); the model's are `extend_context`'s."""
    if length is not None and length < 1:
        raise UserError(f"--extend-to {length}: give a number of tokens past the model's context")
