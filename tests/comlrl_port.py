"""A CoMLRL 1.4.3 user's multi-turn script, as they wrote it: two formatters (functions of the
dataset item, one taking ``external_prompts``), the seed's ``custom_external`` transition copied
from CoMLRL's multi-turn documentation, and a reward with CoMLRL's positional signature. The port
tests run it through lit_marl (``tests/unit/test_comlrl_port.py``); ``scripts/comlrl_prompts.py``
runs it through CoMLRL to pin the prompts CoMLRL builds."""

from typing import List, Optional

TASKS = [
    {"prompt": "Write a slogan for a tea shop.", "topic": "tea"},
    {"prompt": "Write a slogan for a bike repair.", "topic": "bikes"},
]
# what each agent "answered" at turn 1 of each task (generation is not what these tests compare)
COMPLETIONS = [["Tea time, any time!", "Calm in a cup."], ["We fix, you ride!", "Wheels that last."]]


def writer(item):
    return f"You write short slogans.\n\n{item['prompt']}"


def critic(item, external_prompts=None):
    head = f"You polish slogans about {item['topic']}."
    return f"{head}\n\n{external_prompts}" if external_prompts is not None else f"{head}\n\n{item['prompt']}"


FORMATTERS = [writer, critic]


def custom_external(
    prompt: str,
    agent_completions: List[str],
    num_agents: int,
    prompt_history_per_agent: Optional[List[List[str]]] = None,
    response_history_per_agent: Optional[List[List[str]]] = None,
) -> List[str]:
    # Custom logic to format next-turn prompts
    # Access environment feedback, tool outputs, etc.
    next_turn_prompts = []
    for i in range(num_agents):
        # Format prompt for agent i based on history and feedback
        next_prompt = f"{prompt}\nPrevious attempt: {agent_completions[i]}\nPlease revise."
        next_turn_prompts.append(next_prompt)
    return next_turn_prompts


def length_reward(completions0, completions1, batch_items=None):
    """CoMLRL's positional shape: one list per agent; shorter joint answers earn more."""
    assert batch_items is not None and len(batch_items) == len(completions0)
    return [1.0 / (1 + len(a) + len(b)) for a, b in zip(completions0, completions1)]
