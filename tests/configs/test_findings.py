"""docs/findings.md holds as written: every table on it is its grid's results.md as the grid wrote
it, a claim has a verdict only where each of its table lines ran with at least three seeds, and
every grid command on it writes into the folder its table comes from."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers import REPO_ROOT

PAGE = REPO_ROOT / "docs" / "findings.md"


def script(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TABLES = script("findings_tables")  # the page's block syntax, as the refresh script reads it


def blocks(text: str) -> list[tuple[str, str, str]]:
    """Each results block of ``text``: the grid's results.md, the lines it keeps (``""``: all), the table."""
    return [(path, where, table) for _, path, where, table, _ in TABLES.BLOCK.findall(text)]


def diagnostics_blocks(text: str) -> list[tuple[str, str]]:
    return [(grid, table) for _, grid, table, _ in TABLES.DIAGNOSTICS.findall(text)]


VERDICTS = ("reproduced", "not at this scale", "contradicted", "pending")


def table_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("|")]


def sections(page: str) -> list[str]:
    return re.split(r"\n(?=## )", page)[1:]


def test_the_page_tables_are_the_grids_results():
    """Each table on the page is its grid's results.md (or the lines of it the block names), and that
    is the table of the grid's rows (results.jsonl) as the grid script makes it now: neither edited by
    hand nor stale."""
    page, ablation, select = PAGE.read_text(), script("textworld_ablation"), TABLES.select
    for path, where, block in blocks(page):
        results = REPO_ROOT / path
        assert results.is_file(), f"docs/findings.md cites {path}, which is not committed"
        copied = select(table_lines(results.read_text()), where)
        assert table_lines(block) == copied, f"docs/findings.md's copy of {path}{where} differs"
        assert len(copied) > 2, f"docs/findings.md: {path}{where} keeps no line"
        rows = ablation.load_rows(results.parent / "results.jsonl")
        made = ablation.table(ablation.summarize(rows))
        assert table_lines(results.read_text()) == table_lines(made), f"{path} is not the table of its rows"


def test_the_page_diagnostics_are_the_logs_figures():
    """Each RL diagnostics table on the page is what scripts/rl_diagnostics.py makes of the grid's
    committed logs now."""
    diagnostics = script("rl_diagnostics")
    for grid, block in diagnostics_blocks(PAGE.read_text()):
        made = diagnostics.table(diagnostics.cell_rows(REPO_ROOT / grid))
        assert table_lines(block) == table_lines(made), f"docs/findings.md's diagnostics of {grid} differ from its logs"


VERDICT = re.compile(r"\*\*Verdict(?: \(claim (\d)\))?:(?:\*\*)? ([a-z][a-z ]*?)(?: —|[.,]|\*\*|$)", re.M)


def table_rows(block: str) -> list[dict]:
    head, _, *rows = table_lines(block)
    return [dict(zip(TABLES.cells(head), TABLES.cells(row))) for row in rows]


def test_a_verdict_needs_three_seeds_in_every_line():
    """Each of the five claims has one verdict (``**Verdict:** x`` in its section, or ``**Verdict (claim
    n): x.**`` where claims share a grid), one of the four; a verdict that is not pending rests on results
    tables whose every trained line ran with at least three seeds. The ALFWorld study keeps its one-seed
    variants beside its verdict, which must rest on one variant run with three seeds at two budgets."""
    claims: dict[str, str] = {}
    for section in sections(PAGE.read_text()):
        heading = section.splitlines()[0]
        found = VERDICT.findall(section)
        for _, verdict in found:
            assert verdict in VERDICTS, f"{heading}: unknown verdict {verdict!r}"
        rows = [row for _, _, block in blocks(section) for row in table_rows(block)]
        if heading.startswith("## ALFWorld"):
            (verdict,) = [v for _, v in found]
            three = {(r["settings"], r["budget"]) for r in rows if r["stage"] == "end" and int(r["seeds"]) >= 3}
            by_settings = [settings for settings, _ in three]
            assert verdict == "pending" or any(by_settings.count(s) >= 2 for s in by_settings), (
                "ALFWorld: a verdict without one variant at two budgets over three seeds"
            )
            continue
        for number, verdict in found:
            claim = number or re.match(r"## (\d)\.", heading).group(1)
            assert claim not in claims, f"claim {claim}: two verdicts"
            claims[claim] = verdict
            if verdict == "pending":
                continue
            assert rows, f"{heading}: a verdict without a results table"
            for row in rows:
                if row["algorithm"] != "base":  # the untrained model is greedy: one run stands for every seed
                    assert int(row["seeds"]) >= 3, f"{heading}: {row} ran {row['seeds']} seed(s)"
    assert sorted(claims) == ["1", "2", "3", "4", "5"], f"verdicts found for claims {sorted(claims)}"


