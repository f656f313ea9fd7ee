"""The `dofattn` command line: one verb per stage, each in its own module of `dofattn.commands`.

    dofattn dof                                   # DoF per layer of SmolLM2-135M on the Wikipedia sample
    dofattn dof --model gpt2 --lam 0.0625 --out gpt2-dof.json --plot gpt2-dof.png

Each verb's options come from a config dataclass (the library's own where there is one: `dofattn bench`'s are
`bench.BenchConfig`'s fields); see `dofattn.commands`. Only the verb on the command line is loaded in full, so
`dofattn --help` stays quick. Errors in what was asked for print one line (`dofattn: error: ...`) and exit with
status 2.
"""

from __future__ import annotations

import argparse
import sys

from dofattn import __version__
from dofattn.commands import VERBS, module, summary
from dofattn.errors import UserError
from dofattn.options import BUSY_LOAD


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    """The parser, with every verb's subparser in full when `verb` is None, else that verb's alone in full and the
    others' help lines."""
    parser = argparse.ArgumentParser(
        prog="dofattn",
        description="Turn a pretrained softmax-attention LM into a linear-attention one, with feature "
                    "dimensions allocated by the degrees of freedom of each layer's attention kernel.")
    parser.add_argument("--version", action="version", version=f"dofattn {__version__}")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB")
    for name in VERBS:
        command = module(name)
        if verb is None or verb == name:
            command.add_parser(verbs).set_defaults(run=command.run)
        else:
            verbs.add_parser(name, help=summary(command.__doc__))
    return parser


def keep_freed_memory() -> bool:
    """Let freed tensors' memory stay in the process for the next ones instead of going back to the system and
    coming back as new zeroed pages at every step (glibc: memory of blocks up to 64 MiB comes from the heap, which is
    never trimmed; larger ones are mapped and returned as before). On the CPU a layerwise step of the default job
    spent half its time in the kernel doing that: 20 steps of an 8 K block took 17.4 s with 10 M page faults, 5.1 s
    with 0.6 M with this, the results bit for bit the same; an end-to-end step of `window` peaked at 3.35 GiB either
    way (heap blocks of up to 2 GiB: 5.8 s, but 4.08 GiB: the heap fragments). `main` calls it; False where the C
    library is not glibc (then nothing changes). docs/log/experiments.md, 2026-11-28."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(mallopt(M_MMAP_THRESHOLD, 64 << 20) and mallopt(M_TRIM_THRESHOLD, 2 ** 31 - 1))


def wait_passively_when_busy(environ=None, load: float | None = None) -> str | None:
    """With other work on the cores (a 1-minute load average of at least `BUSY_LOAD`), torch's OpenMP threads are
    told to sleep at a barrier instead of spinning (`OMP_WAIT_POLICY=PASSIVE`), unless the policy is set already or
    torch is loaded (the library reads it once, when it loads). A spinning thread waits for a partner the scheduler
    has put off the core; a student's read of a prompt opens thousands of parallel regions, so on a 2-core Intel Xeon
    with one 2-thread job beside it, reading 2,048 tokens took 35.9 s (the teacher 8.7 s) spinning and 7.8 s (the
    teacher 7.8 s) passive; idle, passive costs it 1.5x (docs/log/experiments.md, 2026-12-01). Returns the line to
    print when it set the policy, else None."""
    import os

    environ = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" in environ or "torch" in sys.modules:
        return None
    try:
        load = os.getloadavg()[0] if load is None else load
    except OSError:
        return None
    if load < BUSY_LOAD:
        return None
    environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return (f"dofattn: other work is using the CPU (load {load:.1f}): threads wait passively "
            f"(OMP_WAIT_POLICY=PASSIVE; set OMP_WAIT_POLICY to choose)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    verb = next((a for a in argv if not a.startswith("-")), "")      # the top level has no option with a value
    parser = build_parser(verb if verb in VERBS else "")
    try:
        ns = parser.parse_args(argv)
        if ns.verb is None:
            parser.print_help()
            return 2
        keep_freed_memory()
        if (line := wait_passively_when_busy()) is not None:
            print(line, file=sys.stderr)
        return ns.run(ns)
    except UserError as err:
        print(f"dofattn: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dofattn: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:             # `dofattn recipes --keys | head`: the reader has gone; nothing more to say
        quiet_stdout()
        return 1


def quiet_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush into a closed pipe raises nothing."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
