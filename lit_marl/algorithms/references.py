"""The KL reference of each learner: which weights ``model.kl_reference`` names, and how they are held.

- ``base`` (the default): the model as loaded (``model.model``). Full fine-tuning keeps a frozen copy
  (in ``memory.weights_dtype``); under LoRA the reference is the base itself with the adapters off (no copy).
- ``rl_start``: the policy as RL starts: at the switch from SFT (``PhaseSwitch``), or at the start of a
  run that begins in RL (after ``InitialWeights`` loaded an earlier run's adapters). This is veRL's
  reference (the actor's initial weights, the SFT checkpoint where RL follows SFT): a KL term then
  holds the policy near what SFT taught instead of pulling it back to the base. Full fine-tuning
  copies the policy into its frozen copy then; under LoRA each learner gets a second, frozen adapter
  (``<adapter>_reference``, a LoRA's size) that takes the policy's adapter then. Both are module
  weights: checkpoints hold them, so a resumed run keeps its reference.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from lit_marl.agents import REFERENCE_SUFFIX, peft_of


def build_reference_adapters(models: list[nn.Module]) -> None:
    """A frozen copy of each LoRA model's adapter beside it (``<adapter>_reference``); the active
    adapter stays the one it was."""
    for model in models:
        peft, adapter = peft_of(model)
        name = adapter + REFERENCE_SUFFIX
        if name in peft.peft_config:
            continue
        peft.add_adapter(name, peft.peft_config[adapter])
        for key, p in peft.named_parameters():
            if f".{name}." in key:
                p.requires_grad_(False)


@contextmanager
def reference_adapter(model: nn.Module) -> Iterator[nn.Module]:
    """``model``'s peft model with its reference adapter active (frozen) for the block; the adapter
    active before (and trainable) again after it."""
    peft, adapter = peft_of(model)
    active = peft.active_adapter
    peft.set_adapter(adapter + REFERENCE_SUFFIX, inference_mode=True)
    try:
        yield peft
    finally:
        peft.set_adapter(active)


@torch.no_grad()
def take_policy(module) -> None:
    """Every learner's reference becomes its policy as it is now (``kl_reference: rl_start``)."""
    for n in range(len(module.learners)):
        model = module.model_of(n)
        if module.references is not None:  # a frozen full copy (stored in memory.weights_dtype: copy_ casts)
            module.references[n].load_state_dict(model.state_dict())
            continue
        peft, adapter = peft_of(model)
        params = dict(peft.named_parameters())
        for key, p in params.items():
            if f".{adapter}." in key:
                params[key.replace(f".{adapter}.", f".{adapter}{REFERENCE_SUFFIX}.")].copy_(p)
