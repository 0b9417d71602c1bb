"""The training forwards: log-probs of the tokens a policy produced, conditioned exactly as in
generation (position ids from the attention mask, as ``generate`` computes them for left-padded
prompts), with entropies or hidden states for a value head when asked. Every log-prob a loss
differentiates is computed here; an engine's own log-probs only measure and (optionally) correct
the mismatch between its sampling and this forward (``losses.truncated_is_weights``). Each takes
a ``temperature`` that divides the logits first (``model.update.tempered_logprobs``: veRL's, TRL's
and OpenRLHF's scoring under the sampling distribution); 1: the untempered policy."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lit_marl.losses import nll
from lit_marl.models import recomputes_activations


def completion_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    num_completion: int,
    prompt_groups: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-probs ``[B, num_completion]`` of the last ``num_completion`` tokens of each row,
    conditioned exactly as in generation (``completion_logits``)."""
    logits = completion_logits(model, input_ids, attention_mask, num_completion, prompt_groups)
    return token_logprobs(logits, input_ids[:, -num_completion:], temperature)


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The logits divided by ``temperature`` (as they are at 1)."""
    return logits if temperature == 1.0 else logits / temperature


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``[B, C]``: the log-prob of each target token under its position's logits ``[B, C, V]``."""
    return -F.cross_entropy(tempered(logits, temperature).transpose(1, 2), targets, reduction="none")


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``[B, C]``: the entropy of each position's next-token distribution (nats)."""
    log_p = F.log_softmax(tempered(logits, temperature), dim=-1)
    return -(log_p.exp() * log_p).sum(-1)


def completion_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    num_completion: int,
    prompt_groups: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fp32 logits ``[B, num_completion, V]`` that predict the last ``num_completion`` tokens of
    each row, conditioned exactly as in generation.

    Position ids come from the attention mask, as ``generate`` computes them for left-padded
    prompts, and the LM head runs only on positions that predict completion tokens.

    ``prompt_groups`` (one id per row; rows with the same id have the same prompt, e.g. the G
    samples of one tree node) runs each distinct prompt once and shares its KV cache among its
    rows, gradient included: the prompt is usually most of the sequence, so this cuts the training
    forward/backward by up to G times. Under activation checkpointing (``recomputes_activations``)
    every row runs in full instead: a checkpointed layer drops the cache the rows would share.
    """
    if prompt_groups is None or recomputes_activations(model):
        return _completion_pass(model, input_ids, attention_mask, num_completion)[0]
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
    return logits.float()


def completion_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    num_completion: int,
    entropy: bool = False,
    hidden: bool = False,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One forward: the log-probs ``[B, num_completion]`` of the last ``num_completion`` tokens (as
    ``completion_logprobs``), with ``entropy`` the policy's entropy at those positions (same shape),
    with ``hidden`` the last layer's hidden states ``[B, L, H]`` (for a value head)."""
    logits, states = _completion_pass(model, input_ids, attention_mask, num_completion, hidden)
    logprobs = token_logprobs(logits, input_ids[:, -num_completion:], temperature)
    return logprobs, token_entropy(logits, temperature) if entropy else None, states


def _completion_pass(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, num_completion: int, hidden=False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One plain forward: the fp32 logits that predict the last ``num_completion`` tokens, and with
    ``hidden`` the last layer's hidden states ``[B, L, H]``."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=num_completion + 1,
        use_cache=False,
        output_hidden_states=hidden,
    )
    return out.logits[:, :-1].float(), out.hidden_states[-1] if hidden else None


def final_hidden_states(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The last layer's hidden states ``[B, L, H]`` of left-padded rows, positioned as in generation,
    for a value or reward head: of a causal LM (its LM head runs on one position only) or of a bare
    decoder without a head (a critic's backbone, ``critics.load_critic_backbone``)."""
    head = hasattr(model, "lm_head")
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0),
        use_cache=False,
        **(dict(output_hidden_states=True, logits_to_keep=1) if head else {}),
    )
    return out.hidden_states[-1] if head else out.last_hidden_state


def sequence_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Log-prob of every token given the tokens before it, ``[B, L]`` (column 0, which has no
    context, is 0): what ``generate`` computed for the tokens it sampled, for whole left-padded
    multi-turn sequences."""
    logprobs = completion_logprobs(model, input_ids, attention_mask, input_ids.shape[1] - 1)
    return F.pad(logprobs, (1, 0))


def masked_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    mask: torch.Tensor,
    hidden: bool = False,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[B, L]`` of the tokens where ``mask`` is set, each given the tokens before it
    (0 elsewhere, and in column 0, which has no context), equal to ``sequence_logprobs`` there;
    with ``hidden`` also the last layer's hidden states ``[B, L, H]`` (for a value head).

    The LM head runs only on the positions that predict a masked token: in a multi-turn episode
    an agent's own replies are a small part of a sequence of observations, and full-vocabulary
    logits over every position were most of a training pass's memory (SmolLM2, 4096 tokens:
    ~800 MB per row in fp32, before the backward's copies)."""
    keep = mask.bool().clone()
    keep[:, 0] = False
    predict = F.pad(keep[:, 1:], (0, 1))  # position t-1 predicts token t
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=predict,
        use_cache=False,
        output_hidden_states=hidden,
    )
    logits = out.logits
    if logits.dim() == 3:  # a model that ignores a boolean logits_to_keep returns every position
        logits = logits[predict]
    picked = -F.cross_entropy(tempered(logits.float(), temperature), input_ids[keep], reduction="none")
    logprobs = torch.zeros(input_ids.shape, dtype=picked.dtype, device=picked.device).masked_scatter(keep, picked)
    return logprobs, out.hidden_states[-1] if hidden else None


def sft_loss(model: torch.nn.Module, samples) -> torch.Tensor:
    """The negative log-likelihood of a demonstration's target tokens (``samples.loss_mask``: the
    assistant's), summed; the LM head runs only where a target token is predicted."""
    return nll(
        masked_logprobs(model, samples.input_ids, samples.attention_mask, samples.loss_mask)[0], samples.loss_mask
    )
