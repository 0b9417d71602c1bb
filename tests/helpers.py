"""Paths and builders shared by the tests (plain functions and classes; fixtures live in conftest.py)."""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

from lit_marl.algorithms import MAGRPO
from lit_marl.generation.base import TrainerWeights

REPO_ROOT = Path(__file__).resolve().parent.parent
TEST_SCRIPTS = REPO_ROOT / "tests" / "scripts"
SLOGAN_TRAIN = REPO_ROOT / "data" / "slogan" / "train.jsonl"
SLOGAN_HELDOUT = REPO_ROOT / "data" / "slogan" / "heldout.jsonl"
SLOGAN_PROMPTS = [
    'Write line 1 of a slogan for {topic} with the word "{word0}".',
    'Write line 2 of a slogan for {topic} with the word "{word1}".',
]


def free_port() -> int:
    """A TCP port free right now (tests running in parallel must not share a rendezvous port)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def slogan_data(**overrides):
    """A RolloutDataModule on the slogan task (absolute paths: works from any folder)."""
    from lit_marl.data import RolloutDataModule

    kwargs = dict(
        train_path=str(SLOGAN_TRAIN),
        val_path=str(SLOGAN_HELDOUT),
        agent_prompts=SLOGAN_PROMPTS,
        reward_fn="lit_marl.envs.slogan:reward",
        tasks_per_step=2,
        num_generations=4,
        sampling={"max_new_tokens": 8},
        eval_tasks_per_step=16,
    )
    kwargs.update(overrides)
    if kwargs.get("num_turns", 1) > 1:  # the slogan prompts never read {prompt}: later turns read the transition's
        kwargs.setdefault("external_prompt_passthrough", True)
    return RolloutDataModule(**kwargs)


def corridor_data(**settings):
    """An EpisodeDataModule on the Corridor game's training tasks, with ``settings``."""
    from lit_marl.data import EpisodeDataModule

    return EpisodeDataModule(
        train_path=str(REPO_ROOT / "data" / "corridor" / "train.jsonl"), env="corridor", **settings
    )


def make_trainer(tmp_path, **overrides):
    """A small CPU trainer that writes only under ``tmp_path`` (TensorBoard logger by default)."""
    import lightning as L
    from lightning.pytorch.loggers import TensorBoardLogger

    kwargs = dict(
        accelerator="cpu",
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    kwargs.update(overrides)
    if "logger" not in kwargs:
        kwargs["logger"] = TensorBoardLogger(str(tmp_path))
    return L.Trainer(**kwargs)


def cli_fit(tmp_path, *extra, config: str = "configs/magrpo/slogan_tiny.yaml"):
    """``lit-marl fit --config <config>`` with logs under ``tmp_path`` (run from the repo root)."""
    from lit_marl.cli import build_cli

    return build_cli(args=["fit", "--config", config, "--trainer.logger.init_args.save_dir", str(tmp_path), *extra])


def fit_moves(config: str, *extra: str):
    """``lit-marl fit --config <config> <extra>`` without a logger, from Python: its callback metrics
    and the names of the trainable parameters the fit changed."""
    from lit_marl.cli import build_cli

    cli = build_cli(args=["--config", config, "--trainer.logger", "false", *extra], run=False)
    cli.model.configure_model()
    before = {n: p.detach().clone() for n, p in cli.model.named_parameters() if p.requires_grad}
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    moved = {n for n, p in cli.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])}
    return cli.trainer.callback_metrics, moved


def checkpointed_config(tmp_path, name: str, model: dict | None = None, data: dict | None = None) -> str:
    """``configs/magrpo/slogan_tiny.yaml`` for one training step, checkpointed by StepCheckpoint into
    ``tmp_path/ckpt``, with ``model`` and ``data`` settings changed; written to ``tmp_path/name``."""
    import yaml

    config = yaml.safe_load((REPO_ROOT / "configs/magrpo/slogan_tiny.yaml").read_text())
    config["trainer"].update(limit_train_batches=1, limit_val_batches=0, enable_checkpointing=True, max_epochs=1)
    config["trainer"]["callbacks"] = [
        {"class_path": "lit_marl.callbacks.StepCheckpoint", "init_args": {"dirpath": str(tmp_path / "ckpt")}}
    ]
    config["model"]["init_args"].update(model or {})
    config["data"]["init_args"].update(data or {})
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return str(path)


