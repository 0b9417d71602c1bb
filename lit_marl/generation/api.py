"""An HTTP endpoint as a text writer: the ``api`` comparator of iterative preference training.

A prompt (the user message, not the rendered chat) goes to the endpoint in one of three formats;
``generation/text.py`` turns the texts into rows of the policy (its tokenizer, its end token).

- ``generic`` (CoMLRL's): POST ``{prompt, agent_idx, num_return_sequences, max_new_tokens,
  temperature, top_p, top_k, batch_item, model?}`` (``top_k`` null when off); the reply's
  ``response_field`` (dotted path, default ``completions``) holds the list of texts (strings, or
  objects with ``text``/``content``).
- ``openai_chat``: POST ``{model, messages: [{role: user, content}], n, max_tokens, temperature,
  top_p, top_k?}``; texts from ``choices[].message.content``.
- ``anthropic``: POST ``{model, max_tokens, messages, temperature, top_p, top_k?}`` with
  ``anthropic-version: 2023-06-01``, one request per candidate (the API has no ``n``); text from
  ``content[].text``.

``top_k?``: sent only when top-k is on (OpenAI's own API refuses the field; OpenAI-compatible servers
such as vLLM's take it).

A timeout or a refused connection skips that prompt's candidates (counted; their joint candidates
get no pairs); every other failure (an HTTP error status, a reply that is not JSON or
lacks the texts, fewer texts than asked) raises ``ApiError`` naming what is wrong. The API key is
read from the environment variable ``key_env``, never from the config (configs are logged).
"""

from __future__ import annotations

import json
import os
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Literal

from lit_marl.generation.base import Sampling

ApiFormat = Literal["generic", "openai_chat", "anthropic"]


class ApiError(RuntimeError):
    """The comparator endpoint answered, but not with usable texts."""


@dataclass(frozen=True)
class ApiSettings:
    """Where and how to call the endpoint (``model.comparator_api``)."""

    url: str
    """The endpoint (http:// or https://), POSTed one JSON request per prompt (anthropic: per candidate)."""
    format: ApiFormat = "generic"
    """Request and reply shape: generic (CoMLRL's), openai_chat or anthropic (module docstring)."""
    model: str | None = None
    """The endpoint's model name (openai_chat and anthropic need one)."""
    timeout_s: float = 120.0
    """Seconds to wait for a reply; past it the prompt's candidates are skipped (counted)."""
    key_env: str | None = None
    """Environment variable holding the API key (none: no key sent); never the key itself in a config."""
    key_header: str | None = None
    """Header for the key (default: Authorization with Bearer; x-api-key for anthropic)."""
    headers: dict[str, str] = field(default_factory=dict)
    """Extra request headers."""
    response_field: str = "completions"
    """generic format: the dotted path to the list of texts in the reply."""
    extra_body: dict = field(default_factory=dict)
    """Merged into every request body (e.g. stop sequences)."""

    def __post_init__(self):
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"model.comparator_api.url={self.url!r}: must be an http:// or https:// address")
        if self.format in ("openai_chat", "anthropic") and not self.model:
            raise ValueError(f"model.comparator_api.format={self.format}: set model.comparator_api.model")


