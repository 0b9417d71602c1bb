"""A learned joint reward (MARLHF): a reward model that scores a joint answer, trained with
Bradley-Terry on preference pairs (``algorithms.RewardModelFit``) and then used as the training
reward of any online algorithm (``data.reward_model``); evaluation keeps the task reward.

The model reads the joint answer as text (CoMLRL's format, so its own tokenizer may differ from
the agents'): a causal-LM backbone, a linear head on the hidden state of the last token.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from lit_marl import ConfigError
from lit_marl.envs.base import TextEnv
from lit_marl.generation import left_pad
from lit_marl.logprobs import final_hidden_states
from lit_marl.models import load_model_and_tokenizer

HEAD_FILE, INFO_FILE = "reward_head.pt", "reward_model.json"


def joint_text(prompts: list[str], completions: list[str]) -> str:
    """One joint answer as the reward model reads it (CoMLRL's layout, roles 1-based)."""
    parts = ["Joint multi-agent response"]
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        parts += [f"Agent {i + 1} prompt:\n{prompt}", f"Agent {i + 1} response:\n{completion}"]
    return "\n\n".join(parts)


class JointRewardModel(nn.Module):
    """A causal-LM backbone and a linear head on the last token's final hidden state: one scalar per text."""

    def __init__(self, source: str, freeze_backbone: bool = False, max_length: int = 1024):
        super().__init__()
        self.backbone, self.tokenizer = load_model_and_tokenizer(source)
        self.source, self.max_length = source, max_length
        self.head = nn.Linear(self.backbone.config.hidden_size, 1)
        if freeze_backbone:
            self.backbone.requires_grad_(False)

    def encode(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded ids and mask (the last token is last in every row); a text longer than
        ``max_length`` tokens keeps its end (the answers)."""
        rows = [self.tokenizer(t, add_special_tokens=False)["input_ids"][-self.max_length :] for t in texts]
        return left_pad(rows, self.tokenizer.pad_token_id, self.head.weight.device)

    def score(self, texts: list[str]) -> torch.Tensor:
        """``[len(texts)]`` scores."""
        return self(*self.encode(texts))

    def forward(self, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``[rows]``: the head on the last position's final hidden state (rows from ``encode``)."""
        return self.head(final_hidden_states(self.backbone, input_ids, mask)[:, -1].float()).squeeze(-1)

    def save(self, folder: str | Path) -> None:
        """The backbone as an HF folder, the head beside it."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.backbone.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)
        torch.save(self.head.state_dict(), folder / HEAD_FILE)
        (folder / INFO_FILE).write_text(json.dumps({"source": self.source, "max_length": self.max_length}))

    @classmethod
    def load(cls, folder: str | Path, field: str = "data.reward_model") -> "JointRewardModel":
        folder = Path(folder)
        if not (folder / HEAD_FILE).exists():
            raise ConfigError(
                f"{field}={str(folder)!r} holds no trained reward model ({HEAD_FILE} is missing): train one with "
                "lit_marl.algorithms.RewardModelFit (model.reward_model_dir)"
            )
        info = json.loads((folder / INFO_FILE).read_text())
        model = cls(str(folder), freeze_backbone=True, max_length=info["max_length"])
        model.head.load_state_dict(torch.load(folder / HEAD_FILE, weights_only=True))
        return model.eval()


class LearnedRewardEnv(TextEnv):
    """``inner``'s prompts and transitions, its reward replaced by a reward model's score of the joint answer."""

    def __init__(self, inner: TextEnv, model: JointRewardModel, batch_size: int = 16):
        """
        Args:
            inner: The task's environment: its prompts and transitions are kept, its reward is not.
            model: The trained reward model (``JointRewardModel.load``; the data module's ``reward_model``).
            batch_size: Joint answers the reward model scores per forward pass.
        """
        self.inner, self.model, self.batch_size = inner, model, batch_size

    @property
    def num_agents(self) -> int:
        return self.inner.num_agents

    @property
    def reward_name(self) -> str:
        return f"the reward model {self.model.source}"

    def prompts(self, task: dict) -> list[str]:
        return self.inner.prompts(task)

    @torch.no_grad()
    def reward(self, agent_completions: list[list[str]], tasks: list[dict]) -> list[float]:
        texts = [
            joint_text(self.inner.prompts(task), [agent[j] for agent in agent_completions])
            for j, task in enumerate(tasks)
        ]
        scores = [self.model.score(texts[i : i + self.batch_size]) for i in range(0, len(texts), self.batch_size)]
        return torch.cat(scores).tolist() if scores else []

    @property
    def has_transition(self) -> bool:
        return self.inner.has_transition

    @property
    def transition_name(self) -> str:
        return self.inner.transition_name

    def transition(self, **kwargs):
        return self.inner.transition(**kwargs)
