"""What every engine shares: the ``Sampling`` settings it reads, the ``Generation`` it returns
(token ids in, token ids out), the padding helpers, and the ``Engine`` interface the rollouts call."""

from __future__ import annotations

import hashlib
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from lit_marl import ConfigError
from lit_marl.agents import Agent
from lit_marl.fields import NonNegativeInt, PositiveFloat, PositiveInt, UnitIntervalLeftOpen, check_dataclass


@dataclass(frozen=True)
class Sampling:
    """How each reply is sampled (``data.sampling``): one group every engine reads whole, the lean
    decoder, transformers' ``generate``, vLLM and the HTTP writers alike. The logits are divided by
    ``temperature``, then ``top_k`` keeps the k most likely tokens, then ``top_p`` the smallest set
    whose probability reaches it (transformers' order of its warpers). Training rollouts sample;
    evaluation decodes the same settings greedily (``as_greedy``)."""

    max_new_tokens: PositiveInt = 64
    """Tokens a reply may take (the end token included)."""
    temperature: PositiveFloat = 1.0
    """Sampling temperature of training rollouts."""
    top_p: UnitIntervalLeftOpen = 1.0
    """Nucleus sampling: the smallest set of tokens whose probability reaches it (1: all)."""
    top_k: NonNegativeInt | None = None
    """Only the k most likely tokens are sampled (applied before ``top_p``); null or 0: off."""
    greedy: bool = False
    """Take the most likely token (``temperature``, ``top_p`` and ``top_k`` unused); evaluation always does."""

    def __post_init__(self):
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)):
            raise ConfigError(f"data.sampling.top_k={self.top_k!r}: must be a positive integer k (0 or null: off)")
        check_dataclass("data.sampling", self)

    def as_greedy(self) -> Sampling:
        """These settings decoded greedily (evaluation)."""
        return replace(self, greedy=True)


@dataclass
class Generation:
    """Row ``i * num_samples + k`` holds sample k of prompt i."""

    prompt_ids: torch.Tensor  # [B, P] left-padded
    prompt_mask: torch.Tensor  # [B, P]
    completion_ids: torch.Tensor  # [B, C] right-padded after the end token
    completion_mask: torch.Tensor  # [B, C] 1 on generated tokens up to and including the end token
    num_samples: int = 1  # rows per prompt
    # [B, C] the engine's log-prob of each sampled token under the raw model distribution (before
    # temperature, top-k and top-p, as the trainer's forward computes it), 0 after the end; None: not given
    logprobs: torch.Tensor | None = None
    # [B, C] the completion's real tokens (what attention sees) where they are not all trained: a tool
    # round's results sit between replies with completion_mask 0 (``rollout/tree_tools.py``); None: the mask
    completion_attention: torch.Tensor | None = None

    def rows(self, index: slice) -> "Generation":
        return Generation(
            self.prompt_ids[index],
            self.prompt_mask[index],
            self.completion_ids[index],
            self.completion_mask[index],
            self.num_samples,
            None if self.logprobs is None else self.logprobs[index],
            None if self.completion_attention is None else self.completion_attention[index],
        )

    @property
    def attention(self) -> torch.Tensor:
        """The completion's attention mask: its real tokens, trained or not."""
        return self.completion_mask if self.completion_attention is None else self.completion_attention

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


GenerationCall = tuple[Agent, list[list[int]], int]
"""One agent's share of a turn: ``(agent, prompts, num_samples)``."""


