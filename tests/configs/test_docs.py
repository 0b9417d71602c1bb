"""The documentation stays true: docs/config.md is what scripts/make_config_reference.py generates,
every class and argument a shipped config names is in it, and every relative link of README.md and
docs/*.md reaches an existing file (and heading)."""

from __future__ import annotations

import importlib
import importlib.util
import os
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


def links_and_anchors(path: Path) -> tuple[list[str], set[str]]:
    """The link targets of a Markdown file (outside code) and the anchors of its headings."""
    targets, anchors, counts, fenced = [], set(), {}, False
    for line in path.read_text().splitlines():
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
        targets += re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", prose)
        targets += re.findall(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", prose)
    return targets, anchors


@pytest.mark.parametrize("markdown", MARKDOWN, ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_relative_links_resolve(markdown):
    broken = []
    for target in links_and_anchors(markdown)[0]:
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        resolved = (markdown.parent / file).resolve() if file else markdown
        if not resolved.is_relative_to(REPO_ROOT):  # beside the checkout (../shared/): not the repository's
            continue
        if not resolved.exists():
            broken.append(f"{target}: no file {os.path.relpath(resolved, REPO_ROOT)}")
        elif anchor and resolved.suffix == ".md" and anchor not in links_and_anchors(resolved)[1]:
            broken.append(f"{target}: no heading with the anchor #{anchor} in {resolved.relative_to(REPO_ROOT)}")
    assert not broken, f"{markdown.relative_to(REPO_ROOT)}: broken links:\n" + "\n".join(broken)
