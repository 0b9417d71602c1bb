"""External transitions: how a branch's histories become each agent's next prompt.

A transition is any callable with these keyword arguments (CoMLRL's interface):

- ``prompt``: the agents' first-turn prompts (list, one per agent)
- ``agent_completions``: this branch's response of each agent at the turn just played
- ``num_agents``
- ``prompt_history_per_agent``: per agent, its prompts of every turn of this branch so far
- ``response_history_per_agent``: per agent, its responses of every turn of this branch so far

It returns ``num_agents`` strings. Extra parameters of a transition are bound from the config
(``data.transition_kwargs``). Name one in YAML by import path, e.g.
``lit_marl.rollout.transitions:plain``.
"""

from __future__ import annotations

DEFAULT_REVISE = "Revise your answer and reply with the improved version only."


def plain(
    *,
    prompt: list[str],
    agent_completions: list[str],
    num_agents: int,
    prompt_history_per_agent: list[list[str]],
    response_history_per_agent: list[list[str]],
    instruction: str = DEFAULT_REVISE,
) -> list[str]:
    """Each agent sees its original prompt, its previous answer and a revise instruction."""
    return [f"{prompt[i]}\n\nYour previous answer:\n{agent_completions[i]}\n\n{instruction}" for i in range(num_agents)]
