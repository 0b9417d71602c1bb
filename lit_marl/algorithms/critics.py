"""Value heads and critic models, built once for the algorithms that learn a value: PPO on
episodes, IAC and MAAC on joint trajectories. A critic is a value head on the actor's hidden
states, or a head on a backbone of its own (a critic model, loaded here, checked to read the
actors' token ids)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import nn

from lit_marl import ConfigError
from lit_marl.generation import left_pad
from lit_marl.logprobs import final_hidden_states
from lit_marl.models import load_model_and_tokenizer
from lit_marl.rollout.batch import AgentSamples, Rows


class ValueHead(nn.Module):
    """MLP -> tanh -> scalar on a hidden state, computed in fp32 (under bf16 autocast too: a value is
    a regression target's estimate, and GAE writes fp32 returns beside it)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(hidden_size, hidden_size), nn.Tanh(), nn.Linear(hidden_size, 1))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            return self.net(hidden.float()).squeeze(-1)


CriticType = Literal["v", "q"]


@dataclass
class CriticInputs(Rows):
    """What a critic model reads: token rows (left-padded) and the position of each row's value."""

    position_fields: ClassVar[tuple[str, ...]] = ("positions",)

    # input_ids, attention_mask: [B, L]
    positions: torch.Tensor  # [B]
    old_values: torch.Tensor | None = None  # [B]
    targets: torch.Tensor | None = None  # [B]
    turn_ids: torch.Tensor | None = None  # [B]


def read_positions(samples: AgentSamples, critic_type: CriticType) -> torch.Tensor:
    """Where V(h) (``v``: the last prompt token) or Q(h, a) (``q``: the last token of prompt +
    response, the end token included) is read in each row of ``samples.input_ids``."""
    prompt_width = samples.input_ids.shape[1] - samples.num_completion
    if critic_type == "v":
        return torch.full((len(samples),), prompt_width - 1, device=samples.input_ids.device)
    # the last trained token (a tool round's results inside a completion are not trained)
    mask = samples.completion_mask.long()
    last = (mask * torch.arange(1, mask.shape[1] + 1, device=mask.device)).amax(-1)
    return prompt_width - 1 + last.clamp(min=1)


def critic_inputs(samples: AgentSamples, critic_type: CriticType) -> CriticInputs:
    """A separate critic model's view of one agent's rows (for ``v`` only the prompt: it is causal)."""
    positions = read_positions(samples, critic_type)
    end = int(positions.max()) + 1
    return CriticInputs(samples.input_ids[:, :end], samples.attention_mask[:, :end], positions)


def joint_critic_inputs(per_agent: list[AgentSamples], critic_type: CriticType, pad_id: int) -> CriticInputs:
    """The joint state of each node for a centralized critic: every agent's prompt (``v``), or
    every agent's prompt and response (``q``: the joint action), one after the other; the value is
    read at the last token."""
    ends = [read_positions(samples, critic_type) + 1 for samples in per_agent]
    rows = []
    for r in range(len(per_agent[0])):
        joint: list[int] = []
        for samples, end in zip(per_agent, ends):
            ids, mask = samples.input_ids[r, : int(end[r])], samples.attention_mask[r, : int(end[r])]
            joint += ids[mask.bool()].tolist()
        rows.append(joint)
    device = per_agent[0].input_ids.device
    input_ids, attention_mask = left_pad(rows, pad_id, device)
    positions = torch.full((len(rows),), input_ids.shape[1] - 1, device=device)
    return CriticInputs(input_ids, attention_mask, positions)


class Critic(nn.Module):
    """A value head (MLP -> tanh -> scalar) on a backbone of its own (a critic model), or on the
    actor's hidden states (``backbone`` None: the head is trained through the actor's loss)."""

    def __init__(self, hidden_size: int, backbone: nn.Module | None = None):
        super().__init__()
        self.backbone = backbone
        self.head = ValueHead(hidden_size)

    def read(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.head(hidden[torch.arange(len(positions), device=hidden.device), positions])

    def forward(self, inputs: CriticInputs) -> torch.Tensor:
        return self.read(final_hidden_states(self.backbone, inputs.input_ids, inputs.attention_mask), inputs.positions)


def load_critic_backbone(source: str, agents: list, field: str = "model.critic_model") -> nn.Module:
    """A critic model from ``source`` without its LM head (the decoder a value head reads: a head of
    vocabulary x hidden weights, with their gradients and AdamW state, would never be used); it must
    use the tokenizer of every agent in ``agents``, as it reads their token ids."""
    model, tokenizer = load_model_and_tokenizer(source)
    backbone = model.base_model  # the decoder under the ``*ForCausalLM`` (embeddings, layers, final norm)
    for i, agent in enumerate(agents):
        if tokenizer.get_vocab() != agent.tokenizer.get_vocab():
            raise ConfigError(
                f"{field}={source!r} has another tokenizer than agent {i} ({agent.source}): the critic reads the "
                "actors' token ids; give a critic model with the same tokenizer"
            )
    return backbone
