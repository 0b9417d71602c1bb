"""Batched generation that keeps token ids, and the matching log-prob forward for training.

One call generates for every prompt of every open node at once (prompts left-padded), so a turn
costs one ``generate`` per agent, never one per node.

Generation sits behind one small interface, ``Engine.generate(agent, prompts, num_samples,
max_new_tokens, temperature, top_p, greedy) -> Generation``:

- ``hf``: transformers' ``generate`` (any model);
- ``torch``: ``lit_marl.decoding``'s lean KV-cache decoder for Llama-family models (Llama, Qwen2),
  2-3x faster than ``generate`` on small models, where a token's time is Python overhead;
- ``auto`` (default): ``torch`` where the model supports it, else ``hf``, decided per call;
- ``vllm``: ``lit_marl.vllm_engine`` (optional extra, GPU), weights synced from the trainer.

Engines return token ids only: the log-probs that training needs are always recomputed by the
trainer's own forward (``completion_logprobs``), so an engine's numerics never enter a loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import GenerationConfig

from lit_marl.agents import Agent


@dataclass
class Generation:
    """Row ``i * num_samples + k`` holds sample k of prompt i."""

    prompt_ids: torch.Tensor  # [B, P] left-padded
    prompt_mask: torch.Tensor  # [B, P]
    completion_ids: torch.Tensor  # [B, C] right-padded after the end token
    completion_mask: torch.Tensor  # [B, C] 1 on generated tokens up to and including the end token
    num_samples: int = 1  # rows per prompt

    def rows(self, index: slice) -> "Generation":
        return Generation(
            self.prompt_ids[index],
            self.prompt_mask[index],
            self.completion_ids[index],
            self.completion_mask[index],
            self.num_samples,
        )

    @property
    def num_generated_tokens(self) -> int:
        return int(self.completion_mask.sum())


def left_pad(
    sequences: list[list[int]], pad_id: int, device: torch.device, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids and mask ``[len(sequences), width]`` (default width: the longest sequence)."""
    width = max(len(s) for s in sequences) if width is None else width
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(sequences), width), dtype=torch.long, device=device)
    for row, seq in enumerate(sequences):
        if seq:
            ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long, device=device)
            mask[row, width - len(seq) :] = 1
    return ids, mask


def mask_through_first(ids: torch.Tensor, token_id: int) -> torch.Tensor:
    """1 on every position up to and including the first ``token_id`` of each row (all if none)."""
    hit = (ids == token_id).long()
    return ((hit.cumsum(-1) - hit) == 0).long()


@torch.no_grad()
def generate(
    agent: Agent,
    prompts: list[list[int]],
    num_samples: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    greedy: bool = False,
) -> Generation:
    model = agent.model
    device = next(model.parameters()).device
    repeated = [p for p in prompts for _ in range(num_samples)]
    prompt_ids, prompt_mask = left_pad(repeated, agent.pad_token_id, device)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=not greedy,
        temperature=None if greedy else temperature,
        top_p=None if greedy else top_p,
        top_k=0,  # None would mean transformers' default of 50: samples must come from the policy
        eos_token_id=agent.eos_token_id,
        pad_token_id=agent.pad_token_id,
    )
    was_training = model.training
    model.eval()
    try:
        out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config)
    finally:
        model.train(was_training)
    completion_ids = out[:, prompt_ids.shape[1] :]
    completion_mask = mask_through_first(completion_ids, agent.eos_token_id)
    return Generation(prompt_ids, prompt_mask, completion_ids, completion_mask, num_samples)


GenerationCall = tuple[Agent, list[list[int]], int]
"""One agent's share of a turn: ``(agent, prompts, num_samples)``."""


class Engine(Protocol):
    """What the rollouts call. ``generate``: one batched generation for one agent's prompts (row
    ``i * num_samples + k`` of the result is sample k of prompt i). ``generate_team``: a turn's
    calls for every model of the team at once (one ``Generation`` per call, in order), so an
    engine may decode the agents together; ``generate_each`` is the plain loop."""

    name: str

    def generate(
        self,
        agent: Agent,
        prompts: list[list[int]],
        num_samples: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        greedy: bool = False,
    ) -> Generation: ...

    def generate_team(
        self,
        calls: list[GenerationCall],
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        greedy: bool = False,
    ) -> list[Generation]: ...


