"""Supervised fine-tuning on demonstrations: multi-turn chats, per agent, the loss on the agents' own
tokens only (every assistant turn, or only the last: ``data.demos.loss_on``).

The step itself lives in the shared base (``AgentTeamModule.sft_step``, its loss ``logprobs.sft_loss``)
because every RL algorithm runs it too during the SFT phase of an SFT→RL run
(``callbacks.PhaseSwitch``); this module is the SFT-only run: ``lit-marl fit`` with
``model: lit_marl.algorithms.SFT`` and a data module with ``demos.path``. Demonstrations are
rendered exactly as RL renders episodes (``lit_marl/rollout/demos.py``), so the weights SFT leaves
are scored by RL on the same token sequences.
"""

from __future__ import annotations

from lit_marl import ConfigError
from lit_marl.algorithms.base import AgentTeamModule


class SFT(AgentTeamModule):
    """Supervised fine-tuning only (no RL): each agent learns its own assistant turns of the demonstrations."""

    phase = "sft"

    def setup(self, stage: str) -> None:
        super().setup(stage)
        rollout = self.rollout_settings
        if stage == "fit" and rollout is not None and not rollout.demos:
            raise ConfigError("model: SFT trains on demonstrations: set data.demos.path (scripts/make_demos.py)")

    def validation_step(self, batch, batch_idx: int) -> None:
        if isinstance(batch, list):  # episodes of a stateful environment: the team's outcome
            episodes = batch[0]
            values = {
                "val/reward": float(episodes.rewards.sum(dim=1).mean()),
                "val/won": float(episodes.won.float().mean()),
            }
            self.log_eval(values, float(len(episodes.won)))
        else:
            self.log_rollout(batch, "val")
