"""The fixed MAGRPO benchmark workload, shared by lit_marl's benchmark and the CoMLRL worker so that
both frameworks run exactly the same model, prompts, reward and transition, measured the same way
(``StepProbe``). Plain Python + torch at import: the CoMLRL worker runs in its own virtual
environment, without lit_marl (the model is built from lit_marl's side and passed as a folder).

- model: a tiny random Qwen2 (byte-level BPE, vocab 512 trained on a synthetic corpus; hidden 64,
  2 layers, 4 heads, 2 KV heads, intermediate 128, tied embeddings), built once and cached;
- task i: "Task i: together write about <topic>. <8 filler words>" (the same prompt for each agent);
- joint reward: mean over agent pairs of 0.5 * Jaccard of the two texts' lower-case character sets
  + 0.5 * shorter length / longer length;
- transition: original prompt + "Your previous reply: ..." + "Partner replies: ..." + "Revise and
  combine both:".
"""

from __future__ import annotations

import functools
import os
import random
import shutil
import statistics
import tempfile
import time
from itertools import combinations
from pathlib import Path

TOPICS = [
    "the sea",
    "a mountain town",
    "winter markets",
    "old trains",
    "a quiet library",
    "city gardens",
    "night skies",
    "bread baking",
    "river boats",
    "a school choir",
    "desert roads",
    "paper kites",
]
FILLER = [
    "please",
    "keep",
    "it",
    "short",
    "and",
    "clear",
    "for",
    "everyone",
    "who",
    "reads",
    "this",
    "today",
    "kindly",
    "simple",
    "words",
    "only",
]
MODEL_VERSION = "v2"


def task_prompt(i: int) -> str:
    rng = random.Random(i)
    words = " ".join(rng.choice(FILLER) for _ in range(8))
    return f"Task {i}: together write about {TOPICS[i % len(TOPICS)]}. {words}"


def tasks(n: int) -> list[dict]:
    return [{"task_id": i, "prompt": task_prompt(i)} for i in range(n)]


def pair_score(a: str, b: str) -> float:
    sa, sb = set(a.lower()), set(b.lower())
    jaccard = len(sa & sb) / len(sa | sb) if sa | sb else 1.0
    longer = max(len(a), len(b))
    ratio = min(len(a), len(b)) / longer if longer else 1.0
    return 0.5 * jaccard + 0.5 * ratio


def joint_reward(texts: list[str]) -> float:
    """One joint action: the agents' texts."""
    pairs = list(combinations(texts, 2))
    return sum(pair_score(a, b) for a, b in pairs) / len(pairs) if pairs else 0.0


def next_prompt(original: str, own: str, partners: list[str]) -> str:
    return f"{original}\nYour previous reply: {own}\nPartner replies: {' | '.join(partners)}\nRevise and combine both:"


def _corpus() -> list[str]:
    rng = random.Random(0)
    words = TOPICS + FILLER + "together write about task revise combine both your previous reply partner".split()
    lines = [task_prompt(i) for i in range(400)]
    for _ in range(1500):
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(4, 14))) + rng.choice([".", "!", "?"]))
    return lines


def build_model(folder: Path) -> None:
    """The workload's tiny Qwen2 (built by lit_marl's builder: call it from lit_marl's environment;
    CoMLRL's worker gets the folder)."""
    from lit_marl.models import build_tiny_qwen2

    build_tiny_qwen2(folder, _corpus(), vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2)


def default_model_folder() -> Path:
    """The cached tiny model (built on first use; atomic: a temp folder renamed into place)."""
    root = Path(os.environ.get("LIT_MARL_CACHE", Path.home() / ".cache" / "lit_marl"))
    folder = root / f"bench-qwen2-tiny-{MODEL_VERSION}"
    if not (folder / "config.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{folder.name}-"))
        try:
            build_model(tmp)
            tmp.rename(folder)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not (folder / "config.json").exists():
                raise
    return folder


def bench_trainer(steps: int, **settings):
    """A Lightning trainer for ``steps`` training batches on the CPU and nothing else: no validation,
    logger, checkpoints, progress bar or summary (``settings`` add or override)."""
    import lightning as L  # deferred: CoMLRL's worker imports this module without Lightning

    quiet = dict(accelerator="cpu", max_epochs=1, limit_train_batches=steps, limit_val_batches=0,
                 num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                 enable_model_summary=False)  # fmt: skip
    return L.Trainer(**{**quiet, **settings})


def medians_by(results: list[dict], key: str) -> list[dict]:
    """Per value of ``key`` (in order of first appearance), the median of every other field over the
    results with that value (the ``repeat`` field left out)."""
    out = []
    for value in dict.fromkeys(r[key] for r in results):
        rows = [r for r in results if r[key] == value]
        out.append({field: statistics.median(r[field] for r in rows) for field in rows[0] if field != "repeat"})
    return out


# --------------------------------------------------------------------------- the flags of a run
def add_flags(parser, grid: bool) -> None:
    """The workload's flags, the same for lit_marl's benchmark and the CoMLRL worker; with ``grid``
    the shape flags take lists (the benchmark runs every combination)."""
    many = {"nargs": "+"} if grid else {}
    parser.add_argument("--model", default=None, help="HF model folder (default: the workload's tiny Qwen2)")
    algorithms = ["magrpo", "iac", "maac"]
    parser.add_argument("--algorithm", default=["magrpo"] if grid else "magrpo", choices=algorithms, **many)
    parser.add_argument("--num-agents", type=int, default=2)
    parser.add_argument("--num-generations", type=int, default=[4] if grid else 4, **many)
    parser.add_argument("--num-turns", type=int, default=[1, 2] if grid else 1, **many)
    modes = ["aligned", "cross"]
    parser.add_argument("--joint-mode", default=modes if grid else "aligned", choices=modes, **many)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)


