"""Per-test execution of untrusted programs: tests split one by one, recorded one by one, and no
program gets credit for a test it did not pass, whatever it does to the harness or the machine."""

from __future__ import annotations

import ast
import socket
import threading
import time
import uuid

import pytest

from helpers import REPO_ROOT
from lit_marl.envs.code import CodeEnv, TestLimits, load_problems, run_tests, split_tests
from lit_marl.sandbox import bubblewrap_available

ISOLATION = [False, pytest.param(True, marks=pytest.mark.skipif(not bubblewrap_available(), reason="no bwrap"))]
ADD_TESTS = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(2, 2) == 4\n"
FAST = TestLimits(load_timeout_s=3.0, test_timeout_s=1.5, budget_s=4.0)


# --------------------------------------------------------------------------- splitting
def test_split_check_into_single_tests_with_their_setup():
    source = (
        "import math\nMETADATA = {}\n\n"
        "def check(candidate):\n"
        "    '''doc'''\n"
        "    xs = [1, 2]\n"
        "    assert candidate(xs) == 3\n"
        "    assert True, 'never about the program'\n"
        "    for x in xs:\n"
        "        assert candidate([x]) == x\n"
        "    ys = [math.pi]\n"
        "    assert abs(candidate(ys) - math.pi) < 1e-6\n"
    )
    tests = split_tests(source, "total")
    assert [t.code for t in tests] == [
        "assert candidate(xs) == 3",
        "for x in xs:\n    assert candidate([x]) == x",
        "assert abs(candidate(ys) - math.pi) < 1e-06",
    ]
    assert "xs = [1, 2]" in tests[0].setup and "ys" not in tests[0].setup and "import math" in tests[0].setup
    assert "ys = [math.pi]" in tests[2].setup


def test_split_mbpp_style_and_renamed_parameter():
    mbpp = split_tests("import math\nassert gcd2(4, 6) == 2\nassert gcd2(3, 5) == 1\nassert 1 == 1\n", "gcd2")
    assert [t.code for t in mbpp] == ["assert gcd2(4, 6) == 2", "assert gcd2(3, 5) == 1"]
    assert "import math" in mbpp[0].setup
    renamed = split_tests("def check(f):\n    assert f(1) == 2\n", "inc")
    assert renamed[0].code == "assert f(1) == 2" and "f = candidate" in renamed[0].setup


# --------------------------------------------------------------------------- per-test results
@pytest.mark.parametrize("isolate", ISOLATION)
def test_each_test_recorded_on_its_own(isolate):
    tests = split_tests(ADD_TESTS + "    assert candidate(0, 0) == 0\n", "add")
    programs = [
        "def add(a, b):\n    return a + b",
        "def add(a, b):\n    return 3",  # passes the first test only
        "def add(a, b):\n    if a == 2:\n        raise ValueError('two')\n    return a + b",
        "def add(a, b):\n    return (a + b,)",  # a tuple is not an int
        "def plus(a, b):\n    return a + b",  # no entry point
        "def add(a, b)\n    return a + b",  # syntax error: the program does not load
    ]
    reports = run_tests([(p, tests, "add") for p in programs], FAST, isolate=isolate)
    assert [[o.passed for o in r.outcomes] for r in reports] == [
        [True, True, True],
        [True, False, False],
        [True, False, True],
        [False, False, False],
        [False, False, False],
        [False, False, False],
    ]
    assert reports[2].outcomes[1].error == "RuntimeError" and "ValueError: two" in reports[2].outcomes[1].message
    assert reports[4].outcomes[0].error == "NameError"
    assert not reports[5].loaded and "SyntaxError" in reports[5].load_error
    assert all(r.harness_ok for r in reports)


@pytest.mark.parametrize("isolate", ISOLATION)
def test_hung_test_is_restarted_for_the_next_one(isolate):
    tests = split_tests(ADD_TESTS + "    assert candidate(5, 5) == 10\n", "add")
    program = "def add(a, b):\n    while a == 2:\n        pass\n    return a + b"
    (report,) = run_tests([(program, tests, "add")], FAST, isolate=isolate)
    assert [o.passed for o in report.outcomes] == [True, False, True]
    assert report.outcomes[1].error == "ProgramDied" and "timed out" in report.outcomes[1].message