def generate_each(engine, calls: list[GenerationCall], *args, **kwargs) -> list[Generation]:
    """``generate_team`` as one ``generate`` per call."""
    return [engine.generate(agent, prompts, n, *args, **kwargs) for agent, prompts, n in calls]


class HFEngine:
    """transformers' ``generate``: any causal LM."""

    name = "hf"

    def generate(self, agent, prompts, num_samples, max_new_tokens, temperature=1.0, top_p=1.0, greedy=False):
        return generate(agent, prompts, num_samples, max_new_tokens, temperature, top_p, greedy)

    def generate_team(self, calls, max_new_tokens, temperature=1.0, top_p=1.0, greedy=False):
        return generate_each(self, calls, max_new_tokens, temperature, top_p, greedy)


class TorchEngine:
    """The lean KV-cache decoder of ``lit_marl.decoding`` (Llama-family models). A team's small
    same-shape models decode together, one stacked forward per token. With ``fallback`` a model
    it cannot decode goes to ``generate`` (the ``auto`` engine); without, such a model is refused
    with the reason."""

    def __init__(self, fallback: bool = False):
        self.fallback = fallback
        self.name = "auto" if fallback else "torch"

    def generate(self, agent, prompts, num_samples, max_new_tokens, temperature=1.0, top_p=1.0, greedy=False):
        from lit_marl.decoding import unsupported

        if self.fallback and unsupported(agent.model) is not None:
            return generate(agent, prompts, num_samples, max_new_tokens, temperature, top_p, greedy)
        return self._decode([(agent, prompts, num_samples)], max_new_tokens, temperature, top_p, greedy)[0]

    def generate_team(self, calls, max_new_tokens, temperature=1.0, top_p=1.0, greedy=False):
        from lit_marl.decoding import stackable

        if len(calls) > 1 and stackable([agent.model for agent, _, _ in calls]):
            return self._decode(calls, max_new_tokens, temperature, top_p, greedy)
        return generate_each(self, calls, max_new_tokens, temperature, top_p, greedy)

    @torch.no_grad()
    def _decode(self, calls, max_new_tokens, temperature, top_p, greedy) -> list[Generation]:
        """The calls' models stacked in one ``Decoder`` (the weights as they are now, LoRA merged):
        every call's rows padded to the same count and prompt width, filler rows inactive. When the
        calls sample the same number n per prompt, each prompt runs once for its n samples."""
        from lit_marl.decoding import Decoder

        decoder = Decoder([agent.model for agent, _, _ in calls])
        device = decoder.embed.device
        shared = len({n for _, _, n in calls}) == 1
        n = calls[0][2] if shared else 1
        rows = [prompts if shared else [p for p in prompts for _ in range(k)] for _, prompts, k in calls]
        B, P = max(len(r) for r in rows), max(len(p) for r in rows for p in r)
        ids = torch.empty(len(calls), B, P, dtype=torch.long, device=device)
        mask = torch.zeros(len(calls), B, P, dtype=torch.long, device=device)
        active = torch.zeros(len(calls), B * n, dtype=torch.bool, device=device)
        for a, ((agent, _, _), prompts) in enumerate(zip(calls, rows)):
            ids[a], mask[a] = left_pad(prompts + [[]] * (B - len(prompts)), agent.pad_token_id, device, width=P)
            active[a, : len(prompts) * n] = True
        eos = torch.tensor([agent.eos_token_id for agent, _, _ in calls], device=device)
        pad = torch.tensor([agent.pad_token_id for agent, _, _ in calls], device=device)
        completion = decoder.generate(ids, mask, max_new_tokens, eos, pad, temperature, top_p, greedy, active, n)
        ids, mask = ids.repeat_interleave(n, 1), mask.repeat_interleave(n, 1)  # row i·n+k: prompt i
        out = []
        for a, ((agent, _, k), prompts) in enumerate(zip(calls, rows)):
            count, width = len(prompts) * n, max(len(p) for p in prompts)
            completion_mask = mask_through_first(completion[a, :count], agent.eos_token_id)
            length = max(1, int(completion_mask.sum(-1).max()))  # as generate: up to the last row's end
            out.append(
                Generation(
                    ids[a, :count, P - width :],
                    mask[a, :count, P - width :],
                    completion[a, :count, :length],
                    completion_mask[:, :length],
                    k,
                )
            )
        return out


