"""A training step's text samples and histograms (``StepLog``), written to each logger in the form it
takes: TensorBoard (histograms; the samples in its TEXT tab), Weights & Biases (``wandb.Histogram``
as ``<key>_hist``, since a W&B key holds one value and ``<key>`` is the mean; the sample's Markdown
rendered to ``wandb.Html``), MLflow (the sample as a Markdown artifact per
step, ``<key>/step_<n>.md``; MLflow has no histogram type, so a distribution's quantiles are logged
as metrics ``<key>_p10`` ... ``<key>_p90``, beside the ``_std``, ``_min`` and ``_max`` every logger
gets). Any other logger receives the scalars only, and the run says so once. wandb, mlflow and
markdown are imported only when their logger is in use."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from lightning.pytorch.loggers import Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_warn

HISTOGRAM_BINS = 16
"""Bins of a histogram whose range is known (``StepLog.distribution(bounds=...)``), as CoMLRL's reward histograms."""

QUANTILES = (10, 25, 50, 75, 90)
"""The percentiles MLflow gets of each distribution, in place of a histogram (``<key>_p50``, ...)."""

TAKES_MEDIA = (TensorBoardLogger, WandbLogger, MLFlowLogger)


class StepMedia:
    """Writes a step's histograms and texts to one logger at a time; remembers which loggers it
    told that they receive none (a notice once per run, not once per step)."""

    def __init__(self) -> None:
        self.told: set[str] = set()

    def write(
        self,
        logger: Logger,
        step: int,
        distributions: dict[str, torch.Tensor],
        bounds: dict[str, tuple[float, float]],
        texts: dict[str, str],
    ) -> dict[str, Any]:
        """Write to ``logger`` what it takes apart from the scalars, and return what goes into the
        step's one ``log_metrics`` call beside them (W&B: every value of a step in one row)."""
        distributions = {key: values for key, values in distributions.items() if values.numel()}
        if not distributions and not texts:
            return {}
        if isinstance(logger, TensorBoardLogger):
            _tensorboard(logger, step, distributions, bounds, texts)
            return {}
        if isinstance(logger, WandbLogger):
            return _wandb(distributions, bounds, texts)
        if isinstance(logger, MLFlowLogger):
            for key, text in texts.items():
                logger.experiment.log_text(logger.run_id, text, f"{key}/step_{step:06d}.md")
            return quantiles(distributions)
        name = type(logger).__name__
        if name not in self.told:
            self.told.add(name)
            names = ", ".join(cls.__name__ for cls in TAKES_MEDIA)
            rank_zero_warn(
                f"{name} receives the scalars only: the text samples and histograms "
                f"(model.log_samples_every_n_steps) are written to {names}"
            )
        return {}


def binned(values: torch.Tensor, bounds: tuple[float, float] | None) -> tuple[torch.Tensor, np.ndarray | None]:
    """``values`` and the edges of ``HISTOGRAM_BINS`` equal bins over ``bounds`` (values outside
    are clamped into the edge bins), so every step's histogram has the same bins; without bounds,
    None (the logger picks the bins)."""
    if bounds is None:
        return values, None
    return values.clamp(*bounds), np.linspace(*bounds, HISTOGRAM_BINS + 1)


def quantiles(distributions: dict[str, torch.Tensor]) -> dict[str, float]:
    """``<key>_p<q>`` for each of ``QUANTILES`` of each distribution."""
    out = {}
    for key, values in distributions.items():
        points = np.percentile(values.double().numpy(), QUANTILES)
        out.update({f"{key}_p{q}": float(point) for q, point in zip(QUANTILES, points)})
    return out


def _tensorboard(logger, step, distributions, bounds, texts) -> None:
    for key, values in distributions.items():
        values, edges = binned(values, bounds.get(key))
        bins = "tensorflow" if edges is None else edges
        logger.experiment.add_histogram(key, values, global_step=step, bins=bins)
    for key, text in texts.items():
        logger.experiment.add_text(key, text, global_step=step)


def _wandb(distributions, bounds, texts) -> dict[str, Any]:
    import markdown  # deferred: only a W&B run renders the samples (a dependency of tensorboard)
    import wandb  # deferred: CLI start-up cost; WandbLogger has imported it already

    out: dict[str, Any] = {}
    for key, values in distributions.items():
        values, edges = binned(values, bounds.get(key))
        if edges is None:
            out[f"{key}_hist"] = wandb.Histogram(values.numpy())
        else:
            counts, _ = np.histogram(values.numpy(), bins=edges)
            out[f"{key}_hist"] = wandb.Histogram(np_histogram=(counts, edges))
    for key, text in texts.items():  # Markdown characters of model output are escaped (metrics.markdown_line)
        out[key] = wandb.Html(markdown.markdown(text))
    return out
