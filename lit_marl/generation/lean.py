"""The lean engine: ``generation/decoder.py``'s KV-cache decoder behind the engine interface."""

from __future__ import annotations

import torch

from lit_marl.generation.base import (
    Generation,
    TrainerWeights,
    generate_each,
    left_pad,
    mask_through_first,
    sample_seeds,
)
from lit_marl.generation.decoder import Decoder, stackable, unsupported
from lit_marl.generation.hf import generate


class TorchEngine(TrainerWeights):
    """The lean KV-cache decoder of ``generation/decoder.py`` (Llama-family models). A team's small
    same-shape models decode together, one stacked forward per token. With ``fallback`` a model
    it cannot decode goes to ``generate`` (the ``auto`` engine); without, such a model is refused
    with the reason."""

    def __init__(self, fallback: bool = False):
        self.fallback = fallback
        self.name = "auto" if fallback else "torch"

    def generate(
        self, agent, prompts, num_samples, max_new_tokens, temperature=1.0, top_p=1.0, top_k=None, greedy=False
    ):
        sampling = (temperature, top_p, top_k, greedy)
        if self.fallback and unsupported(agent.model) is not None:
            return generate(agent, prompts, num_samples, max_new_tokens, *sampling)
        return self._decode([(agent, prompts, num_samples)], max_new_tokens, sampling)[0]

    def generate_team(self, calls, max_new_tokens, temperature=1.0, top_p=1.0, top_k=None, greedy=False, seeds=None):
        """``seeds``: per call, one int seed per prompt (per-task sampling streams); None: torch's generator."""
        sampling = (temperature, top_p, top_k, greedy)
        if len(calls) > 1 and stackable([agent.model for agent, _, _ in calls]):
            return self._decode(calls, max_new_tokens, sampling, seeds)
        if seeds is None:
            return generate_each(self, calls, max_new_tokens, *sampling)
        for agent, _, _ in calls:
            reason = unsupported(agent.model)
            if reason is not None:
                raise ValueError(
                    f"data.sampling_streams=per_task samples with the lean decoder, which cannot decode "
                    f"{agent.source}: {reason}; use data.sampling_streams: shared"
                )
        return [self._decode([c], max_new_tokens, sampling, [s])[0] for c, s in zip(calls, seeds)]

    @torch.no_grad()
    def _decode(self, calls, max_new_tokens, sampling, seeds=None) -> list[Generation]:
        """The calls' models stacked in one ``Decoder`` (the weights as they are now, LoRA merged):
        every call's rows padded to the same count and prompt width, filler rows inactive. When the
        calls sample the same number n per prompt, each prompt runs once for its n samples.
        ``sampling``: ``(temperature, top_p, top_k, greedy)``."""
        decoder = Decoder([agent.model for agent, _, _ in calls])
        device = decoder.embed.device
        shared = len({n for _, _, n in calls}) == 1
        n = calls[0][2] if shared else 1
        rows = [prompts if shared else [p for p in prompts for _ in range(k)] for _, prompts, k in calls]
        B, P = max(len(r) for r in rows), max(len(p) for r in rows for p in r)
        ids = torch.empty(len(calls), B, P, dtype=torch.long, device=device)
        mask = torch.zeros(len(calls), B, P, dtype=torch.long, device=device)
        active = torch.zeros(len(calls), B * n, dtype=torch.bool, device=device)
        row_seeds = torch.zeros(len(calls), B * n, dtype=torch.long, device=device) if seeds is not None else None
        for a, ((agent, _, k), prompts) in enumerate(zip(calls, rows)):
            ids[a], mask[a] = left_pad(prompts + [[]] * (B - len(prompts)), agent.pad_token_id, device, width=P)
            active[a, : len(prompts) * n] = True
            if seeds is not None:  # sample j of prompt i: the same seed whether or not n is shared
                row_seeds[a, : len(prompts) * n] = sample_seeds(torch.tensor(seeds[a], dtype=torch.long), k)
        eos = torch.tensor([agent.eos_token_id for agent, _, _ in calls], device=device)
        pad = torch.tensor([agent.pad_token_id for agent, _, _ in calls], device=device)
        completion, logprobs = decoder.generate(ids, mask, max_new_tokens, eos, pad, *sampling, active, n, row_seeds)
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
                    logprobs[a, :count, :length] * completion_mask[:, :length],
                )
            )
        return out
