"""A tool-using trajectory through vLLM's CPU build equals the lean decoder's: the same token ids and
the same loss masks over three turns whose observations are tool results (``make test-vllm``)."""

from __future__ import annotations

import gc

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from lit_marl.agents import Agent  # noqa: E402
from lit_marl.envs.game import StepResult  # noqa: E402
from lit_marl.envs.tool_task import ToolTask  # noqa: E402
from lit_marl.generation import Sampling, make_engine  # noqa: E402
from lit_marl.rollout.episode import EpisodeSettings, run_episodes  # noqa: E402
from lit_marl.tools import ToolCall, ToolResult, ToolResults  # noqa: E402

OPTIONS = {"kv_cache_memory_bytes": 256 << 20, "max_model_len": 2048}
TASKS = [{"prompt": "What is 37 * 91? Use the calculator tool.", "answer": 3367},
         {"prompt": "What is 12 * 64? Use the calculator tool.", "answer": 768}]  # fmt: skip


class ToolTurns(ToolTask):
    """Every reply gets a tool result back (what it called, or that it called nothing), so each
    episode runs its three turns through tool messages whatever the untrained model writes."""

    def act(self, actions):
        reply = actions[0]
        text = f"{len(reply.calls)} call(s), {len(reply.errors)} malformed; you wrote: {reply.content[:40]}"
        return StepResult([ToolResults((ToolResult(ToolCall("calculator", {}), text),))], info=self._info(0.0, False))


def trajectories(agent: Agent, engine) -> list:
    env = ToolTurns(["lit_marl.envs.tool_task:calculator"], "lit_marl.envs.tool_task:number_answer")
    settings = EpisodeSettings(max_turns=3, sampling=Sampling(max_new_tokens=24, greedy=True))
    (batch,) = run_episodes([agent], TASKS, env, settings, engine=engine)
    keep = batch.attention_mask.bool()
    return [(ids[k].tolist(), mask[k].tolist()) for ids, mask, k in zip(batch.input_ids, batch.loss_mask, keep)]


def test_a_tool_trajectory_through_vllm_equals_the_lean_decoders():
    agent = Agent("smollm2-135m-instruct")
    lean = trajectories(agent, make_engine("torch"))
    served = trajectories(agent, make_engine("vllm", OPTIONS))
    gc.collect()
    assert served == lean
    for ids, mask in lean:  # three replies, each its own run of trained tokens between tool messages
        runs = sum(1 for k in range(len(mask)) if mask[k] and (k == 0 or not mask[k - 1]))
        assert runs == 3 and "<tool_response>" in agent.tokenizer.decode(ids)