class RecordingEngine(TrainerWeights):
    """A generation engine that records every call ``(agent, prompts, Generation)`` and passes it
    to ``inner`` (default: the ``auto`` engine)."""

    def __init__(self, inner=None):
        from lit_marl.generation import make_engine

        self.inner = inner or make_engine("auto")
        self.name = self.inner.name
        self.calls = []

    def generate(self, agent, prompts, *args, **kwargs):
        out = self.inner.generate(agent, prompts, *args, **kwargs)
        self.calls.append((agent, [list(p) for p in prompts], out))
        return out

    def generate_team(self, calls, *args, **kwargs):
        outs = self.inner.generate_team(calls, *args, **kwargs)
        self.calls += [(agent, [list(p) for p in prompts], out) for (agent, prompts, _), out in zip(calls, outs)]
        return outs


def tree_from_functions(
    agents,
    tasks,
    prompts,
    reward_fn,
    num_generations=1,
    joint_mode="aligned",
    transition=None,
    batched_transition=False,
    engine=None,
    penalties=None,
    discount=1.0,
    **settings,
):
    """``build_tree`` on literal first prompts (``prompts[t][i]``: agent i's for task t), a reward
    function and an optional CoMLRL transition, with the tree's settings as keyword arguments; its
    returns built with ``discount`` and per-row ``penalties`` (``RolloutBatch.score``)."""
    from dataclasses import fields

    from lit_marl.envs.base import FunctionEnv
    from lit_marl.envs.calls import CallSettings
    from lit_marl.generation import Sampling
    from lit_marl.rollout.tree import TreeSettings, build_tree

    class ListedPrompts(FunctionEnv):
        def prompts(self, task):
            return prompts[next(t for t, row in enumerate(tasks) if row is task)]

    env = ListedPrompts(["{}"] * len(prompts[0]), reward_fn, transition, None, batched_transition)
    env.passthrough = True  # literal prompts: the transition's are read as they are
    calls = {f.name for f in fields(CallSettings)}
    env.call_settings = CallSettings(**{k: v for k, v in settings.items() if k in calls})
    settings = {k: v for k, v in settings.items() if k not in calls}
    if isinstance(settings.get("sampling"), dict):  # as the data module takes it
        settings["sampling"] = Sampling(**settings["sampling"])
    tree = TreeSettings(num_generations=num_generations, joint_mode=joint_mode, **settings)
    batch = build_tree(agents, tasks, env, tree, engine=engine)
    batch.score(discount, penalties)  # what the algorithm does with the rollout's facts
    return batch


PLAIN = "lit_marl.rollout.transitions:plain"


def constant_reward(agent_completions, tasks):
    """Every joint action ties: every advantage is 0."""
    return [1.0] * len(tasks)


COMLRL_DOCS = "helpers:comlrl_docs_transition"


def comlrl_docs_transition(
    prompt, agent_completions, num_agents, prompt_history_per_agent=None, response_history_per_agent=None
):
    """Written as CoMLRL's documentation shows a transition: the task prompt, the agent's previous
    attempt, a revision request."""
    return [
        f"{prompt}\n\nYour previous attempt:\n{agent_completions[i]}\n\nPlease revise it." for i in range(num_agents)
    ]


def two_turn_data(**overrides):
    """Two-turn single-trajectory slogan trees (one response per node): what IAC/MAAC learn from."""
    kwargs = dict(num_generations=1, num_turns=2, transition=PLAIN, sampling={"max_new_tokens": 12}, tasks_per_step=3)
    kwargs.update(overrides)
    return slogan_data(**kwargs)


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}


def unchanged(module: torch.nn.Module, before: dict[str, torch.Tensor]) -> list[str]:
    return [n for n, p in module.named_parameters() if n in before and torch.equal(p.detach(), before[n])]


