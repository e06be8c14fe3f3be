"""IMPALA: asynchronous sampling with V-trace off-policy correction.

Every rollout worker keeps ``max_requests_in_flight_per_worker`` sample calls running. The driver
takes the fragments that have finished as soon as the first one has (stragglers never hold up the
others), the learners train on them with V-trace while the workers go on sampling, and only the
workers whose fragments were used get the new weights. Fragments sampled with older weights are
corrected by V-trace's truncated importance weights; ``policy_lag_mean`` says how old they were.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mpirl.config.fields import AllreduceConfig, OnPolicyConfig
from mpirl.execution.async_ops import FragmentStream, SampleRequests, async_sample, sync_weights
from mpirl.execution.contract import no_config_checks
from mpirl.execution.operators import mean_stats, train_one_step
from mpirl.execution.trainer import Trainer
from mpirl.models.policy import actor_critic_model
from mpirl.models.vtrace import vtrace
from mpirl.workers.learner import Learner
from mpirl.workers.optimizer import decayed_lr
from mpirl.workers.rollout import RolloutWorker

ROLLOUT_WORKER = RolloutWorker
LEARNER = Learner
model_spec = actor_critic_model
check_config = no_config_checks
#: use_lstm works: the rollout ranks carry each env's state and the loss takes sequences.
RECURRENT = True


@dataclass
class Config(OnPolicyConfig, AllreduceConfig):
    """IMPALA's settings. Defaults suit CartPole-v1; every field is a ``--config`` key."""

    # Sampling
    rollout_fragment_length: int = 50
    """Steps per environment in one sample call: the length V-trace walks along. Each update
    takes the fragments that have arrived; on CartPole, 20 learned as fast but less stably (the
    policy collapsed after reaching 400 in 3 of 5 runs, against none of 3 with 50)."""
    max_requests_in_flight_per_worker: int = 2
    """Sample calls kept running on each rollout worker; 2 lets a worker sample the next fragment
    while the learner trains on its last one."""
    fragments_per_call: int = 0
    """0: one sample call per fragment, its answer to the driver, which routes the fragment to
    a learner and the new weights back. n >= 1: each call samples n fragments and streams them
    straight to the learner, which pushes the new weights to the workers itself
    (``FragmentStream``); rank 0 then handles one answer per n fragments, for runs of hundreds
    of rollout ranks. Needs rollout ranks of their own."""
    train_batch_size: int = 800
    """Environment steps per learner update, at least: finished fragments are gathered until
    they hold this many (800: two fragments of 8 environments x 50 steps)."""
    min_steps_per_iteration: int = 2000
    """Environment steps trained on per iteration (one row of metrics), at least."""

    # V-trace
    gamma: float = 0.98
    vtrace_rho_bar: float = 1.0
    """Truncation of the importance weights in the value targets and the policy gradient."""
    vtrace_c_bar: float = 1.0
    """Truncation of the importance weights that carry corrections back in time."""

    # Optimization
    lr: float = 1e-3
    """Adam learning rate at the start. On CartPole, 1e-3 decaying over 800k steps reached 450 on
    8 of 8 seeds (in 246k-609k steps); 2e-3 decaying over 400k learned faster but fell back from
    400-440 before reaching 450 in 3 of 5 runs, and neither a 0.01 entropy weight nor a clip of
    40 fixed that."""
    lr_decay_steps: int = 800_000
    """Environment steps over which the learning rate falls linearly to 0, as in the IMPALA
    paper (late large steps made CartPole's policy collapse); 0 keeps it constant."""
    num_epochs: int = 1
    """Passes over each batch of fragments."""
    num_minibatches: int = 1
    """SGD steps per pass (each takes whole fragments)."""
    ent_coef: float = 0.003


