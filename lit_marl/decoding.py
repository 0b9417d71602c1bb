"""A lean KV-cache decoder for Llama-family causal LMs (Llama, Qwen2): the ``torch`` engine.

On a small model, HF ``generate`` spends most of a token's time in per-token Python (model,
cache, mask and logits-processor objects), not in arithmetic. This decoder runs the same network
as a short list of tensor ops over a preallocated cache:

- it reads the model's own parameters at each call (no copy, so it never goes stale after an
  optimizer step); peft LoRA adapters that are active are merged into the weight they adapt for
  the call (``W + get_delta_weight``), the rest of the model is used as it is;
- positions, masks, RoPE and sampling follow ``generate`` for left-padded prompts: position ids
  from the attention mask, temperature then top-p, ``multinomial`` on the softmax, greedy =
  argmax, finished rows padded after their end token, stop when every row has ended.

``unsupported(model)`` says why a model cannot use it (another architecture, DoRA adapters,
sliding-window attention, dynamic RoPE, sharded parameters); the engine then refuses by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


def _causal_lm(model: nn.Module) -> nn.Module:
    """The ``*ForCausalLM`` under an agent's model (``AdapterView`` and peft wrappers removed)."""
    if hasattr(model, "activate"):  # AdapterView: make this agent's adapter the active one
        model = model.activate()
    if hasattr(model, "get_base_model"):  # peft
        model = model.get_base_model()
    return model