def sgd_recording(algorithm: type) -> type:
    """``algorithm`` with plain SGD at lr=1, so that an update is exactly minus the gradient; it keeps
    each batch (``seen``) and the weights before its update (``before``)."""

    class SGDRecording(algorithm):
        def configure_optimizers(self):
            return [torch.optim.SGD(a.trainable_parameters(), lr=1.0) for a in self.agents]

        def training_step(self, batch, batch_idx):
            self.seen = getattr(self, "seen", []) + [batch]
            self.before = [{n: p.detach().clone() for n, p in a.model.named_parameters()} for a in self.agents]
            return super().training_step(batch, batch_idx)

    return SGDRecording


SGDRecordingMAGRPO = sgd_recording(MAGRPO)


class AdmissibleEngine(TrainerWeights):
    """Plays a game's listed valid commands instead of sampling (the env must show them, e.g.
    ``admissible_commands: true``): sample k of a prompt is its (k + offset)-th listed command from the
    end (TextWorld lists them sorted, the "open ..." and "take ..." ones last), so the
    G samples of a node differ and some earn score. Token ids as a real engine returns them."""

    name = "admissible"

    def __init__(self, offset: int = 0):
        self.offset, self.calls = offset, 0

    def generate_team(self, calls, *args, **kwargs):
        from lit_marl.generation.base import Generation, left_pad

        self.calls += len(calls)
        outs = []
        for agent, prompts, num_samples in calls:
            device = agent.model.device if hasattr(agent.model, "device") else torch.device("cpu")
            prompt_ids, prompt_mask = left_pad(prompts, agent.pad_token_id, device)
            completions = []
            for prompt in prompts:
                text = agent.tokenizer.decode(prompt, skip_special_tokens=True)
                listed = text.rsplit("Valid commands: ", 1)[-1].split("\n")[0].split(", ")
                for k in range(num_samples):
                    command = listed[-1 - (k + self.offset) % len(listed)]  # from the end: "open ..." first
                    completions.append(agent.tokenizer.encode(command, add_special_tokens=False) + [agent.eos_token_id])
            width = max(len(c) for c in completions)
            ids = torch.full((len(completions), width), agent.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(completions), width), dtype=torch.long)
            for row, c in enumerate(completions):
                ids[row, : len(c)], mask[row, : len(c)] = torch.tensor(c), 1
            rows = prompt_ids.repeat_interleave(num_samples, 0), prompt_mask.repeat_interleave(num_samples, 0)
            outs.append(Generation(*rows, ids, mask, num_samples))
        return outs


