"""lm-eval's task names before a model loads (`dofattn.lm_tasks`): kept from its index, refused without it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dofattn import lm_tasks
from dofattn.errors import UserError


class FakeManager:
    """lm-eval's TaskManager as `lm_tasks` uses it, counting the indexes it builds."""
    built: list = []

    def __init__(self, include_path=None, include_defaults=True, **_):
        FakeManager.built.append((include_path, include_defaults))
        self.all_tasks = (["piqa", "niah_single_1"] if include_defaults else []) + (["mine"] if include_path else [])


@pytest.fixture
def fake_index(monkeypatch, tmp_path):
    import lm_eval.tasks

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", FakeManager)
    monkeypatch.setenv("DOFATTN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("DOFATTN_PLAN_CACHE", "on")
    monkeypatch.setattr(lm_tasks, "_MANAGERS", {})
    FakeManager.built = []
    return tmp_path


def test_names_are_kept_from_the_first_index_and_decide_alone_after_it(fake_index, monkeypatch):
    manager = lm_tasks.check_tasks(["piqa"])
    assert isinstance(manager, FakeManager) and FakeManager.built == [(None, True)]
    assert lm_tasks.known_names() == {"piqa", "niah_single_1"}
    assert lm_tasks.check_tasks(["piqa", "niah_single_1"]) is None           # from the kept names
    with pytest.raises(UserError, match="unknown lm-eval task.s. nosuch, other; e.g. piqa"):
        lm_tasks.check_tasks(["piqa", "nosuch", "other"])
    assert FakeManager.built == [(None, True)]                               # no second index
    monkeypatch.setattr(lm_tasks, "_installed", lambda: "another lm-eval")   # a new version or a new task YAML
    assert lm_tasks.known_names() is None and lm_tasks.check_tasks(["piqa"]) is not None
    assert len(FakeManager.built) == 2


def test_a_local_folder_is_read_alone_and_its_names_are_not_kept(fake_index, tmp_path):
    with pytest.raises(UserError, match="unknown lm-eval task.s. nosuch"):
        lm_tasks.check_tasks(["mine", "nosuch"], include_path=str(tmp_path))   # builds and keeps the index
    assert lm_tasks.known_names() == {"piqa", "niah_single_1"}                 # lm-eval's own names only
    FakeManager.built = []
    assert lm_tasks.check_tasks(["mine", "piqa"], include_path=str(tmp_path)) is None
    assert FakeManager.built == [(str(tmp_path), False)]                       # the folder alone
    with pytest.raises(UserError, match="unknown lm-eval task.s. mine"):
        lm_tasks.check_tasks(["mine"])                                         # not without the folder


def test_keeping_off_and_a_damaged_file_build_the_index(fake_index, monkeypatch):
    lm_tasks.check_tasks(["piqa"])
    path = lm_tasks._kept_path(lm_tasks._installed())
    path.write_text("{not json")
    assert lm_tasks.known_names() is None and lm_tasks.check_tasks(["piqa"]) is not None
    assert json.loads(path.read_text())["tasks"] == ["niah_single_1", "piqa"]   # written over
    monkeypatch.setenv("DOFATTN_PLAN_CACHE", "off")
    assert lm_tasks.known_names() is None and lm_tasks.check_tasks(["piqa"]) is not None
    assert FakeManager.built == [(None, True)]                 # the index itself is built once a process


def test_eval_refuses_an_unknown_task_before_torch_or_lm_eval_is_imported(tmp_path):
    """With the names kept, `eval --tasks nosuch_task` is one line, exit 2, in a fresh interpreter that imports
    neither torch, transformers nor lm-eval (issue 69: it waited 14-32 s for lm-eval's index)."""
    env_cache = tmp_path / "cache"
    script = (
        "import json, os, sys\n"
        "os.environ.update(DOFATTN_CACHE=sys.argv[1], DOFATTN_PLAN_CACHE='on')\n"
        "from dofattn import lm_tasks\n"
        "path = lm_tasks._kept_path(lm_tasks._installed())\n"
        "path.parent.mkdir(parents=True)\n"
        "path.write_text(json.dumps({'tasks': ['piqa']}))\n"
        "from dofattn.cli import main\n"
        "code = main(['eval', '--model', 'smollm2-135m', '--tasks', 'nosuch_task'])\n"
        "print('EXIT', code, [m for m in ('torch', 'transformers', 'lm_eval') if m in sys.modules])\n")
    done = subprocess.run([sys.executable, "-c", script, str(env_cache)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert "EXIT 2 []" in done.stdout, done.stdout + done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].endswith("unknown lm-eval task(s) nosuch_task; e.g. piqa, arc_easy, "
                                                         "arc_challenge, winogrande, logiqa, wsc273, mmlu, or a "
                                                         "local task YAML in --task-path")
