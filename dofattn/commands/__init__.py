"""The `dofattn` verbs, one module each (`dofattn.commands.<verb>`), and the options they make from a config
dataclass.

A command module has
- a docstring: the verb's `--help` description, its first line the verb's line in `dofattn --help`;
- `options()`: the dataclasses whose fields are its options, the library job's own config (`jobs.bench.BenchConfig`,
  `jobs.dof.DofConfig`, `jobs.eval.EvalConfig`, `jobs.generate.GenerateConfig`, `export.ExportConfig`, the
  `jobs.sample.SampleSpec` and `SampleRun` of a `SampleConfig`; distill's recipe and `distill.run.DistillConfig`);
- `add_parser(verbs)`: its subparser, made by `add_verb`;
- `run(ns) -> int`: the verb, from the parsed namespace (`config(cls, ns)` turns it into the dataclass): it builds
  the job's config and calls the job, every one of the same shape, `<job>.run(config, progress=print)` (progress:
  a callable that gets each line, or None for quiet), then prints what it gives.

A module imports its library only inside these functions, so that `dofattn --help` reads the docstrings alone.

A field is an option when its metadata has a `help`; the flag is `--field-name` and the help line ends with the
default. The metadata may also give `choices`, `metavar`, `action` ("append"), `positional` (an optional
positional argument), `none`: the word that stands for None on the command line ("auto", "none"), shown as the
default where the default is None, and `was`: the option's old name (or names), which now gets a one-line error
naming the new. The field's type picks the parsing: bool is a switch, int and float are numbers, `list[int]` and
`list[str]` are comma-separated (`list[int]`: token counts, each >= 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import types
import typing

from dofattn.errors import UserError
from dofattn.options import Device

VERBS = ("dof", "distill", "recipes", "eval", "generate", "bench", "sample", "export")


def module(verb: str) -> types.ModuleType:
    """The command module of `verb`."""
    return importlib.import_module(f"dofattn.commands.{verb}")


def summary(doc: str) -> str:
    """A verb's line in `dofattn --help`: the first line of its module's docstring."""
    return doc.strip().splitlines()[0]


def add_verb(verbs, name: str, doc: str, classes, order: tuple[str, ...] = (), epilog: str | None = None):
    """The subparser of verb `name`: `doc` (its module's docstring) as the description, the fields of `classes`
    as options (in `order` where given, the rest after in field order)."""
    sub = verbs.add_parser(name, help=summary(doc), description=doc.strip(), epilog=epilog,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(sub, *classes, order=order)
    return sub


def _fields(classes, order: tuple[str, ...] = ()) -> list[tuple[dataclasses.Field, object]]:
    """(field, type) of every option field of `classes`, in `order` first."""
    from dofattn.options import Machine

    shared = {f.name for f in dataclasses.fields(Machine)}
    items = []
    for cls in classes:
        hints = typing.get_type_hints(cls)
        fields = [f for f in dataclasses.fields(cls) if "help" in f.metadata]
        # a job's own options first, the device options it inherits (`options.Machine`) after them
        items += [(f, hints[f.name]) for f in sorted(fields, key=lambda f: f.name in shared)]
    rank = {name: i for i, name in enumerate(order)}
    return sorted(items, key=lambda item: rank.get(item[0].name, len(rank)))   # stable: field order otherwise


def _base(kind):
    """`X` of `X | None`."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    return args[0] if typing.get_origin(kind) in (typing.Union, types.UnionType) and len(args) == 1 else kind


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _shown(value, none: str | None) -> str | None:
    if value is None:
        return none
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


def add_options(parser: argparse.ArgumentParser, *classes, order: tuple[str, ...] = ()) -> None:
    """An argument for every option field of `classes` (see the module docstring)."""
    for f, kind in _fields(classes, order):
        meta = dict(f.metadata)
        help_text, none = meta.pop("help"), meta.pop("none", None)
        was = meta.pop("was", ())
        for old in (was,) if isinstance(was, str) else was:
            parser.add_argument(flag(old), nargs="?", action=Renamed, help=argparse.SUPPRESS, new=flag(f.name),
                                verb=parser.prog.split()[-1])
        if meta.get("choices") is None:
            meta.pop("choices", None)
        default, kind = _default(f), _base(kind)
        short = (meta.pop("short"),) if "short" in meta else ()        # e.g. -v beside --verbose
        if meta.pop("positional", False):
            parser.add_argument(f.name, nargs="?", default=default, help=help_text)
            continue
        if kind is bool:
            parser.add_argument(*short, flag(f.name), action="store_true", help=help_text)
            continue
        shown = _shown(default, none)
        suffix = f" (default: {shown})" if shown is not None else ""
        parse = finite if kind is float else kind if kind is int else str    # lists: split and checked by `config`
        if none is not None and parse is not str:
            parse = _or_word(parse, none)
        if meta.get("action") == "append":
            parse = _base(typing.get_args(kind)[0]) if typing.get_origin(kind) is list else str
        parser.add_argument(flag(f.name), type=parse, default=default, help=help_text + suffix, **meta)


class Renamed(argparse.Action):
    """An option's old name: a one-line error that gives the new one."""

    def __init__(self, option_strings, dest, new: str, verb: str, **kwargs):
        super().__init__(option_strings, dest=argparse.SUPPRESS, **kwargs)
        self.new, self.verb = new, verb

    def __call__(self, parser, namespace, values, option_string=None):
        raise UserError(f"{self.verb} {option_string} is now {self.new}: `dofattn {self.verb} --help` lists the "
                        f"options")


def finite(text: str) -> float:
    """A float option's value: a number, not nan or infinity (argparse's one-line error otherwise)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _or_word(parse, word: str):
    """`parse` (int, float) that lets `word` through as it is, for `config` to make None."""
    def parse_or_word(text: str):
        return text if text == word else parse(text)

    parse_or_word.__name__ = parse.__name__           # argparse's message: "invalid int value: 'x'"
    return parse_or_word


def token_counts(text: str, what: str) -> list[int]:
    """'512,2048' -> [512, 2048]; a UserError naming `what` for anything but positive integers."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{what} takes comma-separated token counts like 512,2048, got {text!r}") from None
    if not values or min(values) < 1:
        raise UserError(f"{what} takes positive token counts like 512,2048, got {text!r}")
    return values


def _value(f: dataclasses.Field, kind, value):
    """A parsed option as the field holds it: the `none` word is None, a comma-separated list a list."""
    none = f.metadata.get("none")
    if none is not None and value == none:
        return None
    kind = _base(kind)
    if typing.get_origin(kind) is list and isinstance(value, str):
        if typing.get_args(kind) == (int,):
            return token_counts(value, flag(f.name) + (f" (or {none})" if none else ""))
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


def config(cls, ns: argparse.Namespace, **values):
    """An instance of `cls` from the parsed options in `ns` (its fields that are no option: their defaults, or
    `values`)."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in values:
            kwargs[f.name] = values[f.name]
        elif "help" in f.metadata and hasattr(ns, f.name):
            kwargs[f.name] = _value(f, hints[f.name], getattr(ns, f.name))
    made = cls(**kwargs)
    if isinstance(made, Device):
        made.check_machine()                 # before a job imports torch or loads a model
    return made
