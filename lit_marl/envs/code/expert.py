"""The expert of the ``expert_edits`` transition: a model that reviews a program and proposes edits per role.

Either a local model (any model source of ``lit_marl.models``: an HF folder, ``smollm2-135m-instruct``,
``tiny-random``), run in one batched generate over all branches of a turn (greedy the first time), or an
OpenAI-compatible chat endpoint (``base_url`` such as ``http://127.0.0.1:8000/v1``; the API key is read
from the environment variable ``api_key_env``), queried in parallel.

As in CoMLRL's code experiments, the expert answers with one JSON object holding one string per role
(CoMLRL's keys are ``aux`` and ``main``; here they are the functions the roles write, e.g. ``aux`` and the
task's entry point), so that each agent is shown the edits to its own function only. A reply that holds
no such object, or lacks a role, is asked again (``retries`` times, with a note on the format and sampled
at ``retry_temperature``, so that the new reply can differ from the greedy one); a reply still malformed
after the last retry gives its roles the ``fallback`` text and is counted in ``malformed_replies``.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

import torch

from lit_marl import ConfigError
from lit_marl.agents import Agent
from lit_marl.fields import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, check_dataclass
from lit_marl.generation import Sampling, generate
from lit_marl.tasks import template_fields

EXPERT_PROMPT = (
    "You are an expert Python programmer reviewing a program that a team wrote together. Each member writes "
    "one function:\n{roles}\n\nTask:\n{prompt}\n\nTheir program:\n```python\n{code}\n```\n\nFor each function, "
    "propose the minimal edits that make the program correct, as a short list of concrete changes: if the "
    'function is missing, give a minimal correct implementation; if it needs no change, write "No changes '
    'needed.". Do not rewrite the whole program. Reply with only a JSON object with one string per '
    "function, in this format:\n{format}"
)
RETRY_NOTE = (
    "Your previous reply could not be used: {problem}. Reply again with only the JSON object, one string "
    "per function, in this format:\n{format}"
)
TEMPLATE_FIELDS = {"prompt", "code", "roles", "format"}


def reply_format(names: list[str]) -> str:
    """The JSON skeleton the expert is asked to fill: one key per function, in role order."""
    return "{" + ", ".join(f'"{n}": "<edits to {n}>"' for n in names) + "}"


def _key(text: str) -> str:
    """A reply's key normalized, so that `aux`, aux(), def aux and AUX all name the function aux."""
    return re.sub(r"^def\s+|\(.*\)$", "", text.strip().strip("`").strip()).strip().lower()


def _objects(value):
    """``value`` and every JSON object nested in it (an expert may wrap its answer: {"edits": {...}})."""
    if isinstance(value, dict):
        yield value
        for inner in value.values():
            yield from _objects(inner)
    elif isinstance(value, list):
        for inner in value:
            yield from _objects(inner)


def parse_edits(reply: str, names: list[str]) -> tuple[dict[str, str], str]:
    """The edits per function that ``reply`` holds, and what is wrong with it ("" when nothing is).

    Every JSON object in the reply is a candidate (fenced or not, with raw newlines inside its strings,
    as models write them); the one naming the most of ``names`` wins, the last on a tie (a model that
    thinks aloud first puts its answer last). A value is a string, or a list of strings (one edit per
    line); any other value counts as missing."""
    decoder = json.JSONDecoder(strict=False)
    wanted = {_key(n): n for n in names}
    best: dict[str, str] = {}
    start = reply.find("{")
    while start != -1:
        try:
            value, end = decoder.raw_decode(reply, start)
        except json.JSONDecodeError:
            start = reply.find("{", start + 1)
            continue
        for obj in _objects(value):
            found = {}
            for key, text in obj.items():
                if isinstance(text, list) and all(isinstance(t, str) for t in text):
                    text = "\n".join(text)
                if _key(str(key)) in wanted and isinstance(text, str):
                    found[wanted[_key(str(key))]] = text.strip()
            if found and len(found) >= len(best):
                best = found
        start = reply.find("{", end)
    missing = [n for n in names if n not in best]
    if not best:
        return {}, "it holds no JSON object with a string for " + ", ".join(f'"{n}"' for n in names)
    if missing:
        return best, "its JSON object has no string for " + ", ".join(f'"{n}"' for n in missing)
    return best, ""


