"""Expert demonstrations of the code env: canonical solutions, split into helper + entry point."""

from __future__ import annotations

import json
import sys

import pytest

from helpers import REPO_ROOT
from lit_marl.envs.code import CodeEnv, Role, TestLimits, load_problems
from lit_marl.envs.code.canonical import split_solution

LIMITS = TestLimits(test_timeout_s=1.0, budget_s=3.0)
EASY = REPO_ROOT / "data" / "code" / "easy_train.jsonl"


def _run(code: str, name: str, inputs: list[tuple]) -> list:
    namespace: dict = {}
    exec(code, namespace)
    return [namespace[name](*args) for args in inputs]


def _split(source: str, name: str) -> tuple[str, str]:
    """A split of a complete function given as HumanEval does: its ``def`` line, then the body."""
    head, body = source.split("\n", 1)
    split = split_solution(head + "\n", body, name)
    assert split is not None
    return split


def _assert_equivalent(source: str, split: tuple[str, str], name: str, inputs: list[tuple]) -> None:
    aux, main = split
    assert _run(main + "\n\n" + aux, name, inputs) == _run(source, name, inputs)


# --------------------------------------------------------------------------- split_solution
def test_split_moves_the_largest_proper_sub_expression():
    source = "def f(a: int, b: int) -> int:\n    return (a + b) * 7\n"
    split = _split(source, "f")
    assert split == ("def aux(a, b):\n    return a + b", "def f(a: int, b: int) -> int:\n    return aux(a, b) * 7")
    _assert_equivalent(source, split, "f", [(1, 2), (-3, 3), (10, 0)])


def test_split_comprehensions_bind_their_own_names():
    inner = "def f(xs, m):\n    return [abs(x - m) * 2 for x in xs if x]\n"  # the whole value is returned
    split = _split(inner, "f")
    assert split[0] == "def aux(x, m):\n    return abs(x - m) * 2"  # the enclosing target becomes a parameter
    assert "return [aux(x, m) for x in xs if x]" in split[1]
    _assert_equivalent(inner, split, "f", [([1, 0, 5], 2), ([], 1)])
    whole = "def g(xs):\n    return sum([x * x for x in xs if x % 2 == 0]) + 1\n"
    split = _split(whole, "g")
    assert split[0] == "def aux(xs):\n    return sum([x * x for x in xs if x % 2 == 0])"  # x is bound inside
    _assert_equivalent(whole, split, "g", [([1, 2, 3, 4],), ([],)])


def test_split_passes_locals_and_nested_functions_and_imports_what_it_uses():
    stats = "def var(xs):\n    n = len(xs)\n    mean = sum(xs) / n\n    return sum((x - mean) ** 2 for x in xs) / n\n"
    split = _split(stats, "var")
    assert split[0] == "def aux(xs, mean):\n    return sum(((x - mean) ** 2 for x in xs))"
    assert "return aux(xs, mean) / n" in split[1]
    _assert_equivalent(stats, split, "var", [([1.0, 2.0, 4.0],), ([3.0],)])
    nested = (
        "def count_odd(xs):\n    def is_odd(k):\n        return k % 2 == 1\n"
        "    return len([x for x in xs if is_odd(x)])\n"
    )
    aux, main = split = _split(nested, "count_odd")
    assert aux == "def aux(xs, is_odd):\n    return [x for x in xs if is_odd(x)]"
    assert "def is_odd(k):" in main and "return len(aux(xs, is_odd))" in main
    _assert_equivalent(nested, split, "count_odd", [(list(range(30)),), ([],)])
    local_import = "def digest(text):\n    import hashlib\n    return hashlib.md5(text.encode()).hexdigest()[:8]\n"
    split = _split(local_import, "digest")
    assert split[0] == "import hashlib\n\ndef aux(text):\n    return hashlib.md5(text.encode()).hexdigest()"
    _assert_equivalent(local_import, split, "digest", [("abc",), ("",)])


@pytest.mark.parametrize("index", [0, 10, 39, 59, 129, 162])
def test_split_humaneval_solutions_still_pass_their_tests(index):
    """Multi-statement solutions, a helper the prompt defines (10), nested helpers and local imports
    (39, 59, 162): the split program passes the task's own check (run here: trusted code)."""
    task = load_problems(f"humaneval[{index}:{index + 1}]")[0]
    aux, main = split_solution(task["prompt"], task["canonical_solution"], task["entry_point"])
    assert f"def {task['entry_point']}(" in main and "aux(" in main and "def aux" not in main
    namespace: dict = {}
    exec(main + "\n\n" + aux + "\n\n" + task["test"], namespace)
    namespace["check"](namespace[task["entry_point"]])


