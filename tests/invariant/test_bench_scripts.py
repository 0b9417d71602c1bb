"""Every script under scripts/ that prints benchmark numbers runs, on the tiny model and small sizes:
each test runs one script in its own process (its real code path, the sizes cut down by its own
flags) and checks what it prints - the expected rows, their numbers present and finite - so a script
that crashes, prints nothing or prints nan fails here. The timings themselves are never compared.
Scripts that compute in their own process run as forked children of tests/scripts/script_server.py
(torch, Lightning and lit_marl imported once); those that start their own processes (a child per
setting, ranks, a ``lit-marl fit``) and the other venvs' run as plain subprocesses.

bench_magrpo.py's worker is run by test_bench.py. What needs something optional is skipped only when
that thing is absent: CoMLRL's worker (.venv-comlrl), bench_engines.py's vLLM engine and
bench_overlap.py's and bench_turns.py's server (the vllm marker: run with .venv-vllm/bin/python -m pytest -m vllm
tests/invariant/test_bench_scripts.py).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import select
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from helpers import REPO_ROOT, TEST_SCRIPTS

SCRIPTS = REPO_ROOT / "scripts"
NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?|\b[-+]?(?:nan|inf)(?=x|\b)", re.IGNORECASE)


def script_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}


def run_script(name: str, *args: str, cwd: Path, python: str = sys.executable, timeout: int = 300) -> str:
    """``python scripts/<name> <args>`` from ``cwd``; its standard output (it must exit 0 and print)."""
    done = subprocess.run(
        [python, str(SCRIPTS / name), *args], capture_output=True, text=True, env=script_env(), cwd=cwd, timeout=timeout
    )
    return checked(name, done.returncode, done.stdout, done.stderr)


def checked(name: str, returncode: int, stdout: str, stderr: str) -> str:
    assert returncode == 0, f"{name} exited {returncode}:\n{stdout[-2000:]}\n{stderr[-4000:]}"
    assert stdout.strip(), f"{name} printed nothing:\n{stderr[-2000:]}"
    return stdout


class ScriptServer:
    """tests/scripts/script_server.py, started on first use: scripts that compute in their own process
    run as its forked children (each still its own process, as ``python SCRIPT``), so the heavy
    imports are paid once per test process, not once per script. Restarted after a job that did not
    answer (its answer could otherwise be read as the next job's)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def run(self, tmp_path: Path, name: str, args: tuple[str, ...], cwd: Path, timeout: int) -> str:
        if self.proc is None or self.proc.poll() is not None:
            command = [sys.executable, str(TEST_SCRIPTS / "script_server.py")]
            self.proc = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=script_env()
            )
        out = tmp_path / f"{name}.out"
        job = {"script": str(SCRIPTS / name), "args": list(args), "cwd": str(cwd), "out": str(out), "timeout": timeout}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout + 60)
        answer = self.proc.stdout.readline() if ready else ""
        if not answer:
            self.close()
            pytest.fail(f"the script server gave no answer for {name}")
        stdout, stderr = (Path(f"{out}.{stream}").read_text() for stream in ("stdout", "stderr"))
        return checked(name, json.loads(answer)["returncode"], stdout, stderr)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()  # idle between jobs: nothing of a script's is left to end
            self.proc.wait()
            self.proc.stdin.close()
            self.proc.stdout.close()
            self.proc = None


@pytest.fixture(scope="module")
def server():
    scripts = ScriptServer()
    yield scripts
    scripts.close()


def run_forked(server, tmp_path: Path, name: str, *args: str, cwd: Path | None = None, timeout: int = 300) -> str:
    """``run_script`` through the script server: the same run, without the imports."""
    return server.run(tmp_path, name, args, cwd or tmp_path, timeout)


def json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def finite(*values) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values)


def numbers(line: str) -> list[float]:
    """The numbers in a printed line (nan and inf included, so that ``finite`` catches them)."""
    return [float(n) for n in NUMBER.findall(line)]