# --------------------------------------------------------------------------- measuring a step, the same on both sides
class StepProbe:
    """Counters and timers of one benchmark process, used identically for lit_marl and CoMLRL: it
    wraps (never alters) the models' ``generate`` and ``forward``, the reward and transition
    functions and any method to time; ``step_begin`` / ``step_end`` delimit a training step."""

    KEYS = (
        "generate_calls", "generate_s", "generated_tokens", "sequences", "prompt_tokens", "reward_calls",
        "transition_calls", "reward_transition_s", "train_forward_passes", "nograd_forward_passes",
        "optimizer_steps", "update_s",
    )  # fmt: skip

    def __init__(self):
        self.totals = dict.fromkeys(self.KEYS, 0.0)
        self.in_generate = False
        self.steps: list[dict] = []
        self._start: tuple[float, dict] | None = None

    def wrap_engine(self, engine) -> None:
        """Count lit_marl's generation engine instead of ``model.generate`` (which its lean
        decoder never calls): the rollouts make one ``engine.generate_team(calls, ...)`` per turn,
        one call per model of the team, and each call counts as one generate call."""
        generate_team = engine.generate_team

        @functools.wraps(generate_team)
        def counted(calls, *a, **kw):
            start = time.perf_counter()
            self.in_generate = True
            try:
                outs = generate_team(calls, *a, **kw)
            finally:
                self.in_generate = False
            self.totals["generate_calls"] += len(calls)
            self.totals["generate_s"] += time.perf_counter() - start
            for out in outs:
                self.totals["generated_tokens"] += float(out.completion_mask.sum())
                self.totals["sequences"] += out.completion_ids.shape[0]
                self.totals["prompt_tokens"] += float(out.prompt_mask.sum())
            return outs

        engine.generate_team = counted

    def wrap_model(self, model, pad_id: int | None, count_generate: bool = True) -> None:
        """``count_generate=False``: generation is counted by ``wrap_engine`` (and ``model`` need not
        generate at all: a critic's backbone is the decoder without its head)."""
        import torch

        forward = model.forward
        generate = model.generate if count_generate else None

        def counted_generate(*a, **kw):
            start = time.perf_counter()
            self.in_generate = True
            try:
                out = generate(*a, **kw)
            finally:
                self.in_generate = False
            sequences = out if isinstance(out, torch.Tensor) else out.sequences
            prompt = kw["input_ids"] if "input_ids" in kw else a[0]
            completion = sequences[:, prompt.shape[1] :]
            mask = kw.get("attention_mask")
            self.totals["generate_calls"] += 1
            self.totals["generate_s"] += time.perf_counter() - start
            self.totals["generated_tokens"] += float((completion != pad_id).sum())
            self.totals["sequences"] += completion.shape[0]
            self.totals["prompt_tokens"] += float(mask.sum()) if mask is not None else prompt.numel()
            return out

        def counted_forward(*a, **kw):
            if not self.in_generate:
                key = "train_forward_passes" if torch.is_grad_enabled() else "nograd_forward_passes"
                self.totals[key] += 1
            return forward(*a, **kw)

        model.forward = counted_forward
        if count_generate:
            model.generate = counted_generate

    def count_optimizer_step(self, optimizer, args, kwargs) -> None:
        """For ``torch.optim.optimizer.register_optimizer_step_post_hook``."""
        self.totals["optimizer_steps"] += 1

    def timed(self, fn, seconds: str, calls: str | None = None):
        """``fn``, adding its time to ``seconds`` (and counting its calls in ``calls``); keeps
        ``fn``'s signature (CoMLRL inspects its reward function's to decide how to call it)."""

        @functools.wraps(fn)
        def wrapper(*a, **kw):
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.totals[seconds] += time.perf_counter() - start
                if calls is not None:
                    self.totals[calls] += 1

        return wrapper

    def step_begin(self) -> None:
        self._start = (time.perf_counter(), dict(self.totals))

    def step_end(self) -> None:
        t0, before = self._start
        self.steps.append({"time": time.perf_counter() - t0, **{k: self.totals[k] - before[k] for k in self.totals}})

    def summary(self, warmup: int) -> dict:
        """Per-step figures over the steps after ``warmup``: medians of time, means of counts."""
        import resource

        measured = self.steps[warmup:]
        times = [s["time"] for s in measured]

        def mean(key):
            return statistics.fmean(s[key] for s in measured)

        median = statistics.median(times)
        generate_s, reward_s = mean("generate_s"), mean("reward_transition_s")
        out = {
            "step_times_s": [round(t, 4) for t in times],
            "median_step_s": median,
            "min_step_s": min(times),
            "generated_tokens_per_step": mean("generated_tokens"),
            "tokens_per_s": mean("generated_tokens") / median,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "generate_s": generate_s,
            "reward_transition_s": reward_s,
            "train_s": statistics.fmean(times) - generate_s - reward_s,
        }
        for key in self.KEYS:
            if not key.endswith("_s"):
                out[f"{key}_per_step"] = mean(key)
        out["update_s"] = mean("update_s")
        return out
