"""The SWE environment end to end, in the sandbox: the known fix resolves every bundled repository,
doing nothing earns its baseline, tampering earns nothing, budgets end episodes cleanly, harness
faults are retried and counted (never a silent 0), workspaces never outlive their episodes (also
after a raise and a SIGKILL), and tiny-model fits run with GRPO, RLOO and PPO."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import lightning as L
import pytest
import torch

from helpers import make_trainer
from lit_marl import ConfigError
from lit_marl.agents import Agent
from lit_marl.algorithms import GRPO, PPO, RLOO
from lit_marl.data import EpisodeDataModule
from lit_marl.envs.swe import scoring
from lit_marl.envs.swe import workspace as workspace_module
from lit_marl.envs.swe.env import SWEEnv, workspaces
from lit_marl.envs.swe.instances import resolve_source
from lit_marl.envs.swe.tool_mode import from_text_call
from lit_marl.generation import Sampling
from lit_marl.rollout.episode import EpisodeSettings, run_episodes
from lit_marl.sandbox import bubblewrap_available, installed_package_folders
from lit_marl.tools.formats import format_calls

BASELINE = {"textkit": 2 / 4, "intervals": 2 / 4, "shop": 2 / 4, "lru": 2 / 3, "csvlite": 2 / 3, "units": 1 / 3}
"""The fraction of listed tests that pass on each base commit (its PASS_TO_PASS), by hand."""


@pytest.fixture(scope="module")
def rows():
    path = resolve_source("swe:bundled:all")
    return {json.loads(line)["repo"].split("/")[1]: json.loads(line) for line in open(path)}


@pytest.fixture
def root(tmp_path):
    return str(tmp_path / "workspaces")


def in_mode(replies: list[str], mode: str) -> list[str]:
    """Text-mode replies as the same calls in ``mode`` (``tools``: each written as a Hermes tool call)."""
    if mode == "text":
        return replies
    return [format_calls([from_text_call(reply)], "hermes") for reply in replies]


def play(env: SWEEnv, row: dict, replies: list[str]):
    env.start(row)
    for reply in replies:
        result = env.act([reply])
        if result.terminated or result.truncated:
            return result
    raise AssertionError("the episode did not end")


@pytest.mark.parametrize("name", sorted(BASELINE))
def test_known_fix_resolves_and_doing_nothing_earns_the_baseline(rows, root, name):
    env = SWEEnv(workspace_root=root)
    nothing = play(env, rows[name], ["submit"])
    assert nothing.info["score"] == pytest.approx(BASELINE[name]) and not nothing.info["won"] and nothing.terminated
    fixed = play(env, rows[name], [turn[0] for turn in env.expert_turns(rows[name])])
    assert fixed.info["score"] == 1.0 and fixed.info["won"] and "(resolved)" in fixed.observations[0]
    assert fixed.info["counts"]["tool_errors"] == 0 and workspaces(root) == []


@pytest.mark.parametrize("name", sorted(BASELINE))
def test_known_fix_resolves_through_tool_calls_in_tools_mode(rows, root, name):
    """``tool_mode: tools``: the expert's calls written in the model's tool-call format (Hermes's here)
    run through the same code and sandbox and resolve every bundled repository."""
    env = SWEEnv(workspace_root=root, tool_mode="tools", expert_view_context=3)
    turns = [turn[0] for turn in env.expert_turns(rows[name])]
    assert all(t.startswith("<tool_call>\n{") for t in turns) and '"name": "view"' in turns[0]
    fixed = play(env, rows[name], turns)
    assert fixed.info["score"] == 1.0 and fixed.info["won"] and fixed.info["counts"]["tool_errors"] == 0
    assert "(resolved)" in fixed.observations[0] and workspaces(root) == []


def test_the_expert_gives_a_demonstration_of_tool_calls(rows, root):
    chats = SWEEnv(workspace_root=root).demonstration(rows["shop"])
    replies = [m["content"] for m in chats[0] if m["role"] == "assistant"]
    assert [r.split()[0] for r in replies] == ["replace", "replace", "submit"]
    first = chats[0][0]["content"]
    assert "Tests that must keep passing: tests/test_shop.py::test_no_discount" in first and "2 more, hidden" in first
    assert "test_half_up" not in first  # FAIL_TO_PASS arrives with the test_patch, at scoring


def test_the_expert_can_look_before_it_edits(rows, root):
    env = SWEEnv(workspace_root=root, expert_view_context=3)
    calls = [turn[0] for turn in env.expert_turns(rows["shop"])]
    assert [c.split()[0] for c in calls] == ["view", "replace", "view", "replace", "submit"]
    env.start(rows["shop"])
    seen = [env.act([call]) for call in calls]
    assert seen[-1].terminated and seen[-1].info["won"] and seen[-1].info["counts"]["tool_errors"] == 0
    for at in (0, 2):  # each view shows the lines its replace changes, numbered
        old = calls[at + 1].split("<<<<<<< SEARCH\n", 1)[1].split("=======\n", 1)[0]
        assert all(line in seen[at].observations[0] for line in old.splitlines())
    with pytest.raises(ConfigError, match="expert_view_context"):
        SWEEnv(workspace_root=root, expert_view_context=-1)


@pytest.mark.parametrize("mode", ["text", "tools"])
def test_editing_deleting_or_plugging_the_tests_and_writing_outside_earn_nothing(rows, root, tmp_path, mode):
    outside = tmp_path / "outside.txt"
    attacks = [
        "run rm -rf tests",
        f"run echo pwned > {outside}; touch /etc/lit_marl_pwned; echo done",
        "create conftest.py\n<<<<<<< CONTENT\nimport pytest\n@pytest.hookimpl(hookwrapper=True)\n"
        "def pytest_runtest_makereport(item, call):\n    outcome = yield\n    outcome.get_result().outcome = 'passed'\n"
        ">>>>>>> END",
        "create tests/test_slug.py\n<<<<<<< CONTENT\ndef test_collapses_runs():\n    pass\n>>>>>>> END",
        "create pytest.ini\n<<<<<<< CONTENT\n[pytest]\naddopts = -p no:python\n>>>>>>> END",
        "run ln -s / escape && echo linked",
        "create escape/tmp/lit_marl_pwned\n<<<<<<< CONTENT\nx\n>>>>>>> END",
        "submit",
    ]
    env = SWEEnv(workspace_root=root, tool_mode=mode)
    result = play(env, rows["textkit"], in_mode(attacks, mode))
    assert result.info["score"] == pytest.approx(BASELINE["textkit"]) and not result.info["won"]
    assert (
        not outside.exists() and not os.path.exists("/etc/lit_marl_pwned") and not os.path.exists("/tmp/lit_marl_pwned")
    )
    assert result.info["counts"]["tool_errors"] == 1  # the create through the link: outside the repository


@pytest.mark.parametrize(
    "attack",
    [
        "run rm -rf tests && echo x > tests",  # a file where the tests' folder is
        "create .pytest.ini\n<<<<<<< CONTENT\n[pytest]\naddopts = -p no:python\n>>>>>>> END",
        'create pytest.toml\n<<<<<<< CONTENT\n[pytest]\naddopts = ["-p", "no:python"]\n>>>>>>> END',
        'create .pytest.toml\n<<<<<<< CONTENT\n[pytest]\naddopts = ["-p", "no:python"]\n>>>>>>> END',
    ],
)
@pytest.mark.parametrize("mode", ["text", "tools"])
def test_a_file_in_the_tests_place_or_another_pytest_config_earns_nothing(rows, root, attack, mode):
    """Probes through the env's own parser (in both tool modes): scoring restores the tests and every
    pytest config name and never crashes; the episode earns the do-nothing baseline, not resolved."""
    env = SWEEnv(workspace_root=root, tool_mode=mode)
    result = play(env, rows["textkit"], in_mode([attack, "submit"], mode))
    assert result.info["score"] == pytest.approx(BASELINE["textkit"]) and not result.info["won"]


def test_code_that_reaches_into_the_test_run_is_tampering_or_its_crash(rows, root):
    """Code that reads the runner's frames trips the harness (0, counted as tampered; the whole attack
    suite is test_swe_attacks.py); code that kills the run (here: it prints a fake report and exits)
    gives no signed report: scored 0, counted as the agent's crash (the base commit still reports);
    mentioning pytest is no offence."""
    patch = (
        "replace textkit/slug.py\n<<<<<<< SEARCH\ndef slugify(text):\n=======\n{line}\ndef slugify(text):\n"
        ">>>>>>> REPLACE"
    )
    refused = play(
        SWEEnv(workspace_root=root), rows["textkit"], [patch.format(line="import sys; sys._getframe(1)"), "submit"]
    )
    assert refused.info["score"] == 0.0 and refused.info["counts"]["tampered"] == 1
    harmless = play(
        SWEEnv(workspace_root=root), rows["textkit"], [patch.format(line="import _pytest.runner"), "submit"]
    )
    assert harmless.info["score"] == pytest.approx(BASELINE["textkit"]) and harmless.info["counts"]["tampered"] == 0
    exits = 'print("fake report"); raise SystemExit(0)'
    crashed = play(
        SWEEnv(workspace_root=root, tests={"retries": 0}), rows["textkit"], [patch.format(line=exits), "submit"]
    )
    assert crashed.info["score"] == 0.0 and crashed.info["counts"]["tampered"] == 0
    hung = play(
        SWEEnv(workspace_root=root, tests={"retries": 0, "test_timeout_s": 1}),
        rows["intervals"],
        [
            "replace intervals.py\n<<<<<<< SEARCH\n    result = []\n=======\n"
            "    while spans:\n        pass\n    result = []\n>>>>>>> REPLACE",
            "submit",
        ],
    )
    assert hung.info["score"] == pytest.approx(1 / 4)  # test_empty passes; the three that loop fail


def test_run_is_sandboxed_cut_and_timed(rows, root):
    env = SWEEnv(workspace_root=root, command_timeout_s=2, max_observation_chars=500)
    env.start(rows["lru"])
    flood = env.act(["run python3 -c \"print('x' * 20000)\""]).observations[0]
    assert "characters cut" in flood and len(flood) < 700
    assert "[exit timed out]" in env.act(["run sleep 30"]).observations[0]
    assert "Read-only file system" in env.act(["run touch /usr/evil"]).observations[0]
    assert "passed   tests/test_lru.py::test_put_get" in env.act(["test"]).observations[0]
    assert "error: no tool call" in env.act(["please fix it"]).observations[0]
    env.close()
    assert workspaces(root) == []


def test_turn_limit_and_output_budget_end_the_episode_scored(rows, root):
    limited = play(SWEEnv(workspace_root=root, max_steps=2), rows["units"], ["view units.py", "nonsense"])
    assert limited.truncated and not limited.terminated and limited.info["score"] == pytest.approx(1 / 3)
    assert "tool call 2 of 2" in limited.observations[0] and limited.info["counts"]["tool_errors"] == 1
    budget = play(SWEEnv(workspace_root=root, max_output_chars=300), rows["units"], ["view units.py"] * 5)
    assert budget.truncated and "output passed 300 characters" in budget.observations[0]
    full = play(SWEEnv(workspace_root=root, workspace_mb=1), rows["units"], ["run head -c 2000000 /dev/zero > big.bin"])
    assert (
        full.truncated
        and "workspace passed 1 MB" in full.observations[0]
        and full.info["score"] == pytest.approx(1 / 3)
    )
    assert workspaces(root) == []


def test_a_harness_failure_is_retried_and_counted_and_never_scored(rows, root, monkeypatch):
    real = scoring.run_tests
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        report, result = real(*args, **kwargs)
        return (None, result) if calls["n"] == 1 else (report, result)

    monkeypatch.setattr(scoring, "run_tests", flaky)
    env = SWEEnv(workspace_root=root)
    result = play(env, rows["units"], ["submit"])
    assert result.info["score"] == pytest.approx(1 / 3) and result.info["counts"]["harness_retries"] == 1
    binary = play(SWEEnv(workspace_root=root, reward="resolved"), rows["units"], ["submit"])
    assert binary.info["score"] == 0.0 and calls["n"] == 3  # reward=resolved: 1 only when every test passes
    monkeypatch.setattr(scoring, "run_tests", lambda *a, **k: (None, real(*a, **k)[1]))
    monkeypatch.setattr(scoring, "_baseline", {})
    with pytest.raises(scoring.HarnessError, match="also on the base commit"):
        play(SWEEnv(workspace_root=root, tests={"retries": 0}), rows["units"], ["submit"])
    assert workspaces(root) == []


# --------------------------------------------------------------------------- clean-up
def test_workspaces_go_after_an_episode_that_raised(rows, root, monkeypatch):
    agent = Agent("tiny-random")

    def broken(self, actions):
        raise RuntimeError("the env broke mid-episode")

    monkeypatch.setattr(SWEEnv, "act", broken)
    with pytest.raises(RuntimeError, match="broke mid-episode"):
        run_episodes([agent], [rows["lru"], rows["units"]], SWEEnv(workspace_root=root),
                     EpisodeSettings(group_size=2, max_turns=2, sampling=Sampling(max_new_tokens=4),
                                     max_context_tokens=4096))  # fmt: skip
    assert workspaces(root) == []


def test_workspaces_of_a_killed_trainer_go_at_the_next_start(root):
    """The child makes a workspace as an episode does and is SIGKILLed (no clean-up of its own runs);
    it loads only the workspace module, so the test does not pay for importing the project."""
    script = (
        "import importlib.util, os, pathlib, signal, sys\n"
        "spec = importlib.util.spec_from_file_location('workspace', sys.argv[2])\n"
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
        "ws = module.Workspace(pathlib.Path(sys.argv[1]), {'lru.py': (b'x = 1', 0o644)})\n"
        "print(ws.path, flush=True); os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    child = subprocess.run(
        [sys.executable, "-c", script, root, workspace_module.__file__], capture_output=True, text=True
    )
    assert child.returncode == -signal.SIGKILL and os.path.isdir(child.stdout.strip())
    assert len(workspaces(root)) == 1
    SWEEnv(workspace_root=root)  # a new start sweeps
    assert workspaces(root) == []


# --------------------------------------------------------------------------- fits
@pytest.mark.parametrize("algorithm, generations", [(GRPO, 2), (RLOO, 2), (PPO, 1)])
def test_tiny_fits_on_the_bundled_repositories(tmp_path, root, algorithm, generations):
    L.seed_everything(0)
    module = algorithm(model="tiny-random", learning_rate=1e-2)
    data = EpisodeDataModule(
        train_path="swe:bundled:train",
        env="swe",
        env_kwargs={"workspace_root": root, "max_steps": 3},
        tasks_per_step=2,
        num_generations=generations,
        max_turns=2,
        sampling={"max_new_tokens": 8},
        max_context_tokens=4096,
        score_weight=0.5,
    )
    trainer = make_trainer(tmp_path, limit_train_batches=2 if algorithm is GRPO else 1, limit_val_batches=0)
    trainer.fit(module, datamodule=data)
    metrics = trainer.callback_metrics
    assert torch.isfinite(metrics["train/loss"]) and float(metrics["train/reward"]) > 0  # the baselines: 1/3..2/3
    assert workspaces(root) == []


def test_swe_settings_are_checked_by_their_types_and_the_sandbox_limits_configurable(tmp_path):
    root = str(tmp_path / "ws")
    env = SWEEnv(workspace_root=root, command_limits={"memory_mb": 512, "processes": 16}, tests={"disk_mb": 128})
    assert (env.command_limits.memory_mb, env.command_limits.processes, env.command_limits.file_mb) == (512, 16, 16)
    assert env.tests.limits().disk_mb == 128 and env.tests.limits().processes == 64
    with pytest.raises(ConfigError, match=r"data\.env_kwargs\.max_steps=0: must be > 0"):
        SWEEnv(workspace_root=root, max_steps=0)
    with pytest.raises(ConfigError, match=r"data\.env_kwargs\.tests\.processes=0: must be > 0"):
        SWEEnv(workspace_root=root, tests={"processes": 0})
    with pytest.raises(ConfigError, match=r"data\.env_kwargs\.command_limits=\{'swap_mb': 1\}"):
        SWEEnv(workspace_root=root, command_limits={"swap_mb": 1})
    with pytest.raises(ConfigError, match=r"sandbox Limits\.memory_mb=0: must be > 0"):
        SWEEnv(workspace_root=root, command_limits={"memory_mb": 0})


def test_the_first_observation_keeps_the_tests_and_the_tool_help_whole(rows, root):
    """A long problem and a tight limit: the file list, then the problem statement are cut (marked);
    every listed test and the whole tool help stay, within ``max_observation_chars``."""
    from lit_marl.envs.swe.tools import HELP

    row = dict(rows["textkit"], problem_statement="The slug is wrong. " * 600)
    listed = row["PASS_TO_PASS"]
    for limit in (2000, len(HELP) + sum(len(t) + 2 for t in listed) + 520):
        env = SWEEnv(workspace_root=root, max_observation_chars=limit)
        (first,) = env.start(row)
        assert len(first) <= limit and HELP in first and all(test in first for test in listed)
        assert not any(test in first for test in row["FAIL_TO_PASS"]) and "2 more, hidden" in first
        assert "characters cut" in first
        env.close()
    limit = len(HELP) + sum(len(t) + 2 for t in listed) + 320
    env = SWEEnv(workspace_root=root, max_observation_chars=limit)
    (first,) = env.start(dict(rows["textkit"], problem_statement="Fix the slug."))
    assert (
        len(first) <= limit
        and "more files: `run ls -R` lists them" in first
        and "Fix the slug." in first
        and HELP in first
    )
    env.close()


@pytest.mark.skipif(not bubblewrap_available(), reason="the sandbox hides folders only under bubblewrap")
def test_run_commands_see_only_the_tools_packages(rows, root):
    """A package the trainer has installed (more-itertools: a released, fixed version of a repository
    could be one) is not importable in a ``run`` command, and the interpreters' own package folders
    are empty there; pytest is."""
    hidden = installed_package_folders()
    command = "run python3 -c \"import pytest; print('pytest', pytest.__version__)\""
    command += "; python3 -c 'import more_itertools'"
    command += "".join(f"; echo hidden $(ls -A {folder} | wc -l)" for folder in hidden)
    env = SWEEnv(workspace_root=root)
    env.start(rows["units"])
    seen = env.act([command]).observations[0]
    env.close()
    assert f"pytest {pytest.__version__}" in seen and "No module named 'more_itertools'" in seen, seen
    assert hidden and seen.count("hidden 0") == len(hidden), seen


def test_the_tests_run_under_the_tools_own_pytest_with_no_autoloaded_plugins(rows, tmp_path):
    """The runner drops the base interpreter's site-packages: the pytest that runs is the trainer's,
    copied into the tools' own site folder (its version and folder), and a report is signed: a line
    with another key is nothing."""
    from lit_marl.envs.swe.instances import normalize, snapshot
    from lit_marl.envs.swe.workspace import Workspace

    row = normalize(dict(rows["units"]), "units")
    ws = Workspace(tmp_path / "ws", snapshot(row, None))
    report, result = scoring.run_tests(ws, row["PASS_TO_PASS"], [], scoring.TestSettings())
    ws.remove()
    assert report is not None and set(report.outcomes.values()) == {"passed"} and not report.tampered
    site = scoring.tools_site()  # pytest and its requirements only, copied from the trainer's environment
    assert report.notes[0] == f"pytest {pytest.__version__} {site}/pytest"
    assert not any(name.startswith("more_itertools") for name in os.listdir(site))
    assert scoring.signed_report(result.stdout, b"another key") is None


def test_unittest_tests_fail_by_their_reports_not_only_by_raising(tmp_path):
    """unittest reports a failing test to its result (pytest's item) instead of raising: the runner's
    outcome reads that report; passing, failing, erroring and skipped TestCase tests keep their
    outcomes, and an untouched repository is not tampering."""
    from lit_marl.envs.swe.workspace import Workspace

    test = (
        "import unittest\n\n\nclass T(unittest.TestCase):\n"
        "    def test_ok(self):\n        self.assertEqual(1, 1)\n\n"
        "    def test_bad(self):\n        self.assertEqual(1, 2)\n\n"
        "    def test_error(self):\n        raise KeyError('x')\n\n"
        "    @unittest.skip('no')\n    def test_skipped(self):\n        pass\n\n"
        "    def test_subtests(self):\n        for i in range(2):\n            with self.subTest(i=i):\n"
        "                self.assertEqual(i, 0)\n"
    )
    ws = Workspace(tmp_path / "ws", {"tests/test_u.py": (test.encode(), 0o644)})
    names = [f"tests/test_u.py::T::test_{n}" for n in ("ok", "bad", "error", "skipped", "subtests")]
    report, _ = scoring.run_tests(ws, names, [], scoring.TestSettings())
    ws.remove()
    assert report is not None and not report.tampered
    assert [report.outcomes.get(n) for n in names] == ["passed", "failed", "failed", "failed", "failed"]


def test_only_the_changed_functions_of_a_changed_file_are_untrusted(tmp_path):
    """A library function that reads its caller's frame (as deprecation helpers do) stays the
    repository's when the fix changes another function of its file; a changed function that reads
    frames is tampering."""
    from lit_marl.envs.swe.workspace import Workspace

    base_source = (
        "import sys\n\n\ndef caller_name():\n    return sys._getframe(1).f_code.co_name\n\n\n"
        "def double(x):\n    return x + 1\n"
    )
    test = (
        "from mod import caller_name, double\n\n\ndef test_double():\n    assert double(3) == 6\n\n\n"
        "def test_caller():\n    assert caller_name() == 'test_caller'\n"
    )
    base = {"mod.py": (base_source.encode(), 0o644), "tests/test_mod.py": (test.encode(), 0o644)}
    names = ["tests/test_mod.py::test_double", "tests/test_mod.py::test_caller"]
    for body, tampered in (("return x * 2", False), ("return sys._getframe(0).f_lineno and x * 2", True)):
        fixed = base_source.replace("return x + 1", body).encode()
        ws = Workspace(tmp_path / "ws", {**base, "mod.py": (fixed, 0o644)})
        changed = scoring.changed_lines(base, {"mod.py": fixed})
        report, _ = scoring.run_tests(ws, names, [], scoring.TestSettings(), changed)
        ws.remove()
        assert changed == {"mod.py": [9]} and bool(report.tampered) == tampered, report
        if not tampered:
            assert set(report.outcomes.values()) == {"passed"}
