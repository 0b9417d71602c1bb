"""What the logs are made of: wall-clock timers, a training step's diagnostics reduced over ranks in one
gather (``StepLog``), and evaluation metrics that stay right under DDP (torchmetrics)."""

from __future__ import annotations

import re
import time

import torch
from torchmetrics import MeanMetric, Metric

from lit_marl.logger_media import StepMedia
from lit_marl.losses import truncated_is_weights
from lit_marl.parallel.collectives import gather_objects


class Timer:
    """``with Timer() as t: ...`` then ``t.seconds``."""

    def __enter__(self) -> "Timer":
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.start


class StepLog:
    """One training step's diagnostics, recorded while the step runs and written once at its end.

    Lightning's ``self.log`` costs ~0.2-0.9 ms per key on a CPU (``scripts/bench_logging.py``;
    Lightning #20388: a result collection entry, device checks and a sync decision per call); a
    step records 30-80 keys. Here a
    key is a float in a dict; at the step's end ``reduce`` combines every rank's records in ONE
    object gather: ``mean`` keys are means weighted by each rank's ``weight`` (e.g. its joint
    actions), ``min``/``max``/``sum`` keys reduce as named. Histograms are gathered in the same call
    (the whole step's distribution); text samples are rank 0's."""

    def __init__(self) -> None:
        self.media = StepMedia()  # histograms and texts, in the form each logger takes
        self.clear()

    def clear(self) -> None:
        self.scalars: dict[str, tuple[str, float, float]] = {}  # key -> (reduce, value or weighted sum, weight)
        self.distributions: dict[str, list[torch.Tensor]] = {}
        self.texts: dict[str, str] = {}
        self.bounds: dict[str, tuple[float, float]] = {}  # key -> a distribution's known range (histogram bins)

    def __bool__(self) -> bool:
        return bool(self.scalars or self.distributions or self.texts)

    def add(self, values: dict[str, float], weight: float = 1.0, reduce: str = "mean") -> None:
        """Record ``values`` (floats or one-element tensors); a key recorded twice in a step
        combines both records (means by their weights)."""
        for key, value in values.items():
            # a mean is kept as (weighted sum, weight) until ``reduce``
            record = (reduce, float(value) * weight, weight) if reduce == "mean" else (reduce, float(value), 1.0)
            old = self.scalars.get(key)
            if old is not None and old[0] != reduce:
                raise ValueError(f"{key!r} is recorded with reduce={old[0]!r} and {reduce!r}")
            self.scalars[key] = record if old is None else _combine(old, record)

    def distribution(self, key: str, values: torch.Tensor, bounds: tuple[float, float] | None = None) -> None:
        """Record the values of one quantity (e.g. every joint action's reward): ``reduce`` gives
        their mean, ``_std``, ``_min`` and ``_max`` over every rank's values, and the values for a
        histogram; ``bounds`` (its known range, e.g. ``data.reward_range``) fixes the histogram's
        ``logger_media.HISTOGRAM_BINS`` bins, so steps compare bin for bin."""
        self.distributions.setdefault(key, []).append(values.detach().float().flatten().cpu())
        if bounds is not None:
            self.bounds[key] = bounds

    def text(self, key: str, value: str) -> None:
        self.texts[key] = value

    def reduce(self) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        """Every rank's records combined (all ranks call it together): scalars and distributions."""
        local = (self.scalars, {k: torch.cat(v) for k, v in self.distributions.items()})
        gathered = gather_objects(local)
        sums: dict[str, tuple[str, float, float]] = {}
        for scalars, _ in gathered:
            for key, record in scalars.items():
                sums[key] = record if key not in sums else _combine(sums[key], record)
        scalars = {
            key: (value / weight if weight > 0 else 0.0) if kind == "mean" else value
            for key, (kind, value, weight) in sums.items()
        }
        parts: dict[str, list[torch.Tensor]] = {}
        for _, rank_distributions in gathered:
            for key, values in rank_distributions.items():
                parts.setdefault(key, []).append(values)
        distributions = {key: torch.cat(values) for key, values in parts.items()}
        for key, values in distributions.items():
            if values.numel():
                scalars[key] = float(values.mean())
                scalars[f"{key}_std"] = float(values.std(unbiased=False))
                scalars[f"{key}_min"], scalars[f"{key}_max"] = float(values.min()), float(values.max())
        return scalars, distributions

    def write(self, trainer, step: int, samples: bool) -> dict[str, float]:
        """Reduce (every rank together); derive the job's generation and training tokens/s (summed
        tokens over the mean seconds) and, on a GPU in ``PEAK_FLOPS``, the MFU (``perf/train_flops``
        over the training seconds and every rank's peak); write the scalars straight to every logger
        at ``step`` (rank 0) and into ``trainer.callback_metrics`` (callbacks, the progress bar);
        with ``samples`` the histograms and texts too, in the form each logger takes
        (``logger_media``). Returns the scalars; the log is empty after."""
        scalars, distributions = self.reduce()
        if scalars.get("perf/generate_s") and "perf/generated_tokens" in scalars:
            scalars["perf/tokens_per_s"] = scalars["perf/generated_tokens"] / scalars["perf/generate_s"]
        if scalars.get("perf/train_s") and scalars.get("perf/train_tokens"):
            scalars["perf/train_tokens_per_s"] = scalars["perf/train_tokens"] / scalars["perf/train_s"]
            peak = peak_flops(trainer.strategy.root_device)
            if peak and scalars.get("perf/train_flops"):
                scalars["perf/mfu"] = (
                    scalars["perf/train_flops"] / scalars["perf/train_s"] / (peak * trainer.world_size)
                )
        trainer.callback_metrics.update({key: torch.tensor(value) for key, value in scalars.items()})
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                media = self.media.write(logger, step, distributions, self.bounds, self.texts) if samples else {}
                logger.log_metrics({**scalars, **media}, step=step)
        self.clear()
        return scalars


