"""Every command the README shows in a code block runs as written: each program answers ``--help``
(a make target ``make -n``), every option a command passes is one its help lists, and every file it
reads from the repository exists. The tiny fit the README says takes seconds runs for real, and
its console holds the run's own lines, no library noise (deprecations inside the libraries, a
model-summary note, advertisements for hosted services)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def readme_commands() -> list[list[str]]:
    """The commands of the README's bash blocks, continuation lines joined, comments dropped."""
    text = (ROOT / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv:
                commands.append(argv)
    return commands


COMMANDS = readme_commands()
READ_FROM_REPO = ("configs/", "data/", "scripts/")  # what a command reads; other paths it writes first


def program_of(argv: list[str]) -> tuple[str, ...]:
    """The program a command runs: make, a script, or lit-marl with its subcommand."""
    if argv[0] == "make":
        return ("make",)
    if argv[0].endswith("/python"):
        return tuple(argv[:2])
    if argv[0].endswith("/lit-marl") and len(argv) > 1 and not argv[1].startswith("-"):
        return tuple(argv[:2])
    return (argv[0],)


PROGRAMS = sorted({program_of(argv) for argv in COMMANDS})


def test_the_readme_shows_commands_of_each_kind():
    assert {("make",), (".venv/bin/lit-marl", "fit"), (".venv/bin/python", "scripts/make_demos.py")} <= set(PROGRAMS)
    assert len(COMMANDS) >= 20


@pytest.mark.parametrize("program", PROGRAMS, ids=[" ".join(p) for p in PROGRAMS])
def test_readme_commands_are_valid_as_written(program):
    """Each command of ``program`` (its ``--help`` read once): its options are the program's, the
    files it reads are in the repository; a make target's recipe resolves (``make -n``)."""
    commands = [argv for argv in COMMANDS if program_of(argv) == program]
    if program == ("make",):
        for argv in commands:
            result = subprocess.run(["make", "-n", *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=60)
            assert result.returncode == 0, result.stderr
        return
    assert (ROOT / program[0]).exists(), f"{program[0]}: not in the repository's venv (make install)"
    result = subprocess.run(
        [*program, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300, env={**ENV, "COLUMNS": "200"}
    )
    assert result.returncode == 0, f"{' '.join(program)} --help failed:\n{result.stderr[-2000:]}"
    for argv in commands:
        for option in (token.split("=")[0] for token in argv[len(program) :] if token.startswith("--")):
            assert option in result.stdout, f"{' '.join(argv)}: {option} is not an option of {' '.join(program)}"
        for token in argv[1:]:
            if token.startswith(READ_FROM_REPO) and not token.endswith("demos.jsonl"):  # demos.jsonl: written
                assert (ROOT / token).exists(), f"{' '.join(argv)}: {token} is not in the repository"


def test_the_readme_tiny_fit_runs_with_a_quiet_console(tmp_path):
    (argv,) = [a for a in COMMANDS if a[1:] == ["fit", "--config", "configs/magrpo/slogan_tiny.yaml"]]
    result = subprocess.run(
        [*argv, "--trainer.logger.init_args.save_dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=ENV,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    console = result.stdout + result.stderr
    assert "memory plan per rank" in console and "Trainer.fit` stopped" in console
    for noise in ("deprecated", "Tip:", "model summary", "Warning"):
        assert noise not in console, f"{noise!r} on the console:\n{console[-3000:]}"