def unsupported(model: nn.Module) -> str | None:
    """Why ``model`` cannot be decoded here, or None."""
    lm = _causal_lm(model)
    config = getattr(lm, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
    if getattr(config, "use_sliding_window", False):
        return "sliding-window attention"
    rotary = getattr(lm.model, "rotary_emb", None)
    if rotary is None or getattr(rotary, "rope_type", "default") not in ("default", "linear", "llama3", "yarn"):
        return f"RoPE type {getattr(rotary, 'rope_type', None)!r} (dynamic RoPE recomputes per length)"
    for module in lm.modules():
        if getattr(module, "use_dora", {}) and any(module.use_dora.values()):
            return "DoRA adapters"
    for p in lm.parameters():
        if type(p.data).__name__ == "DTensor":
            return "sharded (DTensor) parameters: generate inside TeamShards.gathered()"
    return None


def _linear(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight and bias a (possibly LoRA-adapted) linear layer applies now."""
    base = getattr(module, "base_layer", None)
    if base is None:
        return module.weight, module.bias
    weight = base.weight
    if not module.disable_adapters and not module.merged:
        for name in module.active_adapters:
            if name in module.lora_A:
                weight = weight + module.get_delta_weight(name)
    return weight, base.bias


def _fused(parts: list[tuple[torch.Tensor, torch.Tensor | None]], fuse: bool) -> list[tuple]:
    """Linear layers that read the same input: one concatenated layer when ``fuse`` (one matmul
    instead of several: per-op overhead is what a small model's decoding costs), else as they are."""
    if not fuse or len(parts) == 1:
        return parts
    weight = torch.cat([w for w, _ in parts])
    if all(b is None for _, b in parts):
        return [(weight, None)]
    biases = [b if b is not None else w.new_zeros(w.shape[0]) for w, b in parts]
    return [(weight, torch.cat(biases))]


def _apply(x: torch.Tensor, parts: list[tuple]) -> torch.Tensor:
    if len(parts) == 1:
        return F.linear(x, *parts[0])
    return torch.cat([F.linear(x, *part) for part in parts], dim=-1)


@dataclass
class _Layer:
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    qkv: list  # q, k and v projections (fused or not)
    o: tuple
    gate_up: list  # gate and up projections (fused or not)
    down: tuple


FUSE_BELOW_PARAMETERS = 50_000_000
"""Models smaller than this get their q/k/v and gate/up weights concatenated for the call (a
transient copy of about half the weights): below it a token's time is per-op overhead; above it
decoding is compute-bound and the copy would buy nothing."""


class Decoder:
    """Sampling from one Llama-family model with a static KV cache. Build one per call: it takes
    the model's weights as they are now."""

    def __init__(self, model: nn.Module):
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(f"the torch engine cannot decode this model: {reason}; use engine: hf")
        lm = _causal_lm(model)
        config, body = lm.config, lm.model
        self.eps = body.norm.variance_epsilon
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        first = body.layers[0].self_attn
        self.scaling = first.scaling
        self.act = body.layers[0].mlp.act_fn
        self.inv_freq = body.rotary_emb.inv_freq
        self.rope_scale = body.rotary_emb.attention_scaling
        self.embed = body.embed_tokens.weight
        self.norm = body.norm.weight
        self.lm_head = _linear(lm.lm_head)
        fuse = sum(p.numel() for p in lm.parameters()) < FUSE_BELOW_PARAMETERS
        self.layers = []
        for layer in body.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                _Layer(
                    layer.input_layernorm.weight,
                    layer.post_attention_layernorm.weight,
                    _fused([_linear(attn.q_proj), _linear(attn.k_proj), _linear(attn.v_proj)], fuse),
                    _linear(attn.o_proj),
                    _fused([_linear(mlp.gate_proj), _linear(mlp.up_proj)], fuse),
                    _linear(mlp.down_proj),
                )
            )

    def _rope(self, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(length, device=self.inv_freq.device, dtype=torch.float)
        freqs = positions[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.rope_scale).to(dtype), (emb.sin() * self.rope_scale).to(dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """As the models' RMSNorm: in float32, the weight applied in the input's dtype."""
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * y.to(x.dtype)

    def _forward(self, ids, cos, sin, cache_k, cache_v, start, bias) -> torch.Tensor:
        """Run ``ids`` [B, L] at cache slots ``start:start+L``; returns the last position's hidden
        state. ``bias`` [B, 1, 1, L, start+L] is 0 where a query sees a cache slot, -inf elsewhere.
        Either the prompt (``start == 0``) or one new token (``L == 1``)."""
        B, L = ids.shape
        end = start + L
        H, KV, D = self.num_heads, self.num_kv_heads, self.head_dim
        groups = H // KV
        h = F.embedding(ids, self.embed)
        for i, layer in enumerate(self.layers):
            x = self._rms_norm(h, layer.attn_norm)
            qkv = _apply(x, layer.qkv).view(B, L, H + 2 * KV, D).transpose(1, 2)
            qk = self._rotate(qkv[:, : H + KV], cos, sin)  # RoPE on the query and key heads at once
            cache_k[i, :, :, start:end] = qk[:, H:]
            cache_v[i, :, :, start:end] = qkv[:, H + KV :]
            if start == 0:  # the prompt: torch's fused attention (no [B, heads, L, L] scores kept)
                a = F.scaled_dot_product_attention(
                    qk[:, :H], qk[:, H:], qkv[:, H + KV :], attn_mask=bias[:, :, 0], scale=self.scaling, enable_gqa=True
                )
            else:  # one new token: a few small ops beat the fused kernel's setup
                q = qk[:, :H].reshape(B, KV, groups, D)  # query heads grouped by their KV head
                scores = (q @ cache_k[i, :, :, :end].transpose(-1, -2)).view(B, KV, groups, 1, end)
                probs = (scores * self.scaling + bias).float().softmax(dim=-1).to(q.dtype)
                a = (probs.view(B, KV, groups, end) @ cache_v[i, :, :, :end]).view(B, H, 1, D)
            h = h + F.linear(a.transpose(1, 2).reshape(B, L, -1), *layer.o)
            x = self._rms_norm(h, layer.mlp_norm)
            gate_up = _apply(x, layer.gate_up)
            gate, up = gate_up.chunk(2, dim=-1)
            h = h + F.linear(self.act(gate) * up, *layer.down)
        return self._rms_norm(h[:, -1], self.norm)

    @staticmethod
    def _bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -float("inf"))

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        max_new_tokens: int,
        eos_token_id: int,
        pad_token_id: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        greedy: bool = False,
    ) -> torch.Tensor:
        """Completion ids ``[B, C]`` (C ≤ max_new_tokens) for left-padded prompts, as ``generate``."""
        B, P = prompt_ids.shape
        total = P + max_new_tokens
        dtype = self.embed.dtype
        cos_all, sin_all = self._rope(total, dtype)
        shape = (len(self.layers), B, self.num_kv_heads, total, self.head_dim)
        cache_k = torch.empty(shape, dtype=dtype, device=prompt_ids.device)
        cache_v = torch.empty(shape, dtype=dtype, device=prompt_ids.device)
        keys = torch.zeros(B, total, dtype=torch.bool, device=prompt_ids.device)  # which cache slots hold real tokens
        keys[:, :P] = prompt_mask.bool()
        positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
        causal = torch.ones(P, P, dtype=torch.bool, device=prompt_ids.device).tril()
        # a padding query sees itself only (never attended to: its key is masked for every real query)
        mask = (causal & keys[:, None, :P]) | torch.eye(P, dtype=torch.bool, device=prompt_ids.device)
        cos, sin = cos_all[positions][:, None], sin_all[positions][:, None]
        hidden = self._forward(prompt_ids, cos, sin, cache_k, cache_v, 0, self._bias(mask[:, None, None], dtype))
        next_position = positions[:, -1] + 1
        unfinished = torch.ones(B, dtype=torch.bool, device=prompt_ids.device)
        out = []
        for t in range(max_new_tokens):
            logits = F.linear(hidden, *self.lm_head).float()
            token = self._sample(logits, temperature, top_p, greedy)
            token = torch.where(unfinished, token, torch.full_like(token, pad_token_id))
            out.append(token)
            unfinished &= token != eos_token_id
            if t == max_new_tokens - 1 or not bool(unfinished.any()):
                break
            slot = P + t
            keys[:, slot] = True
            cos, sin = cos_all[next_position][:, None, None], sin_all[next_position][:, None, None]
            bias = self._bias(keys[:, None, None, None, : slot + 1], dtype)
            hidden = self._forward(token[:, None], cos, sin, cache_k, cache_v, slot, bias)
            next_position = next_position + 1
        return torch.stack(out, dim=1)

    @staticmethod
    def _sample(logits: torch.Tensor, temperature: float, top_p: float, greedy: bool) -> torch.Tensor:
        if greedy:
            return logits.argmax(dim=-1)
        if temperature != 1.0:
            logits = logits / temperature
        if top_p < 1.0:  # the smallest set whose probability reaches top_p, as transformers' TopPLogitsWarper
            sorted_logits, order = torch.sort(logits, descending=False)
            remove = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
            remove[..., -1:] = False
            logits = logits.masked_fill(remove.scatter(1, order, remove), -float("inf"))
        # inverse-CDF sampling: the distribution of torch.multinomial at a fraction of its cost here
        cdf = logits.softmax(dim=-1).cumsum(dim=-1)
        u = torch.rand(cdf.shape[0], 1, device=cdf.device, dtype=cdf.dtype) * cdf[:, -1:]
        return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp(max=cdf.shape[1] - 1)


def effective_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain causal LM's state dict (transformers' names) with the active LoRA adapters merged
    into the weights they adapt: what an inference engine that holds its own copy of the weights
    (vLLM) must load after each update. Sharded (DTensor) parameters are gathered."""
    lm = _causal_lm(model)
    adapted = {name: module for name, module in lm.named_modules() if hasattr(module, "base_layer")}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in lm.state_dict(keep_vars=True).items():
        if ".lora_" in name:
            continue
        owner = next((m for prefix, m in adapted.items() if name.startswith(prefix + ".base_layer.")), None)
        if owner is not None:
            weight, bias = _linear(owner)
            tensor = weight if name.endswith(".weight") else bias
            name = name.replace(".base_layer.", ".")
        if type(tensor).__name__ == "DTensor":
            tensor = tensor.full_tensor()
        out[name] = tensor.detach()
    return out