# --------------------------------------------------------------------------- adversarial programs
# Each pretends to be `add` and tries to get credit without computing a + b, or to harm the host.
ADVERSARIAL = {
    "infinite_loop": "def add(a, b):\n    while True:\n        pass",
    "infinite_loop_at_load": "while True:\n    pass\ndef add(a, b):\n    return a + b",
    "fork_bomb": "import os\ndef add(a, b):\n    while True:\n        os.fork()",
    "memory_bomb": "x = bytearray(8 * 1024 ** 3)\ndef add(a, b):\n    return a + b",
    "kill_parent": "import os, signal\ndef add(a, b):\n    os.kill(os.getppid(), signal.SIGKILL)",
    "exit_before_tests": "import os\nos._exit(0)\ndef add(a, b):\n    return a + b",
    "sys_exit_in_call": "import sys\ndef add(a, b):\n    sys.exit(0)",
    "patch_assert": "import builtins\nbuiltins.AssertionError = type('Quiet', (Exception,), {})\n"
    "def add(a, b):\n    return 0",
    "override_builtins": "import builtins\nbuiltins.abs = lambda x: 0\nbuiltins.len = lambda x: 0\n"
    "def add(a, b):\n    return 0",
    "always_equal": "class Any:\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Any()",
    "int_subclass_equal": "class I(int):\n    def __eq__(self, other):\n        return True\n"
    "def add(a, b):\n    return I(0)",
    "fake_report": "import sys, json\nprint(json.dumps({'loaded': True, 'tests': [{'passed': True}] * 2}))\n"
    "def add(a, b):\n    sys.stdout.write('PASSED\\n')\n    return 0",
    "tamper_with_harness": "import os\ndef add(a, b):\n    p = os.getppid()\n"
    "    open(f'/proc/{p}/fd/1', 'w').write('{\"loaded\": true}\\n')\n    return 0",
    "read_harness_memory": "import os\ndef add(a, b):\n"
    "    open(f'/proc/{os.getppid()}/mem', 'rb').read(1)\n    return 0",
}


@pytest.mark.parametrize("isolate", ISOLATION)
@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_adversarial_program_gets_no_credit(isolate, name):
    tests = split_tests(ADD_TESTS, "add")
    start = time.monotonic()
    (report,) = run_tests([(ADVERSARIAL[name], tests, "add")], FAST, isolate=isolate)
    elapsed = time.monotonic() - start
    assert report.passed_frac == 0.0 and len(report.outcomes) == 2, report
    assert all(o.error for o in report.outcomes)  # each failure says why
    assert elapsed < FAST.wall_s + 1  # ended within its limits
    # the trainer's process is unaffected (we are it), and the harness still works afterwards
    (good,) = run_tests([("def add(a, b):\n    return a + b", tests, "add")], FAST, isolate=isolate)
    assert good.passed_frac == 1.0


@pytest.mark.parametrize("isolate", ISOLATION)
def test_new_processes_are_refused_but_threads_work(isolate):
    # RLIMIT_NPROC does not bind root (even mapped under bwrap), so the harness refuses forks itself
    forking = "import os, time\ndef add(a, b):\n    if os.fork() == 0:\n        time.sleep(60)\n    return a + b"
    spawning = (
        "import subprocess\ndef add(a, b):\n    return int(subprocess.check_output(['expr', str(a), '+', str(b)]))"
    )
    threads = (
        "import threading\ndef add(a, b):\n    out = []\n    t = threading.Thread(target=lambda: out.append(a + b))\n"
        "    t.start()\n    t.join()\n    return out[0]"
    )
    tests = split_tests(ADD_TESTS, "add")
    reports = run_tests([(p, tests, "add") for p in (forking, spawning, threads)], FAST, isolate=isolate)
    assert [r.passed_frac for r in reports] == [0.0, 0.0, 1.0]
    assert "Operation not permitted" in reports[0].outcomes[0].message


needs_bwrap = pytest.mark.skipif(not bubblewrap_available(), reason="file and network isolation needs bubblewrap")