ENGINES = ("auto", "torch", "hf", "vllm")


def make_engine(name: str = "auto", options: dict | None = None, field: str = "data.engine") -> Engine:
    """The engine called ``name``; ``options`` go to its constructor (vLLM's settings)."""
    options = dict(options or {})
    if name == "vllm":
        from lit_marl.vllm_engine import VLLMEngine

        return VLLMEngine(**options)
    if options:
        raise ValueError(f"{field}_options={options}: only the vllm engine takes options")
    if name == "hf":
        return HFEngine()
    if name in ("torch", "auto"):
        return TorchEngine(fallback=name == "auto")
    raise ValueError(f"{field}={name!r}: choose one of {', '.join(ENGINES)}")


def completion_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    num_completion: int,
    prompt_groups: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-probs ``[B, num_completion]`` of the last ``num_completion`` tokens of each row,
    conditioned exactly as in generation.

    Position ids come from the attention mask, as ``generate`` computes them for left-padded
    prompts, and the LM head runs only on positions that predict completion tokens.

    ``prompt_groups`` (one id per row; rows with the same id have the same prompt, e.g. the G
    samples of one tree node) runs each distinct prompt once and shares its KV cache among its
    rows, gradient included: the prompt is usually most of the sequence, so this cuts the training
    forward/backward by up to G times.
    """
    if prompt_groups is None:
        return completion_forward(model, input_ids, attention_mask, num_completion)[0]
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    prompt_len = input_ids.shape[1] - num_completion
    _, inverse = torch.unique(prompt_groups, return_inverse=True)
    first = torch.full((int(inverse.max()) + 1,), -1, dtype=torch.long, device=inverse.device)
    first.scatter_reduce_(0, inverse, torch.arange(len(inverse), device=inverse.device), "amin", include_self=False)
    prompts, prompt_mask = input_ids[first, :prompt_len], attention_mask[first, :prompt_len]
    if not torch.equal(prompts[inverse], input_ids[:, :prompt_len]):
        raise ValueError("prompt_groups: rows of one group must have the same prompt")
    prefix = model(
        input_ids=prompts,
        attention_mask=prompt_mask,
        position_ids=position_ids[first, :prompt_len],
        logits_to_keep=1,
        use_cache=True,
    )
    logits = prefix.logits[inverse]  # predicts the first completion token
    if num_completion > 1:
        cache = prefix.cache
        cache.batch_select_indices(inverse)
        rest = model(
            input_ids=input_ids[:, prompt_len:-1],
            attention_mask=attention_mask[:, :-1],
            position_ids=position_ids[:, prompt_len:-1],
            cache=cache,
            use_cache=True,
        ).logits
        logits = torch.cat([logits, rest], dim=1)
    targets = input_ids[:, -num_completion:]
    return -F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")


def completion_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    num_completion: int,
    entropy: bool = False,
    hidden: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One forward: the log-probs ``[B, num_completion]`` of the last ``num_completion`` tokens (as
    ``completion_logprobs``), with ``entropy`` the policy's entropy at those positions (same shape),
    with ``hidden`` the last layer's hidden states ``[B, L, H]`` (for a value head)."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=num_completion + 1,
        use_cache=False,
        output_hidden_states=hidden,
    )
    logits = out.logits[:, :-1].float()
    logprobs = -F.cross_entropy(logits.transpose(1, 2), input_ids[:, -num_completion:], reduction="none")
    entropies = None
    if entropy:
        log_p = F.log_softmax(logits, dim=-1)
        entropies = -(log_p.exp() * log_p).sum(-1)
    return logprobs, entropies, out.hidden_states[-1] if hidden else None


def sequence_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Log-prob of every token given the tokens before it, ``[B, L]`` (column 0, which has no
    context, is 0): what ``generate`` computed for the tokens it sampled, for whole left-padded
    multi-turn sequences."""
    logprobs = completion_logprobs(model, input_ids, attention_mask, input_ids.shape[1] - 1)
    return F.pad(logprobs, (1, 0))
