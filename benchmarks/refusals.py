"""How long a command takes to refuse a bad value, and whether it imported torch or transformers first.

    python3 benchmarks/refusals.py --out refusals.json

Each case runs `dofattn.cli.main(argv)` in a fresh interpreter (in an empty temporary folder) and records its exit
code, the seconds from importing `dofattn.cli` to the refusal, whether torch and transformers were imported, and
the error line; the table goes to stdout, every row to --out. The cases are tests/test_cli.py's VALUE_ONLY (which
asserts the imports, not the times).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CODE = ("import sys, time\nt = time.perf_counter()\nfrom dofattn.cli import main\n"
        "try:\n    code = main(sys.argv[1:])\nexcept SystemExit as stop:\n    code = stop.code\n"
        "print('@@', code, round(time.perf_counter() - t, 3), 'torch' in sys.modules, 'transformers' in sys.modules,"
        " file=sys.stderr)")


def cases() -> list[list[str]]:
    sys.path.insert(0, str(ROOT))
    from tests.test_cli import VALUE_ONLY

    return [argv for argv, _ in VALUE_ONLY]


def measure(argv: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        done = subprocess.run([sys.executable, "-c", CODE, *argv], capture_output=True, text=True, cwd=folder)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    code, seconds, torch, transformers = lines[-1].split()[1:]
    errors = [line for line in lines if "error:" in line]
    return {"argv": argv, "exit": int(code), "seconds": float(seconds), "torch": torch == "True",
            "transformers": transformers == "True", "error": errors[-1] if errors else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="write the rows to this JSON file")
    args = parser.parse_args()
    rows = []
    for argv in cases():
        rows.append(row := measure(argv))
        print(f"{' '.join(argv):55s} exit {row['exit']}  {row['seconds']:6.2f} s  torch {row['torch']!s:5s}  "
              f"transformers {row['transformers']}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"python": sys.version.split()[0], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
