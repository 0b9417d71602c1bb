"""MADPO: multi-agent direct preference optimization on scored joint candidates (CoMLRL's MADPO).

Per task every agent samples K candidates (``data.num_generations``, ``joint_mode: aligned``: the
k-th responses form joint candidate k); the task reward scores each joint candidate; ordered pairs
with a reward gap (``rollout/pairs.py``) are the preferences. The joint policy is the product of
the agents' policies, so its log-ratio of chosen over rejected is the sum of the agents' own
D_i = log pi_i(y_w^i) - log pi_i(y_l^i); agent i minimises -log sigmoid(beta (D_i + sum_{j != i}
sg(D_j))) (``losses.joint_dpo``): gradient through its own D_i only, the others' taken before any
update.

The update is one optimizer step per learner per training step. Its gradient is computed exactly
as a weighted sum of the candidates' log-probs: d loss / d log pi_i(y_k) is a constant at the
current weights, so the candidates become rows with that weight as their advantage and take the
same forward/backward path (shared prompts, micro-batches, ranks) as every other row of lit_marl.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Literal

import torch

from lit_marl.algorithms.base import AgentTeamModule
from lit_marl.algorithms.settings import read_groups
from lit_marl.fields import PositiveFloat, check_fields
from lit_marl.logprobs import completion_logprobs
from lit_marl.losses import joint_dpo, masked_sum, reinforce
from lit_marl.metrics import Timer
from lit_marl.rollout.batch import AgentSamples, RolloutBatch
from lit_marl.rollout.buffer import RolloutBuffer
from lit_marl.rollout.pairs import PAIR_FIELDS, PairSettings, check_candidate_rollouts, rollout_pairs


class MADPO(AgentTeamModule):
    """Multi-agent DPO: pairs of joint candidates by reward gap, a joint-factorised DPO loss per agent."""

    def __init__(
        self,
        dpo_beta: PositiveFloat = 0.1,
        pairs: PairSettings = PairSettings(),
        dpo_reference: Literal["none", "initial"] = "none",
        candidate_policy: Literal["initial", "current"] = "initial",
        **kwargs,
    ):
        """
        Args:
            dpo_beta: DPO's beta: how sharply the joint log-ratio is pushed apart (CoMLRL's default 0.1).
            pairs: Which pairs a task's candidates give (``rollout.pairs.PairSettings``): their order
                (``selection``: the largest reward gaps first by default) and cap (``per_task``).
            dpo_reference: ``none`` (CoMLRL's, reference-free: D_i is the policy's log-ratio) or
                ``initial`` (DPO's reference-anchored form: D_i minus the same log-ratio under the
                initial weights; with LoRA the base with adapters off, no copy).
            candidate_policy: Who samples the candidates: ``initial`` (offline, as CoMLRL: the
                initial weights, frozen; CoMLRL samples its dataset once, here every step samples
                afresh from the same policy) or ``current`` (on-policy, iterative DPO).
            **kwargs: The team's settings (model, lora, learning_rate, ...): see ``AgentTeamModule``.
        """
        super().__init__(**kwargs)
        check_fields("model", MADPO.__init__, locals())
        read_groups(self, {"pairs": PAIR_FIELDS}, pairs=(PairSettings, pairs))
        self.pair_settings = self.pairs.of(type(self))
        self.dpo_beta = dpo_beta
        self.dpo_reference = dpo_reference
        self.candidate_policy = candidate_policy

    def build_models(self) -> None:
        super().build_models()
        if self.dpo_reference == "initial" or self.candidate_policy == "initial":
            self.build_references()

    def setup(self, stage: str) -> None:
        super().setup(stage)
        self.require_groups(stage, "joint candidates of the same task in pairs")
        if stage == "fit":
            check_candidate_rollouts(self.rollout_settings, "MADPO")

    def generation_models(self) -> list[torch.nn.Module]:
        """The initial weights sample the candidates (``candidate_policy: initial``): the references too."""
        initial = list(self.references or []) if self.candidate_policy == "initial" else []
        return super().generation_models() + initial

    overlaps_rollouts = False  # its rollouts may sample the initial weights, an iterative one's a comparator

    @contextmanager
    def rollout_team(self):
        """Candidates come from the initial weights (``candidate_policy: initial``) or the current ones."""
        if self.candidate_policy == "current":
            yield self.agents
            return
        with self.initial_team() as team:
            yield team

    # ------------------------------------------------------------------ the step
    def rl_step(self, batch: RolloutBatch, batch_idx: int) -> None:
        with Timer() as train_time, self.computing(update=True):
            pairs = rollout_pairs(batch, self.pair_settings, self.shuffle_generator)
            self.dpo_update(batch.agents, pairs.chosen, pairs.rejected, pairs.gaps)
        self.record({"train/tasks_without_pairs": float(pairs.tasks_without_pairs)}, reduce="sum")
        self.record({"perf/train_s": train_time.seconds})
        self.log_rollout(batch, "train")

    def dpo_update(
        self, agents: list[AgentSamples], chosen: torch.Tensor, rejected: torch.Tensor, gaps: torch.Tensor
    ) -> None:
        """One optimizer step per learner on the pairs (rows ``chosen[p]`` over ``rejected[p]`` of
        every agent's samples ``agents``), and the loss's statistics."""
        deltas = torch.stack([self.log_ratios(i, s, chosen, rejected) for i, s in enumerate(agents)])
        for index, roles in enumerate(self.learners):
            weights = self.candidate_weights(deltas, roles, chosen, rejected, len(agents[0]))
            merged = RolloutBuffer()  # a shared model's roles: each role's nodes its own (own prompts)
            for role, weight in zip(roles, weights):
                merged.add(agents[role].with_advantages(-weight))
            samples = merged.drain(self.agents[roles[0]].pad_token_id)
            kept_rows = torch.nonzero(samples.advantages != 0).flatten()  # candidates in no pair: no gradient
            kept = samples.select(kept_rows) if kept_rows.numel() else None
            loss_fn = lambda mb, i=index: self.loss(mb, None, i)  # noqa: E731
            self.update_agent(index, kept, loss_fn, count=float(len(chosen) * len(roles)), shared_prompts=True)
            if len(chosen):
                self.record({f"{self.learner_name(index)}/delta": float(deltas[roles].mean())}, weight=len(chosen))
        if len(chosen):  # every agent's loss has the same value, -log sigmoid(beta * joint): logged once
            joint = deltas.sum(0)
            stats = {
                "train/loss": float(joint_dpo(deltas, 0, self.dpo_beta).mean()),
                "train/dpo_accuracy": float((joint > 0).float().mean()),
                "train/reward_gap": float(gaps.mean()),
                "train/joint_delta": float(joint.mean()),
            }
            self.record(stats, weight=len(chosen))
        self.record({"train/pairs": float(len(chosen))}, reduce="sum")

    @torch.no_grad()
    def log_ratios(
        self, role: int, samples: AgentSamples, chosen: torch.Tensor, rejected: torch.Tensor
    ) -> torch.Tensor:
        """``[pairs]``: D_i = log pi_i(y_w) - log pi_i(y_l) of agent ``role`` at the current weights
        (minus the initial weights' with ``dpo_reference: initial``)."""
        model = self.agents[role].model
        logprobs = self.sequence_logprobs(model, samples)
        if self.dpo_reference == "initial":
            with self.reference_model(self.learner_of(role)) as reference:
                logprobs = logprobs - self.sequence_logprobs(reference, samples)
        logprobs = logprobs.float().cpu()
        return logprobs[chosen] - logprobs[rejected]

    def sequence_logprobs(self, model: torch.nn.Module, samples: AgentSamples) -> torch.Tensor:
        """``[rows]``: each candidate's summed token log-prob (end token included), in passes of the team's size."""
        out = []
        for rows in self.passes(samples, [model], shared_prompts=self.prompt_groups(samples) is not None):
            part = samples.select(rows)
            args = (part.input_ids, part.attention_mask, part.num_completion)
            out.append(
                masked_sum(
                    completion_logprobs(model, *args, prompt_groups=self.prompt_groups(part)), part.completion_mask
                )
            )
        return torch.cat(out)

    def candidate_weights(
        self, deltas: torch.Tensor, roles: list[int], chosen: torch.Tensor, rejected: torch.Tensor, rows: int
    ) -> list[torch.Tensor]:
        """Per role of this learner ``[rows]``: d (sum over pairs of the role's joint DPO loss) / d log pi(y_k)
        of every candidate k (0 for one in no pair), from ``losses.joint_dpo``'s gradient in D_i."""
        out = []
        for role in roles:
            d = deltas.clone().requires_grad_(True)
            (grad,) = torch.autograd.grad(joint_dpo(d, role, self.dpo_beta).sum(), d)
            weight = torch.zeros(rows)  # D_i = log pi(y_w) - log pi(y_l): +grad on the chosen, -grad on the rejected
            weight.index_add_(0, chosen, grad[role])
            weight.index_add_(0, rejected, -grad[role])
            out.append(weight.to(self.device))
        return out

    def loss(self, samples: AgentSamples, stats: dict | None, learner: int) -> torch.Tensor:
        """Learner ``learner``'s loss on its candidates, summed over rows: -A * log pi(y) with A =
        -(the DPO loss's derivative in log pi(y)): its gradient is the joint DPO loss's, at the
        current weights (``stats``: none to gather)."""
        args = (samples.input_ids, samples.attention_mask, samples.num_completion)
        logprobs = completion_logprobs(self.model_of(learner), *args, prompt_groups=self.prompt_groups(samples))
        return reinforce(masked_sum(logprobs, samples.completion_mask), samples.advantages).sum()