def lines_with(out: str, pattern: str) -> list[str]:
    return [line for line in out.splitlines() if re.search(pattern, line)]


def test_the_script_server_reports_a_failing_script(server, tmp_path):
    with pytest.raises(AssertionError, match="bench_logging.py exited 2"):
        run_forked(server, tmp_path, "bench_logging.py", "--logger", "nowhere")
    assert "invalid choice: 'nowhere'" in (tmp_path / "bench_logging.py.out.stderr").read_text()


# --------------------------------------------------------------------------- model passes and memory
def test_bench_checkpointing_prints_both_settings_and_their_ratios(tmp_path):
    out = run_script(
        "bench_checkpointing.py",
        *("--model", "tiny-random", "--rows", "1", "--tokens", "32", "--repeats", "1", "--variants", "lora"),
        cwd=tmp_path,
    )
    for setting in ("plain", "checkpointed"):
        (line,) = lines_with(out, rf"^lora {setting}\s+peak")
        peak, pass_gib, loaded, planned, seconds = numbers(line)
        assert finite(peak, pass_gib, loaded, planned, seconds) and peak > 0 and loaded > 0 and seconds > 0, line
    (ratios,) = lines_with(out, r"^lora: checkpointing keeps")
    memory, seconds = numbers(ratios)[:2]
    assert finite(seconds) and seconds > 0, ratios  # memory: nan only if the plain pass never raised the peak
    assert not math.isinf(memory), ratios


def test_bench_fsdp_modes_reports_each_rank_of_the_per_layer_mode(tmp_path):
    out = run_script(
        "bench_fsdp_modes.py",
        *("--model", "tiny-random", "--rows", "1", "--tokens", "16", "--modes", "per_layer"),
        cwd=tmp_path,
    )
    for rank in (0, 1):
        (line,) = lines_with(out, rf"^per_layer rank {rank}: pass peak")
        peak = float(re.search(r"pass peak\s+(\S+) MiB", line).group(1))
        layers = float(re.search(r"'layers gathered in a pass': ([^}]+)}", line).group(1))
        gradients = float(re.search(r"gradients (\S+) MiB", line).group(1))
        assert finite(peak, layers, gradients) and layers > 0 and gradients > 0, line


def test_bench_memory_prints_the_plan_beside_the_measured_peak(tmp_path):
    out = run_script("bench_memory.py", "--out", str(tmp_path / "run"), cwd=tmp_path)
    assert "memory plan per rank" in out
    (line,) = lines_with(out, r"^planned peak")
    planned, measured, ratio = numbers(line)
    assert finite(planned, measured, ratio) and planned > 0 and measured > 0, line


def test_bench_logprobs_prints_both_modes(tmp_path):
    out = run_script(
        "bench_logprobs.py",
        *("--model", "tiny-random", "--rows", "1", "--length", "64", "--repeats", "1"),
        cwd=tmp_path,
    )
    for mode in ("full", "masked"):
        (line,) = lines_with(out, rf"^\s*{mode}: ")
        seconds, peak, loss = numbers(line)
        assert finite(seconds, peak, loss) and seconds > 0, line
    (ratios,) = lines_with(out, r"^masked/full")
    assert finite(*numbers(ratios)), ratios


def test_bench_phases_reports_every_phase_of_both_ranks(server, tmp_path):
    out = run_forked(
        server,
        tmp_path,
        "bench_phases.py",
        *("--model", "tiny-random", "--steps", "1", "--out", str(tmp_path / "run")),
        cwd=tmp_path,
    )
    for rank in (0, 1):
        for phase in ("setup", "rollout", "evaluation", "update"):
            (line,) = lines_with(out, rf"^rank {rank} {phase}\s+measured peak RSS")
            measured, planned, ratio = numbers(line.split(phase, 1)[1])
            assert finite(measured, planned, ratio) and measured > 0 and planned > 0, line
    assert "same weights on both ranks: True" in out