class Engine(Protocol):
    """What the rollouts call, every call with its ``Sampling``. ``generate``: one batched generation
    for one agent's prompts (row ``i * num_samples + k`` of the result is sample k of prompt i).
    ``generate_team``: a turn's calls for every model of the team at once (one ``Generation`` per call, in order), so an
    engine may decode the agents together; ``generate_each`` is the plain loop. Its ``seeds`` (per
    call, one int per prompt; ``data.sampling_streams: per_task``) give every sample its own random
    stream: the lean decoder takes them, the others refuse them. The engines sample alike, as
    ``Sampling`` says (an HTTP endpoint gets its fields in its request)."""

    name: str
    own_weights: bool  # the engine serves its own copy of the weights (vLLM), synced from the trainer's
    remote: bool  # it generates off the trainer's devices (vLLM servers): a rollout may overlap the update

    def rollout(self, agents: list[Agent]) -> AbstractContextManager:
        """The block of one rollout by ``agents`` (every rank enters it for every batch): vLLM syncs
        every model first, in order, and sleeps after it (``enable_sleep_mode``); nothing for the others."""

    def check_team(self, agents: list[Agent], device_type: str) -> None:
        """Checks before step 1 (once, the team built and on its device); raises ConfigError. vLLM's:
        the settings its instances would be refused only when they start, at the first rollout;
        nothing for engines that serve no copy of their own (``TrainerWeights``)."""

    def close(self) -> None:
        """Stop what the engine started (the vllm_server engine's servers; nothing for the others)."""

    def generate(self, agent: Agent, prompts: list[list[int]], num_samples: int, sampling: Sampling) -> Generation: ...

    def generate_team(
        self, calls: list[GenerationCall], sampling: Sampling, seeds: list[list[int]] | None = None
    ) -> list[Generation]: ...


class TrainerWeights:
    """For engines that generate with the trainer's own weights: no copy to sync, nothing to free."""

    own_weights = False
    remote = False
    kept_kv_bytes = 0  # the KV cache kept between calls of a rollout (the lean engine's budget)

    def rollout(self, agents: list[Agent]) -> AbstractContextManager:
        return nullcontext()

    def check_team(self, agents: list[Agent], device_type: str) -> None:
        return None

    def close(self) -> None:
        return None


def generate_each(engine, calls: list[GenerationCall], sampling: Sampling) -> list[Generation]:
    """``generate_team`` as one ``generate`` per call."""
    return [engine.generate(agent, prompts, n, sampling) for agent, prompts, n in calls]


# ---------------------------------------------------------------------- per-task sampling streams
# With ``data.sampling_streams: per_task`` a response's random numbers depend only on its seed (the
# run's seed, the step, the task, its tree node, role and sample index), not on which other prompts
# share its batch or rank: the same task samples the same responses on 1 rank or 2 (up to float
# differences in the logits between batch shapes). The uniforms come from a counter-based hash, so
# nothing is drawn from torch's generators.
_MASK32 = 0xFFFFFFFF


def prefill_counts(engine) -> tuple[int, int]:
    """The prompt tokens an engine has taken from its kept KV cache and computed so far (``(0, 0)`` for
    engines that do not count)."""
    return tuple(getattr(engine, "prefill", (0, 0)))


def prefill_stats(engine, before: tuple[int, int]) -> dict[str, float]:
    """A rollout's prompt tokens computed, and the share taken from the kept cache, as stats (``before``:
    the engine's ``prefill_counts`` when it started)."""
    now = prefill_counts(engine)
    reused, computed = now[0] - before[0], now[1] - before[1]
    return {
        "perf/prompt_tokens_computed": float(computed),
        "perf/prompt_reused_frac": reused / max(reused + computed, 1),
    }


def stream_seed(*parts) -> int:
    """A 32-bit seed from any printable parts (stable across processes, unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=4).digest(), "little")


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash on int64 tensors (multipliers below 2^31 keep every product in range)."""
    x = x & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def sample_seeds(prompt_seeds: torch.Tensor, num_samples: int) -> torch.Tensor:
    """``[B * n]`` seeds of the n samples of each of ``[B]`` prompts (row i * n + k: sample k of prompt i)."""
    k = torch.arange(num_samples, device=prompt_seeds.device).repeat(len(prompt_seeds))
    return _mix32(_mix32(prompt_seeds.repeat_interleave(num_samples)) ^ (k * 0x2545F491))


def counter_uniforms(seeds: torch.Tensor, step: int) -> torch.Tensor:
    """``[rows]`` uniforms in (0, 1) for decoding step ``step`` of rows with ``seeds`` (24 bits each)."""
    h = _mix32(_mix32(seeds) ^ ((step * 0x27D4EB2D) & _MASK32))
    return ((h & 0xFFFFFF).double() + 0.5) / 2**24