class ScriptedEngine(TrainerWeights):
    """Replies from a script instead of sampling: at its t-th call (turn t), the b-th prompt (the
    b-th episode still live) gets ``script[t][b]`` (one agent). Token ids as a real engine returns them."""

    name = "scripted"

    def __init__(self, script: list[list[str]]):
        self.script, self.turn = script, 0

    def generate_team(self, calls, *args, **kwargs):
        from lit_marl.generation.base import Generation, left_pad

        ((agent, prompts, _),) = calls
        prompt_ids, prompt_mask = left_pad(prompts, agent.pad_token_id, torch.device("cpu"))
        assert len(self.script[self.turn]) == len(prompts), "one scripted reply per live episode"
        replies = [agent.tokenizer.encode(text, add_special_tokens=False) for text in self.script[self.turn]]
        replies = [r + [agent.eos_token_id] for r in replies]
        self.turn += 1
        ids = torch.full((len(replies), max(map(len, replies))), agent.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, reply in enumerate(replies):  # completions are right-padded
            ids[row, : len(reply)], mask[row, : len(reply)] = torch.tensor(reply), 1
        return [Generation(prompt_ids, prompt_mask, ids, mask, 1)]


def raising_reward(agent_completions, tasks):
    """A reward that always fails (``data.reward_fn: helpers:raising_reward``)."""
    raise RuntimeError("the scorer is down")


def task_zero_wins(agent_completions, tasks):
    """Success (and reward 1) exactly on the task whose id ends in -0, whatever the text."""
    won = [float(str(t["id"]).endswith("-0")) for t in tasks]
    return {"reward": won, "success": won}


LENGTH_REWARD = "helpers:length_reward"


def length_reward(agent_completions, tasks):
    """A joint reward in [0, 1] that varies with every agent's text: the joint answer's length in
    characters, scaled (the tiny random model's answers differ in length, so candidates rarely tie)."""
    return [min(1.0, sum(len(agent[j]) for agent in agent_completions) / 200.0) for j in range(len(tasks))]


class HalvesAdapter:
    """A centralized adapter for the tiny random model (it never writes tags): the joint prompt is the
    roles' prompts joined, and the completion's words are split into equal consecutive parts."""

    def build_prompt(self, task, agent_prompts):
        return " / ".join(agent_prompts)

    def parse_completion(self, completion, task, num_agents):
        words = completion.split()
        size = -(-len(words) // num_agents) if words else 0
        return [" ".join(words[i * size : (i + 1) * size]) for i in range(num_agents)]


class _ComparatorHandler(BaseHTTPRequestHandler):
    """A comparator endpoint for the api tests; the path picks the behaviour."""

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
        path = self.path
        if path == "/slow" or (path == "/every_other_slow" and len(self.server.seen) % 2 == 0):
            time.sleep(1.0)
            path = "/generic"
        path = "/generic" if path == "/every_other_slow" else path
        if path == "/402":
            self.send_response(402)
            self.end_headers()
            self.wfile.write(b'{"error": "no credit"}')
            return
        if path == "/generic":
            reply = {"out": {"texts": [f"{body['agent_idx']}:{k}" for k in range(body["num_return_sequences"])]}}
        elif path == "/tagged":  # a role's section, as a sequential comparator is asked for
            i = body["agent_idx"]
            reply = {"completions": [f"<agent_{i}> line {k} </agent_{i}>" for k in range(body["num_return_sequences"])]}
        elif path == "/openai":
            reply = {"choices": [{"message": {"content": f"chat {k}"}} for k in range(body.get("n", 2))]}
        elif path == "/anthropic":
            reply = {"content": [{"type": "text", "text": "msg"}]}
        elif path == "/short":
            reply = {"completions": ["only one"]}
        else:
            data = b"<html>not json</html>"
            self.send_response(200)
            self.end_headers()
            self.wfile.write(data)
            return
        data = json.dumps(reply).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(data)
        except BrokenPipeError:  # the client gave up waiting (the timeout test)
            pass


@contextmanager
def comparator_server():
    """An HTTP comparator endpoint on 127.0.0.1 (a free port): ``server.seen`` lists the requests."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _ComparatorHandler)
    httpd.seen = []
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd
    finally:
        httpd.shutdown()


# Qwen 2.5's tools section and tool-response grouping, trimmed to what they render
QWEN25_TOOLS = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}{{- 'You are Qwen.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen.<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif not (m.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def answer_length(task: dict, answer: str, calls: list[dict]) -> float:
    """A tool task's reward that varies with every answer (a random model's too): its length, capped at 1."""
    return min(len(answer) / 40.0, 1.0)


def lora_team(base: torch.nn.Module, source: str, tokenizer) -> list:
    """Two agents as LoRA adapters ``agent0``/``agent1`` on one ``base`` (``source``'s architecture), with
    trained-looking (random, non-zero) adapters so that the two differ from the base and from each other;
    their peft model is ``agents[0].model.shared``."""
    from peft import get_peft_model

    from lit_marl.agents import AdapterView, Agent, LoraSettings, lora_config

    shared = get_peft_model(base, lora_config(LoraSettings(r=4, alpha=8)), adapter_name="agent0")
    shared.add_adapter("agent1", lora_config(LoraSettings(r=4, alpha=8)))
    with torch.no_grad():
        for name, p in shared.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return [Agent(source, loaded=(AdapterView(shared, f"agent{i}"), tokenizer)) for i in (0, 1)]
