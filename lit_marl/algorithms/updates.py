"""The optimizer step every algorithm takes: micro-batched passes whose losses sum to the same
gradient however the rows are split (over passes and ranks), gradients summed over ranks, a
NaN/inf step skipped with the weights untouched, clipping per part, FSDP's gradients reduced, a
resting parameter group (PPO's policy during its critic warm-up) left out of the step."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch

from lit_marl.models import checkpointed_passes
from lit_marl.parallel.collectives import all_ranks_sum, sum_gradients
from lit_marl.rollout.batch import AgentSamples, pass_rows, pass_tokens


def clipped_apart(optimizer) -> list[list[torch.Tensor]]:
    """The parameters clipped as one, per ``role`` of the optimizer's groups (a policy, its critic)."""
    parts: dict = {}
    for group in optimizer.param_groups:
        parts.setdefault(group.get("role"), []).extend(group["params"])
    return list(parts.values())


def rest(optimizer, roles: frozenset) -> None:
    """Drop the gradients of the optimizer's groups whose ``role`` is in ``roles``: AdamW skips a
    parameter without a gradient, so its weights, its moments and its step count stay as they are.
    A zero gradient would not do: AdamW's weight decay would still move the weights, and the step
    count would advance, shrinking the group's first real updates (bias correction)."""
    for group in optimizer.param_groups:
        if group.get("role") in roles:
            for p in group["params"]:
                p.grad = None


