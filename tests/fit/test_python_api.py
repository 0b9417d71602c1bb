"""docs/python.md's example runs as written (in a scratch folder): a two-agent, two-turn MAGRPO fit
from a script, with a formatter function, a format string, a CoMLRL-shaped reward and transition."""

from __future__ import annotations

import re
import subprocess
import sys

from helpers import REPO_ROOT


def test_the_python_page_example_runs(tmp_path):
    page = (REPO_ROOT / "docs" / "python.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", page, re.S)
    script = tmp_path / "example.py"
    script.write_text(code + "\nassert trainer.global_step == 2 and model.agents is not None\n")
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    reward = float(done.stdout.strip().splitlines()[-1])
    assert 0 < reward < 1  # 1 / (1 + characters of the two answers)
    assert "in eval mode" not in done.stderr  # the agents stay in eval mode on purpose: no warning
    assert "RL · " in done.stdout + done.stderr  # the run's own bar (phase), not Lightning's default