@needs_bwrap
def test_cannot_write_outside_its_temp_dir():
    target = REPO_ROOT / f"pwned-{uuid.uuid4().hex}"
    program = f"def add(a, b):\n    open({str(target)!r}, 'w').write('x')\n    return a + b"
    (report,) = run_tests([(program, split_tests(ADD_TESTS, "add"), "add")], FAST)
    assert report.passed_frac == 0 and not target.exists()


@needs_bwrap
def test_cannot_read_outside_its_temp_dir():
    # a file of answers next to the checkout (e.g. the test data) is invisible to the program
    secret = REPO_ROOT / f".answers-{uuid.uuid4().hex}"
    secret.write_text("3\n4\n")
    try:
        program = f"def add(a, b):\n    return int(open({str(secret)!r}).read().split()[a - 1])"
        (report,) = run_tests([(program, split_tests(ADD_TESTS, "add"), "add")], FAST)
    finally:
        secret.unlink()
    assert report.passed_frac == 0 and "FileNotFoundError" in report.outcomes[0].message


@needs_bwrap
def test_cannot_open_a_network_connection():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def answer():  # a local oracle that would give the right sums
        server.settimeout(10)
        try:
            while True:
                conn, _ = server.accept()
                a, b = map(int, conn.recv(64).split())
                conn.sendall(str(a + b).encode())
                conn.close()
        except OSError:
            pass

    threading.Thread(target=answer, daemon=True).start()
    program = (
        "import socket\ndef add(a, b):\n"
        f"    s = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        "    s.sendall(f'{a} {b}'.encode())\n    return int(s.recv(64))"
    )
    try:
        (isolated,) = run_tests([(program, split_tests(ADD_TESTS, "add"), "add")], FAST, isolate=True)
        (open_net,) = run_tests([(program, split_tests(ADD_TESTS, "add"), "add")], FAST, isolate=False)
    finally:
        server.close()
    assert open_net.passed_frac == 1.0  # the oracle works: the program would cheat without isolation
    assert isolated.passed_frac == 0.0 and "ConnectionRefused" in isolated.outcomes[0].message


# --------------------------------------------------------------------------- HumanEval
class _DropReturns(ast.NodeTransformer):
    def visit_Return(self, node):
        return ast.Pass()


def _without_returns(source: str, entry_point: str) -> str:
    tree = ast.parse(source)
    for stmt in tree.body:
        if isinstance(stmt, ast.FunctionDef) and stmt.name == entry_point:
            _DropReturns().visit(stmt)
    return ast.unparse(tree)


@pytest.mark.parametrize("every", [4, pytest.param(1, marks=pytest.mark.slow)], ids=["every_4th", "all_164"])
def test_humaneval_canonical_solutions_get_full_credit_and_broken_ones_none(every):
    """The canonical solutions pass every test through the sandboxed reward; with their return
    statements removed they pass only the tests that a function returning None passes too
    (HumanEval has a few, e.g. ``assert not candidate(...)``). ``make test`` checks every 4th
    problem (41, ~20 s), ``make test-slow`` all 164."""
    problems = load_problems("humaneval")
    assert len(problems) == 164
    problems = problems[::every]
    env = CodeEnv(roles="single")
    solutions = [p["prompt"] + p["canonical_solution"] for p in problems]
    out = env.reward([solutions], problems)
    assert out["level/tests_passed"] == [1.0] * len(problems)
    assert out["reward"] == pytest.approx([1.0] * len(problems))

    jobs = [
        (_without_returns(s, p["entry_point"]), env.tests_of(p), p["entry_point"]) for s, p in zip(solutions, problems)
    ]
    broken = run_tests(jobs)
    credited = [i for i, r in enumerate(broken) if r.passed_frac > 0]
    assert len(credited) <= 10, [problems[i]["task_id"] for i in credited]
    stubs = [
        (
            f"def {problems[i]['entry_point']}(*args, **kwargs):\n    return None",
            env.tests_of(problems[i]),
            problems[i]["entry_point"],
        )
        for i in credited
    ]
    for i, stub in zip(credited, run_tests(stubs)):
        assert [o.passed for o in broken[i].outcomes] == [o.passed for o in stub.outcomes], problems[i]["task_id"]


