"""The commands and code the README and docs show, kept true: every documented ``lit-marl`` command
parses (its configs exist, its options are real) with ``--print_config``; the README's first
commands run as written (a tiny fit, then ``lit-marl plot`` of its logs); the README's reward and
transition examples work through lit_marl's own checks. ``make test-slow`` runs every documented
command that can run here (tiny models, one process)."""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest
import torch

from lit_marl.cli import build_cli

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]


def documented_commands() -> list[tuple[str, list[str]]]:
    """(where, argv after ``lit-marl``) of every ``lit-marl`` line in the docs' bash blocks; a
    shell loop's body is taken with its variable set to its first value."""
    found = []
    for path in DOCS:
        for block in re.findall(r"```(?:bash|sh)\n(.*?)```", path.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                loop = re.match(r"for (\w+) in (\S+).*?; do (.*?); done", line.strip())
                if loop:
                    line = loop.group(3).replace(f"${loop.group(1)}", loop.group(2))
                line = line.split("  #")[0].split(" # ")[0].strip()
                if re.match(r"(\.venv/bin/)?lit-marl ", line):
                    found.append((path.name, shlex.split(line)[1:]))
    return found


COMMANDS = documented_commands()
FITS = [(where, argv) for where, argv in COMMANDS if argv[0] in ("fit", "validate", "test")]


def test_the_docs_document_commands():
    assert len(FITS) >= 30 and any(argv[0] == "plot" for _, argv in COMMANDS)


@pytest.mark.parametrize("name", ["export", "chat"])
def test_documented_export_and_chat_commands_parse(name):
    """Their options are real (the checkpoints they name come from a run)."""
    commands = [argv for _, argv in COMMANDS if argv[0] == name]
    assert commands, f"no `lit-marl {name}` in the docs"
    for argv in commands:
        parser = {"export": ("lit_marl.trained", "export_parser"), "chat": ("lit_marl.chat", "parser")}[name]
        getattr(importlib.import_module(parser[0]), parser[1])().parse_args(argv[1:])


@pytest.mark.parametrize("where, argv", FITS, ids=[f"{w}:{' '.join(a)[:80]}" for w, a in FITS])
def test_documented_command_parses(where, argv, in_repo_root, capsys):
    for i, arg in enumerate(argv):
        if arg == "--config":
            assert (REPO_ROOT / argv[i + 1]).is_file(), f"{where}: {argv[i + 1]} does not exist"
    if "--print_config" in argv:
        argv = [a for a in argv if a != "--print_config"]
    args = [a for i, a in enumerate(argv) if a != "--ckpt_path" and (i == 0 or argv[i - 1] != "--ckpt_path")]
    with pytest.raises(SystemExit) as done:
        build_cli(args=[*args, "--print_config"])
    assert done.value.code in (0, None), f"{where}: lit-marl {' '.join(argv)}\n{capsys.readouterr().err[-2000:]}"


def _run(argv: list[str], logs: Path):
    """``lit-marl ARGV`` in this process, its logs under ``logs``."""
    return build_cli(args=[*argv, "--trainer.logger.init_args.save_dir", str(logs)])


def test_readme_first_commands_run_and_plot(in_repo_root, tmp_path):
    (where, fit), *_ = FITS
    assert where == "README.md" and fit == ["fit", "--config", "configs/magrpo/slogan_tiny.yaml"], fit
    cli = _run(fit, tmp_path)
    assert torch.isfinite(cli.trainer.callback_metrics["train/loss"])
    from lit_marl.plots import main as plot

    out = tmp_path / "curves.png"
    plot([str(tmp_path), "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _tiny_single_process(argv: list[str]) -> bool:
    import yaml

    configs = [yaml.safe_load((REPO_ROOT / argv[i + 1]).read_text()) for i, a in enumerate(argv) if a == "--config"]
    model = {k: v for c in configs for k, v in ((c.get("model") or {}).get("init_args") or {}).items()}
    trainer = {k: v for c in configs for k, v in (c.get("trainer") or {}).items()}
    data = {k: v for c in configs for k, v in ((c.get("data") or {}).get("init_args") or {}).items()}
    games = any(str(data.get(k, "")).startswith(("textworld:", "alfworld:")) for k in ("train_path", "val_path"))
    # a run that reads another run's output (a checkpoint, MARLHF's reward model) is covered by its own test
    reads_a_run = "--ckpt_path" in argv or "--data.init_args.reward_model" in argv
    return model.get("model") == "tiny-random" and "strategy" not in trainer and not games and not reads_a_run


RUNNABLE = [(w, a) for w, a in FITS if _tiny_single_process(a)]


@pytest.mark.slow
@pytest.mark.parametrize("where, argv", RUNNABLE, ids=[f"{w}:{' '.join(a)[:80]}" for w, a in RUNNABLE])
def test_documented_tiny_command_runs(where, argv, in_repo_root, tmp_path):
    if "--print_config" in argv:
        pytest.skip("covered by the parse test")
    cli = _run(argv, tmp_path)
    assert cli.trainer.state.finished, f"{where}: lit-marl {' '.join(argv)}"


# --------------------------------------------------------------------------- the README's code
def _readme_code() -> dict:
    blocks = re.findall(r"```python\n(.*?)```", (REPO_ROOT / "README.md").read_text(), re.S)
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)
    return namespace


def test_readme_reward_and_transition_examples_work():
    from lit_marl.envs.base import FunctionEnv
    from lit_marl.envs.calls import call_reward

    code = _readme_code()
    rewards, metrics = call_reward(code["joint_reward"], [["Go!", "no"], ["Yes!", "Yes!"]], [{}, {}])
    assert rewards.tolist() == [1.0, 0.0] and metrics == {"success": 0.5}
    env = FunctionEnv(["Line 1 about {topic}.", "Line 2 about {topic}."], code["joint_reward"], code["feedback"])
    env.passthrough = True  # as the README says: it writes whole prompts
    (state,) = env.reset([{"topic": "tea"}])
    env.step([state], [["Tea!", "More tea!"]], turn=0)
    prompts = state.observations
    assert prompts == [
        "Line 1 about tea.\nYou wrote: Tea!\nImprove it.",
        "Line 2 about tea.\nYou wrote: More tea!\nImprove it.",
    ]
