"""An agent is a causal LM, its tokenizer and the way it turns a prompt into token ids."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lit_marl.models import load_model_and_tokenizer


@dataclass
class LoraSettings:
    """LoRA adapters (peft) instead of full fine-tuning."""

    r: int = 16
    """Adapter rank."""
    alpha: int = 32
    """Scaling numerator: the update is scaled by alpha / r."""
    dropout: float = 0.0
    """Dropout on the adapter input."""
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    """Linear layers that get adapters."""


class Agent(nn.Module):
    def __init__(self, source: str, lora: LoraSettings | None = None, system_prompt: str | None = None):
        super().__init__()
        model, self.tokenizer = load_model_and_tokenizer(source)
        if lora is not None:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(
                model,
                LoraConfig(
                    r=lora.r,
                    lora_alpha=lora.alpha,
                    lora_dropout=lora.dropout,
                    target_modules=list(lora.target_modules),
                    task_type="CAUSAL_LM",
                ),
            )
        self.model = model
        self.source = source
        self.system_prompt = system_prompt

    def encode_prompt(self, text: str, raw: bool = False) -> list[int]:
        """Render one user message with the model's chat template, ready for the assistant's reply;
        ``raw`` tokenizes the text verbatim instead (a transition that formats prompts itself)."""
        if raw:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        messages = [{"role": "user", "content": text}]
        if self.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def chat_continuation(self, text: str, closed: bool = True) -> list[int]:
        """Token ids that follow an assistant reply to add the user message ``text`` and open the
        next reply: only the new chat segment, rendered by the chat template (the reply's own
        tokens are never re-tokenized). ``closed``: the reply ended with its end-of-turn token;
        otherwise (cut by the token budget) the segment starts with the template's closing."""
        marker = "\u2063REPLY\u2063"
        head = [{"role": "user", "content": "x"}, {"role": "assistant", "content": marker}]
        if self.system_prompt is not None:
            head.insert(0, {"role": "system", "content": self.system_prompt})
        render = self.tokenizer.apply_chat_template
        base = render(head, tokenize=False)
        full = render([*head, {"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        if not full.startswith(base) or marker not in base:
            raise ValueError(
                f"the chat template of {self.source} does not extend a conversation by appending to it; "
                "multi-turn token-in/token-out needs one that does"
            )
        closing = base[base.index(marker) + len(marker) :]  # e.g. "<|im_end|>\n"
        eos = self.tokenizer.decode([self.eos_token_id])
        if closed:
            if not closing.startswith(eos):
                raise ValueError(f"the chat template of {self.source} does not close a reply with {eos!r}")
            closing = closing[len(eos) :]
        return self.tokenizer(closing + full[len(base) :], add_special_tokens=False)["input_ids"]

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    @property
    def eos_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id

    @torch.no_grad()
    def decode(self, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
        return [self.tokenizer.decode(row[m.bool()], skip_special_tokens=True) for row, m in zip(ids, mask)]


def roles_by_model(agents: list[Agent]) -> list[list[int]]:
    """Roles grouped by the agent object that plays them: a parameter-shared team is one group,
    separate agents are one group each. One generate per group and turn, one optimizer per group."""
    groups: dict[int, list[int]] = {}
    for i, agent in enumerate(agents):
        groups.setdefault(id(agent), []).append(i)
    return list(groups.values())
