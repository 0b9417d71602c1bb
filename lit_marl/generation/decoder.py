"""A lean KV-cache decoder for Llama-family causal LMs (Llama, Qwen2): the ``torch`` engine.

On a small model, HF ``generate`` spends most of a token's time in per-token Python (model,
cache, mask and logits-processor objects), not in arithmetic. This decoder runs the same network
as a short list of tensor ops over a preallocated cache:

- it reads the model's own parameters at each call (no copy, so it never goes stale after an
  optimizer step); peft LoRA adapters that are active are merged into the weight they adapt for
  the call (``W + get_delta_weight``), the rest of the model is used as it is; under autocast
  (``trainer.precision: bf16-mixed``) the weights are cast to its dtype once per call, but for an
  ``FP32Linear`` LM head, which stays fp32 as in the training forward (sampling draws from fp32 logits);
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

from lit_marl.generation.base import Sampling, counter_uniforms
from lit_marl.models import FP32Linear

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
        if any(vars(module).get("use_dora", {}).values()):  # peft LoRA layers keep a plain dict
            return "DoRA adapters"
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in lm.parameters()):
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


def _cast(weights, dtype: torch.dtype):
    """Every tensor of a nested structure of dicts, lists and tuples cast to ``dtype``."""
    if isinstance(weights, dict):
        return {k: _cast(v, dtype) for k, v in weights.items()}
    if isinstance(weights, (list, tuple)):
        return type(weights)(_cast(v, dtype) for v in weights)
    return weights if weights is None else weights.to(dtype)


def _stack(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
    """One tensor with a leading agent dimension: a view for one agent, a copy for several."""
    if tensors[0] is None:
        return None
    return tensors[0].unsqueeze(0) if len(tensors) == 1 else torch.stack(tensors)


def _stack_linear(parts: list[tuple]) -> tuple:
    """The agents' (weight, bias) of one layer as ``(W [A, out, in], b [A, out] | None)``."""
    return _stack([w for w, _ in parts]), _stack([b for _, b in parts])


