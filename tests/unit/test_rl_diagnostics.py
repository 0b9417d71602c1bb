"""scripts/rl_diagnostics.py: a grid cell's RL steps read from its CSV log, the steps with a learning
signal told from the tied ones."""

from __future__ import annotations

import importlib.util

import pytest

from helpers import REPO_ROOT

spec = importlib.util.spec_from_file_location("rl_diagnostics", REPO_ROOT / "scripts" / "rl_diagnostics.py")
diagnostics = importlib.util.module_from_spec(spec)
spec.loader.exec_module(diagnostics)

HEADER = "agent0/kl_ref,phase/demos,step,train/advantage_std,train/approx_kl,train/skipped_steps,train/won\n"


def write_cell(grid, name: str, lines: list[str]) -> None:
    folder = grid / "cells" / name / "logs" / "version_0"
    folder.mkdir(parents=True)
    (folder / "metrics.csv").write_text(HEADER + "\n".join(lines) + "\n")


def test_tied_steps_carry_no_signal_and_sft_steps_are_not_rl(tmp_path, capsys):
    write_cell(tmp_path, "grpo-s0", [
        ",1.0,0,,,,",             # an SFT step: no train/won
        "0.0,,1,0.0,,1,0.25",     # every group tied: skipped
        "0.01,,2,0.8,0.02,0,0.5",
        ",,3,0.0,,1,0.0",
        "0.03,,3,,0.04,,",        # the same step's values on a second row
    ])  # fmt: skip
    (tmp_path / "cells" / "base").mkdir()  # a cell without a log (the baseline) is left out
    write_cell(tmp_path, "grpo-s1", [",,1,0.5,0.01,0,0.5"])  # still running: not in results.jsonl
    (tmp_path / "results.jsonl").write_text('{"cell": "grpo-s0"}\n{"cell": "grpo-s0"}\n{"cell": "base"}\n')
    (row,) = diagnostics.cell_rows(tmp_path)
    assert row["RL steps"] == "3" and row["train won"] == "0.250"
    assert row["steps with signal"] == "1 of 3" and row["updates skipped"] == "2"
    assert row["approx KL"] == "0.0300" and row["KL to ref"] == "0.0300" and row["EV > 0"] == "-"
    diagnostics.main([str(tmp_path), "--cells", "grpo-*"])
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("| cell | RL steps") and printed[2].startswith("| grpo-s0 | 3 | 0.250 | 1 of 3")
    with pytest.raises(SystemExit, match="no cells/ or results.jsonl"):
        diagnostics.main([str(tmp_path / "cells")])
