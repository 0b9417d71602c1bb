"""The code environment: problems, roles as data, the level-based reward, feedback transitions."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from helpers import REPO_ROOT
from lit_marl import ConfigError
from lit_marl.envs.code import CodeEnv, Expert, RewardWeights, Role, extract_code, load_problems

DATA = REPO_ROOT / "tests" / "data"
ADD = {
    "task_id": "T/add",
    "prompt": 'import math\n\ndef add(a: int, b: int) -> int:\n    """Return a + b."""\n',
    "entry_point": "add",
    "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(2, 2) == 4\n"
    "    assert candidate(0, 5) == 5\n    assert candidate(-1, 1) == 0\n",
}
GOOD = "```python\ndef add(a, b):\n    return a + b\n```"


def _fields(out, j):
    return {k: v[j] for k, v in out.items()}


# --------------------------------------------------------------------------- problems
def test_humaneval_ships_offline_and_slices():
    assert len(load_problems("humaneval")) == 164
    head, tail = load_problems("humaneval[:130]"), load_problems("humaneval[130:]")
    assert len(head) == 130 and len(tail) == 34 and tail[0]["task_id"] == "HumanEval/130"


def test_local_files_in_both_schemas():
    mbpp = load_problems(str(DATA / "mbpp_sample.jsonl"))
    assert [p["entry_point"] for p in mbpp] == ["digit_product", "long_words", "find_gcd"]
    assert mbpp[0]["task_id"] == "MBPP/901" and "assert digit_product(234) == 24" in mbpp[0]["prompt"]
    coop = load_problems(str(DATA / "coophumaneval_sample.jsonl"))
    assert coop[1]["entry_point"] == "vowel_ratio"
    env = CodeEnv()
    canonical = [p["canonical_solution"] for p in mbpp] + [p["prompt"] + p["canonical_solution"] for p in coop]
    out = env.reward([canonical], mbpp + coop)
    assert out["level/tests_passed"] == [1.0] * 5


def test_bundled_easy_problems_pass_with_their_solutions():
    rows = load_problems(str(REPO_ROOT / "data" / "code" / "easy_heldout.jsonl"))
    out = CodeEnv().reward([[r["prompt"] + r["canonical_solution"] for r in rows]], rows)
    assert out["success"] == [1.0] * len(rows)


def test_problem_sources_fail_clearly(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match=r"data\.train_path='mbpp'.*offline.*local JSONL"):
        load_problems("mbpp")
    with pytest.raises(ConfigError, match=r"not a file, and not one of humaneval"):
        load_problems("humaneval-typo")
    with pytest.raises(ConfigError, match="selects no problems"):
        load_problems("humaneval[200:]")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "?", "answer": 1}) + "\n")
    with pytest.raises(ConfigError, match="neither in the HumanEval schema"):
        load_problems(str(bad))


# --------------------------------------------------------------------------- code extraction
def test_extract_code_keeps_definitions_only():
    text = "Here you go:\n```python\nimport os\ndef f(x):\n    return x\n\nprint(f(2))\nassert f(1) == 1\n```\nDone."
    assert extract_code(text) == "import os\n\ndef f(x):\n    return x"
    assert extract_code("def g():\n    return 1") == "def g():\n    return 1"  # no fence
    assert extract_code("```\ndef g(:\n```") == "def g(:"  # kept for the syntax level
    assert "def aux" not in extract_code("def aux():\n    return 0\ndef main():\n    return aux()", drop={"aux"})
    unclosed = "```python\ndef h():\n    return 2\n"  # cut by max_new_tokens
    assert extract_code(unclosed) == "def h():\n    return 2"


# --------------------------------------------------------------------------- reward levels
def test_single_role_levels():
    env = CodeEnv()
    replies = [
        GOOD,
        "def add(a, b):\n    return 3",  # one test of four
        "def plus(a, b):\n    return a + b",  # no definition
        "def add(a, b)\n    return a + b",  # syntax error
        "def add(a, b):\n    return math.floor(a) + b",  # the task's import is in the program
    ]
    out = env.reward([replies], [ADD] * len(replies))
    w = RewardWeights()
    best = w.definitions + w.syntax + w.tests
    assert out["reward"] == pytest.approx(
        [1.0, (w.definitions + w.syntax + w.tests / 4) / best, 0.0, w.definitions / best, 1.0]
    )
    assert out["level/definitions"] == [1, 1, 0, 1, 1]
    assert out["level/syntax"] == [1, 1, 0, 0, 1]
    assert out["level/tests_passed"] == [1, 0.25, 0, 0, 1]
    assert out["success"] == [1, 0, 0, 0, 1]


AUX = "def aux(a, b):\n    return a + b"


def test_two_roles_collaboration_levels():
    env = CodeEnv(roles="aux_main")
    mains = [
        "def add(a, b):\n    s = aux(a, b)\n    return s",  # uses aux: full credit
        "def add(a, b):\n    return aux(a, b)",  # a thin wrapper
        "def add(a, b):\n    aux(a, b)\n    return a + b",  # ignores aux's result
        "def add(a, b):\n    return a + b",  # does not call aux
        "def add(a, b):\n    return aux(a, b) + 1",  # calls aux but passes no test: no bonus
        "def aux(a, b):\n    return 0\ndef add(a, b):\n    return aux(a, b) * 1",  # may not replace aux
    ]
    out = env.reward([[AUX] * len(mains), mains], [ADD] * len(mains))
    w = RewardWeights()
    best = w.definitions + w.syntax + w.tests + w.calls_helper + w.not_wrapper
    base = w.definitions + w.syntax + w.tests
    assert out["reward"] == pytest.approx(
        [
            1.0,
            (base + w.calls_helper) / best,
            (base + w.calls_helper + w.not_wrapper + w.ignored_result) / best,
            base / best,
            (w.definitions + w.syntax) / best,
            1.0,  # the main's own aux was dropped, the helper's used
        ]
    )
    assert out["collab/calls_helper"] == [1, 1, 1, 0, 1, 1]
    assert out["collab/not_wrapper"] == [1, 0, 1, 0, 1, 1]
    assert out["collab/ignored_result"] == [0, 0, 1, 0, 0, 0]
    missing_aux = env.reward([["def helper():\n    return 1"], [mains[0]]], [ADD])
    assert missing_aux["level/definitions"] == [0.5] and missing_aux["level/tests_passed"] == [0.0]


def test_three_roles_are_data():
    roles = [
        Role("double", "Write `double(x)` returning 2 * x. {prompt}"),
        Role("inc", "Write `inc(x)` returning x + 1. {prompt}"),
        Role("{entry_point}", "Write `{defines}` using {helpers}. {prompt}"),
    ]
    env = CodeEnv(roles=roles)
    task = {
        "task_id": "T/f",
        "prompt": "f(x) = 2x + 1",
        "entry_point": "f",
        "test": "def check(candidate):\n    assert candidate(1) == 3\n    assert candidate(5) == 11\n",
    }
    assert env.num_agents == 3 and env.prompts(task)[2] == "Write `f` using double, inc. f(x) = 2x + 1"
    replies = [
        ["def double(x):\n    return 2 * x"],
        ["def inc(x):\n    return x + 1"],
        ["def f(x):\n    return inc(double(x))"],
    ]
    assert env.reward(replies, [task])["reward"] == pytest.approx([(0.1 + 0.1 + 0.6 + 0.1) / 1.0])  # thin wrapper


def test_bad_roles_and_settings_fail_clearly():
    with pytest.raises(ConfigError, match="the last role writes the entry point"):
        CodeEnv(roles=[Role("{entry_point}", "x"), Role("aux", "y")])
    with pytest.raises(ConfigError, match="two roles define the same function"):
        CodeEnv(roles=[Role("aux", "x"), Role("aux", "y"), Role("{entry_point}", "z")])
    with pytest.raises(ConfigError, match="expert_edits needs data.env.expert"):
        CodeEnv(transition="expert_edits")
    with pytest.raises(ConfigError, match="sandbox_slice='some'"):
        CodeEnv(sandbox_slice="some")
    env = CodeEnv(roles=[Role("{entry_point}", "Solve {problem_text}")])
    with pytest.raises(ConfigError, match="uses the field 'problem_text'"):
        env.load_tasks(str(DATA / "coophumaneval_sample.jsonl"), "data.train_path")


# --------------------------------------------------------------------------- feedback
def _next_prompts(env, replies, task=ADD):
    prompts = env.prompts(task)
    return env.transition(
        task=[task],
        prompt=[task["prompt"]],
        agent_completions=[replies],
        num_agents=len(replies),
        prompt_history_per_agent=[[[p] for p in prompts]],
        response_history_per_agent=[[[r] for r in replies]],
    )[0]


@pytest.mark.parametrize(
    "sandbox_slice, shown",
    [(1, [0]), (2, [0, 1]), (-1, [3]), (-2, [2, 3]), (0, [0, 1, 2, 3]), (None, [0, 1, 2, 3]), ("all", [0, 1, 2, 3])],
)
def test_level_feedback_reveals_the_sliced_tests(sandbox_slice, shown):
    env = CodeEnv(sandbox_slice=sandbox_slice)
    (prompt,) = _next_prompts(env, ["def add(a, b):\n    return 3"])
    codes = [t.code for t in env.tests_of(ADD)]
    for k, code in enumerate(codes):
        assert (f"Test `{code}`" in prompt) == (k in shown), (k, prompt)
    assert "Test `assert candidate(1, 2) == 3` passed" in prompt or 0 not in shown
    assert "Test `assert candidate(2, 2) == 4` failed: AssertionError" in prompt or 1 not in shown
    assert f"of the {len(shown)} shown tests passed" in prompt
    # the reward still counts every test
    assert env.reward([["def add(a, b):\n    return 3"]], [ADD])["level/tests_passed"] == [0.25]


def test_level_feedback_static_checks_and_helper_notes():
    env = CodeEnv(roles="aux_main")
    aux_prompt, main_prompt = _next_prompts(env, [AUX, "def add(a, b):\n    return a +\n"])
    assert "SyntaxError in the code of add at line 2" in main_prompt and "column" in main_prompt
    assert "Test `" not in main_prompt  # nothing ran
    aux_prompt, main_prompt = _next_prompts(env, ["def other():\n    pass", "def add(a, b):\n    return a + b"])
    assert "`aux` is missing" in aux_prompt and "`aux` is missing" in main_prompt
    aux_prompt, main_prompt = _next_prompts(env, [AUX, "def add(a, b):\n    return a + b"])
    assert "does not call `aux`" in main_prompt and "does not call" not in aux_prompt
    assert "Your teammate's `aux`" in main_prompt and AUX in main_prompt  # main learns aux's signature
    assert main_prompt.startswith(env.prompts(ADD)[1]) and "Your code at turn 1:" in main_prompt
    _, wrapper = _next_prompts(env, [AUX, "def add(a, b):\n    return aux(a, b)"])
    assert "only returns `aux`'s result" in wrapper


def test_plain_transition_and_history_options():
    env = CodeEnv(transition="plain", include_original_prompt=False, history="all")
    prompts = env.prompts(ADD)
    (prompt,) = env.transition(
        task=[ADD],
        prompt=[ADD["prompt"]],
        agent_completions=[[GOOD]],
        num_agents=1,
        prompt_history_per_agent=[[prompts * 2]],
        response_history_per_agent=[[["def add(a, b):\n    return 0", GOOD]]],
    )[0]
    assert not prompt.startswith(prompts[0]) and "Feedback" not in prompt
    assert "Your code at turn 1:" in prompt and "Your code at turn 2:" in prompt and prompt.endswith("block.")


# --------------------------------------------------------------------------- expert edits
class _StubChat(BaseHTTPRequestHandler):
    requests: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _StubChat.requests.append((self.path, self.headers.get("Authorization"), body))
        content = body["messages"][0]["content"]
        if "FAIL" in content:
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"boom")
            return
        text = json.dumps({"aux": "Keep `aux` as it is.", "add": "Replace `return 3` by `return aux(a, b)`."})
        if "PROSE" in content and "could not be used" not in content:  # malformed until the re-ask
            text = "Replace `return 3` by `return a + b`."
        reply = {
            "choices": [{"message": {"role": "assistant", "content": f"Here are the edits:\n```json\n{text}\n```"}}]
        }
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def stub_endpoint():
    server = HTTPServer(("127.0.0.1", 0), _StubChat)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _StubChat.requests = []
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def test_expert_edits_from_an_openai_compatible_endpoint(stub_endpoint, monkeypatch):
    monkeypatch.setenv("STUB_KEY", "sk-test")
    expert = Expert(model="stub-coder", base_url=stub_endpoint, api_key_env="STUB_KEY", retries=0)
    env = CodeEnv(roles="aux_main", transition="expert_edits", expert=expert)
    aux_prompt, main_prompt = _next_prompts(env, [AUX, "def add(a, b):\n    return 3"])
    # each agent gets the edits to its own function only
    assert (
        "proposes these edits to your `aux`:\nKeep `aux` as it is." in aux_prompt
        and "return aux(a, b)" not in aux_prompt
    )
    assert "proposes these edits to your `add`:\nReplace `return 3` by `return aux(a, b)`." in main_prompt
    assert "Keep `aux`" not in main_prompt
    ((path, auth, body),) = _StubChat.requests  # one request per branch, shared by its agents
    assert path == "/v1/chat/completions" and auth == "Bearer sk-test" and body["model"] == "stub-coder"
    message = body["messages"][0]["content"]
    assert "def aux(a, b)" in message and "return 3" in message and body["temperature"] == 0.0
    assert "- `aux`: agent 1 (helper)" in message and '{"aux": "<edits to aux>", "add": "<edits to add>"}' in message
    assert expert.malformed_replies == 0 and expert.format_retries == 0
    # a prose reply is asked again, sampled, with a note on the format
    _StubChat.requests = []
    prose = Expert(model="stub-coder", base_url=stub_endpoint, retries=1, prompt="PROSE {prompt} {code} {format}")
    env = CodeEnv(roles="aux_main", transition="expert_edits", expert=prose)
    _, main_prompt = _next_prompts(env, [AUX, "def add(a, b):\n    return 3"])
    assert "your `add`:\nReplace `return 3` by `return aux(a, b)`." in main_prompt
    first, again = (body for _, _, body in _StubChat.requests)
    assert "could not be used: it holds no JSON object" in again["messages"][0]["content"]
    assert again["temperature"] == prose.retry_temperature > 0 and first["temperature"] == 0.0
    assert prose.format_retries == 1 and prose.malformed_replies == 0
    failing = Expert(model="stub-coder", base_url=stub_endpoint, retries=1, prompt="FAIL {prompt} {code} {format}")
    with pytest.raises(RuntimeError, match=r"expert endpoint .*/v1/chat/completions .* failed after 2 attempts.*boom"):
        failing.propose(["task"], ["code"], [{"add": "agent 1"}])


def test_expert_edits_from_a_local_model():
    # six random tokens are never the JSON object: one sampled re-ask, then the fallback, counted
    expert = Expert(model="tiny-random", max_new_tokens=6, retries=1)
    env = CodeEnv(roles="aux_main", transition="expert_edits", expert=expert)
    aux_prompt, main_prompt = _next_prompts(env, [AUX, "def add(a, b):\n    return 3"])
    assert "proposes these edits to your `aux`:" in aux_prompt and "proposes these edits to your `add`:" in main_prompt
    assert expert.format_retries == 1 and expert.malformed_replies == 1
    greedy = Expert(model="tiny-random", max_new_tokens=6, retries=0)
    roles = [{"f": "agent 1"}, {"g": "agent 1"}]
    assert greedy.propose(["a", "b"], ["x", "y"], roles) == greedy.propose(["a", "b"], ["x", "y"], roles)
    assert greedy.format_retries == 0 and greedy.malformed_replies == 4
