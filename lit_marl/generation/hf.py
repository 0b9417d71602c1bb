"""transformers' ``generate`` behind the engine interface: any causal LM."""

from __future__ import annotations

import torch
from transformers import GenerationConfig

from lit_marl.agents import Agent
from lit_marl.generation.base import Generation, Sampling, TrainerWeights, generate_each, left_pad, mask_through_first


@torch.no_grad()
def generate(agent: Agent, prompts: list[list[int]], num_samples: int, sampling: Sampling) -> Generation:
    model = agent.model
    device = next(model.parameters()).device
    repeated = [p for p in prompts for _ in range(num_samples)]
    prompt_ids, prompt_mask = left_pad(repeated, agent.pad_token_id, device)
    greedy = sampling.greedy
    config = GenerationConfig(
        max_new_tokens=sampling.max_new_tokens,
        do_sample=not greedy,
        temperature=None if greedy else sampling.temperature,
        top_p=None if greedy else sampling.top_p,
        top_k=0 if greedy else sampling.top_k or 0,  # 0: off (None would mean transformers' default of 50)
        eos_token_id=agent.eos_token_id,
        pad_token_id=agent.pad_token_id,
        output_logits=True,  # the raw logits, before temperature, top-k and top-p: the samples' log-probs
        return_dict_in_generate=True,
    )
    was_training = model.training
    model.eval()
    try:
        out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config)
    finally:
        model.train(was_training)
    completion_ids = out.sequences[:, prompt_ids.shape[1] :]
    completion_mask = mask_through_first(completion_ids, agent.eos_token_id)
    logits = torch.stack(out.logits, dim=1).float()
    logprobs = logits.log_softmax(-1).gather(2, completion_ids[..., None]).squeeze(2)
    return Generation(prompt_ids, prompt_mask, completion_ids, completion_mask, num_samples, logprobs * completion_mask)


class HFEngine(TrainerWeights):
    """transformers' ``generate``: any causal LM."""

    name = "hf"

    def generate(self, agent, prompts, num_samples, sampling):
        return generate(agent, prompts, num_samples, sampling)

    def generate_team(self, calls, sampling, seeds=None):
        if seeds is not None:
            raise ValueError(f"data.sampling_streams=per_task needs the lean decoder, not the {self.name} engine")
        return generate_each(self, calls, sampling)
