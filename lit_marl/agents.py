"""An agent is a causal LM, its tokenizer and the way it turns a prompt into token ids."""

from __future__ import annotations

import copy
import functools
import shutil
import sys
import tempfile
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lit_marl import ConfigError
from lit_marl.fields import PositiveFloat, PositiveInt, UnitIntervalRightOpen, check_fields
from lit_marl.models import check_source, load_model_and_tokenizer
from lit_marl.tools.calls import ToolResults
from lit_marl.tools.formats import ParsedReply, ToolFormat, parse_reply, result_messages, system_block, tool_format

REPLY_MARKER = "\u2063REPLY\u2063"
"""A reply text no template rewrites, to find where a reply sits in a template's rendering."""


@dataclass
class LoraSettings:
    """LoRA adapters (peft) instead of full fine-tuning."""

    r: PositiveInt = 16
    """Adapter rank."""
    alpha: PositiveFloat = 32
    """Scaling numerator: the update is scaled by alpha / r."""
    dropout: UnitIntervalRightOpen = 0.0
    """Dropout on the adapter input: must stay 0 (the models run without dropout; kept for configs that say 0)."""
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    """Linear layers that get adapters."""

    def __post_init__(self):
        check_fields("model.lora", LoraSettings, {k: getattr(self, k) for k in ("r", "alpha", "dropout")})
        if not self.target_modules:
            raise ConfigError("model.lora.target_modules=[]: name at least one linear layer, e.g. [q_proj, v_proj]")
        if self.dropout > 0:
            raise ConfigError(
                f"model.lora.dropout={self.dropout}: lit_marl's models run without dropout (eval mode), so the update "
                "scores the very policy that sampled; adapter dropout would train another one. Set it to 0"
            )


def lora_config(lora: LoraSettings):
    from peft import LoraConfig

    return LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        task_type="CAUSAL_LM",
    )


class AdapterView(nn.Module):
    """One agent's LoRA adapter on a base model that its teammates share (one copy of the base
    weights for the team): every call runs with this agent's adapter active, and
    ``disable_adapter()`` gives the base itself (the reference policy)."""

    def __init__(self, shared: nn.Module, adapter: str):
        super().__init__()
        self.shared = shared  # a peft model holding every agent's adapter
        self.adapter = adapter

    def activate(self) -> nn.Module:
        if self.shared.active_adapter != self.adapter:
            self.shared.set_adapter(self.adapter)  # peft: only the active adapter requires grad
        return self.shared

    def forward(self, *args, **kwargs):
        return self.activate()(*args, **kwargs)

    def generate(self, *args, **kwargs):
        return self.activate().generate(*args, **kwargs)

    def disable_adapter(self):
        return self.shared.disable_adapter()

    @property
    def config(self):
        return self.shared.config

    def own_parameters(self) -> list[nn.Parameter]:
        return [p for name, p in self.shared.named_parameters() if f".{self.adapter}." in name]

    def merged(self) -> nn.Module:
        """A copy of the base with this adapter merged in (the team's model is left as it is)."""
        copy_ = copy.deepcopy(self.shared)
        copy_.set_adapter(self.adapter)
        return copy_.merge_and_unload(adapter_names=[self.adapter])

    def save_adapter(self, folder: Path) -> None:
        """This adapter alone, in a folder that ``AutoPeftModelForCausalLM`` loads."""
        with tempfile.TemporaryDirectory() as tmp:
            self.shared.save_pretrained(tmp, selected_adapters=[self.adapter])  # writes tmp/<adapter>/
            shutil.copytree(Path(tmp) / self.adapter, folder, dirs_exist_ok=True)


REFERENCE_SUFFIX = "_reference"  # a learner's frozen KL reference adapter: <adapter>_reference (never served)


def peft_of(model: nn.Module) -> tuple[nn.Module, str]:
    """The peft model holding a LoRA agent's adapter, and that adapter's name (an ``AdapterView``'s on
    its team's shared base, else the model's own)."""
    if isinstance(model, AdapterView):
        return model.shared, model.adapter
    return model, model.active_adapter