class OptimizerSteps:
    """The steps of ``AgentTeamModule`` (a mixin: it uses the module's optimizers, passes and shards)."""

    resting_roles: frozenset = frozenset()
    """The ``role`` of each parameter group that sits the optimizer steps out (``rest``); none by default."""

    def update_agent(
        self,
        index: int,
        samples: AgentSamples | None,
        loss_fn: Callable,
        count: float | None = None,
        shared_prompts: bool = False,
        skipped_zero_loss: bool = False,
        also: tuple | None = None,
    ) -> float:
        """One optimizer step for learner ``index`` (see ``learners``); see ``optimizer_step_on``."""
        optimizers = self.optimizers()
        optimizer = optimizers[index] if isinstance(optimizers, list) else optimizers
        step = (count, shared_prompts, skipped_zero_loss, sum(p.numel() for p in self.model_of(index).parameters()))
        return self.optimizer_step_on(optimizer, samples, loss_fn, self.learner_name(index), *step, also=also)

    def optimizer_step_on(
        self,
        optimizer,
        rows,
        loss_fn: Callable,
        name: str,
        count: float | tuple[float, ...] | None = None,
        shared_prompts: bool = False,
        skipped_zero_loss: bool = False,
        parameters: int = 0,
        also: tuple | None = None,
    ) -> float:
        """One step of ``optimizer`` on ``rows`` (anything with ``len``, ``select`` and ``input_ids``; None: this rank
        has nothing for this step but joins it). ``loss_fn`` returns the summed loss of a
        micro-batch (``micro_batches``); the step's loss is the sum over the rows of every
        rank divided by ``count`` (default: the rows) summed over ranks, so neither micro-batching nor
        the split over ranks changes the gradient; a tuple ``count``: ``loss_fn`` returns a vector of terms,
        each divided by its own count (a term no rank counts is 0). ``skipped_zero_loss``: this rank left
        out rows whose loss (and gradient) is exactly zero; parameters still without a gradient get a zero
        one, so the optimizer steps as it would after their backward (AdamW's momentum and weight
        decay act, as in CoMLRL). ``parameters``: the model's, for ``perf/train_flops`` (6 per
        parameter and token the passes compute). ``also``: ``(rows, loss_fn, count, model)`` of a second
        term of the same step (RL's demonstrations: ``model.update.sft_coef``), its summed loss divided by
        its own count summed over ranks, its passes (forwarding ``model`` alone) after the first's; every
        rank gives one or none. Returns the loss of ``rows``, and with ``also`` the pair."""
        # full rows under checkpointing (a checkpointed layer drops the shared cache) and per-layer FSDP
        shared_prompts = shared_prompts and not self.memory.activation_checkpointing and not self.per_layer_fsdp
        local = count if isinstance(count, tuple) else (count if count is not None else len(rows or ()),)
        totals = [all_ranks_sum(float(c), self.device) for c in local]
        tokens = 0
        params = [p for group in optimizer.param_groups for p in group["params"]]
        models = self.shards.roots_of(params) if self.shards is not None else []
        terms = [(rows, loss_fn, totals, shared_prompts, models)]  # each: rows, loss, counts, shared, forwarded
        if also is not None:
            extra_rows, extra_fn, extra_count, extra_model = also
            extra_total = [all_ranks_sum(float(extra_count), self.device)]
            terms.append((extra_rows, extra_fn, extra_total, False, [extra_model] if models else []))
        sums = []
        with checkpointed_passes(self):
            for term_rows, term_fn, term_totals, shared, forwarded in terms:
                sums.append(0.0)
                mine = term_rows if term_rows is not None and len(term_rows) and max(term_totals) > 0 else None
                for chunk in self.passes(mine, forwarded, True, shared):
                    micro = term_rows.select(chunk)
                    loss = sum(term / n for term, n in zip(term_fn(micro).reshape(-1), term_totals) if n > 0)
                    self.manual_backward(loss)
                    sums[-1] += float(loss.detach())
                    tokens += pass_tokens(micro, shared)
        self.record({"perf/train_tokens": float(tokens), "perf/train_flops": 6.0 * parameters * tokens}, reduce="sum")
        if skipped_zero_loss:
            for p in params:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
        if self.shards is not None:
            self.shards.reduce_gradients(params)  # the sharded weights' gradients, summed over ranks
        sum_gradients(params, self.device)  # the module is not wrapped in DDP: parallel/strategies.py
        rest(optimizer, self.resting_roles)  # before the checks: a resting group's gradient is not used
        sums = [all_ranks_sum(value, self.device) for value in sums]
        loss_sum = sum(sums)
        result = sums[0] if also is None else tuple(sums)
        broken = sum(int(p.grad is not None and not torch.isfinite(p.grad).all()) for p in params)
        broken = all_ranks_sum(float(broken), self.device)  # every rank decides alike (FSDP: each its shards)
        if not math.isfinite(loss_sum) or broken:
            self.skip_nonfinite_step(optimizer, name, loss_sum)
            return result
        clip = torch.nn.utils.clip_grad_norm_ if self.shards is None else self.shards.clip_grad_norm_
        for part in clipped_apart(optimizer) if self.hparams.max_grad_norm > 0 else ():
            clip(part, self.hparams.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if self.shards is not None:
            self.shards.refresh(params)
        return result

    def skip_nonfinite_step(self, optimizer, name: str, loss_sum: float) -> None:
        """A NaN/inf loss or gradient would write NaN into the weights: the step is skipped (its
        gradients dropped, weights and optimizer state untouched), counted, and the run stopped once
        more than ``model.max_nonfinite_steps`` were."""
        optimizer.zero_grad(set_to_none=True)
        what = f"non-finite loss {loss_sum}" if not math.isfinite(loss_sum) else "a non-finite gradient"
        self.nonfinite_skips += 1
        limit = self.hparams.get("max_nonfinite_steps", 0)
        if self.nonfinite_skips > limit:
            raise FloatingPointError(
                f"{name}: {what} at global step {self.global_step}; the optimizer step was skipped and the "
                f"weights are unchanged ({self.nonfinite_skips} such step(s), model.max_nonfinite_steps={limit}). "
                "Lower model.learning_rate or check the rewards."
            )
        warnings.warn(
            f"{name}: {what} at global step {self.global_step}: optimizer step skipped, weights unchanged "
            f"({self.nonfinite_skips} of model.max_nonfinite_steps={limit})",
            RuntimeWarning,
            stacklevel=3,
        )
        self.record({"train/nonfinite_skips": float(self.nonfinite_skips)}, reduce="max")

    def micro_batches(self, rows, shared_prompts: bool = False) -> list[torch.Tensor]:
        """Row indices of the forward/backward passes over ``rows`` (``rollout.batch.pass_rows``)."""
        cap, budget = self.memory.forward_batch_size, self.memory.forward_token_budget
        return [r.to(self.device) for r in pass_rows(rows, budget, cap, shared_prompts)]
