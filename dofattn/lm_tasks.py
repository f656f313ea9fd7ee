"""lm-eval's task names, known before a model loads: `eval --tasks` refuses a name lm-eval lacks in well under a
second (no torch, no lm-eval import), and builds lm-eval's index only for names it will run.

    check_tasks(["piqa", "niah_single_1"])        # None, or a one-line UserError naming the unknown ones

lm-eval's own index (`TaskManager`) reads every task YAML it ships, 15-30 s on 2 cores. The names it finds are kept
in `cache_dir()/lm-eval/tasks-HASH.json` under lm-eval's version, its install folder and the newest change to the
folders of its tasks (a walk of about 1,400 folders, 0.1 s), so a new lm-eval, or a task YAML added to it, is
indexed again. The first `--tasks` on a machine builds the index; a local `--task-path` folder is read on its own
(quick). `DOFATTN_PLAN_CACHE` turns keeping off or moves it, as for plans (`kept`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os

from dofattn.errors import UserError
from dofattn.kept import enabled, folder

HUB_TASKS = ("piqa", "arc_easy", "arc_challenge", "winogrande", "logiqa", "wsc273", "mmlu")


@functools.cache
def _installed() -> str:
    """What lm-eval's task names depend on: its version, its folder and the newest change among its task folders
    (a one-line UserError if it is not installed); read once a process."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("--tasks needs lm-evaluation-harness: pip install -e '.[eval]' in the dofattn checkout")
    try:
        version = importlib.metadata.version("lm_eval")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    folder = next(iter(spec.submodule_search_locations))
    newest = max((os.stat(path).st_mtime_ns for path, _, _ in os.walk(os.path.join(folder, "tasks"))), default=0)
    return f"{version} {folder} {newest}"


def _kept_path(key: str):
    return folder("lm-eval") / f"tasks-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def local_names(include_path: str | None) -> set[str]:
    """The tasks of the local folder `include_path` alone (lm-eval reads only its YAMLs: quick); none without one."""
    if not include_path:
        return set()
    from lm_eval.tasks import TaskManager

    return set(TaskManager(include_path=include_path, include_defaults=False).all_tasks)


def known_names() -> set[str] | None:
    """lm-eval's own task names as its index last found them for this lm-eval (None if it was never built here)."""
    path = _kept_path(_installed())
    if not enabled() or not path.is_file():
        return None
    try:
        return set(json.loads(path.read_text())["tasks"])
    except (OSError, ValueError, KeyError, TypeError):
        return None                                     # damaged: indexed again, and written over


_MANAGERS: dict = {}      # (what lm-eval is, include_path) -> its TaskManager, built once a process (read-only)


def task_manager(include_path: str | None = None):
    """lm-eval's TaskManager (its index of every task: seconds, so built once a process for each `include_path`);
    its own names are kept for `check_tasks` where they are not yet."""
    key = _installed()
    manager = _MANAGERS.get((key, include_path))
    if manager is None:
        from lm_eval.tasks import TaskManager

        manager = _MANAGERS[key, include_path] = TaskManager(include_path=include_path)
    if enabled() and known_names() is None:
        from dofattn.io import write_json

        try:
            path = _kept_path(key)
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json(path, {"key": key, "tasks": sorted(set(manager.all_tasks) - local_names(include_path))})
        except OSError:
            pass                                        # a cache that cannot be written is only slower
    return manager


def check_tasks(tasks: list[str], include_path: str | None = None):
    """Whether every name of `tasks` is one of lm-eval's tasks or a local one of `include_path`: a one-line
    UserError naming the unknown ones (or saying lm-eval is not installed) if not. From the kept names when
    lm-eval's index was built here before (None is returned: `lm_eval_tasks` builds the index it runs with);
    else the index is built now, kept, and returned."""
    known = known_names()
    if known is None:
        manager = task_manager(include_path)
        names = set(manager.all_tasks)
    else:
        manager, names = None, known
        if not set(tasks) <= known:                      # the folder's own tasks, if any
            names = known | local_names(include_path)
    unknown = [t for t in tasks if t not in names]
    if unknown:
        raise UserError(f"unknown lm-eval task(s) {', '.join(unknown)}; e.g. {', '.join(HUB_TASKS)}, or a local "
                        f"task YAML in --task-path")
    return manager
