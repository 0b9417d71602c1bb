"""The house rules of the code's shape (ARCHITECTURE.md), checked on the source tree by
``scripts/check_layers.py``: no import circle, no unexplained function-level project import, no
algorithm file over 500 lines, no function over 80 lines in rollout/ and algorithms/."""

from __future__ import annotations

import subprocess
import sys

from helpers import REPO_ROOT


def test_the_source_tree_keeps_its_layers():
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "check_layers.py")], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_check_finds_a_circle_and_a_silent_deferred_import(tmp_path):
    """The check can fail: a copy of the tree with an import circle and a reason-less local import."""
    import shutil

    shutil.copytree(REPO_ROOT / "lit_marl", tmp_path / "lit_marl")
    shutil.copytree(REPO_ROOT / "callbacks", tmp_path / "callbacks")
    shutil.copytree(REPO_ROOT / "scripts", tmp_path / "scripts")
    returns = tmp_path / "lit_marl" / "returns.py"
    returns.write_text(returns.read_text() + "\nfrom lit_marl.rollout.tree import build_tree  # noqa: E402\n")
    losses = tmp_path / "lit_marl" / "losses.py"
    losses.write_text(losses.read_text() + "\n\ndef late():\n    from lit_marl.returns import tree_returns\n")
    done = subprocess.run(
        [sys.executable, str(tmp_path / "scripts" / "check_layers.py")], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1
    assert "import circle: " in done.stdout and "lit_marl.returns" in done.stdout
    assert "lit_marl/losses.py" in done.stdout and "without a reason" in done.stdout
