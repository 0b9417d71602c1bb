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

from lit_marl import ConfigError
from lit_marl.agents import AdapterView, Agent, peft_of

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
            if hasattr(model, "peft_config"):  # its own adapter, not a KL reference kept beside it
                model.save_pretrained(folder, selected_adapters=[peft_of(model)[1]])
            else:
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


def load_adapters(module, dirpath: str | Path, field: str = "InitialWeights.path") -> None:
    """Each learner's LoRA adapter read from an ``export_team(..., lora="adapter")`` folder (an earlier
    run's ``HFExport``) into ``module``'s adapter of the same role: a new run starts from that run's
    weights (e.g. RL from an SFT run). The adapters must have the run's shape (rank, alpha, target
    modules); every adapter tensor is replaced, nothing else."""
    dirpath = Path(dirpath).expanduser()
    if not (dirpath / MANIFEST).is_file():
        raise ConfigError(
            f"{field}={str(dirpath)!r} holds no {MANIFEST}: give a folder that HFExport(lora: adapter) wrote"
        )
    if module.shards is not None:
        raise ConfigError(f"{field}: adapters load into whole models, not FSDP shards: use a DDP or 1-device run")
    roles = json.loads((dirpath / MANIFEST).read_text())["roles"]
    if len(roles) != len(module.agents):
        raise ConfigError(f"{field}: the folder's team has {len(roles)} agents, this run's {len(module.agents)}")
    for learner_roles in module.learners:
        folders = sorted({roles[role] for role in learner_roles})
        if len(folders) > 1:  # one model here, several there: which one would be a silent choice
            raise ConfigError(
                f"{field}: roles {learner_roles} share one model in this run, but the folder gives them "
                f"{len(folders)} ({', '.join(folders)}): start from an export of a parameter-shared run, or "
                f"set model.share_parameters: false"
            )
        model, folder = module.agents[learner_roles[0]].model, dirpath / folders[0]
        if not isinstance(model, AdapterView) and not hasattr(model, "peft_config"):
            raise ConfigError(f"{field}: {folder} is a LoRA adapter, but this run trains whole models: set model.lora")
        _load_adapter(*peft_of(model), folder, field)


def _load_adapter(peft_model, adapter: str, folder: Path, field: str) -> None:
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    if not (folder / "adapter_config.json").is_file():
        raise ConfigError(f"{field}: {folder} is a merged model, not an adapter: export with HFExport(lora: adapter)")
    saved, ours = json.loads((folder / "adapter_config.json").read_text()), peft_model.peft_config[adapter]
    shape = {"r": ours.r, "lora_alpha": ours.lora_alpha, "target_modules": sorted(ours.target_modules)}
    theirs = {"r": saved["r"], "lora_alpha": saved["lora_alpha"], "target_modules": sorted(saved["target_modules"])}
    if shape != theirs:
        raise ConfigError(f"{field}: {folder}'s adapter is {theirs}, this run's model.lora {shape}: give the same")
    result = set_peft_model_state_dict(peft_model, load_file(str(folder / "adapter_model.safetensors")), adapter)
    missing = [k for k in result.missing_keys if "lora_" in k and f".{adapter}." in k]
    if result.unexpected_keys or missing:
        raise ConfigError(
            f"{field}: {folder}'s adapter does not fit this run's model (unexpected {result.unexpected_keys[:3]}, "
            f"missing {missing[:3]}): give the export of a run of the same model"
        )
