"""The documentation stays true: docs/config.md is what scripts/make_config_reference.py generates,
every class and argument a shipped config names is in it, every link of README.md and docs/*.md is
an http(s) URL or reaches an existing file (and heading) inside the repository, and the docs and the
configs' comments speak to users: no internal issue numbers, no story of the project's development."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest
import yaml

from helpers import REPO_ROOT

CONFIG_MD = REPO_ROOT / "docs" / "config.md"
YAMLS = sorted((REPO_ROOT / "configs").rglob("*.yaml"))
MARKDOWN = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
# the classes that name a registered environment and take its arguments: (name key, arguments key)
ENV_ARGUMENTS = {
    "lit_marl.data.EpisodeDataModule": ("env", "env_kwargs"),
    "lit_marl.data.RolloutDataModule": ("env", "env_kwargs"),
}


@pytest.fixture(scope="module")
def reference():
    """scripts/make_config_reference.py as a module."""
    path = REPO_ROOT / "scripts" / "make_config_reference.py"
    spec = importlib.util.spec_from_file_location("make_config_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_reference_is_generated(reference):
    problem = reference.out_of_date(reference.generate())
    assert not problem, problem


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text lower-cased, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def documented_sections() -> tuple[dict[str, dict[str, str]], dict[str, str], dict[str, str]]:
    """From docs/config.md: each documented class path's arguments (name -> type cell), the class path
    of each registered environment name, and the class path under each heading anchor."""
    sections, env_names, anchors, anchor = {}, {}, {}, None
    for line in CONFIG_MD.read_text().splitlines():
        if line.startswith("### "):
            anchor = slug(line[4:])
        elif match := re.match(r"`(?:class_path: |env: ([\w-]+)` \(`)?(lit_marl[\w.]+)`", line):
            path = match.group(2)
            sections[path], anchors[anchor] = {}, path
            if match.group(1):
                env_names[match.group(1)] = path
        elif line.startswith("| `") and anchor in anchors:
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            sections[anchors[anchor]][cells[0].strip("`")] = cells[1]
    return sections, env_names, anchors


def class_nodes(node):
    """Every mapping with a ``class_path`` in a parsed YAML document, nested ones included."""
    if isinstance(node, dict):
        if "class_path" in node:
            yield node
        for value in node.values():
            yield from class_nodes(value)
    elif isinstance(node, list):
        for value in node:
            yield from class_nodes(value)


def resolve(path: str):
    """The class a ``class_path`` names, or None."""
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


@pytest.mark.parametrize("config", YAMLS, ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_config_classes_and_arguments_are_documented(config, reference):
    sections, env_names, anchors = documented_sections()
    problems = []

    def check_keys(where: str, keys, arguments: dict[str, str]) -> None:
        if "**kwargs" not in arguments:  # a class that takes more keywords than it lists
            problems.extend(f"{where}: {k!r} is not a documented argument" for k in keys if k not in arguments)

    for node in class_nodes(yaml.safe_load(config.read_text())):
        if not node["class_path"].startswith("lit_marl."):
            continue
        cls = resolve(node["class_path"])  # a longer import path names the same class
        path = reference.class_path(cls) if cls is not None else node["class_path"]
        if path not in sections:
            problems.append(f"{node['class_path']} is not documented in docs/config.md")
            continue
        init_args = node.get("init_args") or {}
        check_keys(path, init_args, sections[path])
        for key, value in init_args.items():  # a settings class given as a mapping: its fields
            links = re.findall(r"\]\(#([\w-]+)\)", sections[path].get(key, ""))
            if isinstance(value, dict) and "class_path" not in value and len(links) == 1:
                check_keys(f"{path} {key}", value, sections[anchors[links[0]]])
        name_key, kwargs_key = ENV_ARGUMENTS.get(path, (None, None))
        if not isinstance(init_args.get(name_key), str):  # an environment object: checked as a class above
            continue
        if init_args[name_key] in env_names:
            check_keys(
                f"{path} {kwargs_key}", init_args.get(kwargs_key) or {}, sections[env_names[init_args[name_key]]]
            )
        else:
            problems.append(f"{path} {name_key}={init_args[name_key]!r} is not a documented registered environment")
    assert not problems, "\n".join(problems)


def links_and_anchors(path: Path) -> tuple[list[tuple[int, str]], set[str]]:
    """The link targets of a Markdown file (outside code), each with its line number, and the
    anchors of its headings."""
    targets, anchors, counts, fenced = [], set(), {}, False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if fenced:
            continue
        if heading := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line):
            base = slug(heading.group(1))
            anchors.add(base if base not in counts else f"{base}-{counts[base]}")  # GitHub numbers repeats
            counts[base] = counts.get(base, 0) + 1
        anchors.update(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", line))
        prose = re.sub(r"(`+).*?\1", "", line)  # no links inside code spans
        found = re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", prose)
        found += re.findall(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", prose)
        targets += [(number, target) for target in found]
    return targets, anchors


def link_problems(markdown: Path, root: Path = REPO_ROOT) -> list[str]:
    """Every link of ``markdown`` that is neither an http(s)/mailto URL nor a relative path to a file
    (and heading) inside ``root``, as ``file:line: target: why``."""
    root, problems = root.resolve(), []
    where = markdown.resolve().relative_to(root).as_posix()
    for number, target in links_and_anchors(markdown)[0]:
        if scheme := re.match(r"([a-zA-Z][a-zA-Z0-9+.-]*):", target):
            if scheme.group(1).lower() not in ("http", "https", "mailto"):
                problems.append(
                    f"{where}:{number}: {target}: a {scheme.group(1)}: link works on one machine only; link a file "
                    "of the repository by its relative path, or an http(s) URL"
                )
            continue
        file, _, anchor = target.partition("#")
        resolved = (markdown.parent / file).resolve() if file else markdown.resolve()
        if not resolved.is_relative_to(root):
            problems.append(
                f"{where}:{number}: {target}: leaves the repository, so a reader of the repository "
                "cannot follow it; link the repository's own page (e.g. docs/architecture.md) or an http(s) URL"
            )
        elif not resolved.exists():
            problems.append(f"{where}:{number}: {target}: no file {resolved.relative_to(root).as_posix()}")
        elif anchor and resolved.suffix == ".md" and anchor not in links_and_anchors(resolved)[1]:
            problems.append(
                f"{where}:{number}: {target}: no heading with the anchor #{anchor} in "
                f"{resolved.relative_to(root).as_posix()}"
            )
    return problems


@pytest.mark.parametrize("markdown", MARKDOWN, ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_links_stay_inside_the_repository_and_resolve(markdown):
    problems = link_problems(markdown)
    assert not problems, "broken links:\n" + "\n".join(problems)


# --------------------------------------------------------------------------- docs speak to users
# An internal issue or pull-request number means nothing to a reader of the repository. A reference
# to another project's tracker names the project (owner/repo#123) or links the URL; both pass.
# A '#' right after a word character, '/' or '&' (owner/repo#12, HTML's &#8594;) is not a reference;
# neither are headings ('# Title'), shebangs ('#!') nor hex colours ('#6206E0'; all-digit ones are
# taken as colours at 6 or 8 digits, the widths of #RRGGBB and #RRGGBBAA).
ISSUE_NUMBERS = [
    (re.compile(r"\b(?:issues?|bugs?|tickets?)\s+(?:#|no\.\s*)?\d+\b", re.I), "an issue number"),
    (re.compile(r"\b(?:PRs?|pull requests?)\s+(?:#|no\.\s*)?\d+\b"), "a pull-request number"),
    (re.compile(r"(?<![\w/&#])#\d+\b(?<!#\d{6})(?<!#\d{8})"), "an issue or pull-request number"),
]
# The development's story: what changed, when, in which session. Each phrase reads as history in any
# context (unlike "no longer", "now" or "old", which user docs also need: "no longer matches its
# checksum", "the old value" of PPO's value clipping).
HISTORY = [
    (re.compile(r"\b(?:this|previous|earlier|last|next) (?:session|wave)\b", re.I), "names a working session"),
    (
        re.compile(r"\b(?:used to be|we used to|earlier we|previously|formerly|until now|as it was then)\b", re.I),
        "tells what the project used to do",
    ),  # fmt: skip
    (re.compile(r"\b(?:was changed to|(?:before|after|in) this change|this commit)\b", re.I), "tells of a change"),
    (re.compile(r"\b(?:was|were|is now|are now|has been|have been) fixed\b", re.I), "tells of a fix"),
    (re.compile(r"\bthe previous (?:shipped )?config\b", re.I), "refers to an earlier config"),
    (re.compile(r"\(new\)", re.I), "marks something as new"),
    (
        re.compile(r"\bI (?:did not|didn't|saw|ran|tried|measured|found|read|could not|cannot tell)\b"),
        "narrates the author's work",
    ),  # fmt: skip
]
WHY = {
    "issue": "internal issue numbers mean nothing to a user: say what is true, or name the other project "
    "(owner/repo#123) or link its URL",
    "history": "development history: say what IS true for a user (a measurement may keep the conditions it ran "
    "under, not a story of changes)",
}


def prose(text: str, comments_only: bool = False):
    """(line number, text) of what a reader reads as prose: Markdown outside fenced code, inline code
    and link targets/URLs, or (``comments_only``) the comments of a YAML file."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if comments_only:
            comment = re.search(r"(?:^|\s)#(.*)$", line)
            if comment:
                yield number, comment.group(1)
            continue
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if fenced:
            continue
        line = re.sub(r"(`+).*?\1", " ", line)  # code spans
        line = re.sub(r"\]\([^)]*\)", "]", line)  # link targets (file anchors such as page.md#1-step)
        line = re.sub(r"<?\b(?:https?|mailto|file):[^\s)>]*>?", " ", line)  # bare URLs
        line = re.sub(r"<[^>]*>", " ", line)  # HTML tags (<a name="..."> anchors)
        yield number, line