# --------------------------------------------------------------------------- training steps
def test_bench_cpu_times_a_tiny_fit(server, tmp_path):
    out = run_forked(
        server,
        tmp_path,
        "bench_cpu.py",
        *("--config", "configs/magrpo/slogan_tiny.yaml", "--steps", "1", "--repeats", "1", "--loads", "0"),
        *("--precisions", "auto", "--threads", "lit-marl", "--timeout", "240"),
        cwd=tmp_path,
    )
    (cell,) = lines_with(out, r"repeat 0 load=0 auto->")
    steps = re.search(r"steps \[([^\]]*)\] s", cell).group(1).split()
    assert len(steps) == 1 and finite(*map(float, steps)), cell
    (row,) = lines_with(out, r"^\| 0 \| lit-marl \| auto ")
    assert "!" not in row and "-" not in row.split("|")[4], row  # not failed; s/step present
    assert finite(*[float(cell) for cell in row.split("|")[4:8]]), row


def test_bench_ppo_update_splits_the_step(server, tmp_path):
    out = run_forked(
        server,
        tmp_path,
        "bench_ppo_update.py",
        *("--config", "configs/ppo/corridor_tiny.yaml", "--steps", "1", "--set", "data.max_turns=2"),
        cwd=REPO_ROOT,  # the config's task files are relative to the repository
    )
    for part in ("rollout", "update", "update: before the loss (no grad)", "  loss forwards", "  backwards"):
        (line,) = lines_with(out, rf"^{re.escape(part)}\s+\d")
        seconds, calls = numbers(line.split(part, 1)[1])
        assert finite(seconds) and seconds > 0 and calls >= 1, line
    for kind in ("no-grad", "grad"):
        (line,) = lines_with(out, rf"^{kind} passes:")
        assert finite(*numbers(line)) and numbers(line)[0] > 0, line
    (line,) = lines_with(out, r"^peak RSS in update:")
    assert finite(*numbers(line)) and numbers(line)[0] > 0, line
    (result,) = json_lines(out)
    assert result["steps"] == 1 and result["calls"]["update"] == 1


def test_gpu_check_runs_on_cpu(server, tmp_path):
    out = run_forked(
        server,
        tmp_path,
        "gpu_check.py",
        *("--device", "cpu", "--model", "tiny-random", "--rows", "4", "--new-tokens", "4"),
        *("--ppo-tasks", "2", "--ppo-turns", "2", "--out", str(tmp_path / "run")),
        cwd=tmp_path,
    )
    result = json_lines(out)[-1]
    decode, ppo = result["decode_torch"], result["ppo"]
    assert decode["tokens"] > 0 and finite(decode["s"], decode["tokens_per_s"]) and decode["tokens_per_s"] > 0
    assert (
        ppo["global_step"] >= 1 and finite(ppo["ppo_step_s"], ppo["planned_peak_gib"]) and ppo["planned_peak_gib"] > 0
    )
    assert json.loads((tmp_path / "run" / "gpu_check.json").read_text()) == result


def test_magrpo_step_counts_prints_every_tree_shape(server, tmp_path):
    out = run_forked(
        server,
        tmp_path,
        "magrpo_step_counts.py",
        *("--num-generations", "2", "--max-new-tokens", "4", "--repeats", "1"),
        cwd=tmp_path,
    )
    rows = json_lines(out)
    assert [(r["joint_mode"], r["num_turns"]) for r in rows] == [
        ("aligned", 1),
        ("aligned", 2),
        ("cross", 1),
        ("cross", 2),
    ]
    for r in rows:  # one batched generate per agent and turn, one reward call per turn, one update per agent
        assert r["generate_calls"] == 2 * r["num_turns"] and r["reward_calls"] == r["num_turns"], r
        assert r["optimizer_steps"] == 2 and r["generated_tokens"] > 0, r
        assert finite(r["step_s_median"], r["step_s_min"]) and r["step_s_min"] > 0, r
    # the update's forward passes are counted (a group whose rewards tie has no advantage, so no pass)
    assert sum(r["forward_backward_passes"] for r in rows) > 0


