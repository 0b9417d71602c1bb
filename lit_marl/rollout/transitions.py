"""External transitions: how a branch's histories become each agent's next prompt.

A transition is any callable with these keyword arguments (CoMLRL's interface):

- ``prompt``: the task's prompt, a string: the task row's ``prompt`` field (another field with
  ``data.reward_calls.transition_prompt_field``; the empty string where the row has none, as in CoMLRL)
- ``agent_completions``: this branch's response of each agent at the turn just played
- ``num_agents``
- ``prompt_history_per_agent``: per agent, its prompts of every turn of this branch so far (its
  first-turn prompt first, the prompt of the turn just played last)
- ``response_history_per_agent``: per agent, its responses of every turn of this branch so far
  (the turn just played included)

It returns ``num_agents`` strings. Extra parameters of a transition are bound from the config
(``data.transition_kwargs``). Name one in YAML by import path, e.g.
``lit_marl.rollout.transitions:plain``.
"""

from __future__ import annotations

DEFAULT_REVISE = "Revise your answer and reply with the improved version only."


def plain(
    *,
    prompt: str,
    agent_completions: list[str],
    num_agents: int,
    prompt_history_per_agent: list[list[str]],
    response_history_per_agent: list[list[str]],
    instruction: str = DEFAULT_REVISE,
) -> list[str]:
    """Each agent sees its own first prompt (its role's instructions, which hold the task), its
    previous answer and a revise instruction."""
    return [
        f"{prompt_history_per_agent[i][0]}\n\nYour previous answer:\n{agent_completions[i]}\n\n{instruction}"
        for i in range(num_agents)
    ]


plain.reads_task_prompt = False  # it builds on each agent's own first prompt: no warning for rows without one
