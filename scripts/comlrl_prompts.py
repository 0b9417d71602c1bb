"""The prompts CoMLRL 1.4.3 builds for a ported multi-turn script, for lit_marl's port test.

Runs CoMLRL's own MAGRPO prompt path (``_generate_completions_with_external_prompts`` ->
``_generate_completions``: its formatters, built by its ``build_formatters``, the seed's
``custom_external`` transition from its multi-turn documentation, ``external_prompt_passthrough``)
and records the text it hands to the tokenizer and the token ids the tokenizer gives, for two
turns, with and without passthrough. Generation never runs: the tokenizer call is where it stops.
``tests/unit/test_comlrl_port.py`` pins the output:

    bash scripts/setup_comlrl_venv.sh
    OMP_NUM_THREADS=1 .venv-comlrl/bin/python scripts/comlrl_prompts.py ~/.cache/lit_marl/tiny-random-v1 \
        > tests/fixtures/comlrl_1.4.3_prompts.json

The scenario (formatters, transition, tasks, completions) is the one in ``tests/comlrl_port.py``,
which both sides import.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
from comlrl.utils.formatters import build_formatters
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from comlrl_port import COMPLETIONS, FORMATTERS, TASKS, custom_external  # noqa: E402


class Stop(Exception):
    pass


class Recorder:
    """The tokenizer CoMLRL calls: records the texts and the ids, then stops the generation."""

    def __init__(self, tokenizer, seen: list):
        self.tokenizer, self.seen = tokenizer, seen

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __call__(self, texts, **kwargs):
        ids = self.tokenizer(texts, **kwargs)["input_ids"]
        self.seen.extend({"text": t, "ids": [int(i) for i in row]} for t, row in zip(texts, ids.tolist()))
        raise Stop


def prompts(tokenizer, passthrough: bool) -> list:
    """Per task, per turn, per agent: what CoMLRL tokenizes."""
    trainer = MAGRPOTrainer.__new__(MAGRPOTrainer)
    trainer.args = MAGRPOConfig(num_agents=2, num_turns=2, external_prompt_passthrough=passthrough)
    trainer.num_agents = 2
    trainer.formatters = build_formatters(FORMATTERS, 2, pass_none_external_prompts=False)
    seen: list = []
    trainer.tokenizer = Recorder(tokenizer, seen)
    trainer.tokenizers = [trainer.tokenizer] * 2
    agent = torch.nn.Linear(1, 1)
    out = []
    for t, item in enumerate(TASKS):
        turns, external = [], [None, None]
        history = [[], []]
        for _turn in range(2):
            texts = []
            for i in range(2):
                try:
                    trainer._generate_completions_with_external_prompts(
                        agent, [item], agent_idx=i, max_new_tokens=1, external_prompts=external[i]
                    )
                except Stop:
                    pass
                texts.append(seen[-1])
                history[i].append(external[i] if external[i] is not None else seen[-1]["text"])
            turns.append(texts)
            responses = [[COMPLETIONS[t][i]] for i in range(2)]
            external = custom_external(
                prompt=item.get("prompt", ""),
                agent_completions=[COMPLETIONS[t][i] for i in range(2)],
                num_agents=2,
                prompt_history_per_agent=[list(h) for h in history],
                response_history_per_agent=responses,
            )
        out.append(turns)
    return out


def main() -> None:
    tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
    import comlrl

    result = {
        "command": "OMP_NUM_THREADS=1 .venv-comlrl/bin/python scripts/comlrl_prompts.py <tiny-random folder>",
        "comlrl": getattr(comlrl, "__version__", "1.4.3"),
        "formatted": prompts(tokenizer, passthrough=False),
        "passthrough": prompts(tokenizer, passthrough=True),
    }
    json.dump(result, sys.stdout)
    print()


if __name__ == "__main__":
    main()