# a wrong entry point, then the same with a definition that shadows what the tests use: a builtin
# (abs, tuple, range) or a helper the prompt gives (poly, encode_cyclic, encode_shift)
SHADOWING = {
    2: ("def truncate_number(number):\n    return 0.0", "def abs(x):\n    return 0"),
    4: ("def mean_absolute_deviation(numbers):\n    return 0.0", "def abs(x):\n    return 0"),
    32: ("def find_zero(xs):\n    return 0.0", "def poly(xs, x):\n    return 0.0"),
    33: ("def sort_third(l):\n    return list(l)", "def tuple(x):\n    return 0"),
    37: ("def sort_even(l):\n    return list(l)", "def tuple(x):\n    return 0"),
    38: ("def decode_cyclic(s):\n    return s", "def encode_cyclic(s):\n    return s"),
    44: ("def change_base(x, base):\n    return ''", "def range(*args):\n    return []"),
    50: ("def decode_shift(s):\n    return s", "def encode_shift(s):\n    return s"),
    53: ("def add(x, y):\n    return 1", "def range(*args):\n    return []"),
}


def _fenced(code: str) -> str:
    return f"```python\n{code}\n```"


def test_names_a_program_defines_do_not_change_what_the_tests_compute():
    """HumanEval problems whose tests use a builtin or a prompt helper by name: a wrong program earns
    exactly what it earns without its shadowing definition (on the harness that handed every name
    of the program to the tests, 4, 32, 33, 37, 38 and 50 got full credit this way, 2, 44 and 53
    more than the program alone). And HumanEval/33's `sort_third(x)` in its check is the reference,
    not the program (an identity function passed 3 of 7 asserts comparing it with itself; now 1)."""
    problems = {int(p["task_id"].split("/")[1]): p for p in load_problems("humaneval")}
    tasks = [problems[i] for i in SHADOWING]
    env = CodeEnv(roles="single")
    wrong = env.reward([[_fenced(w) for w, _ in SHADOWING.values()]], tasks)["level/tests_passed"]
    shadowed = env.reward([[_fenced(f"{s}\n\n{w}") for w, s in SHADOWING.values()]], tasks)["level/tests_passed"]
    assert shadowed == wrong, dict(zip(SHADOWING, zip(wrong, shadowed)))
    assert max(wrong) < 1.0
    # the reference is what 33's own-name asserts compare with: an identity function fails them
    identity_33 = wrong[list(SHADOWING).index(33)]
    assert identity_33 < 0.5
    # the task's helpers are still there for the tests: right programs pass in full
    right = env.reward([[_fenced(problems[i]["prompt"] + problems[i]["canonical_solution"]) for i in SHADOWING]], tasks)
    assert right["level/tests_passed"] == [1.0] * len(SHADOWING)


def test_a_helper_that_shadows_a_builtin_carries_nothing():
    """Helper + main: the helper agent's reply alone (an `abs` beside its `aux`) must not pass a
    wrong entry point."""
    task = next(p for p in load_problems("humaneval") if p["task_id"] == "HumanEval/2")
    env = CodeEnv(roles="aux_main")
    helper = _fenced("def aux(x):\n    return x\n\ndef abs(x):\n    return 0")
    plain = _fenced("def aux(x):\n    return x")
    main = _fenced("def truncate_number(number):\n    return aux(0.0)")
    shadowed = env.reward([[helper], [main]], [task])["level/tests_passed"]
    honest = env.reward([[plain], [main]], [task])["level/tests_passed"]
    assert shadowed == honest and honest[0] < 1.0


@pytest.mark.parametrize("isolate", ISOLATION)
def test_a_program_that_leaves_its_process_group_is_still_stopped(isolate):
    """The program joins the harness's process group, so a kill of its own group finds no one: the
    harness must still stop it and go on (a wait without a timeout held the run to its wall limit
    and lost the whole report)."""
    program = "import os, time\nos.setpgid(0, os.getpgid(os.getppid()))\ndef add(a, b):\n    time.sleep(100)\n"
    start = time.perf_counter()
    (report,) = run_tests([(program, split_tests(ADD_TESTS, "add"), "add")], FAST, isolate=isolate)
    elapsed = time.perf_counter() - start
    assert report.harness_ok and report.loaded, report.load_error
    assert [o.passed for o in report.outcomes] == [False, False]
    assert elapsed < FAST.wall_s - 1, f"{elapsed:.1f} s: the harness waited for the program"