class Agent(nn.Module):
    def __init__(
        self,
        source: str,
        lora: LoraSettings | None = None,
        system_prompt: str | None = None,
        loaded: tuple[nn.Module, object] | None = None,
    ):
        """``loaded``: a model and tokenizer built already (e.g. an ``AdapterView``); else ``source`` is loaded."""
        super().__init__()
        model, self.tokenizer = loaded if loaded is not None else load_model_and_tokenizer(source)
        if lora is not None and loaded is None:
            from peft import get_peft_model

            model = get_peft_model(model, lora_config(lora))
        self.model = model
        self.source = source
        self.system_prompt = system_prompt
        self.tools: list[dict] = []
        """The schemas of the tools this agent may call (``use_tools``); none by default."""
        self.tool_format: ToolFormat | None = None

    @staticmethod
    def team_on_shared_base(
        source: str, lora: LoraSettings, num_agents: int, system_prompt: str | None
    ) -> list["Agent"]:
        """``num_agents`` agents as LoRA adapters ``agent0``, ``agent1``, ... on one copy of ``source``."""
        from peft import get_peft_model

        base, tokenizer = load_model_and_tokenizer(source)
        shared = get_peft_model(base, lora_config(lora), adapter_name="agent0")
        for i in range(1, num_agents):
            shared.add_adapter(f"agent{i}", lora_config(lora))
        return [
            Agent(source, None, system_prompt, (AdapterView(shared, f"agent{i}"), tokenizer)) for i in range(num_agents)
        ]

    def use_tools(self, tools: list, parser: str = "auto") -> ToolFormat | None:
        """Let this agent call ``tools`` (``lit_marl.tools.Tool``): rendered and read in its model's own
        format (``tools.formats.tool_format``); an empty list: none. Returns the format."""
        schemas = [tool.schema for tool in tools]
        if schemas != self.tools or (self.tool_format is None) == bool(schemas):
            self.tools, self.tool_format = schemas, tool_format(self.tokenizer, parser) if schemas else None
        return self.tool_format

    def _system(self) -> list[dict]:
        """The system message: the system prompt and, where the template ignores ``tools=``, the tools."""
        parts = [] if self.system_prompt is None else [self.system_prompt]
        if self.tool_format is not None and self.tool_format.render == "system":
            parts.append(system_block(self.tools))
        return [{"role": "system", "content": "\n\n".join(parts)}] if parts else []

    def _render(self, messages: list[dict], **kwargs):
        tools = {"tools": self.tools} if self.tool_format is not None and self.tool_format.render == "template" else {}
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **tools, **kwargs)

    def encode_prompt(self, text: str, raw: bool = False) -> list[int]:
        """Render one user message with the model's chat template, ready for the assistant's reply (with
        the agent's tools, ``use_tools``); ``raw`` tokenizes the text as it is instead, with the tokenizer's
        own special tokens (a BOS where the tokenizer adds one), as CoMLRL tokenizes a formatter's text."""
        if raw:
            return self.tokenizer(text)["input_ids"]
        ids = self._render([*self._system(), {"role": "user", "content": text}], tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def observation_messages(self, observation: str | ToolResults) -> list[dict]:
        """The messages an observation is: a user message, or tool results as this agent's format renders them."""
        if isinstance(observation, ToolResults):
            if self.tool_format is None:
                raise ValueError("tool results for an agent without tools (use_tools)")
            return result_messages([(r.call.name, r.text) for r in observation.results], self.tool_format)
        return [{"role": "user", "content": observation}]

    def read_reply(self, reply_ids: list[int]) -> ParsedReply:
        """A reply as generated (special tokens kept, its end-of-turn token dropped) read into text and calls."""
        if reply_ids and reply_ids[-1] == self.eos_token_id:
            reply_ids = reply_ids[:-1]
        text = self.tokenizer.decode(reply_ids, skip_special_tokens=False)
        return parse_reply(text, self.tool_format, self.tokenizer, self.tools)

    def chat_continuation(self, text: str | ToolResults, closed: bool = True) -> list[int]:
        """Token ids that follow an assistant reply to add the user message ``text`` (or the tool
        messages of ``ToolResults``) and open the next reply: only the new chat segment, rendered by
        the chat template (the reply's own tokens are never re-tokenized). ``closed``: the reply ended
        with its end-of-turn token; otherwise (cut by the token budget) the segment starts with the
        template's closing.

        The segment is what the template writes after a reply that is history (followed by a user
        message), so templates that render the latest reply differently from earlier ones work too:
        Qwen3's puts an empty think block before the last reply only and strips earlier replies'
        think blocks. Every reply stays in the context as generated (``rewrites_history`` tells
        whether the template's own rendering of the dialogue would differ: docs/scale.md)."""
        head = self._one_exchange(REPLY_MARKER)
        full = self._render([*head, *self.observation_messages(text)], tokenize=False)
        marker = REPLY_MARKER
        if full.count(marker) != 1:
            raise ValueError(
                f"the chat template of {self.source} does not render a past reply and the next user message as "
                "given; multi-turn token-in/token-out needs one that does"
            )
        segment = full[full.index(marker) + len(marker) :]  # e.g. "<|im_end|>\n<|im_start|>user\n...assistant\n"
        eos = self.tokenizer.decode([self.eos_token_id])
        if closed:
            if not segment.startswith(eos):
                raise ValueError(f"the chat template of {self.source} does not close a reply with {eos!r}")
            segment = segment[len(eos) :]
        return self.tokenizer(segment, add_special_tokens=False)["input_ids"]

    @functools.cached_property
    def rewrites_history(self) -> bool:
        """Whether the chat template renders a dialogue other than by extending its shorter prefix
        (e.g. Qwen3 drops earlier think blocks): then an episode's verbatim context is not the
        template's rendering of the same dialogue, though training still sees exactly what each turn
        was generated from."""
        head, render = self._one_exchange(f"<think>\nr\n</think>\n\n{REPLY_MARKER}"), self.tokenizer.apply_chat_template
        base = render(head, tokenize=False)
        full = render([*head, {"role": "user", "content": "y"}], add_generation_prompt=True, tokenize=False)
        return not full.startswith(base[: base.index(REPLY_MARKER) + len(REPLY_MARKER)])

    def _one_exchange(self, reply: str) -> list[dict]:
        """A probe dialogue for reading the chat template: (the system prompt,) a user turn, ``reply``."""
        return [*self._system(), {"role": "user", "content": "x"}, {"role": "assistant", "content": reply}]

    @functools.cached_property
    def opens_reasoning(self) -> bool:
        """Whether the chat template's generation prompt opens a ``<think>`` block itself (reasoning
        models such as QwQ or the Qwen3 thinking variants): their replies start inside the reasoning."""
        prompt = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False
        )
        return prompt.rfind("<think>") > prompt.rfind("</think>")

    def trainable_parameters(self) -> list[nn.Parameter]:
        if isinstance(self.model, AdapterView):  # its own adapter's, whichever adapter is active now
            return self.model.own_parameters()
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


