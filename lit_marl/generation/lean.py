"""The lean engine: ``generation/decoder.py``'s KV-cache decoder behind the engine interface."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from lit_marl.generation.base import (
    Generation,
    Sampling,
    TrainerWeights,
    generate_each,
    left_pad,
    mask_through_first,
    sample_seeds,
)
from lit_marl.generation.decoder import Decoder, _causal_lm, stackable, unsupported
from lit_marl.generation.hf import generate
from lit_marl.generation.kept import Kept, KeptCache
from lit_marl.generation.weights import weight_version


class TorchEngine(TrainerWeights):
    """The lean KV-cache decoder of ``generation/decoder.py`` (Llama-family models). A team's small
    same-shape models decode together, one stacked forward per token. With ``fallback`` a model
    it cannot decode goes to ``generate`` (the ``auto`` engine); without, such a model is refused
    with the reason."""

    def __init__(self, fallback: bool = False, kept_kv_gib: float = 4.0):
        if not isinstance(kept_kv_gib, (int, float)) or kept_kv_gib < 0:
            raise ValueError(f"data.engine_options.kept_kv_gib={kept_kv_gib!r}: a number of GiB >= 0 (0: keep nothing)")
        self.fallback = fallback
        self.name = "auto" if fallback else "torch"
        self.kept_kv_bytes = int(kept_kv_gib * 2**30)
        self.kept: KeptCache | None = None  # the KV cache kept between calls, inside a rollout block
        self.prefill = [0, 0]  # prompt tokens taken from the kept cache, computed

    def generate(self, agent, prompts, num_samples, sampling):
        if self.fallback and unsupported(agent.model) is not None:
            return generate(agent, prompts, num_samples, sampling)
        return self._decode([(agent, prompts, num_samples)], sampling)[0]

    def generate_team(self, calls, sampling, seeds=None):
        """``seeds``: per call, one int seed per prompt (per-task sampling streams); None: torch's generator."""
        if len(calls) > 1 and stackable([agent.model for agent, _, _ in calls]):
            return self._decode(calls, sampling, seeds)
        if seeds is None:
            return generate_each(self, calls, sampling)
        for agent, _, _ in calls:
            reason = unsupported(agent.model)
            if reason is not None:
                raise ValueError(
                    f"data.sampling_streams=per_task samples with the lean decoder, which cannot decode "
                    f"{agent.source}: {reason}; use data.sampling_streams: shared"
                )
        return [self._decode([c], sampling, [s])[0] for c, s in zip(calls, seeds)]

    @contextmanager
    def rollout(self, agents):
        """The block of one rollout: the KV cache of each call's sequences is kept for the next call
        (``generation/kept.py``) and freed when the block ends. Outside a block nothing is kept."""
        if self.kept is not None or not self.kept_kv_bytes:  # nested, or keeping is off
            yield
            return
        self.kept = KeptCache(self.kept_kv_bytes)
        try:
            yield
        finally:
            self.kept = None

    @torch.no_grad()
    def _decode(self, calls, sampling: Sampling, seeds=None) -> list[Generation]:
        """The calls' models stacked in one ``Decoder`` (the weights as they are now, LoRA merged):
        every call's rows padded to the same count and prompt width, filler rows inactive. When the
        calls sample the same number n per prompt, each prompt runs once for its n samples; in a
        rollout block each prompt's longest kept prefix is copied and only the rest is fed."""
        decoder = Decoder([agent.model for agent, _, _ in calls])
        device = decoder.embed.device
        shared = len({n for _, _, n in calls}) == 1
        n = calls[0][2] if shared else 1
        rows = [prompts if shared else [p for p in prompts for _ in range(k)] for _, prompts, k in calls]
        B = max(len(r) for r in rows)
        keys = [self._key(agent, decoder) for agent, _, _ in calls] if self.kept is not None else None
        past = [] if keys is None else [m for key, r in zip(keys, rows) for m in self._take(key, r, B)]
        prefixes = [n for _, n in past] or [0] * (len(calls) * B)  # per prompt row, its kept prefix's length
        fed = [[p[prefixes[a * B + i] :] for i, p in enumerate(r)] for a, r in enumerate(rows)]
        reused = sum(prefixes)
        self.prefill[0] += reused
        self.prefill[1] += sum(len(p) for r in rows for p in r) - reused
        width = max(len(p) for r in fed for p in r)
        ids = torch.empty(len(calls), B, width, dtype=torch.long, device=device)
        mask = torch.zeros(len(calls), B, width, dtype=torch.long, device=device)
        active = torch.zeros(len(calls), B * n, dtype=torch.bool, device=device)
        row_seeds = torch.zeros(len(calls), B * n, dtype=torch.long, device=device) if seeds is not None else None
        for a, ((agent, _, k), prompts) in enumerate(zip(calls, fed)):
            ids[a], mask[a] = left_pad(prompts + [[]] * (B - len(prompts)), agent.pad_token_id, device, width=width)
            active[a, : len(prompts) * n] = True
            if seeds is not None:  # sample j of prompt i: the same seed whether or not n is shared
                row_seeds[a, : len(prompts) * n] = sample_seeds(torch.tensor(seeds[a], dtype=torch.long), k)
        eos = torch.tensor([agent.eos_token_id for agent, _, _ in calls], device=device)
        pad = torch.tensor([agent.pad_token_id for agent, _, _ in calls], device=device)
        completion, logprobs = decoder.generate(
            ids, mask, eos, pad, sampling, active, n, row_seeds, past or None, keys is not None
        )
        out = []
        for a, ((agent, _, k), prompts) in enumerate(zip(calls, rows)):
            count = len(prompts) * n
            completion_mask = mask_through_first(completion[a, :count], agent.eos_token_id)
            length = max(1, int(completion_mask.sum(-1).max()))  # as generate: up to the last row's end
            prompt_ids, prompt_mask = left_pad([p for p in prompts for _ in range(n)], agent.pad_token_id, device)
            out.append(
                Generation(
                    prompt_ids,
                    prompt_mask,
                    completion[a, :count, :length],
                    completion_mask[:, :length],
                    k,
                    logprobs[a, :count, :length] * completion_mask[:, :length],
                )
            )
        if keys is not None:
            for a, (key, prompts, generation) in enumerate(zip(keys, rows, out)):
                self._put(decoder, key, a, B, n, prompts, prefixes[a * B : a * B + len(prompts)], generation)
        return out

    def _key(self, agent, decoder: Decoder) -> tuple[tuple, tuple]:
        """A model's key in the kept cache and the version of its weights (any change: nothing reused)."""
        return (id(agent.model), decoder.embed.dtype), weight_version(_causal_lm(agent.model))

    def _take(self, key, prompts: list[list[int]], B: int) -> list[tuple]:
        """The kept prefix of each of a call's prompts, ``(None, 0)`` for its filler rows up to ``B``."""
        return self.kept.take(*key, prompts) + [(None, 0)] * (B - len(prompts))

    def _put(self, decoder: Decoder, key, a: int, B: int, n: int, prompts, prefixes, generation: Generation) -> None:
        """Keep each result row's sequence (its prompt and the reply tokens whose keys were computed), in
        place in the call's cache."""
        lengths = generation.completion_mask.sum(-1).tolist()
        entries = []
        for row, length in enumerate(lengths):
            i = row // n
            prompt, prefix = prompts[i], prefixes[i]
            k, v, r, slots = decoder.kept(a * B * n + row, prefix, len(prompt) - prefix, length)
            reply = generation.completion_ids[row, : sum(end - start for start, end in slots) - len(prompt)]
            entries.append(Kept(prompt + reply.tolist(), k, v, r, slots))
        self.kept.put(*key, entries)