def user_facing_problems(where: str, text: str, comments_only: bool = False) -> list[str]:
    """``file:line: why: the line`` for every issue number and history phrase in the prose of ``text``."""
    problems = []
    for number, line in prose(text, comments_only):
        for checks, kind in ((ISSUE_NUMBERS, "issue"), (HISTORY, "history")):  # the first finding of each kind
            found = next(((m, what) for pattern, what in checks if (m := pattern.search(line))), None)
            if found:
                problems.append(
                    f"{where}:{number}: {found[0].group(0)!r} {found[1]}; {WHY[kind]}: {line.strip()[:120]}"
                )
    return problems


@pytest.mark.parametrize("markdown", MARKDOWN, ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_docs_speak_to_users(markdown):
    problems = user_facing_problems(markdown.relative_to(REPO_ROOT).as_posix(), markdown.read_text())
    assert not problems, "\n".join(problems)


def test_config_comments_speak_to_users():
    problems = [
        problem
        for config in YAMLS
        for problem in user_facing_problems(config.relative_to(REPO_ROOT).as_posix(), config.read_text(), True)
    ]
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- the checks themselves
@pytest.mark.parametrize(
    "text, caught",
    [
        ("Fixed in issue 12, see there.", "'issue 12' an issue number"),
        ("Issues 12 and 13 describe it.", "'Issues 12' an issue number"),
        ("As in issue #34.", "'issue #34' an issue number"),
        ("The budget (#34) is spent.", "'#34' an issue or pull-request number"),
        ("A fast path is proposed in PR #21769.", "'PR #21769' a pull-request number"),
        ("See [the bug](page.md) in #7.", "'#7' an issue or pull-request number"),
        ("This session measured it.", "names a working session"),
        ("Measured in the previous session.", "names a working session"),
        ("The planner used to be greedy.", "tells what the project used to do"),
        ("Previously the loss was summed.", "tells what the project used to do"),
        ("The default was changed to 0.5.", "tells of a change"),
        ("Before this change every step logged.", "tells of a change"),
        ("The baseline is biased; it was fixed.", "tells of a fix"),
        ("Held-out success (new) is logged.", "marks something as new"),
        ("Stacked bangs, the previous config's hack.", "refers to an earlier config"),
        ("I did not run aligned pairs.", "narrates the author's work"),
    ],
)
def test_user_facing_checks_catch(text, caught):
    (problem,) = user_facing_problems("docs/x.md", f"# A page\n\n{text}\n")
    assert problem.startswith("docs/x.md:3: ") and caught in problem, problem
    assert WHY["issue" if "number" in caught else "history"] in problem


@pytest.mark.parametrize(
    "text",
    [
        "# A heading\n## 2 agents, a sub-heading",
        "```bash\n#!/bin/bash\ngit log  # see issue 12\n```",
        "The bar's colour is #6206E0 or #888888, in a table `| # | what |`.",
        "| # | what |\n|---|---|\n| 1 | a row |",
        "Lightning-AI/pytorch-lightning#20388 and volcengine/verl#7244 name their projects.",
        "[the issue](https://github.com/o/r/issues/12), <https://github.com/o/r/pull/34>",
        "[a step](page.md#1-the-first-step), an arrow &#8594; here, `#12` in code.",
        "Every rank must issue the same collectives; the actor issues the command.",
        "Each program starts a new session; its body no longer matches the checksum.",
        "Clipped around the old value; the earlier turns are context; it is now greedy.",
        "Runs logged by older releases map to the same panels.",
    ],
)
def test_user_facing_checks_pass_legitimate_docs(text):
    assert user_facing_problems("docs/x.md", text) == []


def test_config_comment_checks_read_comments_only():
    config = "color: '#123456'\nname: x  # see issue 12\n# the previous config used lr 3e-4\nkey: 1 # fine\n"
    problems = user_facing_problems("configs/x.yaml", config, comments_only=True)
    assert [p.split(": ")[0] for p in problems] == ["configs/x.yaml:2", "configs/x.yaml:3"], problems


@pytest.mark.parametrize(
    "link, why",
    [
        ("[arch](../../shared/ARCHITECTURE.md)", "leaves the repository"),
        ("[abs](/etc/hosts)", "leaves the repository"),
        ("[gone](missing.md)", "no file docs/missing.md"),
        ("[here](page.md#nowhere)", "no heading with the anchor #nowhere in docs/page.md"),
        ("[local](file:///etc/hosts)", "a file: link works on one machine only"),
        ("[ref]: ../../shared/ARCHITECTURE.md", "leaves the repository"),
    ],
)
def test_link_check_catches(tmp_path, link, why):
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "ARCHITECTURE.md").write_text("# Architecture\n")  # exists, but outside
    page = root / "docs" / "page.md"
    page.write_text(f"# Page\n\n{link}\n")
    (problem,) = link_problems(page, root)
    assert problem.startswith("docs/page.md:3: ") and why in problem, problem


def test_link_check_passes_links_inside_the_repository(tmp_path):
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (root / "README.md").write_text("# Read me\n")
    page = root / "docs" / "page.md"
    page.write_text(
        "# Page\n\n## Two words\n\n[r](../README.md), [s](#two-words), [t](../README.md#read-me), "
        "[u](https://example.org/x), [m](mailto:a@b.c), `[v](../../outside.md)`\n"
    )
    assert link_problems(page, root) == []
