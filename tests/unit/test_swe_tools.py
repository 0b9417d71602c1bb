"""The SWE environment's pure parts: tool-call parsing and the file tools on a workspace, patches,
instance rows, scoring's choice of files and its tamper check, workspace clean-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from lit_marl import ConfigError
from lit_marl.envs.swe import bundled
from lit_marl.envs.swe.env import cut
from lit_marl.envs.swe.instances import (
    apply_patch,
    is_test_path,
    load_instances,
    normalize,
    parse_patch,
    resolve_source,
)
from lit_marl.envs.swe.scoring import carried, scoring_files, shadowing, signed_report
from lit_marl.envs.swe.tools import ToolError, as_calls, create, insert, parse, replace, search, view
from lit_marl.envs.swe.workspace import Workspace, sweep

ROW = {
    "instance_id": "x-1",
    "repo": "o/x",
    "base_commit": "abc",
    "problem_statement": "p",
    "FAIL_TO_PASS": ["tests/test_a.py::test_new"],
    "PASS_TO_PASS": ["tests/test_a.py::test_old"],
}


@pytest.fixture
def ws(tmp_path):
    space = Workspace(
        tmp_path / "root", {"pkg/a.py": (b"one\ntwo\nthree\n", 0o644), "tests/test_a.py": (b"t\n", 0o644)}
    )
    yield space
    space.remove()


# --------------------------------------------------------------------------- parsing
def test_parse_finds_the_tool_line_after_text_and_inside_a_fence():
    call = parse("I will look first.\n```\nview pkg/a.py 2 3\n```")
    assert (call.name, call.args) == ("view", ["pkg/a.py", "2", "3"])
    assert parse("RUN ls -la  ").rest == "ls -la" and parse("submit").name == "submit"


@pytest.mark.parametrize("reply", ["", "I think the bug is in line 3", "open pkg/a.py", "view 'unclosed"])
def test_malformed_calls_raise_a_tool_error_that_says_what_to_do(reply):
    with pytest.raises(ToolError, match="tool call|cannot read"):
        parse(reply)


# --------------------------------------------------------------------------- file tools
def test_view_numbers_lines_and_windows(ws):
    out = view(ws, parse("view pkg/a.py 2 3"))
    assert "   2 two\n   3 three" in out and "one" not in out and "of 3" in out
    with pytest.raises(ToolError, match="no file"):
        view(ws, parse("view pkg/missing.py"))
    with pytest.raises(ToolError, match="line numbers"):
        view(ws, parse("view pkg/a.py two"))


def test_search_in_one_file_or_everywhere(ws):
    assert search(ws, parse("search two")) == "pkg/a.py:2: two"
    assert search(ws, parse("search t tests/test_a.py")) == "tests/test_a.py:1: t"
    assert search(ws, parse('search "o" pkg/a.py')).count("\n") == 1  # "one", "two"
    assert "no line" in search(ws, parse("search nowhere"))


def test_replace_needs_one_exact_occurrence(ws):
    block = "replace pkg/a.py\n<<<<<<< SEARCH\n{old}\n=======\n{new}\n>>>>>>> REPLACE"
    replace(ws, parse(block.format(old="two", new="TWO\n2")))
    assert (ws.path / "pkg/a.py").read_text() == "one\nTWO\n2\nthree\n"
    with pytest.raises(ToolError, match="does not occur"):
        replace(ws, parse(block.format(old="two", new="x")))
    with pytest.raises(ToolError, match="no '>>>>>>> REPLACE'"):
        replace(ws, parse("replace pkg/a.py\n<<<<<<< SEARCH\none\n=======\nx"))
    (ws.path / "pkg/b.py").write_text("x\nx\n")
    with pytest.raises(ToolError, match="occurs 2 times"):
        replace(ws, parse(block.format(old="x", new="y").replace("pkg/a.py", "pkg/b.py")))


def test_insert_and_create(ws):
    insert(ws, parse("insert pkg/a.py 1\n<<<<<<< INSERT\nmid\n>>>>>>> END"))
    assert (ws.path / "pkg/a.py").read_text() == "one\nmid\ntwo\nthree\n"
    with pytest.raises(ToolError, match="LINE must be in 0..4"):
        insert(ws, parse("insert pkg/a.py 9\n<<<<<<< INSERT\nx\n>>>>>>> END"))
    create(ws, parse("create pkg/new/c.py\n<<<<<<< CONTENT\nc = 1\n>>>>>>> END"))
    assert (ws.path / "pkg/new/c.py").read_text() == "c = 1\n"
    with pytest.raises(ToolError, match="exists"):
        create(ws, parse("create pkg/a.py\n<<<<<<< CONTENT\nx\n>>>>>>> END"))


@pytest.mark.parametrize("path", ["../escape.py", "/etc/passwd", "pkg/../../escape.py", "link/x.py"])
def test_no_file_tool_reaches_outside_the_workspace(ws, path):
    os.symlink("/", ws.path / "link")  # a link the agent made with `run ln -s / link`
    for tool, reply in [
        (create, f"create {path}\n<<<<<<< CONTENT\nx\n>>>>>>> END"),
        (view, f"view {path}"),
        (insert, f"insert {path} 0\n<<<<<<< INSERT\nx\n>>>>>>> END"),
    ]:
        with pytest.raises(ToolError, match="outside the repository"):
            tool(ws, parse(reply))
    assert not (ws.path.parent / "escape.py").exists()


def test_cut_keeps_head_and_tail_and_says_how_much_went():
    out = cut("a" * 5000 + "END", 300)
    assert out.startswith("a" * 200) and out.endswith("END") and "characters cut" in out and len(out) < 400
    assert cut("short", 300) == "short"


# --------------------------------------------------------------------------- patches
def test_expert_calls_replay_the_known_fix_of_every_bundled_repo():
    """The gold patch parsed into hunks gives the fixed files back, and its tool calls do too."""
    for name, spec in bundled.REPOS.items():
        before = {path: spec["files"][path] for path in spec["fixed"]}
        patch = bundled.unified_diff(before, spec["fixed"])
        files = {p: t.encode() for p, t in spec["files"].items()}
        fixed = apply_patch(files, patch, name)
        assert {p: fixed[p].decode() for p in spec["fixed"]} == spec["fixed"], name
        calls = as_calls(parse_patch(patch))
        assert calls[-1] == "submit" and all(parse(c).name == "replace" for c in calls[:-1])
    hunks = parse_patch(
        bundled.unified_diff({"a.py": "x = 1\n", "b.py": "gone\n"}, {"a.py": "x = 1\n", "c.py": "new\n"})
    )
    assert [(h.path, h.created, h.deleted) for h in hunks] == [("b.py", False, True), ("c.py", True, False)]
    assert apply_patch({"b.py": b"gone\n"}, bundled.unified_diff({"b.py": "gone\n"}, {"c.py": "new\n"}), "t") == {
        "c.py": b"new\n"
    }
    with pytest.raises(ValueError, match="does not apply"):
        apply_patch({"a.py": b"other\n"}, bundled.unified_diff({"a.py": "x\n"}, {"a.py": "y\n"}), "test_patch")


def test_two_bundled_repos_need_more_than_one_hunk_and_the_splits_are_disjoint():
    sizes = {n: len(parse_patch(bundled.unified_diff({p: s["files"][p] for p in s["fixed"]}, s["fixed"])))
             for n, s in bundled.REPOS.items()}  # fmt: skip
    assert (
        sizes["shop"] == 2
        and len({h.path for h in parse_patch(bundled.instance("shop", bundled.Path("."), "c")["patch"])}) == 2
    )
    assert not set(bundled.SPLITS["train"]) & set(bundled.SPLITS["test"])


def test_bundled_repositories_are_written_deterministically(tmp_path):
    first = bundled.write(tmp_path / "a")
    second = bundled.write(tmp_path / "b")
    commits = lambda files: [json.loads(line)["base_commit"] for line in files["all"].read_text().splitlines()]  # noqa: E731
    assert commits(first) == commits(second) and len(set(commits(first))) == len(bundled.REPOS)
    head = subprocess.run(
        ["git", "-C", str(tmp_path / "a/repos/lru"), "log", "--format=%H"], capture_output=True, text=True
    )
    assert head.stdout.split() == [commits(first)[3]]


# --------------------------------------------------------------------------- instance rows
def test_instances_load_through_datasets_with_swe_gym_string_lists(tmp_path):
    import datasets

    rows = [dict(ROW, FAIL_TO_PASS=json.dumps(ROW["FAIL_TO_PASS"]), PASS_TO_PASS=json.dumps(ROW["PASS_TO_PASS"]))]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "gym.parquet"))
    loaded = load_instances(str(tmp_path / "gym.parquet"))
    assert loaded[0]["FAIL_TO_PASS"] == ROW["FAIL_TO_PASS"] and loaded[0]["test_args"] == []
    out = resolve_source(f"swe:{tmp_path / 'gym.parquet'}")
    assert json.loads(open(out).readline())["PASS_TO_PASS"] == ROW["PASS_TO_PASS"]
    (tmp_path / "two.jsonl").write_text("".join(json.dumps(ROW) + "\n" for _ in range(2)))
    with pytest.raises(ConfigError, match="appears twice"):
        load_instances(str(tmp_path / "two.jsonl"))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"base_commit": ""}, "missing base_commit"),
        ({"FAIL_TO_PASS": "not json"}, "neither a list"),
        ({"FAIL_TO_PASS": ["test_a"]}, "pytest node ids"),
        ({"FAIL_TO_PASS": [], "PASS_TO_PASS": []}, "both empty"),
        ({"test_cmd": "make test"}, "only pytest"),
    ],
)
def test_bad_instance_rows_name_the_field(change, message):
    with pytest.raises(ConfigError, match=message):
        normalize(dict(ROW, **change), "row 1")
    assert normalize(dict(ROW, test_cmd="python -m pytest -x"), "row")["test_args"] == ["-x"]


def test_missing_repository_says_how_to_get_it():
    with pytest.raises(ConfigError, match="git clone --mirror https://github.com/o/x.git"):
        from lit_marl.envs.swe.instances import repo_folder

        repo_folder(normalize(dict(ROW), "r"), "/nonexistent")


# --------------------------------------------------------------------------- what scoring runs
def test_scoring_takes_test_files_and_pytest_config_from_the_base_commit():
    tests = ["tests/test_a.py::test_new"]
    base = {
        "pkg/a.py": (b"bug\n", 0o644),
        "tests/test_a.py": (b"assert fixed\n", 0o644),
        "setup.cfg": (b"[x]\n", 0o644),
    }
    current = {
        "pkg/a.py": b"fix\n",
        "tests/test_a.py": b"assert True\n",  # edited test
        "conftest.py": b"def pytest_runtest_makereport(): ...\n",  # a new plugin
        "pkg/test_helper_test.py": b"x\n",  # a new test-looking file
        "setup.cfg": b"[tool:pytest]\naddopts = -p evil\n",
    }
    files, changes = scoring_files(base, current, tests, "")
    assert files == {
        "pkg/a.py": (b"fix\n", 0o644),
        "tests/test_a.py": (b"assert fixed\n", 0o644),
        "setup.cfg": (b"[x]\n", 0o644),
    }
    assert set(changes) == {"pkg/a.py"}
    files, _ = scoring_files(base, {"pkg/a.py": b"bug\n"}, tests, "")  # the agent deleted the tests
    assert files["tests/test_a.py"] == (b"assert fixed\n", 0o644)
    assert is_test_path("src/testing/util.py", []) and not is_test_path("src/contest.py", [])


def test_files_that_change_imports_without_being_source_are_never_carried():
    never = ["pkg/__pycache__/a.cpython-311.pyc", "a.pyc", "evil-1.0.dist-info/entry_points.txt", "x.egg-link"]
    never += ["x.egg-info/PKG-INFO", "zz.pth", "pkg/_speed.cpython-311-x86_64-linux-gnu.so"]
    for path in never:
        assert not carried(path), path
    assert carried("pkg/a.py") and carried("README.md") and carried("pkg/data/table.csv")
    base = {"pkg/a.py": (b"bug\n", 0o644)}
    files, changes = scoring_files(base, {"pkg/a.py": b"bug\n", "pkg/__pycache__/a.cpython-311.pyc": b"fix"}, [], "")
    assert files == base and changes == {}


def test_new_modules_that_shadow_others_are_refused():
    base = {"pkg/__init__.py": (b"", 0o644), "pkg/mod.py": (b"", 0o644), "six.py": (b"", 0o644)}
    assert "shadows the module pkg/mod.py" in shadowing(base, {"pkg/mod/__init__.py": b"x = 1"})
    assert "shadows the installed module 're'" in shadowing(base, {"re.py": b""})
    assert "shadows the installed module 'json'" in shadowing(base, {"json/__init__.py": b""})
    assert "'pytest'" in shadowing(base, {"pytest.py": b""})
    assert not shadowing(base, {"pkg/mod.py": b"changed", "pkg/helpers.py": b"", "six.py": b"the repository's own"})
    assert not shadowing(base, {"pkg/json.py": b""})  # inside a package: pkg.json, no shadow


def _signed(key: bytes, seq: int, kind: str, *fields: str) -> str:
    import hashlib
    import hmac

    body = " ".join([str(seq), kind, *(f.encode().hex() for f in fields)])
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest() + " " + body


def test_only_lines_signed_with_the_runs_key_in_order_to_their_end_are_a_report():
    lines = [_signed(b"key", 0, "ready"), _signed(b"key", 1, "outcome", "t::a", "passed"),
             _signed(b"key", 2, "outcome", "t::b", "passed"), _signed(b"key", 3, "failed", "t::b"),
             _signed(b"key", 4, "finish", "1", "the log")]  # fmt: skip
    report = signed_report("noise\n" + "\nforged\n".join(lines) + "\n", b"key")
    assert report.complete and report.outcomes == {"t::a": "passed", "t::b": "failed"} and report.log == "the log"
    assert signed_report("\n".join(lines), b"other key") is None  # another key: nothing came
    assert signed_report("\n".join(lines[1:]), b"key") is None  # never ready: the run may be tried again
    swapped = lines[:2] + [lines[3], lines[2]] + lines[4:]
    for broken in (lines[:2] + lines[3:], lines[:2] + lines[1:], lines[:-1], swapped):
        assert not signed_report("\n".join(broken), b"key").complete  # a line dropped, replayed, the end missing
    tampered = signed_report("\n".join([lines[0], _signed(b"key", 1, "tamper", "why")]), b"key")
    assert tampered.tampered == ["why"] and not tampered.complete  # what came before a break still counts


# --------------------------------------------------------------------------- workspace clean-up
def test_sweep_removes_workspaces_of_dead_processes_only(tmp_path):
    root = tmp_path / "root"
    mine = Workspace(root, {"a.py": (b"x", 0o644)})
    child = subprocess.run(
        [sys.executable, "-c", "import sys, os; sys.path[:0] = sys.argv[1:2]; from lit_marl.envs.swe.workspace import "
         "Workspace; from pathlib import Path; w = Workspace(Path(sys.argv[2]), {}); print(w.path); os._exit(0)",
         os.getcwd(), str(root)], capture_output=True, text=True, check=True)  # fmt: skip
    orphan = child.stdout.strip()
    assert os.path.isdir(orphan)  # os._exit: no finalizer ran, as after a SIGKILL
    assert sweep(root) == 1 and not os.path.exists(orphan) and mine.path.is_dir()
    young = root / "ws-nowner"
    young.mkdir()
    assert sweep(root) == 0 and young.is_dir()  # no owner file yet: maybe being made
    os.utime(young, (time.time() - 120, time.time() - 120))
    assert sweep(root) == 1 and not young.exists()
    mine.remove()
    assert not mine.path.exists() and not mine.owner.exists()