def _linear3(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Each agent's linear layer on its own rows: ``x`` [A, N, in] -> [A, N, out]."""
    if bias is None:
        return torch.bmm(x, weight.transpose(1, 2))
    return torch.baddbmm(bias.unsqueeze(1), x, weight.transpose(1, 2))


def _apply(x: torch.Tensor, parts: list[tuple]) -> torch.Tensor:
    if len(parts) == 1:
        return _linear3(x, *parts[0])
    return torch.cat([_linear3(x, *part) for part in parts], dim=-1)


def _repeat(n: int, dim: int, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Each of ``tensors`` with every entry along ``dim`` repeated ``n`` times in place."""
    return [x.repeat_interleave(n, dim) for x in tensors]


@dataclass
class _Layer:
    attn_norm: torch.Tensor  # [A, 1, hidden]
    mlp_norm: torch.Tensor
    qkv: list  # q, k and v projections (fused or not), each (W [A, out, in], b)
    o: tuple
    gate_up: list  # gate and up projections (fused or not)
    down: tuple


FUSE_BELOW_PARAMETERS = 50_000_000
"""Models smaller than this get their q/k/v and gate/up weights concatenated for the call, and
several agents' models are stacked to decode in one forward per token (a transient copy of the
weights): below it a token's time is per-op overhead; above it decoding is compute-bound and the
copy would buy nothing."""


def _shape(lm: nn.Module) -> tuple:
    c = lm.config
    return (
        c.model_type, c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers,
        c.num_attention_heads, c.num_key_value_heads, getattr(c, "head_dim", None), c.hidden_act,
        lm.model.norm.variance_epsilon, tuple(lm.model.rotary_emb.inv_freq.tolist()),
        float(lm.model.rotary_emb.attention_scaling), lm.lm_head.bias is not None,
        next(lm.parameters()).dtype, next(lm.parameters()).device,
    )  # fmt: skip


def stackable(models: list[nn.Module]) -> bool:
    """Whether these models can decode together in one forward per token: all supported, the
    same shapes, and small (see ``FUSE_BELOW_PARAMETERS``)."""
    return all(unsupported(m) is None for m in models) and _alike(models)


def _alike(models: list[nn.Module]) -> bool:
    """Supported models that can be stacked: the same shapes, all small."""
    lms = [_causal_lm(m) for m in models]
    small = all(sum(p.numel() for p in lm.parameters()) < FUSE_BELOW_PARAMETERS for lm in lms)
    return small and len({_shape(lm) for lm in lms}) == 1


class Decoder:
    """Sampling from one Llama-family model, or from several models of the same shape at once
    (one forward per token for the whole team: each agent's rows through its own weights, by
    batched matmuls over an agent dimension), with a static KV cache. Build one per call: it
    takes the models' weights as they are now."""

    def __init__(self, models: nn.Module | list[nn.Module]):
        models = list(models) if isinstance(models, (list, tuple)) else [models]
        for model in models:
            reason = unsupported(model)
            if reason is not None:
                raise ValueError(f"the torch engine cannot decode this model: {reason}; use engine: hf")
        if len(models) > 1 and not _alike(models):  # each model was checked just above
            raise ValueError("these models cannot decode in one stacked forward (different shapes or too large)")
        lm = _causal_lm(models[0])
        device = next(lm.parameters()).device.type
        # under autocast (trainer.precision: bf16-mixed) the weights are cast once here, not per matmul
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        per_agent = [self._read(model, dtype) for model in models]  # in turn: AdapterViews switch adapters
        config, body = lm.config, lm.model
        self.num_agents = len(models)
        self.eps = body.norm.variance_epsilon
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.vocab_size = per_agent[0]["embed"].shape[0]
        self.scaling = body.layers[0].self_attn.scaling
        self.act = body.layers[0].mlp.act_fn
        self.inv_freq = body.rotary_emb.inv_freq
        self.rope_scale = body.rotary_emb.attention_scaling
        self.embed = _stack([a["embed"] for a in per_agent]).flatten(0, 1)  # [A * vocab, hidden]
        self.norm = _stack([a["norm"] for a in per_agent]).unsqueeze(1)
        self.lm_head = _stack_linear([a["lm_head"] for a in per_agent])
        self.layers = []
        for i in range(len(per_agent[0]["layers"])):
            layers = [a["layers"][i] for a in per_agent]
            self.layers.append(
                _Layer(
                    _stack([layer["attn_norm"] for layer in layers]).unsqueeze(1),
                    _stack([layer["mlp_norm"] for layer in layers]).unsqueeze(1),
                    [_stack_linear([layer["qkv"][k] for layer in layers]) for k in range(len(layers[0]["qkv"]))],
                    _stack_linear([layer["o"] for layer in layers]),
                    [
                        _stack_linear([layer["gate_up"][k] for layer in layers])
                        for k in range(len(layers[0]["gate_up"]))
                    ],
                    _stack_linear([layer["down"] for layer in layers]),
                )
            )

    @staticmethod
    def _read(model: nn.Module, dtype: torch.dtype | None = None) -> dict:
        """One model's weights as they are now (LoRA merged; q/k/v and gate/up fused if small), cast
        to ``dtype`` (None: as they are)."""
        lm = _causal_lm(model)
        body = lm.model
        fuse = sum(p.numel() for p in lm.parameters()) < FUSE_BELOW_PARAMETERS
        layers = []
        for layer in body.layers:
            attn, mlp = layer.self_attn, layer.mlp
            layers.append(
                {
                    "attn_norm": layer.input_layernorm.weight,
                    "mlp_norm": layer.post_attention_layernorm.weight,
                    "qkv": _fused([_linear(attn.q_proj), _linear(attn.k_proj), _linear(attn.v_proj)], fuse),
                    "o": _linear(attn.o_proj),
                    "gate_up": _fused([_linear(mlp.gate_proj), _linear(mlp.up_proj)], fuse),
                    "down": _linear(mlp.down_proj),
                }
            )
        weights = {
            "embed": body.embed_tokens.weight,
            "norm": body.norm.weight,
            "lm_head": _linear(lm.lm_head),
            "layers": layers,
        }
        if dtype is None:
            return weights
        cast = _cast(weights, dtype)
        if isinstance(lm.lm_head, FP32Linear):  # sample from the fp32 head the trainer's log-probs use
            cast["lm_head"] = weights["lm_head"]
        return cast

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
        """Run ``ids`` [A, B, L] (agent a's rows through agent a's weights) at cache slots
        ``start:start+L``; returns the last position's hidden state [A, B, hidden]. Attention runs
        over the A * B rows; ``bias`` [A*B, 1, 1, L, start+L] is 0 where a query sees a cache slot,
        -inf elsewhere. The prompt (``start == 0``), the new tokens of prompts whose earlier tokens are
        in the cache (``start`` > 0), or one new token (``L == 1``)."""
        A, B, L = ids.shape
        end = start + L
        H, KV, D = self.num_heads, self.num_kv_heads, self.head_dim
        groups = H // KV
        offsets = torch.arange(A, device=ids.device).view(A, 1, 1) * self.vocab_size
        h = F.embedding(ids + offsets, self.embed).view(A, B * L, -1)
        for i, layer in enumerate(self.layers):
            x = self._rms_norm(h, layer.attn_norm)
            qkv = _apply(x, layer.qkv).view(A * B, L, H + 2 * KV, D).transpose(1, 2)
            qk = self._rotate(qkv[:, : H + KV], cos, sin)  # RoPE on the query and key heads at once
            cache_k[i, :, :, start:end] = qk[:, H:]
            cache_v[i, :, :, start:end] = qkv[:, H + KV :]
            if start == 0:  # the prompt: torch's fused attention (no [rows, heads, L, L] scores kept)
                a = F.scaled_dot_product_attention(
                    qk[:, :H], qk[:, H:], qkv[:, H + KV :], attn_mask=bias[:, :, 0], scale=self.scaling, enable_gqa=True
                )
            elif L > 1:  # new tokens after a kept prefix: the same, over the cache's slots
                k, v = cache_k[i, :, :, :end], cache_v[i, :, :, :end]
                a = F.scaled_dot_product_attention(
                    qk[:, :H], k, v, attn_mask=bias[:, :, 0], scale=self.scaling, enable_gqa=True
                )
            else:  # one new token: a few small ops beat the fused kernel's setup
                q = qk[:, :H].reshape(A * B, KV, groups, D)  # query heads grouped by their KV head
                scores = (q @ cache_k[i, :, :, :end].transpose(-1, -2)).view(A * B, KV, groups, 1, end)
                probs = (scores * self.scaling + bias).float().softmax(dim=-1).to(q.dtype)
                a = (probs.view(A * B, KV, groups, end) @ cache_v[i, :, :, :end]).view(A * B, H, 1, D)
            h = h + _linear3(a.transpose(1, 2).reshape(A, B * L, -1), *layer.o)
            x = self._rms_norm(h, layer.mlp_norm)
            gate, up = _apply(x, layer.gate_up).chunk(2, dim=-1)
            h = h + _linear3(self.act(gate) * up, *layer.down)
        return self._rms_norm(h.view(A, B, L, -1)[:, :, -1], self.norm)

    @staticmethod
    def _bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -float("inf"))

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        eos_token_id: int | torch.Tensor,
        pad_token_id: int | torch.Tensor,
        sampling: Sampling,
        active: torch.Tensor | None = None,
        num_samples: int = 1,
        seeds: torch.Tensor | None = None,
        past: list | None = None,
        keep: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Completion ids and the log-prob of each sampled token under the raw model distribution (fp32 logits before
        temperature, top-k and top-p, as the training forward computes them), each ``[B, C]`` (C ≤ the
        ``sampling.max_new_tokens``), for left-padded prompts, as ``generate``: for ``[B, P]`` prompts of one model,
        ``[A, B, C]`` for ``[A, B, P]`` prompts of A stacked models (row block a through model a). ``eos_token_id`` /
        ``pad_token_id``: one id, or one per agent ``[A]``. ``active`` ``[A, B]``: rows to decode (others are filler,
        finished at once). ``num_samples`` n: each prompt is sampled n times (rows i·n .. i·n+n-1 of the result, B·n
        rows; ``active`` then covers those): its prompt runs once and the n rows share the cache it leaves, as
        ``num_return_sequences`` does without running the prompt n times. ``seeds`` ``[A, B·n]`` (int64, one per
        result row: ``generation/base.py: sample_seeds``): each row samples from its own counter-based stream
        (``counter_uniforms``) instead of torch's generator; ``_sample`` draws each token. ``past``: per prompt row
        (``[A·B]``, agent-major) a ``generation/kept.py: Kept`` and how many of its first tokens the prompt shares
        (``(None, 0)``: none); ``prompt_ids`` then hold the tokens after it (one at least), the list is emptied once
        copied. ``keep``: hold the cache for ``kept`` afterwards."""
        single = prompt_ids.dim() == 2
        if single:
            prompt_ids, prompt_mask = prompt_ids[None], prompt_mask[None]
            active = active[None] if active is not None else None
            seeds = seeds[None] if seeds is not None else None
        A, B, P = prompt_ids.shape
        if A != self.num_agents:
            raise ValueError(f"{A} prompt blocks for {self.num_agents} stacked models")
        device, rows = prompt_ids.device, A * B
        eos = torch.as_tensor(eos_token_id, device=device).expand(A).repeat_interleave(B)
        pad = torch.as_tensor(pad_token_id, device=device).expand(A).repeat_interleave(B)
        C = max((n for _, n in past), default=0) if past is not None else 0
        dtype = self.embed.dtype
        max_new_tokens = sampling.max_new_tokens
        cos_all, sin_all, cache_k, cache_v, keys = self._new_cache(rows, C + P + max_new_tokens, device)
        hidden, next_position = self._prefill(prompt_ids, prompt_mask.reshape(rows, P), past, C, cos_all, sin_all,
                                              cache_k, cache_v, keys)  # fmt: skip
        if num_samples > 1:  # the samples of a prompt continue from its one cache
            B, rows = B * num_samples, rows * num_samples
            cache_k, cache_v, hidden = _repeat(num_samples, 1, cache_k, cache_v, hidden)
            keys, next_position, eos, pad = _repeat(num_samples, 0, keys, next_position, eos, pad)
        unfinished = torch.ones(rows, dtype=torch.bool, device=device)
        if active is not None:
            unfinished &= active.reshape(rows).bool()
        row_seeds = None if seeds is None else seeds.reshape(-1).to(device)
        out, logprobs = [], []
        for t in range(max_new_tokens):
            logits = _linear3(hidden.to(self.lm_head[0].dtype), *self.lm_head).float().view(rows, -1)
            uniforms = None if row_seeds is None or sampling.greedy else counter_uniforms(row_seeds, t)
            token = self._sample(logits, sampling, uniforms)
            token = torch.where(unfinished, token, pad)
            out.append(token)
            logprobs.append(logits.log_softmax(-1).gather(1, token[:, None]).squeeze(1))
            unfinished &= token != eos
            if t == max_new_tokens - 1 or not bool(unfinished.any()):
                break
            slot = C + P + t
            keys[:, slot] = True
            cos, sin = cos_all[next_position][:, None, None], sin_all[next_position][:, None, None]
            bias = self._bias(keys[:, None, None, None, : slot + 1], dtype)
            hidden = self._forward(token.view(A, B, 1), cos, sin, cache_k, cache_v, slot, bias)
            next_position = next_position + 1
        if keep:  # what ``kept`` reads: the cache, where the fed tokens start, how many replies' tokens are in it
            self.left = (cache_k, cache_v, C, P, len(out) - 1)
        completion = torch.stack(out, dim=1).view(A, B, -1)
        token_logprobs = torch.stack(logprobs, dim=1).view(A, B, -1)
        return (completion[0], token_logprobs[0]) if single else (completion, token_logprobs)

    def _new_cache(self, rows: int, slots: int, device):
        """What a call decodes into: the rotary tables for ``slots`` positions, the K and V cache
        ``[layers, rows, kv heads, slots, head dim]`` (written before read), and which slots hold real tokens."""
        dtype = self.embed.dtype
        shape = (len(self.layers), rows, self.num_kv_heads, slots, self.head_dim)
        cache_k, cache_v = (torch.empty(shape, dtype=dtype, device=device) for _ in range(2))
        return (*self._rope(slots, dtype), cache_k, cache_v, torch.zeros(rows, slots, dtype=torch.bool, device=device))

    def _prefill(self, ids, mask, past, C, cos_all, sin_all, cache_k, cache_v, keys):
        """The prompts' tokens into the cache: row r's kept prefix (``past[r]``: a ``Kept`` and how many of
        its tokens, right-aligned before slot ``C``) copied, its fed tokens ``ids`` (left-padded, ``mask``)
        computed at slots ``C:C+P``. Returns the last fed position's hidden state and each row's next position."""
        rows, P = mask.shape
        device, dtype = ids.device, cache_k.dtype
        offset = torch.zeros(rows, dtype=torch.long, device=device)
        if C:  # slots left of a shorter prefix are never written: zeros, not NaN bits a masked score would spread
            cache_k[:, :, :, :C].zero_(), cache_v[:, :, :, :C].zero_()
        for r, (entry, n) in enumerate(past if C else ()):
            if n:
                entry.write(n, cache_k[:, r, :, C - n : C], cache_v[:, r, :, C - n : C])
                keys[r, C - n : C], offset[r] = True, n
        if past:  # copied: the kept caches it points into may be freed before decoding
            past.clear()
        keys[:, C : C + P] = mask.bool()
        positions = (mask.cumsum(-1) - 1).clamp(min=0) + offset[:, None]
        causal = torch.ones(P, P, dtype=torch.bool, device=device).tril()
        # a padding query sees itself only (never attended to: its key is masked for every real query)
        seen = (causal & keys[:, None, C : C + P]) | torch.eye(P, dtype=torch.bool, device=device)
        if C:  # every fed query sees its row's kept prefix
            seen = torch.cat([keys[:, None, :C].expand(rows, P, C), seen], dim=-1)
        cos, sin = cos_all[positions][:, None], sin_all[positions][:, None]
        hidden = self._forward(ids, cos, sin, cache_k, cache_v, C, self._bias(seen[:, None, None], dtype))
        return hidden, positions[:, -1] + 1

    def kept(self, row: int, prefix: int, fed: int, reply: int) -> tuple[torch.Tensor, torch.Tensor, int, tuple]:
        """Where row ``row``'s sequence is after ``generate(..., keep=True)`` (row numbers as in its result):
        the cache's keys and values ``[layers, rows, kv_heads, slots, head_dim]``, the row, and the slot
        ranges of its ``prefix`` kept tokens, its ``fed`` tokens and the first of its ``reply`` tokens whose
        keys were computed (the last sampled never is), in order."""
        cache_k, cache_v, C, P, computed = self.left
        return cache_k, cache_v, row, ((C - prefix, C), (C + P - fed, C + P + min(reply, computed)))

    @staticmethod
    def _sample(logits: torch.Tensor, sampling: Sampling, uniforms: torch.Tensor | None = None) -> torch.Tensor:
        """One token per row: the most likely (greedy), or drawn from the ``_warp``ed logits."""
        if sampling.greedy:
            return logits.argmax(dim=-1)
        # inverse-CDF sampling: the distribution of torch.multinomial at a fraction of its cost here
        cdf = Decoder._warp(logits, sampling).softmax(dim=-1).cumsum(dim=-1)
        if uniforms is None:
            uniforms = torch.rand(cdf.shape[0], device=cdf.device)
        u = uniforms.to(cdf.dtype)[:, None] * cdf[:, -1:]
        return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp(max=cdf.shape[1] - 1)

    @staticmethod
    def _warp(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
        """The logits transformers' warpers leave, in transformers' order: temperature, then top-k (the
        k most likely, ties with the k-th kept; None or 0: off), then top-p; -inf where never sampled."""
        temperature, top_p, top_k = sampling.temperature, sampling.top_p, sampling.top_k
        if temperature != 1.0:
            logits = logits / temperature
        if top_k and top_k < logits.shape[-1]:  # as TopKLogitsWarper
            logits = logits.masked_fill(logits < torch.topk(logits, top_k, dim=-1).values[..., -1:], -float("inf"))
        if top_p < 1.0:  # the smallest set whose probability reaches top_p, as TopPLogitsWarper
            sorted_logits, order = torch.sort(logits, descending=False)
            remove = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
            remove[..., -1:] = False
            logits = logits.masked_fill(remove.scatter(1, order, remove), -float("inf"))
        return logits