_REDUCE = {"min": min, "max": max, "sum": lambda a, b: a + b}


def _combine(old: tuple[str, float, float], new: tuple[str, float, float]) -> tuple[str, float, float]:
    """Two records of one key (``StepLog``: one rank's twice, or two ranks'): a mean's weighted sums
    and weights add, min/max/sum reduce as named."""
    kind = old[0]
    if kind == "mean":
        return kind, old[1] + new[1], old[2] + new[2]
    return kind, _REDUCE[kind](old[1], new[1]), 1.0


TURN_KEY = re.compile(r"turn_(\d+)/")
# rollout stats that count (summed over ranks); the others are seconds, rates and fractions (means)
COUNTS = re.compile(r"(perf/generated_tokens|train/(episodes|tree_nodes|env_steps|tool_\w+)|turn_\d+/nodes)$")


def record_rollout_mismatch(
    log: StepLog, logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, cap: float | None
) -> None:
    """The trainer's log-probs of sampled tokens against the rollout engine's (``mask``: the tokens):
    ``train/rollout_logp_diff``, the mean |delta log p|; ``train/rollout_ratio``, the distribution of
    pi / pi_rollout (with ``_std``, ``_min``, ``_max``); with truncated importance sampling at ``cap``,
    ``train/rollout_is_capped_frac``, the tokens whose ratio was cut to it."""
    mask = mask.bool()
    tokens = float(mask.sum())
    if not tokens:
        return
    delta = (logprobs.detach().float() - rollout_logprobs.float())[mask]
    log.add({"train/rollout_logp_diff": float(delta.abs().mean())}, weight=tokens)
    log.distribution("train/rollout_ratio", delta.exp())
    if cap is not None:
        log.add({"train/rollout_is_capped_frac": float((delta.exp() > cap).float().mean())}, weight=tokens)


def rollout_correction(
    log: StepLog, behaviour: torch.Tensor, samples, mask: torch.Tensor, cap: float | None, temperature: float = 1.0
) -> torch.Tensor | None:
    """Record the mismatch of the trainer's ``behaviour`` log-probs with the rollout engine's (the
    rows' ``rollout_logprobs``: ``record_rollout_mismatch``) and return the truncated
    importance-sampling weights at ``cap`` (None: the correction is off). Log-probs scored at another
    ``temperature`` (``model.update.tempered_logprobs``) are not compared: the engines' are untempered."""
    rollout = samples.rollout_logprobs if temperature == 1.0 else None
    if rollout is not None:
        record_rollout_mismatch(log, behaviour, rollout, mask, cap)
    if cap is None:
        return None
    if rollout is None:
        raise ValueError(
            "model.update.rollout_is_cap is set, but the rollout engine gave no log-probs of its samples "
            "(data.engine: auto, torch, hf and vllm give them); remove model.update.rollout_is_cap"
        )
    return truncated_is_weights(behaviour, rollout, cap)