def test_no_split_without_a_movable_sub_expression():
    assert split_solution("def f(x):\n", "    return x\n", "f") is None
    assert split_solution("def f(s):\n", "    return len(s)\n", "f") is None  # only the whole value moves
    assert split_solution("def f(aux):\n", "    return (aux + 1) * 2\n", "f") is None  # the name is taken
    assert split_solution("def f(x):\n", "    y = (yield x) + 1\n    return y\n", "f") is None  # a yield stays
    assert split_solution("def f(x):\n", "    return (\n", "f") is None


# --------------------------------------------------------------------------- demonstrations
@pytest.mark.parametrize("roles", ["single", "aux_main"])
def test_demonstrations_of_easy_tasks_get_the_full_reward(roles):
    rows = load_problems(str(EASY))
    tasks = [rows[i] for i in (0, 6, 18, 24, 30, 45)]
    env = CodeEnv(roles=roles, test_limits=LIMITS)
    demos = [env.demonstration(t) for t in tasks]
    for task, demo in zip(tasks, demos):
        assert [chat[0] for chat in demo] == [{"role": "user", "content": p} for p in env.prompts(task)]
        assert all(chat[1]["role"] == "assistant" and chat[1]["content"].startswith("```python\n") for chat in demo)
    out = env.reward([[demo[i][1]["content"] for demo in demos] for i in range(env.num_agents)], tasks)
    assert out["reward"] == pytest.approx([1.0] * len(tasks))
    if roles == "aux_main":
        assert demos[0][0][1]["content"] == "```python\ndef aux(a, b):\n    return a + b\n```"
        assert demos[0][1][1]["content"].endswith('"""\n    return aux(a, b) * 2\n```')


def test_make_demos_keeps_the_demonstrations_at_full_reward(tmp_path, capsys):
    """scripts/make_demos.py on 20 HumanEval tasks plus a wrong and a missing canonical solution:
    the splits that exist are scored at full reward by the env itself; the rest are rejected."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import make_demos

    tasks = load_problems("humaneval[:20]")
    wrong = {**tasks[0], "task_id": "T/wrong", "canonical_solution": tasks[1]["canonical_solution"]}
    missing = {**tasks[3], "task_id": "T/missing", "canonical_solution": ""}
    source = tmp_path / "tasks.jsonl"
    source.write_text("".join(json.dumps(t) + "\n" for t in [*tasks, wrong, missing]))
    out = tmp_path / "demos.jsonl"
    kwargs = json.dumps({"roles": "aux_main", "test_limits": {"test_timeout_s": 1.0, "budget_s": 3.0}})
    make_demos.main(
        ["--env", "lit_marl.envs.code:CodeEnv", "--env-kwargs", kwargs, "--tasks", str(source)] + ["--out", str(out)]
    )
    kept = {row["task_id"]: row["messages"] for row in map(json.loads, out.read_text().splitlines())}
    assert len(kept) == 18 and not {"HumanEval/2", "HumanEval/8", "T/missing", "T/wrong"} & set(kept)
    report = capsys.readouterr().out
    assert "18 demonstrations" in report and "4 rejected" in report and "reward below 1.0" in report
    assert "def is_palindrome" not in kept["HumanEval/10"][1][1]["content"]  # the prompt gives it (the prelude)
    env = CodeEnv(roles="aux_main", test_limits=LIMITS)
    chosen = [t for t in tasks if t["task_id"] in kept][:3]
    assert [env.demonstration(t) for t in chosen] == [kept[t["task_id"]] for t in chosen]


def test_demonstration_errors_name_the_task_or_the_roles():
    task = load_problems(str(EASY))[3]  # return max(nums): nothing to split
    with pytest.raises(ValueError, match=r"'Easy/train/3'.*`aux`"):
        CodeEnv(roles="aux_main").demonstration(task)
    with pytest.raises(ValueError, match=r"'Easy/train/3' has no canonical_solution"):
        CodeEnv().demonstration({**task, "canonical_solution": "  \n"})
    roles = [Role("double", "{prompt}", "d"), Role("inc", "{prompt}"), Role("{entry_point}", "{prompt}", "main")]
    with pytest.raises(NotImplementedError, match=r"\['d', 'inc', 'main'\]"):
        CodeEnv(roles=roles).demonstration(task)