def test_soak_memory_reports_rss_for_a_short_run(server, tmp_path):
    out = run_forked(server, tmp_path, "soak_memory.py", "--steps", "3", cwd=tmp_path)
    (summary,) = json_lines(out)
    assert summary["algorithm"] == "magrpo" and summary["steps"] == 3
    assert summary["rss_mb_at_step"] and all(finite(v) and v > 0 for v in summary["rss_mb_at_step"].values())
    (growth,) = lines_with(out, r"^growth over the second half")
    assert finite(*numbers(growth)), growth


def test_bench_episodes_prints_each_repeat_and_the_medians(server, tmp_path):
    out = run_forked(
        server,
        tmp_path,
        "bench_episodes.py",
        *("--episodes", "4", "--max-turns", "2", "--max-new-tokens", "4", "--repeats", "1"),
        *("--threads", "1", "--env-workers", "2"),
        cwd=REPO_ROOT,  # reads data/corridor/train.jsonl from the repository root
    )
    repeat, summary = json_lines(out)
    assert repeat["episodes"] == 4 and 4 <= repeat["env_steps"] <= 8
    assert summary["model"] == "tiny-random"
    for key in ("seconds", "env_steps_per_s", "generated_tokens_per_s", "generate_share", "env_share"):
        assert finite(repeat[key], summary[key]) and repeat[key] >= 0, key


def test_bench_engines_prints_each_engine(server, tmp_path):
    out = run_forked(
        server,
        tmp_path,
        "bench_engines.py",
        *("--prompts", "2", "--num-samples", "2", "--max-new-tokens", "4", "--repeats", "1"),
        cwd=tmp_path,
    )
    results = json_lines(out)[-1]["results"]
    assert [(r["engine"], r["sequences"]) for r in results] == [("torch", 4), ("hf", 4)]
    for r in results:
        assert finite(r["median_s"], r["tokens_per_s"], r["logp_diff_mean"], r["logp_diff_max"]), r
        assert r["tokens_per_call"] > 0 and isinstance(r["greedy_equals_generate"], bool), r


def test_bench_magrpo_driver_prints_a_row_and_the_summary(server, tmp_path):
    """The driver around the worker test_bench.py runs: a worker that fails becomes an ERROR row (the
    driver itself exits 0), so the row must carry the worker's figures."""
    out = run_forked(
        server,
        tmp_path,
        "bench_magrpo.py",
        *("--num-generations", "2", "--num-turns", "1", "--joint-mode", "aligned", "--max-new-tokens", "4"),
        *("--steps", "1", "--warmup", "0", "--floor"),
    )
    (row,) = lines_with(out, r"^magrpo G=2 T=1 aligned \| lit_marl: ")
    assert "ERROR" not in row and finite(*numbers(row.split("lit_marl:", 1)[1])), row
    (result,) = json_lines(out)[-1]["results"]
    figures = result["lit_marl"]
    assert figures["generate_calls_per_step"] == 2 and figures["optimizer_steps_per_step"] == 2, figures
    assert finite(figures["median_step_s"], figures["floor_s"], figures["step_over_floor"]), figures


def test_bench_trees_prints_each_setting_and_its_summary(server, tmp_path):
    out = run_forked(
        server,
        tmp_path,
        "bench_trees.py",
        *("--num-generations", "2", "--num-turns", "2", "--tasks", "1", "--max-new-tokens", "4", "--repeats", "1"),
    )
    *repeats, summary_off, summary_kept = json_lines(out)
    assert [r["kept_kv_gib"] for r in repeats] == [0.0, 4.0]
    for r in (*repeats, summary_off, summary_kept):
        assert r["nodes"] == 1 + 2 and r["generated_tokens"] > 0 and finite(r["generate_s"]), r
    off, kept = repeats
    assert off["prompt_tokens_reused"] == 0 and kept["prompt_tokens_reused"] > 0  # children extend their parent
    assert summary_kept["transition"] == "workload" and summary_kept["kept_kv_gib"] == 4.0


