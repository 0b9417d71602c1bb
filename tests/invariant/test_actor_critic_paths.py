"""Actor-critic invariants: the one-pass update equals the two-pass one, and the PPO form at its
first step has the ratio-free gradient."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from helpers import make_trainer, snapshot, tree_from_functions, two_turn_data
from lit_marl.algorithms import IAC, MAAC
from lit_marl.generation import Sampling


@pytest.mark.parametrize(
    "cls, settings",
    [
        (
            IAC,
            dict(update={"logprob_reduction": "mean"}, critic={"kind": "head", "type": "v", "value_clip_range": None}),
        ),
        (
            IAC,
            dict(update={"logprob_reduction": "mean"}, critic={"kind": "model", "type": "q", "value_clip_range": 0.1}),
        ),
        (
            IAC,
            dict(
                critic={"kind": "head", "value_clip_range": None},
                update={"entropy_coef": 0.01, "logprob_reduction": "mean"},
                share_parameters=True,
            ),
        ),
        (
            IAC,
            dict(
                update={"logprob_reduction": "mean"}, critic={"kind": "model"}, share_parameters=True, policy_loss="ppo"
            ),
        ),
        (MAAC, dict(update={"logprob_reduction": "mean"}, critic={"type": "v", "value_clip_range": None})),
        (
            MAAC,
            dict(
                update={"logprob_reduction": "mean"},
                critic={"type": "q"},
                policy_loss="ppo",
                advantage={"normalization": False},
            ),
        ),
    ],
)
def test_update_in_one_pass_equals_the_two_pass_update(tmp_path, cls, settings):
    """When an update is one optimizer step per model on rows that fit one pass, the behaviour
    log-probs and values come from the update's own forward (no separate no-grad pass): the weights
    and the logged values, targets and advantages equal those of the two-pass path (forced here by
    one row per pass, which accumulates the same gradient)."""
    runs = {}
    for name, passes in (("one", {}), ("two", dict(memory={"forward_batch_size": 1}))):
        L.seed_everything(5)
        module = cls(model="tiny-random", num_agents=2, learning_rate=1e-3, **settings, **passes)
        module.configure_model()
        start = {f"actor.{k}": v for k, v in snapshot(module).items()}
        prepared: list[int] = []
        module.prepare = lambda per_agent, calls=prepared, run=module.prepare: calls.append(1) or run(per_agent)
        trainer = make_trainer(tmp_path / name, limit_train_batches=1, limit_val_batches=0)
        trainer.fit(module, datamodule=two_turn_data())
        assert len(prepared) == (0 if name == "one" else 1), f"{name}: prepare ran {len(prepared)} times"
        weights = {f"actor.{k}": v for k, v in snapshot(module).items()}
        timed = [k for k in trainer.callback_metrics if k.startswith("perf/") or k.endswith("_per_s")]
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k not in timed}
        runs[name] = weights, metrics, trainer.global_step, start
    (w1, m1, steps1, start), (w2, m2, steps2, _) = runs["one"], runs["two"]
    assert steps1 == steps2
    assert w1.keys() == w2.keys()
    moved = [k for k in w1 if not torch.equal(w1[k], start[k])]
    assert moved, "nothing moved: the comparison is void"
    # Adam's first step is lr * g / (|g| + eps): a float-rounding difference moves only the few
    # weights whose gradient is ~0 (by a fraction of lr); a different gradient moves most by ~2 lr
    for key in w1:
        diff = (w1[key] - w2[key]).abs()
        assert float(diff.max()) < 1e-4, key
        assert int((diff > 1e-6).sum()) <= max(2, diff.numel() // 1000), key
    assert m1.keys() == m2.keys()
    for key in m1:
        assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=1e-5), key


def test_ppo_form_at_the_first_step_has_the_ratio_free_gradient(tiny_agents):
    """With the behaviour log-probs equal to the current ones the ratio is 1 and no clipping is
    active: d/dθ [ratio * A] = A * d/dθ log pi, the ratio-free gradient."""
    torch.manual_seed(0)
    batch = tree_from_functions(
        tiny_agents,
        [{"t": 0}, {"t": 1}],
        [["a", "b"], ["c", "d"]],
        lambda agent_completions, tasks: [0.0] * len(tasks),
        1,
        sampling=Sampling(max_new_tokens=6),
    )
    samples = batch.agents[0]
    gradients = {}
    for form in ("reinforce", "ppo"):
        module = IAC(model="tiny-random", num_agents=2, policy_loss=form, update={"entropy_coef": 0.0})
        module.agents = torch.nn.ModuleList(tiny_agents)
        module.configure_model()
        with torch.no_grad():
            old = module.actor_forward(0, samples)[0]
        prepared = samples.with_advantages(torch.tensor([1.5, -0.5]))
        prepared.old_logprobs, prepared.old_values, prepared.targets = old, torch.zeros(2), torch.zeros(2)
        model = module.model_of(0)
        model.zero_grad()
        module.critic_kind = "model"  # policy term only: no value head in this comparison
        module.loss(prepared, {}, 0).backward()
        gradients[form] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
    assert gradients["ppo"].keys() == gradients["reinforce"].keys() and gradients["ppo"]
    for name, grad in gradients["reinforce"].items():
        torch.testing.assert_close(gradients["ppo"][name], grad, rtol=1e-5, atol=1e-7)
    # and the comparison can fail: a stale behaviour policy changes the PPO gradient
    module.policy_form = "ppo"
    prepared.old_logprobs = old - 0.5
    module.loss(prepared, {}, 0).backward()
    moved = {n: p.grad for n, p in module.model_of(0).named_parameters() if p.grad is not None}
    assert any(not torch.allclose(moved[n], g) for n, g in gradients["reinforce"].items())
    module.model_of(0).zero_grad()
