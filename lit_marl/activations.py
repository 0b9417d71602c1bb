"""The activations of one training pass, measured, not guessed (the memory plan's, ``lit_marl.memory``).

``activation_profile`` runs one forward of a 1- and a 2-layer copy of each trainable model's
architecture (same widths, LoRA adapters and autocast dtype, a 256-token vocabulary) and counts the
tensors autograd saves for the backward; the difference is one layer's bytes per token, the rest
the embedding and norms. The LM head's logits are analytic (fp32: the logits, their log-softmax,
and its gradient: 12 bytes per scored position and vocabulary entry). A pass of
``memory.forward_token_budget`` tokens (or of one longer episode: ``update_pass_bytes``) then needs
``tokens x (layers x per_layer + other)`` plus the scored positions' logits; with activation
checkpointing, only each layer's input (the residual stream) and one layer's recompute at a time.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from lit_marl.models import causal_lm, store_frozen, trained
from lit_marl.parallel.fsdp import shardable_models

LOGIT_BYTES = 12  # per scored position and vocabulary entry: fp32 logits, log-softmax, its gradient
PROFILE_TOKENS = 64
PROFILE_VOCAB = 256


@dataclass(frozen=True)
class ActivationProfile:
    """Bytes autograd keeps for a training pass: per token and per decoder layer, per token for the
    rest (embedding, final norm), per layer whatever the tokens (autocast's bf16 copies of the
    weights), a constant, and per token and layer under checkpointing (the layer's input only)."""

    per_layer_token: float
    other_token: float
    per_layer: float
    other: float
    layer_input: float
    layers: int
    vocab: int

    def pass_bytes(self, tokens: int, scored: int, checkpointing: bool) -> float:
        if checkpointing:  # every layer's input, one layer recomputed at a time
            kept = tokens * (self.layers * self.layer_input + self.per_layer_token) + self.per_layer
        else:
            kept = self.layers * (tokens * self.per_layer_token + self.per_layer)
        return kept + tokens * self.other_token + self.other + scored * self.vocab * LOGIT_BYTES


def _saved_bytes(model: nn.Module, autocast: torch.dtype | None, tokens: int) -> int:
    """Bytes of the tensors autograd saves in one forward of ``tokens`` tokens (parameters excluded)."""
    sizes: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        sizes[storage.data_ptr()] = max(sizes.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    ids = torch.randint(0, PROFILE_VOCAB, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            model(input_ids=ids, logits_to_keep=1)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(size for ptr, size in sizes.items() if ptr not in weights)


_PROFILES: dict[tuple, ActivationProfile] = {}  # one measurement per architecture, adapters and dtypes


def activation_profile(model: nn.Module, autocast: torch.dtype | None = None) -> ActivationProfile:
    """Measure ``model``'s activation bytes per token on small CPU copies of its architecture."""
    lm = causal_lm(model)
    config = lm.config
    peft = getattr(model, "peft_config", None)
    frozen = sorted({str(p.dtype) for p in model.parameters() if not p.requires_grad})
    key = (config.to_json_string(), repr(peft), autocast, tuple(frozen))
    if key not in _PROFILES:
        _PROFILES[key] = _measure(model, lm, config, peft, autocast)
    return _PROFILES[key]


def _measure(model: nn.Module, lm: nn.Module, config, peft, autocast: torch.dtype | None) -> ActivationProfile:
    from transformers import AutoModelForCausalLM

    counts = {}
    for layers in (1, 2):
        small = copy.deepcopy(config)
        small.num_hidden_layers, small.vocab_size = layers, PROFILE_VOCAB
        if getattr(small, "layer_types", None) is not None:
            small.layer_types = small.layer_types[:layers]
        with torch.random.fork_rng(devices=[]):  # sdpa: the run's kernel may not run on a CPU (flash)
            copy_ = AutoModelForCausalLM.from_config(small, dtype=torch.float32, attn_implementation="sdpa")
            copy_ = copy_.eval()
            if peft:
                from peft import get_peft_model

                copy_ = get_peft_model(copy_, copy.deepcopy(next(iter(peft.values())))).eval()
        _match_dtypes(copy_, model)
        for tokens in (PROFILE_TOKENS // 2, PROFILE_TOKENS):
            counts[layers, tokens] = _saved_bytes(copy_, autocast, tokens)
    t1, t2 = PROFILE_TOKENS // 2, PROFILE_TOKENS
    layer_at = {t: counts[2, t] - counts[1, t] for t in (t1, t2)}
    per_layer_token = (layer_at[t2] - layer_at[t1]) / (t2 - t1)
    per_layer = layer_at[t2] - t2 * per_layer_token
    other_token = (counts[1, t2] - counts[1, t1]) / (t2 - t1) - per_layer_token
    embed = lm.get_input_embeddings().weight
    return ActivationProfile(
        per_layer_token=per_layer_token,
        other_token=other_token,
        per_layer=per_layer,
        other=counts[1, t2] - t2 * (per_layer_token + other_token) - per_layer,
        layer_input=config.hidden_size * embed.element_size(),  # the residual stream, as embedded
        layers=config.num_hidden_layers,
        vocab=config.vocab_size,
    )


def _match_dtypes(small: nn.Module, model: nn.Module) -> None:
    """The small copy stores its frozen weights as ``model`` does (``model.memory.weights_dtype``)."""
    if any(p.dtype == torch.bfloat16 for p in model.parameters() if not p.requires_grad):
        store_frozen(small, "bfloat16")


def update_pass_bytes(module, dtype: torch.dtype | None, notes: list[str], rollout=None) -> float:
    """One update pass (the memory plan's): the largest policy pass plus every other trained model's
    (critic backbones, reward models: no logits; an actor-critic update runs policy and critic in one
    graph). A pass holds ``memory.forward_token_budget`` tokens or one longer row (an episode of up to
    ``max_context_tokens``); the LM head scores every position, or in an episode update (demonstrations
    aside) the agent's own tokens only: ``max_turns x sampling.max_new_tokens`` a row,
    ``memory.forward_batch_size`` rows."""
    tokens = module.memory.forward_token_budget
    if tokens is None:
        notes.append("model.memory.forward_token_budget is null: a pass's activations are unbounded, not counted")
        return 0.0
    episode, rows = rollout.episode if rollout is not None else None, module.memory.forward_batch_size
    tokens = max(tokens, episode.max_context_tokens) if episode is not None else tokens
    scored, what = tokens, "every position scored (an upper bound on the logits)"
    if episode is not None and not rollout.demos and rows is not None:
        scored = min(tokens, rows * episode.max_turns * episode.sampling.max_new_tokens)
        what = f"at most {scored} scored (the agent's own tokens)"
    policies = {id(agent.model) for agent in module.agents or []}
    checkpointing = module.memory.activation_checkpointing
    policy, others = [0.0], 0.0
    for model in shardable_models(module):
        if not any(trained(n, p) for n, p in model.named_parameters()):
            continue
        is_policy = id(model) in policies or any(id(m) in policies for m in model.modules())
        size = activation_profile(model, dtype).pass_bytes(tokens, scored if is_policy else 0, checkpointing)
        if is_policy:
            policy.append(size)
        else:
            others += size
    notes.append(f"a pass of {tokens} tokens, {what}")
    return max(policy) + others