class ApiWriter:
    """The endpoint as a text writer (``generation/text.py``): ``calls`` counts the requests made."""

    def __init__(self, settings: ApiSettings):
        self.settings = settings
        self.calls = 0

    def complete(self, prompts, role, tasks, n, sampling: Sampling) -> list[list[str] | None]:
        """Per prompt (of task ``tasks[i]``) ``n`` texts, or None where the endpoint timed out."""
        return [self.texts_for(p, role, task, n, sampling) for p, task in zip(prompts, tasks)]

    # ------------------------------------------------------------------ one request
    def texts_for(self, prompt: str, role: int, task: dict, n: int, sampling: Sampling):
        """``n`` texts for one prompt, or None when the endpoint timed out / could not be reached;
        greedy decoding is asked as temperature 0."""
        s = self.settings
        max_new_tokens, top_p, top_k = sampling.max_new_tokens, sampling.top_p, sampling.top_k
        temperature = 0.0 if sampling.greedy else sampling.temperature
        fields = dict(temperature=temperature, top_p=top_p, **({"top_k": top_k} if top_k else {}))
        if s.format == "anthropic":
            body = {"model": s.model, "max_tokens": max_new_tokens, "messages": [{"role": "user", "content": prompt}]}
            body.update(**fields, **s.extra_body)
            out = []
            for _ in range(n):
                reply = self._post(body)
                if reply is None:
                    return None
                out += self._texts(reply, 1)
            return out
        if s.format == "openai_chat":
            body = {"model": s.model, "messages": [{"role": "user", "content": prompt}], "n": n}
            body.update(max_tokens=max_new_tokens, **fields, **s.extra_body)
        else:
            body = {"prompt": prompt, "agent_idx": role, "num_return_sequences": n, "max_new_tokens": max_new_tokens}
            body.update(temperature=temperature, top_p=top_p, top_k=top_k or None, batch_item=_jsonable(task))
            if s.model:
                body["model"] = s.model
            body.update(s.extra_body)
        reply = self._post(body)
        return None if reply is None else self._texts(reply, n)

    def _post(self, body: dict):
        s = self.settings
        headers = {"Content-Type": "application/json", **s.headers}
        if s.format == "anthropic":
            headers.setdefault("anthropic-version", "2023-06-01")
        if s.key_env:
            key = os.environ.get(s.key_env)
            if not key:
                raise ApiError(f"model.comparator_api.key_env={s.key_env}: that environment variable is not set")
            header = s.key_header or ("x-api-key" if s.format == "anthropic" else "Authorization")
            headers[header] = key if header.lower() != "authorization" else f"Bearer {key}"
        request = urllib.request.Request(s.url, json.dumps(body).encode(), headers, method="POST")
        self.calls += 1
        try:
            with urllib.request.urlopen(request, timeout=s.timeout_s) as response:
                raw = response.read().decode("utf-8", errors="replace")
        except urllib.error.HTTPError as e:
            detail = e.read().decode("utf-8", errors="replace")[:300]
            if e.code == 402:
                raise ApiError(
                    f"the comparator API ({s.url}) answered 402 Payment Required: the account is out of credit"
                ) from e
            raise ApiError(f"the comparator API ({s.url}) answered HTTP {e.code}: {detail}") from e
        except (TimeoutError, socket.timeout):
            return None
        except urllib.error.URLError as e:
            if isinstance(e.reason, (TimeoutError, socket.timeout, ConnectionError)):
                return None
            raise ApiError(f"the comparator API ({s.url}) could not be called: {e.reason}") from e
        try:
            return json.loads(raw)
        except json.JSONDecodeError as e:
            raise ApiError(f"the comparator API ({s.url}) did not answer JSON: {raw[:200]!r}") from e

    def _texts(self, reply, n: int) -> list[str]:
        s = self.settings
        if s.format == "openai_chat":
            found, where = (
                [c.get("message", {}).get("content") for c in _list(reply, "choices")],
                "choices[].message.content",
            )
        elif s.format == "anthropic":
            found = ["".join(b.get("text", "") for b in _list(reply, "content") if b.get("type", "text") == "text")]
            where = "content[].text"
        else:
            value = reply
            for part in s.response_field.split("."):
                value = value.get(part) if isinstance(value, dict) else None
            value = [value] if isinstance(value, str) else value
            if not isinstance(value, list):
                raise ApiError(
                    f"the comparator API's reply has no list of texts at {s.response_field!r} "
                    f"(model.comparator_api.response_field): {json.dumps(reply)[:200]}"
                )
            found = [v.get("text", v.get("content")) if isinstance(v, dict) else v for v in value]
            where = s.response_field
        if len(found) < n or not all(isinstance(t, str) for t in found[:n]):
            raise ApiError(
                f"the comparator API returned {len(found)} texts at {where} for {n} asked (or a non-text entry): "
                f"{json.dumps(reply)[:200]}"
            )
        return found[:n]


def _list(reply, key: str) -> list[dict]:
    value = reply.get(key) if isinstance(reply, dict) else None
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ApiError(f"the comparator API's reply has no {key!r} list: {json.dumps(reply)[:200]}")
    return value


def _jsonable(value):
    """The task row as JSON (tensors and other objects as their values or strings)."""
    return json.loads(json.dumps(value, default=lambda v: v.tolist() if hasattr(v, "tolist") else str(v)))
