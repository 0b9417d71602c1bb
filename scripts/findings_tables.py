"""Copies each grid's current table into docs/findings.md.

    python scripts/findings_tables.py [--page docs/findings.md]

Every ``<!-- results: <path> -->`` ... ``<!-- end results -->`` block of the page is replaced by the
table lines of ``<path>`` (a grid's ``results.md``, written by ``scripts/textworld_ablation.py``) or,
where the block names columns and values (``<!-- results: <path> algorithm=base,ppo rewards=-,dense
-->``), by the lines holding one of the listed values in each named column. Every ``<!-- diagnostics:
<grid> -->`` ... ``<!-- end diagnostics -->`` block is replaced by the table
``scripts/rl_diagnostics.py <grid>`` prints from the grid's committed logs, so the page shows what
the grids wrote; ``tests/configs/test_findings.py`` checks that they are equal.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(<!-- results: (\S+)((?: [\w:]+=\S+)*) -->\n)(.*?)(<!-- end results -->)", re.S)
DIAGNOSTICS = re.compile(r"(<!-- diagnostics: (\S+) -->\n)(.*?)(<!-- end diagnostics -->)", re.S)
CELL = re.compile(r"(?<!\\)\|")  # a column separator (a cell's own ``|`` is escaped)


def cells(line: str) -> list[str]:
    return [cell.strip() for cell in CELL.split(line.strip().strip("|"))]


def select(lines: list[str], where: str) -> list[str]:
    """A table's lines (head and separator first) that hold, in each column ``where`` names
    (``algorithm=base,ppo rewards=-,dense``), one of its comma-separated values."""
    conditions = {name: values.split(",") for name, _, values in (part.partition("=") for part in where.split())}
    if not conditions:
        return lines
    head, separator, *rows = lines
    names = cells(head)
    unknown = sorted(set(conditions) - set(names))
    if unknown:
        raise ValueError(f"results block: no column {unknown} (the table has {names})")
    index = {name: names.index(name) for name in conditions}
    kept = [row for row in rows if all(cells(row)[index[name]] in values for name, values in conditions.items())]
    return [head, separator, *kept]


def diagnostics_table(grid: Path) -> str:
    """``scripts/rl_diagnostics.py``'s table of a grid's cells."""
    if str(REPO / "scripts") not in sys.path:  # run as a script it is; imported by a test it is not
        sys.path.insert(0, str(REPO / "scripts"))
    import rl_diagnostics

    return rl_diagnostics.table(rl_diagnostics.cell_rows(grid))


def refresh(page: str, root: Path = REPO) -> str:
    def table(match: re.Match) -> str:
        path = root / match.group(2)
        if not path.is_file():
            sys.exit(f"findings_tables: {match.group(2)} does not exist (run its grid first)")
        lines = select([line for line in path.read_text().splitlines() if line.startswith("|")], match.group(3))
        return match.group(1) + "\n".join(lines) + "\n" + match.group(5)

    def diagnostics(match: re.Match) -> str:
        return match.group(1) + diagnostics_table(root / match.group(2)) + "\n" + match.group(4)

    return DIAGNOSTICS.sub(diagnostics, BLOCK.sub(table, page))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--page", type=Path, default=REPO / "docs" / "findings.md")
    args = parser.parse_args(argv)
    before = args.page.read_text()
    after = refresh(before)
    args.page.write_text(after)
    count = len(BLOCK.findall(after)) + len(DIAGNOSTICS.findall(after))
    print(f"findings_tables: {count} table(s), {'changed' if after != before else 'unchanged'}")


if __name__ == "__main__":
    main()
