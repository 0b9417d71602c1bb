"""Each agent of a team as a standard Hugging Face folder, loadable with ``from_pretrained``, and back.

``export_team`` writes every distinct model of the team to ``<dirpath>/agent<i>`` (``shared`` for a
parameter-shared team) with its tokenizer and chat template, and ``<dirpath>/team.json``: the
folder that plays each role and the agents' system prompt. A LoRA agent is either merged into its
base weights (``lora: merged``, a plain model) or saved as its adapter only (``lora: adapter``,
loaded with peft on the base named in its ``adapter_config.json``). Critics and value heads are
training machinery and stay in checkpoints. The ``HFExport`` callback and ``lit-marl export`` (a
checkpoint's team) both write through it; ``exported_team`` reads such a folder back as agents.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Literal

from transformers import AutoTokenizer

from lit_marl.agents import AdapterView, Agent

MANIFEST = "team.json"
LoraExport = Literal["merged", "adapter"]


def export_team(module, dirpath: str | Path, lora: LoraExport = "merged", write: bool = True) -> list[Path]:
    """Write every agent of ``module`` (an ``AgentTeamModule``) now, and the manifest; returns the
    folders. Under FSDP every rank must call this (the weights are gathered), with ``write`` on one."""
    dirpath, folders = Path(dirpath), []
    for index, roles in enumerate(module.learners):
        agent = module.agents[roles[0]]
        folder = dirpath / module.learner_name(index)
        model = agent.model
        if module.shards is not None:
            model = module.shards.full_copy(model)  # None except on rank 0
        if not write:
            continue
        if isinstance(model, AdapterView):  # one adapter of a team's shared base
            if lora == "merged":
                model.merged().save_pretrained(folder)
            else:
                model.save_adapter(folder)
        else:
            if hasattr(model, "peft_config") and lora == "merged":
                model = copy.deepcopy(model).merge_and_unload()  # the training copy keeps its adapter
            model.save_pretrained(folder)
        agent.tokenizer.save_pretrained(folder)
        folders.append(folder)
    if write:
        roles = [module.learner_name(module.learner_of(role)) for role in range(len(module.agents))]
        manifest = {"roles": roles, "system_prompt": module.agents[0].system_prompt}
        (dirpath / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return folders


def exported_team(source: str) -> list[Agent]:
    """The agents of an export folder, one per role (``team.json``; a shared folder plays each of
    its roles as one agent), or one agent of any other model source (an HF or adapter folder, an
    HF id, ``tiny-random``)."""
    path = Path(source).expanduser()
    if not (path / MANIFEST).is_file():
        return [_agent(source, None)]
    manifest = json.loads((path / MANIFEST).read_text())
    agents: dict[str, Agent] = {}
    for name in manifest["roles"]:
        agents.setdefault(name, _agent(str(path / name), manifest.get("system_prompt")))
    return [agents[name] for name in manifest["roles"]]


def _agent(source: str, system_prompt: str | None) -> Agent:
    folder = Path(source).expanduser()
    if not (folder / "adapter_config.json").is_file():
        return Agent(source, None, system_prompt)
    from peft import AutoPeftModelForCausalLM  # deferred: peft is needed for adapter folders only

    model = AutoPeftModelForCausalLM.from_pretrained(str(folder))  # the base its adapter_config.json names
    return Agent(source, None, system_prompt, (model.eval(), AutoTokenizer.from_pretrained(str(folder))))