def record_stats(log: StepLog, stats: dict[str, float], weight: float) -> None:
    """A rollout's ``stats`` into ``log``: counts summed over ranks, the rest weighted means."""
    log.add({k: v for k, v in stats.items() if COUNTS.match(k)}, reduce="sum")
    log.add({k: v for k, v in stats.items() if not COUNTS.match(k)}, weight=weight)


# ``self.log`` of a value every rank already holds reduced (the same on all ranks): Lightning warns on
# each epoch-level key logged without sync_dist under DDP, and sync_dist alone would all-reduce it
# again; with rank_zero_only its sync is a no-op (result.py ``_Sync``), so nothing is reduced twice
# and the epoch's weighted mean stays the one each rank computes
REDUCED = {"sync_dist": True, "rank_zero_only": True}


class StepLogging:
    """What a LightningModule of the team logs, and how: a training step ``record``s into
    ``self.step_log`` (a ``StepLog``) and ``write_step_log`` writes it at the step's end; evaluation batches
    go through ``log_eval`` (Lightning's per-epoch aggregation). The x axis of every log is
    ``training_steps``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.step_log = StepLog()  # this step's diagnostics, written once at its end (``write_step_log``)
        self.step_metrics: dict[str, float] = {}  # the last written ones, over all ranks (the progress bar's)
        self._step_clock = time.perf_counter()

    def log_rollout(self, batch, prefix: str) -> None:
        """A tree rollout's metrics (``rollout.batch.RolloutBatch``): a training step records them
        (``record``: per turn as ``turn_<t>/``, averaged over ranks weighted by joint actions; the
        reward's spread over every joint action); an evaluation batch logs them under ``prefix`` (``val``, ``test``)."""
        size = float(batch.rewards.numel())
        if prefix != "train":
            values = {"reward": float(batch.rewards.mean()), **batch.metrics}
            self.log_eval({f"{prefix}/{key}": value for key, value in values.items()}, size)
            return
        log = self.step_log
        log.distribution("train/reward", batch.rewards, batch.reward_range)
        turns = [float(len(rewards)) for rewards in batch.turn_rewards]  # each turn's joint actions
        for turn, rewards in enumerate(batch.turn_rewards):
            log.distribution(f"turn_{turn}/reward", rewards, batch.reward_range)
        for key, value in batch.metrics.items():
            turn = TURN_KEY.match(key)
            if turn:  # a turn's metric: weighed by that turn's joint actions
                log.add({key: value}, weight=turns[int(turn.group(1))])
            elif key != "reward":
                log.add({f"train/{key}": value}, weight=size)
        record_stats(log, batch.stats, size)
        if batch.sample and self.sample_step():
            log.text("train/sample", batch.sample)

    def log_eval(self, values: dict[str, float], weight: float) -> None:
        """An evaluation batch's metrics, averaged over ranks (weighted) and logged per epoch; keys may
        differ between ranks (``StepLog.reduce``: one object gather, not one reduce per key)."""
        batch = StepLog()
        batch.add(values, weight)
        batch.add({"_weight": weight}, reduce="sum")  # every rank's, for Lightning's epoch mean
        means, _ = batch.reduce()
        count = means.pop("_weight")
        for key, value in means.items():
            self.log(key, value, batch_size=max(int(count), 1), **REDUCED)
        if self.trainer.state.fn == "fit":  # Lightning's x for these (its ``step`` key): the steps done, as ours
            self.log("step", float(self.training_steps), batch_size=1, **REDUCED)

    def record(self, values: dict[str, float], weight: float = 1.0, reduce: str = "mean") -> None:
        """Record diagnostics of this training step (``StepLog``): written once, at the step's end."""
        self.step_log.add(values, weight, reduce)

    @property
    def training_steps(self) -> int:
        """Training steps so far, the current one included: the x axis of every log (0 before training)."""
        return self.trainer.fit_loop.epoch_loop.batch_progress.total.ready

    def sample_step(self) -> bool:
        """Whether this step logs a rendered tree or episode and histograms (``log_samples_every_n_steps``)."""
        every = self.hparams.get("log_samples_every_n_steps", 0)
        return every > 0 and (self.training_steps - 1) % every == 0

    def on_train_start(self) -> None:
        self._step_clock = time.perf_counter()

    def exclude_from_step_time(self, seconds: float) -> None:
        """Work between steps that is no step's (a held-out evaluation): kept out of ``perf/step_s``."""
        self._step_clock += seconds

    def write_step_log(self, step_end: bool = True) -> None:
        """Write the step's records (``StepLog.write``) on ``trainer.log_every_n_steps`` steps and
        ``sample_step`` steps, with the wall time since the last step's end; ``step_end=False``:
        records made after the step (the epoch end's buffer flush: always written, they hold the
        update's losses). ``log_every_n_steps: 0`` writes no step's records. Every rank calls it together."""
        now, step, every = time.perf_counter(), self.training_steps, self.trainer.log_every_n_steps
        if step_end:
            seconds, self._step_clock = now - self._step_clock, now
            if (not every or step % every) and not self.sample_step():
                self.step_log.clear()
                return
            self.record({"perf/step_s": seconds}, reduce="max")
        samples = step_end and self.sample_step()
        self.step_metrics = {**self.step_metrics, **self.step_log.write(self.trainer, step, samples)}


# dense bf16 tensor-core peak per device (vendor figures), for MFU; a device not listed reports none
PEAK_FLOPS = {"H200": 989.5e12, "H100": 989.5e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12}


def peak_flops(device: torch.device) -> float | None:
    """The peak FLOP/s of a CUDA device named in ``PEAK_FLOPS`` (the first name contained in the
    device's), else None (CPUs, unknown GPUs: no MFU is logged)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_FLOPS.items() if key in name), None)


# TensorBoard's Markdown: backslash escapes for its syntax; & < > as entities (a backslash before
# them would be shown)
_MARKDOWN = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;", **{c: "\\" + c for c in "\\`*_[]#|"}})


def markdown_line(text: str, chars: int) -> str:
    """``text`` on one line (a Markdown list item breaks on a newline), Markdown's special
    characters escaped (model output is shown as written), clipped to ``chars``."""
    text = " ".join(text.split())
    text = text if len(text) <= chars else text[:chars] + " …"
    return text.translate(_MARKDOWN)


# --------------------------------------------------------------------------- evaluation metrics (torchmetrics)
def pass_at_k(num_samples: torch.Tensor, num_correct: torch.Tensor, k: int) -> torch.Tensor:
    """The unbiased pass@k of each problem (Chen et al. 2021, the Codex paper): with n samples of
    which c are correct, 1 - C(n-c, k) / C(n, k), the chance that k of the n drawn without
    replacement hold a correct one; computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i) (no huge
    binomials). Needs n >= k."""
    n, c = num_samples.long(), num_correct.long()
    if (n < k).any():
        raise ValueError(f"pass@{k} needs at least {k} samples per problem; got {int(n.min())}")
    if ((c < 0) | (c > n)).any():
        raise ValueError("pass@k: the correct samples of a problem must be between 0 and its samples")
    out = torch.ones(n.shape, dtype=torch.float64)
    for j, (nj, cj) in enumerate(zip(n.tolist(), c.tolist())):
        if nj - cj >= k:  # else every draw of k holds a correct sample: 1
            i = torch.arange(nj - cj + 1, nj + 1, dtype=torch.float64)
            out[j] = 1.0 - torch.prod(1.0 - k / i)
    return out


class PassAtK(Metric):
    """The mean unbiased pass@k over problems (``pass_at_k``), summed over ranks: every rank adds
    its problems' values and counts, ``compute`` divides the totals."""

    full_state_update = False

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k
        self.add_state("total", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("problems", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, num_samples: torch.Tensor, num_correct: torch.Tensor) -> None:
        self.total += pass_at_k(num_samples, num_correct, self.k).sum().to(self.total.device)
        self.problems += len(num_samples)

    def compute(self) -> torch.Tensor:
        return self.total / self.problems.clamp(min=1)


class EvalMeans:
    """Named evaluation metrics, each a torchmetrics ``MeanMetric`` weighted by the tasks it covers
    (a metric of one task type by that type's tasks), reduced over every rank at ``compute``. Ranks
    may report different keys (trees that ended early have no later turns): ``compute`` first
    agrees on the union, a rank without a key adds nothing to it, so every rank joins every sync."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.means: dict[str, MeanMetric] = {}

    def _metric(self, key: str) -> MeanMetric:
        if key not in self.means:
            self.means[key] = MeanMetric(nan_strategy="ignore").to(self.device)
        return self.means[key]

    def update(self, key: str, value: float, weight: float) -> None:
        self._metric(key).update(torch.tensor(float(value)), torch.tensor(float(weight)))

    def compute(self) -> dict[str, float]:
        keys = sorted({key for part in gather_objects(sorted(self.means)) for key in part})
        out = {}
        for key in keys:
            metric = self._metric(key)
            metric.update(torch.tensor(0.0), torch.tensor(0.0))  # joins the sync on ranks without the key
            out[key] = float(metric.compute())
        return out
