"""The expert of the ``expert_edits`` transition: a model that reviews a program and proposes edits.

Either a local model (any model source of ``lit_marl.models``: an HF folder, ``smollm2-135m-instruct``,
``tiny-random``), run greedily in one batched generate over all branches of a turn, or an
OpenAI-compatible chat endpoint (``base_url`` such as ``http://127.0.0.1:8000/v1``; the API key is read
from the environment variable ``api_key_env``), queried in parallel.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from lit_marl.agents import Agent
from lit_marl.generation import generate

EXPERT_PROMPT = (
    "You are an expert Python programmer reviewing a team's solution.\n\nTask:\n{prompt}\n\nTheir code:\n"
    "```python\n{code}\n```\n\nPropose the minimal edits that make it correct, as a short list of concrete "
    "changes. Do not rewrite the whole program."
)


@dataclass
class Expert:
    model: str
    """A model source to run locally, or the model name at the endpoint when ``base_url`` is set."""
    base_url: str | None = None
    """An OpenAI-compatible API root (``.../v1``); None runs ``model`` locally."""
    api_key_env: str = "OPENAI_API_KEY"
    """Environment variable holding the endpoint's API key (no key is sent when it is unset)."""
    max_new_tokens: int = 256
    timeout_s: float = 60.0
    retries: int = 2
    max_parallel: int = 8
    prompt: str = EXPERT_PROMPT
    """Template with ``{prompt}`` (the task) and ``{code}`` (the team's program)."""

    def __post_init__(self):
        self._agent = None

    def propose(self, task_prompts: list[str], programs: list[str]) -> list[str]:
        """One proposal per (task, program), in order."""
        messages = [self.prompt.format(prompt=p, code=c) for p, c in zip(task_prompts, programs)]
        if not messages:
            return []
        if self.base_url is None:
            return self._local(messages)
        with ThreadPoolExecutor(max_workers=min(self.max_parallel, len(messages))) as pool:
            return list(pool.map(self._ask_endpoint, messages))

    def _local(self, messages: list[str]) -> list[str]:
        if self._agent is None:
            self._agent = Agent(self.model)
            self._agent.model.requires_grad_(False)
        agent = self._agent
        with torch.no_grad():
            out = generate(agent, [agent.encode_prompt(m) for m in messages], 1, self.max_new_tokens, greedy=True)
        return [text.strip() for text in agent.decode(out.completion_ids, out.completion_mask)]

    def _ask_endpoint(self, message: str) -> str:
        body = json.dumps(
            {
                "model": self.model,
                "messages": [{"role": "user", "content": message}],
                "max_tokens": self.max_new_tokens,
                "temperature": 0.0,
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
                return reply["choices"][0]["message"]["content"].strip()
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