_said: set[str] = set()


def give_tools(agents: list, tools, parser: str = "auto") -> None:
    """Each agent gets ``tools`` (none: an empty list) in its own format (``Agent.use_tools``); the run
    says which format each model uses, once."""
    for i, agent in enumerate(agents):
        if not hasattr(agent, "use_tools"):
            if tools:
                raise ConfigError(
                    f"agent {i} ({type(agent).__name__}) cannot call tools: it writes through an API or a text "
                    "engine; drop data.tools or give every role a model"
                )
            continue
        fmt = agent.use_tools(list(tools), parser)
        line = f"lit-marl: agent {i} ({agent.source}): {fmt.describe()}" if fmt is not None else None
        if line is not None and line not in _said:
            _said.add(line)
            print(line, file=sys.stderr)


def roles_by_model(agents: list[Agent]) -> list[list[int]]:
    """Roles grouped by the agent object that plays them: a parameter-shared team is one group,
    separate agents are one group each. One generate per group and turn, one optimizer per group."""
    groups: dict[int, list[int]] = {}
    for i, agent in enumerate(agents):
        groups.setdefault(id(agent), []).append(i)
    return list(groups.values())


def team_sources(
    model: str | list[str], num_agents: int, share_parameters: bool, lora: bool, lora_shared_base: bool
) -> list[str]:
    """Every agent's model source, checked against the team's layout settings."""
    sources = [model] * num_agents if isinstance(model, str) else list(model)
    if len(sources) != num_agents:
        raise ConfigError(f"model.model lists {len(sources)} sources for {num_agents} agents: give one per agent")
    if share_parameters and len(set(sources)) != 1:
        raise ConfigError(f"model.share_parameters=true needs one model source, got {sources}")
    if lora_shared_base and (not lora or share_parameters or len(set(sources)) != 1):
        raise ConfigError(
            "model.lora_shared_base=true puts one LoRA adapter per agent on one base: it needs model.lora, one "
            f"model source (got {sources}) and model.share_parameters=false (a shared model needs no adapters "
            "of its own)"
        )
    for i, source in enumerate(sources):
        check_source(source, field=f"model.model[{i}]" if not isinstance(model, str) else "model.model")
    return sources


@dataclass
class Team:
    """What the training module hands the data module once per step, the one way the two meet at
    run time: the phase, the current agents, and the context managers that give the agents who
    sample this step's training rollouts and a comparator's second rollout (iterative preference
    training), each inside the passes' context (precision; FSDP's gathered weights) that
    ``computing`` enters for the engine generating."""

    phase: str
    """``sft`` (demonstrations) or ``rl`` (rollouts)."""
    agents: list[Agent]
    sampling: Callable[[], AbstractContextManager[list[Agent]]]
    """The agents that sample training rollouts (the current ones, or e.g. the initial weights)."""
    comparator: Callable[[list[dict]], AbstractContextManager]
    """A comparator for a second rollout of the tasks (agents, engine, check), or None inside."""
    computing: Callable[[object], AbstractContextManager]
    """The passes' context for a rollout generated by an engine."""