def test_grid_commands_write_where_their_tables_come_from():
    page = PAGE.read_text()
    cited = {Path(path).parent for path, _, _ in blocks(page)}
    outs = {Path(out) for out in re.findall(r"textworld_ablation\.py[^`]*?--out (\S+)", page, re.S)}
    assert outs, "docs/findings.md gives no grid command"
    assert cited <= outs, f"tables without the command that made them: {sorted(map(str, cited - outs))}"
    assert all(str(out).startswith("docs/findings/") for out in outs), "grids write under docs/findings/"
    assert "[docs/findings.md](docs/findings.md)" in (REPO_ROOT / "README.md").read_text()


def test_the_refresh_script_copies_each_grids_table(tmp_path):
    """A block gets its grid's table, or the lines whose named columns hold the listed values."""
    (tmp_path / "grid").mkdir()
    (tmp_path / "grid" / "results.md").write_text(
        "# title\n\n| a | b c |\n|---|---|\n| 1 | x \\| y |\n| 2 | z |\n| 3 | w |\n\nfoot\n"
    )
    page = "## 1.\n<!-- results: grid/results.md -->\n| old |\n<!-- end results -->\ntext\n"
    refreshed = TABLES.refresh(page, tmp_path)
    table = "| a | b c |\n|---|---|\n| 1 | x \\| y |\n| 2 | z |\n| 3 | w |\n"
    assert refreshed == f"## 1.\n<!-- results: grid/results.md -->\n{table}<!-- end results -->\ntext\n"
    assert blocks(refreshed)[0][2] == table  # what the equality test reads
    some = TABLES.refresh(page.replace(".md -->", ".md a=1,3 -->"), tmp_path)
    assert blocks(some)[0][1:] == (" a=1,3", "| a | b c |\n|---|---|\n| 1 | x \\| y |\n| 3 | w |\n")
    (tmp_path / "grid" / "results.md").write_text("| SFT:RL | n |\n|---|---|\n| 20:80 | 1 |\n| 60:40 | 2 |\n")
    some = TABLES.refresh(page.replace(".md -->", ".md SFT:RL=60:40 -->"), tmp_path)
    assert blocks(some)[0][1:] == (" SFT:RL=60:40", "| SFT:RL | n |\n|---|---|\n| 60:40 | 2 |\n")
    with pytest.raises(ValueError, match="no column"):
        TABLES.refresh(page.replace(".md -->", ".md c=1 -->"), tmp_path)


def test_every_grid_command_on_the_page_parses():
    """The page's grid commands run as written: their options exist and the grid is well formed."""
    import shlex

    ablation = script("textworld_ablation")
    page = PAGE.read_text()
    commands = [
        shlex.split(line.split("textworld_ablation.py", 1)[1])
        for block in re.findall(r"```bash\n(.*?)```", page, re.S)
        for line in block.replace("\\\n", " ").splitlines()
        if "textworld_ablation.py" in line
    ]
    assert len(commands) >= 4
    made: dict[Path, set[str]] = {}
    for argv in commands:
        args = ablation.parse_args(argv)
        ablation.check_grid(args)
        made.setdefault(args.out, set()).update(name for name, _ in ablation.grid_cells(args))
        stages = {r["cell"]: r.get("sft_stage") for r in ablation.load_rows(REPO_ROOT / args.out / "results.jsonl")}
        for name, key in ablation.grid_cells(args):  # a setting moved into a group keeps the stage a cell started from
            if key is not None and stages.get(name):
                assert sft_stage_name(ablation, args, key) == stages[name], name
    for out, names in made.items():  # every finished cell is one of a command's cells: its exact command is here
        finished = {row["cell"] for row in ablation.load_rows(REPO_ROOT / out / "results.jsonl")}
        assert finished <= names, f"{out}: cells no command on the page makes: {sorted(finished - names)}"


def sft_stage_name(ablation, args, key: dict) -> str:
    """The SFT stage a grid's cell starts from, as the grid computes it from today's configs."""
    config = ablation.cell_config(args, key["algorithm"], key["density"], key["split"], key["train"], key["seed"], None)
    (phase,) = [c for c in config["trainer"]["callbacks"] if c["class_path"].endswith("PhaseSwitch")]
    switch = {**phase["init_args"], "budget": ablation.budget(args, key["split"])[0] * args.demo_cost, "split": "1:0"}
    return ablation.sft_stage_id(args, config, switch, key["train"], key["seed"])


def test_the_overlap_table_in_generation_md_is_its_grids_results():
    """docs/generation.md's table of the quickstart on vLLM servers (on-policy against one step off-policy)
    is the committed results.md, and that is overlap_curves.py's table of the grid's rows."""
    import json

    overlap = script("overlap_curves")
    page = (REPO_ROOT / "docs" / "generation.md").read_text()
    blocks = re.findall(r"<!-- overlap results: (\S+) -->\n(.*?)<!-- end overlap results -->", page, re.S)
    assert blocks, "docs/generation.md quotes no overlap results"
    for path, block in blocks:
        results = REPO_ROOT / path
        assert table_lines(block) == table_lines(results.read_text()), f"docs/generation.md's copy of {path} differs"
        rows = [json.loads(line) for line in (results.parent / "results.jsonl").read_text().splitlines()]
        assert table_lines(results.read_text()) == table_lines(overlap.table(rows)), f"{path} is not its rows' table"
