"""Vanilla policy gradient, written as a plug-in from mpirl's public operators.

    PYTHONPATH=examples/plugins mpiexec -n 3 mpirl train --algo vanilla_pg --env CartPole-v1

Each iteration: every rollout worker plays whole-fragment batches, advantages are Monte Carlo
returns minus a learned baseline (GAE with lambda 1), standardized over the batch; the learners
take a few full-batch gradient steps and learner 0 broadcasts the new weights.
"""

from dataclasses import dataclass

import torch

from mpirl.execution import (
    AllreduceConfig,
    Learner,
    OnPolicyConfig,
    PlanState,
    RolloutWorker,
    Trainer,
    actor_critic_model,
    broadcast_weights,
    no_config_checks,
    parallel_rollouts,
    stateless,
    train_one_step,
)

# The rest of the contract (docs/plugins.md), from mpirl's defaults.
ROLLOUT_WORKER = RolloutWorker
LEARNER = Learner
RECURRENT = False  # the loss takes single steps, not sequences
model_spec = actor_critic_model
check_config = no_config_checks
setup = stateless  # nothing kept between iterations


@dataclass
class Config(OnPolicyConfig, AllreduceConfig):
    """Every field is a --config key; the docstring under each one is its documentation."""

    rollout_fragment_length: int = 128
    """Steps per environment per iteration."""
    gae_lambda: float = 1.0
    """1: advantages are Monte Carlo returns minus the baseline."""
    sgd_steps: int = 4
    """Full-batch gradient steps per iteration."""

    def advantage_lambda(self) -> float:
        """The rollout workers' GAE lambda: this config's key (``ConfigHooks``)."""
        return self.gae_lambda


def loss(policy, batch: dict[str, torch.Tensor], config: Config):
    """REINFORCE with a baseline: -log pi(a|s) * advantage, plus the baseline's squared error."""
    logp, entropy, values = policy.evaluate(batch["obs"], batch["actions"])
    policy_loss = -(logp * batch["advantages"]).mean()
    vf_loss = 0.5 * (values - batch["value_targets"]).pow(2).mean()
    total = policy_loss + config.vf_coef * vf_loss - config.ent_coef * entropy.mean()
    return total, {"policy_loss": policy_loss.item(), "vf_loss": vf_loss.item()}


def training_step(trainer: Trainer, state: PlanState) -> dict[str, float]:
    """Sample on every rollout rank, train the learners, broadcast the weights."""
    config = trainer.config
    samples = parallel_rollouts(trainer.rollouts, trainer.learners,
                                config.rollout_fragment_length, trainer.obs_filter)
    trainer.count(samples)
    stats = train_one_step(trainer.learners, samples, num_epochs=config.sgd_steps,
                           num_minibatches=1, standardize=("advantages",))
    broadcast_weights(trainer.learners, trainer.rollouts)
    return stats