@dataclass
class Expert:
    """The model of the ``expert_edits`` transition (local or an OpenAI-compatible endpoint): it reviews the
    team's program and proposes edits per function."""

    model: str
    """A model source to run locally, or the model name at the endpoint when ``base_url`` is set."""
    base_url: str | None = None
    """An OpenAI-compatible API root (``.../v1``); None runs ``model`` locally."""
    api_key_env: str = "OPENAI_API_KEY"
    """Environment variable holding the endpoint's API key (no key is sent when it is unset)."""
    max_new_tokens: PositiveInt = 256
    """Tokens of one reply; a JSON object cut short by this budget is malformed (and asked again)."""
    timeout_s: PositiveFloat = 60.0
    """Socket timeout of one endpoint request, after which it is re-sent (``retries``); unused locally."""
    retries: NonNegativeInt = 2
    """Re-asks of a malformed reply, and (endpoint) re-sends of a failed request."""
    retry_temperature: NonNegativeFloat = 0.7
    """Sampling temperature of a re-ask (the first ask is greedy), so that it can differ."""
    fallback: Literal["raw", "none"] = "raw"
    """What a role gets from a reply still malformed after the retries: ``raw``, the expert's whole
    reply (free-form advice is still advice); ``none``, a note that there are no edits (CoMLRL)."""
    max_parallel: PositiveInt = 8
    """Endpoint requests in flight at once; a local model answers all of a turn's branches in one batch."""
    prompt: str = EXPERT_PROMPT
    """Template with ``{prompt}`` (the task), ``{code}`` (the team's program), ``{roles}`` (one line per
    function: who writes it) and ``{format}`` (the JSON object to reply with; required)."""
    malformed_replies: int = field(default=0, init=False)
    """Replies still malformed after the last retry, since construction (for a caller to log)."""
    format_retries: int = field(default=0, init=False)
    """Re-asks made because a reply was malformed, since construction."""

    def __post_init__(self):
        check_dataclass("data.env.expert", self)
        fields_used = template_fields(self.prompt)
        if "format" not in fields_used:
            raise ConfigError(
                "data.env.expert.prompt: the template must contain {format}, where the JSON object the expert "
                "replies with (one string per function) is shown; without it no reply can be split per role"
            )
        if fields_used - TEMPLATE_FIELDS:
            raise ConfigError(
                f"data.env.expert.prompt: unknown fields {sorted(fields_used - TEMPLATE_FIELDS)}; the template "
                f"may use {sorted(TEMPLATE_FIELDS)}"
            )
        self._agent = None

    def propose(
        self, task_prompts: list[str], programs: list[str], roles: list[dict[str, str]]
    ) -> list[dict[str, str]]:
        """The edits per function of each (task, program), in order: ``roles[b]`` maps each function of
        program ``b`` (in role order) to who writes it, and the result maps it to the edits to show that
        role. Malformed replies are asked again; after the last retry their roles get the fallback."""
        names = [list(r) for r in roles]
        messages = [
            self.prompt.format(
                prompt=p,
                code=c,
                roles="\n".join(f"- `{n}`: {who}" for n, who in r.items()),
                format=reply_format(list(r)),
            )
            for p, c, r in zip(task_prompts, programs, roles)
        ]
        if not messages:
            return []
        replies = self._ask(messages, sample=False)
        parsed = [parse_edits(reply, n) for reply, n in zip(replies, names)]
        for _ in range(self.retries):
            todo = [b for b, (_, problem) in enumerate(parsed) if problem]
            if not todo:
                break
            self.format_retries += len(todo)
            notes = [RETRY_NOTE.format(problem=parsed[b][1], format=reply_format(names[b])) for b in todo]
            again = self._ask([f"{messages[b]}\n\n{note}" for b, note in zip(todo, notes)], sample=True)
            for b, reply in zip(todo, again):
                replies[b], parsed[b] = reply, parse_edits(reply, names[b])
        out = []
        for reply, (edits, problem), n in zip(replies, parsed, names):
            if problem:
                self.malformed_replies += 1
                edits = {name: edits[name] if name in edits else self._fallback(reply, name) for name in n}
            out.append({name: edits[name] or "No changes needed." for name in n})
        return out

    def _fallback(self, reply: str, name: str) -> str:
        if self.fallback == "raw" and reply.strip():
            return f"(The expert's reply did not follow the per-function format; here it is in full.)\n{reply}"
        return f"The expert proposes no edits to `{name}`."

    def _ask(self, messages: list[str], sample: bool) -> list[str]:
        if self.base_url is None:
            return self._local(messages, sample)
        with ThreadPoolExecutor(max_workers=min(self.max_parallel, len(messages))) as pool:
            return list(pool.map(lambda m: self._ask_endpoint(m, sample), messages))

    def _local(self, messages: list[str], sample: bool) -> list[str]:
        if self._agent is None:
            self._agent = Agent(self.model)
            self._agent.model.requires_grad_(False)
        agent = self._agent
        greedy = not sample or self.retry_temperature == 0
        sampling = Sampling(self.max_new_tokens, self.retry_temperature or 1.0, greedy=greedy)
        with torch.no_grad():
            out = generate(agent, [agent.encode_prompt(m) for m in messages], 1, sampling)
        return [text.strip() for text in agent.decode(out.completion_ids, out.completion_mask)]

    def _ask_endpoint(self, message: str, sample: bool = False) -> str:
        body = json.dumps(
            {
                "model": self.model,
                "messages": [{"role": "user", "content": message}],
                "max_tokens": self.max_new_tokens,
                "temperature": self.retry_temperature if sample else 0.0,
            }
        ).encode()
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.api_key_env)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        url = self.base_url.rstrip("/") + "/chat/completions"
        for attempt in range(self.retries + 1):
            try:
                request = urllib.request.Request(url, data=body, headers=headers, method="POST")
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    reply = json.loads(response.read())
                return (reply["choices"][0]["message"]["content"] or "").strip()
            except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
                if attempt == self.retries:
                    detail = (
                        err.read().decode(errors="replace")[:300] if isinstance(err, urllib.error.HTTPError) else ""
                    )
                    raise RuntimeError(
                        f"expert endpoint {url} (model {self.model!r}) failed after {attempt + 1} attempts: "
                        f"{err} {detail}"
                    ) from err
                time.sleep(0.5 * 2**attempt)
            except (KeyError, IndexError, ValueError) as err:
                raise RuntimeError(f"expert endpoint {url} gave a reply that is not a chat completion: {err}") from err
        raise AssertionError("unreachable")