def loss(policy, batch: dict[str, torch.Tensor], config: Config):
    """V-trace policy gradient, value loss towards the V-trace targets, and entropy bonus, for a
    minibatch of whole fragments (``[rows, T]``)."""
    rows, steps = batch["logp"].shape
    if "state_in" in batch:  # use_lstm: each fragment is one sequence, from its first state
        logp, entropy, values, final = policy.evaluate_sequences(
            batch["obs"], batch["actions"], batch["state_in"], batch["resets"])
        logp, entropy, values = logp.T, entropy.T, values.T  # [T, B]
        bootstrap = policy.values_after(batch["bootstrap_obs"], final, batch["dones"][:, -1])
    else:
        logp, entropy, values = policy.evaluate(batch["obs"].flatten(0, 1),
                                                batch["actions"].flatten(0, 1))
        logp, entropy, values = (x.view(rows, steps).T for x in (logp, entropy, values))
        bootstrap = policy.values(batch["bootstrap_obs"])
    targets = vtrace(batch["logp"].T, logp.detach(), batch["rewards"].T, values.detach(),
                     bootstrap.detach(), config.gamma * (1.0 - batch["dones"].T),
                     config.vtrace_rho_bar, config.vtrace_c_bar)
    mask = batch["mask"].T
    count = mask.sum().clamp(min=1.0)
    policy_loss = -(logp * targets.pg_advantages * mask).sum() / count
    vf_loss = 0.5 * ((values - targets.vs).pow(2) * mask).sum() / count
    entropy_mean = (entropy * mask).sum() / count
    total = policy_loss + config.vf_coef * vf_loss - config.ent_coef * entropy_mean
    stats = {"policy_loss": policy_loss.item(), "vf_loss": vf_loss.item(),
             "entropy": entropy_mean.item(), "mean_rho": targets.clipped_rhos.mean().item()}
    return total, stats


def setup(trainer: Trainer) -> SampleRequests | FragmentStream:
    """The sample calls kept running on every rollout worker from one iteration to the next
    (settled before each checkpoint); with ``fragments_per_call``, streamed to the learners."""
    config = trainer.config
    if config.fragments_per_call:
        return FragmentStream(trainer, config.rollout_fragment_length,
                              config.fragments_per_call, config.max_requests_in_flight_per_worker)
    return SampleRequests(trainer, config.rollout_fragment_length,
                          config.max_requests_in_flight_per_worker)


def training_step(trainer: Trainer, requests: SampleRequests | FragmentStream
                  ) -> dict[str, float]:
    """Train on fragments as they finish until ``min_steps_per_iteration`` steps are used."""
    config = trainer.config
    if config.fragments_per_call:
        return streamed_training_step(trainer, requests)
    stats, start = [], trainer.timesteps_total
    while trainer.timesteps_total - start < config.min_steps_per_iteration:
        samples = async_sample(requests, trainer.learners, trainer.obs_filter,
                               config.train_batch_size)
        trainer.count(samples)
        # The paper's schedule: linearly to 0 over lr_decay_steps.
        lr = decayed_lr(config.lr, 0.0, config.lr_decay_steps, trainer.timesteps_total)
        stats.append(train_one_step(trainer.learners, samples, num_epochs=config.num_epochs,
                                    num_minibatches=config.num_minibatches, standardize=(),
                                    lr=lr))
        sync_weights(requests, trainer.learners, samples)
    return mean_stats(stats) | requests.metrics()


def streamed_training_step(trainer: Trainer, stream: FragmentStream) -> dict[str, float]:
    """``training_step`` with ``fragments_per_call``: the learners take the fragments streamed to
    them; rank 0 starts each update and reads the calls' answers."""
    config = trainer.config
    stats, start = [], trainer.timesteps_total
    while trainer.timesteps_total - start < config.min_steps_per_iteration:
        lr = decayed_lr(config.lr, 0.0, config.lr_decay_steps, trainer.timesteps_total)
        row, taken = stream.update(
            config.train_batch_size,
            config.min_steps_per_iteration - (trainer.timesteps_total - start),
            num_epochs=config.num_epochs,
            num_minibatches=config.num_minibatches, standardize=(), lr=lr)
        stats.append(row)
        trainer.count(stream.take_answers(taken))
    return mean_stats(stats) | stream.metrics()