@pytest.mark.vllm
def test_bench_engines_runs_vllm(tmp_path):
    """bench_engines.py's vLLM engine on the CPU build (its own venv, ``make vllm``)."""
    pytest.importorskip("vllm", reason="vLLM is not installed (.venv-vllm: make vllm)")
    out = run_script(
        "bench_engines.py",
        *("--engine", "vllm", "--model", "tiny-random"),  # the workload model's head_dim 16: no CPU attention kernel
        *("--prompts", "2", "--num-samples", "2", "--max-new-tokens", "4", "--repeats", "1"),
        cwd=tmp_path,
        timeout=600,
    )
    (result,) = json_lines(out)[-1]["results"]
    assert result["engine"] == "vllm" and finite(result["median_s"], result["tokens_per_s"], result["logp_diff_max"])


@pytest.mark.vllm
def test_bench_overlap_runs_both_settings_on_a_cpu_server(tmp_path):
    """bench_overlap.py on the tiny model: a fit per setting on one CPU server, each step's staleness
    (0 then 1s when generated ahead), steps per minute and the summary ratio."""
    pytest.importorskip("vllm", reason="vLLM is not installed (.venv-vllm: make vllm)")
    args = ("--model", "tiny-random", "--steps", "3", "--repeats", "1", "--turn-sleep", "0.1", "--max-turns", "2")
    out = run_script("bench_overlap.py", *args, cwd=tmp_path, timeout=900)
    fits = {row["max_staleness"]: row for row in json_lines(out)}
    assert fits[0]["staleness_per_step"] == [0.0, 0.0, 0.0] and fits[1]["staleness_per_step"] == [0.0, 1.0, 1.0]
    assert finite(fits[0]["steps_per_minute"], fits[1]["steps_per_minute"])
    (summary,) = lines_with(out, "median steps/min")
    assert len(numbers(summary)) >= 3


@pytest.mark.vllm
def test_bench_turns_plays_the_same_episodes_lockstep_and_independent_on_a_cpu_server(tmp_path):
    """bench_turns.py on the tiny model: a rollout per setting on one CPU server, the same episodes, both
    times, the sleep floors and the ratio."""
    pytest.importorskip("vllm", reason="vLLM is not installed (.venv-vllm: make vllm)")
    args = ("--model", "tiny-random", "--episodes", "3", "--max-turns", "2", "--repeats", "1", "--mean-sleep", "0.1")
    out = run_script("bench_turns.py", *args, cwd=tmp_path, timeout=900)
    rollouts = {row["turns"]: row for row in json_lines(out)}
    assert rollouts["lockstep"]["turns_played"] == rollouts["independent"]["turns_played"] > 0
    assert finite(rollouts["lockstep"]["rollout_s"], rollouts["independent"]["rollout_s"])
    (summary,) = lines_with(out, "median rollout s")
    assert "same episodes: True" in summary and len(numbers(summary)) >= 5


# --------------------------------------------------------------------------- environments and the sandbox
def test_bench_sandbox_prints_each_mode_and_the_speedups(server, tmp_path):
    out = run_forked(server, tmp_path, "bench_sandbox.py", "--programs", "2", "--workers", "2", cwd=tmp_path)
    *modes, speedups = json_lines(out)
    assert [(m["kind"], m["mode"]) for m in modes] == [
        ("plain", "serial"),
        ("plain", "pool"),
        ("harness", "serial"),
        ("harness", "pool"),
    ]
    assert all(m["programs"] == 2 and m["passed"] == 2 and finite(m["programs_per_s"]) for m in modes), modes
    assert set(speedups) == {"plain_pool_speedup", "harness_pool_speedup"} and finite(*speedups.values())


