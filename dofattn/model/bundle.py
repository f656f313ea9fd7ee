"""An export's own copy of the code it runs, so that it loads where dofattn is not installed.

    (folder / BUNDLE_FILE).write_text(bundle_text())       # `dofattn export` does this
    from .dofattn_code import load                         # the export's modeling file does this
    DofattnConfig, DofattnForCausalLM = load("model.exported").student_classes("LlamaForCausalLM", module=__name__)

`bundle_text` is one Python file, `dofattn_code.py`: the package's modules that loading and running a student can
reach (the import closure of `dofattn.model.exported`, imports inside functions included, and the Triton kernels, which load
only where Triton does), each module's source as it is in this dofattn, one source line to a line of the file, with
its imports of `dofattn` renamed to the bundle's own package (`_dofattn_<hash>`), and an importer that serves them
from the file. So:
- the export's code cannot drift from the package's: it is the package's, copied when the export is written;
- transformers copies the file beside the modeling file (a relative import) and checks the imports of both: the
  bundle's own are the standard library's; the modules' (torch and transformers; Triton, fla or peft where
  present) run only when their module is imported, as in the package;
- an installed dofattn is never imported by an export, and exports of different dofattn versions load side by
  side (another name each).
"""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path

from dofattn import __version__

BUNDLE_FILE = "dofattn_code.py"
ROOTS = ("dofattn.model.exported", "dofattn.ops.triton")   # an export's classes; the kernels, loaded by name
PACKAGE = Path(__file__).resolve().parent.parent   # the dofattn package's folder


def module_file(name: str) -> Path | None:
    """The source file of the package's module `name` (dotted), or None if there is none."""
    path = PACKAGE.parent.joinpath(*name.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def imported(name: str) -> set[str]:
    """The package's modules that the module `name` imports anywhere in its source (inside functions too), and
    the packages above each."""
    found = set()
    for node in ast.walk(ast.parse(module_file(name).read_text())):
        names = ([node.module] + [f"{node.module}.{a.name}" for a in node.names]
                 if isinstance(node, ast.ImportFrom) and node.module and not node.level
                 else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        for full in names:
            if full == "dofattn" or full.startswith("dofattn."):
                parts = full.split(".")
                found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return {n for n in found if module_file(n) is not None}


def closure(roots=ROOTS) -> list[str]:
    """Every module the roots reach through imports, sorted."""
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(imported(name) - seen)
    return sorted(seen)


def renamed(source: str, modules: set[str], package: str) -> str:
    """`source` with its imports of dofattn (statements, and string literals naming a module of the bundle below
    the package, as `importlib.import_module` takes them) pointing at `package`. The bare word "dofattn" (the
    attention implementation, the config entry, a child module's name) stays."""
    lines = source.splitlines(keepends=True)
    tree = ast.parse(source)
    starts = []                                       # (line, column) of each "dofattn" to rename
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            named = [node.module] if node.module and not node.level else []
        elif isinstance(node, ast.Import):
            named = [a.name for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.lineno == node.end_lineno:
            named = [node.value] if "." in node.value and node.value in modules else []   # "dofattn" alone: a name
        else:
            continue
        if any(n == "dofattn" or n.startswith("dofattn.") for n in named):
            starts.append((node.lineno - 1, lines[node.lineno - 1].index("dofattn", node.col_offset)))
    for row, col in sorted(starts, reverse=True):                                      # from the end of a line
        lines[row] = lines[row][:col] + package + lines[row][col + len("dofattn"):]
    return "".join(lines)


LOADER = '''

import importlib
import importlib.abc
import importlib.util
import linecache
import sys


class _Importer(importlib.abc.MetaPathFinder, importlib.abc.InspectLoader):
    """Serves the modules of SOURCES as the package PACKAGE, each with its source in `linecache` (under a name of
    its own) for `inspect`, which Triton's kernels read."""

    def find_spec(self, fullname, path=None, target=None):
        key = fullname[len(PACKAGE) + 1:] if fullname.startswith(PACKAGE + ".") else "" if fullname == PACKAGE else None
        if key is None or key not in SOURCES:
            return None
        return importlib.util.spec_from_loader(fullname, self, origin=self.filename(key),
                                               is_package=key in PACKAGES)

    def filename(self, key):
        return f"{__file__}/{key or '__init__'}.py"

    def key(self, fullname):
        return fullname[len(PACKAGE) + 1:] if fullname != PACKAGE else ""

    def is_package(self, fullname):
        return self.key(fullname) in PACKAGES

    def get_source(self, fullname):
        return "\\n".join(SOURCES[self.key(fullname)]) + "\\n"

    def get_code(self, fullname):
        name, source = self.filename(self.key(fullname)), self.get_source(fullname)
        linecache.cache[name] = (len(source), None, source.splitlines(True), name)
        return compile(source, name, "exec", dont_inherit=True)

    def exec_module(self, module):
        module.__file__ = self.filename(self.key(module.__name__))
        exec(self.get_code(module.__name__), module.__dict__)


def load(module=""):
    """The bundle's module `module` (dotted, under the package: "exported"), its package importable from here on."""
    if not any(isinstance(f, _Importer) and f.package == PACKAGE for f in sys.meta_path):
        importer = _Importer()
        importer.package = PACKAGE
        sys.meta_path.append(importer)
    return importlib.import_module(f"{PACKAGE}.{module}" if module else PACKAGE)
'''


def bundle_text(roots=ROOTS) -> str:
    """dofattn_code.py: the modules `roots` reach, renamed under their own package, and their importer."""
    names = closure(roots)
    sources = {name: module_file(name).read_text() for name in names}
    digest = hashlib.sha256("".join(f"{n}\0{s}\0" for n, s in sources.items()).encode()).hexdigest()[:12]
    package = f"_dofattn_{digest}"
    modules = set(names)
    packages = sorted(n.removeprefix("dofattn").lstrip(".") for n in names if module_file(n).name == "__init__.py")
    out = [f'"""The code of a dofattn student, copied from dofattn {__version__} by `dofattn export`: {len(names)} of '
           "its modules,",
           "as they are there (their imports of dofattn renamed to this copy's package), and an importer that serves",
           "them. The export's modeling file loads its classes from here, so neither dofattn nor its version need be",
           'installed. Generated: do not edit; export again to change it."""',
           "", f"PACKAGE = {package!r}", f"PACKAGES = {packages!r}", "SOURCES = {}"]
    for name in names:
        key = name.removeprefix("dofattn").lstrip(".")
        out.append("")
        out.append(f"SOURCES[{key!r}] = [")
        out.extend(f"    {line!r}," for line in renamed(sources[name], modules, package).splitlines())
        out.append("]")
    return "\n".join(out) + "\n" + LOADER
