"""A random sample of option values (NaN, infinity, 0, negative, huge) through every command's checks.

Every numeric option of every command, and a numeric recipe key of each table, is given values drawn from `VALUES`
(a fixed seed, so a failure reproduces). Each case runs `dofattn.cli.main` in one fresh interpreter in which importing
torch or transformers raises `Heavy`: a case either is refused (exit 2, one `error:` line, nothing written) or passes
the checks that need only the options and reaches the heavy part (the import). NaN and infinity never pass, and
nothing ends in a traceback. Large values that pass here meet the plan (a run of months, a block past free memory:
`distill.plan.warn`, `check_room`) or the model's context once it is read.
"""

import dataclasses
import json
import random
import subprocess
import sys
import typing

from dofattn.commands import VERBS, _base, _fields, module

VALUES = ["nan", "inf", "-inf", "0", "-1", "-0.5", "1e30", "99999999999", "2.5"]
NOT_FINITE = {"nan", "inf", "-inf"}
BASE = {"dof": [], "distill": [], "eval": ["--model", "smollm2-135m"], "generate": [], "bench": [],
        "sample": ["--out", "s.jsonl"], "export": ["--model", ".", "--out", "x"]}
RECIPE_KEYS = ["layerwise.lr", "layerwise.steps", "end_to_end.lr", "end_to_end.seq_len", "dof.lam", "student.window",
               "eval.blocks"]
CASES_PER_VERB = 12


def numeric_options(verb: str) -> list[str]:
    """The flags of `verb` that take a number (int or float, or a list of them)."""
    flags = []
    for f, kind in _fields(module(verb).options()):
        kind = _base(kind)
        if typing.get_origin(kind) is list:
            kind = _base(typing.get_args(kind)[0])
        if kind in (int, float) and not f.metadata.get("positional"):
            flags.append("--" + f.name.replace("_", "-"))
    return flags


def cases() -> list[list[str]]:
    rng = random.Random(69)
    found = []
    for verb in VERBS:
        if verb == "recipes":
            continue
        pairs = [(flag, value) for flag in numeric_options(verb) for value in VALUES]
        for flag, value in rng.sample(pairs, min(CASES_PER_VERB, len(pairs))):
            found.append([verb, *BASE[verb], f"{flag}={value}"])      # = : argparse reads "-1" as a value
    for key in RECIPE_KEYS:
        for value in rng.sample(VALUES, 3):
            found.append(["distill", "--set", f"{key}={value}"])
    return found


SCRIPT = """
import json, sys, traceback

class Heavy(Exception):
    pass

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'transformers'):
            raise Heavy(name)

sys.meta_path.insert(0, Refuse())
from dofattn.cli import main
for argv in json.loads(sys.argv[1]):
    print('@@', file=sys.stderr, flush=True)
    try:
        code = main(argv)
    except SystemExit as exit:
        code = exit.code
    except Heavy:
        code = 'heavy'
    except BaseException:
        traceback.print_exc()
        code = 'traceback'
    print(json.dumps(code), flush=True)
"""


def test_a_random_sample_of_option_values_is_refused_in_one_line_or_passes(tmp_path):
    argvs = cases()
    assert len(argvs) > 60 and {a[0] for a in argvs} == set(VERBS) - {"recipes"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(argvs)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=600)
    codes = [json.loads(line) for line in done.stdout.splitlines() if line.strip()[:1] in '0123456789"-']
    errs = done.stderr.split("@@\n")[1:]
    assert len(codes) == len(argvs) == len(errs), done.stderr[-3000:]
    for argv, code, err in zip(argvs, codes, errs):
        lines = [line for line in err.splitlines() if "error:" in line]
        assert code in (2, "heavy"), (argv, code, err)
        if code == 2:
            assert len(lines) == 1, (argv, err)
        if argv[-1].split("=")[-1] in NOT_FINITE:
            assert code == 2 and ("finite" in lines[0] or "invalid int" in lines[0] or "a whole number" in lines[0]
                                  or "integer" in lines[0]), (argv, err)
    assert not [p for p in tmp_path.iterdir()], sorted(p.name for p in tmp_path.iterdir())
    threads = [code for argv, code in zip(argvs, codes) if "--threads=99999999999" in argv]
    assert all(code == 2 for code in threads)
    refused = sum(code == 2 for code in codes)
    assert refused > len(argvs) // 3                  # the sample has bad values, and they are caught