def test_bench_swe_prints_setup_test_run_and_episode_rates(server, tmp_path):
    out = run_forked(server, tmp_path, "bench_swe.py", "--episodes", "2", "--workers", "2", cwd=tmp_path)
    expected = [
        r"^workspace setup: median",
        r"^test run \(\d+ tests",
        r"^expert episodes, 1 worker",
        r"^expert episodes, 2",
    ]
    for pattern in expected:
        (line,) = lines_with(out, pattern)
        assert numbers(line) and finite(*numbers(line)), line
    assert "workspaces left: 0" in out


def test_bench_textworld_prints_generation_steps_and_branch_costs(server, tmp_path):
    out = run_forked(
        server, tmp_path, "bench_textworld.py", "--games", "1", "--workers", "1", "--repeats", "1", cwd=tmp_path
    )
    (generation,) = lines_with(out, r"^generation w2-o3-q4: serial")
    (steps,) = lines_with(out, r"^env steps: ")
    branches = lines_with(out, r"^branch after \d+ commands: clone")
    assert len(branches) == 3
    for line in (generation, steps, *branches):
        assert finite(*numbers(line)), line


# --------------------------------------------------------------------------- logging, CoMLRL's side
def test_bench_logging_prints_each_logger_and_a_summary(server, tmp_path):
    out = run_forked(
        server, tmp_path, "bench_logging.py", *("--keys", "2", "--steps", "13", "--repeats", "1"), cwd=tmp_path
    )
    assert len(lines_with(out, r"^logger=(tensorboard|none)\s+keys=  2: loop")) == 2
    summary = json_lines(out)[-1]
    assert [r["logger"] for r in summary["results"]] == ["tensorboard", "none"]
    for r in summary["results"]:
        assert finite(*r["ms_per_step"].values(), *r["logging_ms_per_step"].values()), r


COMLRL_PYTHON = REPO_ROOT / ".venv-comlrl" / "bin" / "python"


def test_comlrl_worker_helpers_without_comlrl():
    """The CoMLRL worker's part that needs no CoMLRL: its calling conventions for the shared reward
    and transition, and the tree size it checks CoMLRL's steps against."""
    with mock.patch.dict(os.environ):  # the worker sets WANDB_MODE and friends as it is imported
        sys.path.insert(0, str(SCRIPTS))
        worker = importlib.import_module("bench_comlrl_worker")
        workload = importlib.import_module("bench_workload")
    probe = worker.Probe()
    assert probe.reward_func(["ab", "xy"], ["ab", "cd"]) == [workload.joint_reward(["ab", "ab"]), 0.5]
    nxt = probe.transition("P", ["a0", "a1"], 2)
    assert nxt == [workload.next_prompt("P", "a0", ["a1"]), workload.next_prompt("P", "a1", ["a0"])]
    assert worker.nodes_per_tree(4, 1, 2, "cross") == 1
    assert worker.nodes_per_tree(2, 2, 2, "aligned") == 1 + 2 and worker.nodes_per_tree(2, 2, 2, "cross") == 1 + 4


@pytest.mark.skipif(
    not COMLRL_PYTHON.exists(), reason="CoMLRL's venv is absent (.venv-comlrl: scripts/setup_comlrl_venv.sh)"
)
def test_comlrl_worker_runs_one_step(tmp_path):
    sys.path.insert(0, str(SCRIPTS))
    model = importlib.import_module("bench_workload").default_model_folder()  # built here: the venv lacks lit_marl
    out = run_script(
        "bench_comlrl_worker.py",
        *(
            "--model",
            str(model),
            "--algorithm",
            "magrpo",
            "--num-generations",
            "2",
            "--num-turns",
            "1",
            "--max-new-tokens",
            "4",
        ),
        *("--steps", "1", "--warmup", "0"),
        cwd=tmp_path,
        python=str(COMLRL_PYTHON),
        timeout=600,
    )
    result = json_lines(out)[-1]
    assert result["framework"] == "comlrl" and result["generate_calls_per_step"] > 0
    assert finite(result["median_step_s"], result["tokens_per_s"])
