"""Value-based learning on replay: a Q network, an epsilon-greedy rollout worker, a replay learner.

* ``QNetwork``: an MLP (optionally dueling) from observations to one value per discrete action.
  Its weights cross ranks as one flat float32 vector, like ``Policy``'s.
* ``TransitionWorker``: a ``RolloutWorker`` that acts epsilon-greedily and sends its steps
  (observations, actions, rewards, terminations, truncations with final observations) straight to
  a replay shard rank, not to a learner. It takes new weights either from the synchronous
  broadcast or, asynchronously, from the newest weights message learner 0 posted to it.
* ``QLearner``: a ``Learner`` that receives minibatches from replay shard ranks, takes one
  (allreduced) SGD step per minibatch against a target network, and sends the TD errors back to
  the shard each minibatch came from.

An off-policy loss is ``(policy, target, batch, config) -> (loss, td_errors, stats)``.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from mpirl.core import RankContext
from mpirl.dispatch import WorkerGroup, wait
from mpirl.env_guard import EPISODE_DROPPED, FAILURES, unwrap_env_failure
from mpirl.errors import ConfigError, RemoteError
from mpirl.layout import REPLAY
from mpirl.learner import Learner, minibatch_rows
from mpirl.operators import (
    SampleResult,
    add_sample_metrics,
    broadcast_weights,
    mean_stats,
    replay_dest,
    store_to_replay,
    train_from_replay,
)
from mpirl.policy import _ACTIVATIONS, FlatParameters, Policy, _mlp
from mpirl.replay import (
    INSERT_TAG,
    PRIORITY_TAG,
    SAMPLE_TAG,
    WEIGHTS_TAG,
    ReplaySettings,
    ReplayShard,
)
from mpirl.rollout import RolloutWorker


@dataclass(frozen=True)
class QSpec:
    """What every rank needs to build the same Q network."""

    observation_space: gym.Space
    action_space: gym.Space
    hidden_sizes: tuple[int, ...] = (64, 64)
    activation: str = "relu"
    dueling: bool = True

    def build(self, device: str = "cpu") -> QNetwork:
        return QNetwork(self).to(device)


def check_discrete(action_space: gym.Space, algo: str) -> None:
    """ConfigError unless ``action_space`` is Discrete (Q networks need a finite action set)."""
    if not isinstance(action_space, gym.spaces.Discrete):
        raise ConfigError(f"{algo} needs a Discrete action space; this environment's is "
                          f"{action_space}. Use SAC or PPO for continuous actions.")


class QNetwork(FlatParameters):
    """Q values for every action of a Discrete space; dueling splits them into V + A - mean(A)."""

    encode = Policy.encode  # observations as Policy encodes them

    def __init__(self, spec: QSpec) -> None:
        super().__init__()
        if spec.activation not in _ACTIVATIONS:
            raise ConfigError(f"activation must be one of {sorted(_ACTIVATIONS)}, "
                              f"got {spec.activation!r}")
        check_discrete(spec.action_space, "a Q network")
        self.spec = spec
        space = spec.observation_space
        self.obs_dim = int(np.prod(space.shape)) if isinstance(space, gym.spaces.Box) \
            else int(space.n)
        self.num_actions = int(spec.action_space.n)
        hidden = list(spec.hidden_sizes)
        body = _mlp([self.obs_dim, *hidden], spec.activation, out_gain=np.sqrt(2))
        self.body = nn.Sequential(*body, _ACTIVATIONS[spec.activation]())
        width = hidden[-1] if hidden else self.obs_dim
        self.advantage = nn.Linear(width, self.num_actions)
        self.value = nn.Linear(width, 1) if spec.dueling else None

    def forward(self, obs: np.ndarray | torch.Tensor) -> torch.Tensor:
        x = self.body(self.encode(obs))
        advantage = self.advantage(x)
        if self.value is None:
            return advantage
        return self.value(x) + advantage - advantage.mean(-1, keepdim=True)

    @torch.no_grad()
    def act(self, obs: np.ndarray, deterministic: bool = True):
        """Greedy actions, as ``Policy.act`` returns them: ``(actions, log_probs, values)``."""
        q = self(obs)
        values, actions = q.max(-1)
        return actions.cpu().numpy(), np.zeros(len(actions), np.float32), values.cpu().numpy()

    def explore(self, obs: np.ndarray, epsilon: float, rng: np.random.Generator) -> np.ndarray:
        """Epsilon-greedy actions for a batch of observations."""
        greedy = self.act(obs)[0]
        random = rng.integers(0, self.num_actions, len(greedy))
        return np.where(rng.random(len(greedy)) < epsilon, random, greedy)

    def env_actions(self, actions: np.ndarray) -> np.ndarray:
        return actions


class TransitionWorker(RolloutWorker):
    """An epsilon-greedy rollout worker whose steps go to a replay shard."""

    MESSAGES = (*RolloutWorker.MESSAGES, "sample_transitions")

    def __init__(self, context: RankContext, *args: Any, **kwargs: Any) -> None:
        super().__init__(context, *args, **kwargs)
        self.rng = np.random.default_rng(self.seed + 17)
        # Each chunk's number: a shard joins a chunk to this worker's streams only when it
        # stored the one numbered just before. Resetting the envs outside sampling skips a
        # number, and so does a chunk lost in flight at a checkpoint.
        self.chunks_sent = 0
        self.weights_taken = 0
        self.weights_version = 0  # learner 0's SGD step count when it posted these weights

    def _take_posted_weights(self) -> None:
        """Apply the newest weights learner 0 posted (asynchronous sync); older ones are
        skipped."""
        channel = self.context.data_channel
        newest = None
        while channel is not None and (item := channel.poll(tag=WEIGHTS_TAG)) is not None:
            newest = item[0]
        if newest is not None:
            self.weights_version, flat = newest
            self.policy.set_flat_weights(flat)
            self.weights_taken += 1

    def sample_transitions(self, steps_per_env: int, epsilon: float, dest: int | None
                           ) -> dict[str, Any]:
        """Step every environment ``steps_per_env`` times, epsilon-greedily; send the chunk of
        steps to replay rank ``dest`` (or return it in ``chunk`` when ``dest`` is None).
        Returns counts and episode metrics like ``sample``."""
        self._take_posted_weights()
        num_envs = self.envs.num_envs
        shape = (steps_per_env, num_envs)
        obs = np.empty((*shape, *self.obs_shape), self.envs.single_observation_space.dtype)
        space = self.envs.single_action_space
        actions = np.empty((*shape, *space.shape), space.dtype)
        rewards = np.empty(shape, np.float32)
        terminated = np.empty(shape, bool)
        truncated = np.empty(shape, bool)
        failed = np.zeros(shape, bool)
        final_obs = []  # only truncated steps have one: sent compactly, not as a [T, N] block
        returns, lengths = [], []
        for t in range(steps_per_env):
            action = self.policy.explore(self.obs, epsilon, self.rng)
            next_obs, reward, term, trunc, infos = self.envs.step(action)
            obs[t], actions[t], rewards[t] = self.obs, action, reward
            terminated[t], truncated[t] = term, trunc
            for i in np.flatnonzero(trunc):
                final_obs.append(infos["final_obs"][i])
            self.episode_return += reward
            self.episode_length += 1
            done = term | trunc
            if FAILURES in infos:
                self._note_failures(infos)
                dropped = infos.get(EPISODE_DROPPED, np.zeros(num_envs, bool))
                failed[t] = dropped
                done = done & ~dropped
                self.episode_return[dropped] = 0.0
                self.episode_length[dropped] = 0
            for i in np.flatnonzero(done):
                returns.append(float(self.episode_return[i]))
                lengths.append(int(self.episode_length[i]))
            self.episode_return[done] = 0.0
            self.episode_length[done] = 0
            if self.recorder is not None:
                self.recorder.step(self.obs, action, reward, term, trunc,
                                   np.zeros(num_envs, np.float32), infos,
                                   infos.get(EPISODE_DROPPED))
            self.obs = next_obs
        chunk = {"worker": self.context.role_index, "obs": obs, "actions": actions,
                 "rewards": rewards, "terminated": terminated, "truncated": truncated,
                 "final_obs": np.array(final_obs, obs.dtype).reshape(-1, *self.obs_shape),
                 "failed": failed, "seq": self.chunks_sent}
        self.chunks_sent += 1
        failures, self._unreported_failures = self._unreported_failures, 0
        metrics = {"env_steps": steps_per_env * num_envs, "episode_returns": returns,
                   "episode_lengths": lengths, "env_failures": failures,
                   "weights_taken": self.weights_taken, "weights_version": self.weights_version}
        if self.recorder is not None:
            metrics["dumped"] = (self.recorder.path.name, self.recorder.flush())
        if dest is None:
            metrics["chunk"] = chunk
        else:
            self.context.data_channel.flush()
            self.context.data_channel.isend(chunk, dest, INSERT_TAG)
        return metrics

    def evaluate(self, episodes: int, deterministic: bool = True) -> dict[str, Any]:
        self.chunks_sent += 1  # evaluation resets the envs: the streams start again
        return super().evaluate(episodes, deterministic)

    def get_state(self) -> dict[str, Any]:
        return {**super().get_state(), "epsilon_rng": self.rng.bit_generator.state,
                "chunks_sent": self.chunks_sent}

    def set_state(self, state: dict[str, Any]) -> bool:
        continued = super().set_state(state)
        self.rng.bit_generator.state = state["epsilon_rng"]
        # Environments restored with their episodes in progress continue their streams, so a
        # resumed run stores what one never stopped would; reset ones start new streams.
        self.chunks_sent = state.get("chunks_sent", 0) + (0 if continued else 1)
        return continued


class QLearner(Learner):
    """A learner on replay: minibatches from shard ranks, a target network, TD errors back."""

    MESSAGES = (*Learner.MESSAGES, "train_replay")

    def __init__(self, context: RankContext, *args: Any, **kwargs: Any) -> None:
        super().__init__(context, *args, **kwargs)
        self.target = copy.deepcopy(self.policy).requires_grad_(False)
        self.target_update_freq = self.loss_config.target_network_update_freq
        self.updates = 0
        self.posted = 0

    def train_replay(self, sources: list[int], messages: list[dict] | None,
                     priority_dests: dict[int, int | None], post_weights_to: list[int] = (),
                     post_every: int = 0) -> dict[str, Any]:
        """Train on the minibatches replay ranks ``sources`` sent (or ``messages`` given in the
        call): one SGD step each, averaged over learners. The TD errors of shard k's minibatches
        go back to rank ``priority_dests[k]``, or in the result (``priorities``) where that is
        None. With ``post_weights_to``, learner 0 sends its weights to those rollout ranks every
        ``post_every`` updates, without waiting for them to be received."""
        received = list(messages or [])
        if sources:
            received += self.context.data_channel.recv_each(sources, SAMPLE_TAG)
        totals: dict[str, float] = {}
        returned, steps = [], 0
        for message in received:
            if "error" in message:
                raise RuntimeError(message["error"])
            errors = []
            for batch in message["batches"]:
                errors.append(self._replay_step(batch, totals))
                steps += 1
            update = {"indices": np.concatenate([b["indices"] for b in message["batches"]]),
                      "generations": np.concatenate([b["generations"]
                                                     for b in message["batches"]]),
                      "td": np.concatenate(errors)}
            dest = priority_dests.get(message["shard"])
            if dest is None:
                returned.append((message["shard"], update))
            else:
                self.context.data_channel.isend(update, dest, PRIORITY_TAG)
        if self.context.data_channel is not None:
            self.context.data_channel.flush()
        if post_weights_to and post_every and self.updates - self.posted >= post_every:
            flat = self.policy.get_flat_weights()
            for rank in post_weights_to:
                self.context.data_channel.isend((self.updates, flat), rank, WEIGHTS_TAG)
            self.posted = self.updates
        stats = {k: v / max(steps, 1) for k, v in totals.items()}
        return stats | {"sgd_steps": steps, "priorities": returned,
                        "num_target_updates": self.updates // self.target_update_freq}

    def _replay_step(self, batch: dict[str, np.ndarray], totals: dict[str, float]
                     ) -> np.ndarray:
        tensors = {k: torch.as_tensor(v, device=self.device) for k, v in batch.items()
                   if k not in ("indices", "generations")}
        loss, td, stats = self.loss(self.policy, self.target, tensors, self.loss_config)
        self.optimizer.zero_grad(set_to_none=False)
        loss.backward()
        self._apply_shared_gradient(minibatch_rows(tensors))
        self.updates += 1
        tau = getattr(self.loss_config, "tau", 1.0)
        if tau < 1.0:  # soft update every step (SAC)
            with torch.no_grad():
                for mine, theirs in zip(self.target.parameters(), self.policy.parameters(),
                                        strict=True):
                    mine.lerp_(theirs, tau)
        elif self.updates % self.target_update_freq == 0:
            self.target.load_state_dict(self.policy.state_dict())
        for key, value in stats.items():
            totals[key] = totals.get(key, 0.0) + float(value)
        return td.detach().cpu().numpy()

    def get_state(self) -> dict[str, Any]:
        return {**super().get_state(), "target": self.target.get_flat_weights(),
                "updates": self.updates, "posted": self.posted}

    def set_state(self, state: dict[str, Any]) -> None:
        super().set_state(state)
        self.target.set_flat_weights(state["target"])
        self.updates, self.posted = state["updates"], state["posted"]


# What DQN and Ape-X share: the loss, the replay group, the config checks.

#: The statistics dqn_loss reports. Every iteration reports them (NaN before training starts),
#: since progress.csv takes its columns from the first row.
DQN_STATS = ("td_loss", "q_mean", "td_error_abs")


def dqn_loss(policy: QNetwork, target: QNetwork, batch: dict[str, torch.Tensor], config: Any):
    """Huber loss of Q(s, a) against the n-step target ``r + discount * Q_target(s', a')``,
    weighted by the importance weights of prioritized replay. ``a'`` is the online network's
    argmax with ``double_q`` (double DQN), else the target network's."""
    q = policy(batch["obs"]).gather(1, batch["actions"].long().view(-1, 1)).squeeze(1)
    with torch.no_grad():
        next_target = target(batch["next_obs"])
        chooser = policy(batch["next_obs"]) if config.double_q else next_target
        best = chooser.argmax(-1, keepdim=True)
        targets = batch["rewards"] + batch["discounts"] * next_target.gather(1, best).squeeze(1)
    td = q - targets
    loss = (batch["weights"] * nn.functional.smooth_l1_loss(q, targets, reduction="none")).mean()
    stats = {"td_loss": loss.item(), "q_mean": q.mean().item(),
             "td_error_abs": td.abs().mean().item()}
    return loss, td, stats


def q_model_spec(observation_space: gym.Space, action_space: gym.Space, config: Any) -> QSpec:
    return QSpec(observation_space, action_space, tuple(config.hidden_sizes), config.activation,
                 config.dueling)


def replay_settings(config: Any) -> ReplaySettings:
    """The replay keys of a DQN-family config."""
    return ReplaySettings(config.buffer_size, config.prioritized_replay,
                          config.prioritized_replay_alpha, config.prioritized_replay_beta,
                          config.prioritized_replay_eps, config.n_step, config.gamma)


def replay_beta(config: Any, timesteps: int) -> float:
    """The importance-sampling exponent after ``timesteps`` env steps: annealed linearly from
    ``prioritized_replay_beta`` to ``prioritized_replay_beta_final`` over
    ``prioritized_replay_beta_anneal_steps`` (Schaul et al., 2016). It follows from
    ``timesteps_total``, so a resumed run continues the schedule."""
    if not config.prioritized_replay_beta_anneal_steps:
        return config.prioritized_replay_beta
    return linear_epsilon(timesteps, config.prioritized_replay_beta,
                          config.prioritized_replay_beta_final,
                          config.prioritized_replay_beta_anneal_steps)


def check_q_config(config: Any, env: Any, algo: str, continuous: bool = False) -> None:
    """ConfigError on every rank, before anything starts, for a config or environment that a
    replay plan cannot run: DQN-family plans need Discrete actions, SAC Box actions."""
    replay_settings(config).check(config.train_batch_size, max(config.num_replay_shards, 1))
    action_space = env.spaces()[1]
    if not continuous:
        check_discrete(action_space, algo)
    elif not isinstance(action_space, gym.spaces.Box):
        raise ConfigError(f"{algo} needs a continuous (Box) action space; this environment's "
                          f"is {action_space}. Use DQN or PPO for discrete actions.")


def spawn_replay(algo: Any) -> WorkerGroup:
    """The replay shards of ``algo``: one per replay rank, or one in the driver's process when
    there are none. Rollout worker i feeds shard i mod K, each of its envs a stream of its own.
    The group joins the checkpoint (``checkpoint_replay``)."""
    config = algo.config
    shards = max(1, algo.driver.placement.count(REPLAY))
    streams = math.ceil(len(algo.rollouts) / shards) * config.num_envs_per_worker
    observation_space, action_space = algo.env.spaces()
    replay = algo.driver.spawn(
        REPLAY, ReplayShard, config.buffer_size // shards, streams, observation_space,
        action_space, replay_settings(config), shards, config.num_envs_per_worker, config.seed,
        local_if_empty=True)
    algo.extra_groups.append(replay)
    return replay


def sample_and_train(algo: Any, epsilon: float, stat_keys: tuple[str, ...]
                     ) -> dict[str, float]:
    """One synchronous replay iteration (DQN, SAC): every rollout worker samples into replay
    with ``epsilon``; once ``learning_starts`` env steps are stored the learners take
    ``sgd_steps_per_env_step`` SGD steps per new env step (fractions carry over) and learner 0
    broadcasts the weights (a run resumed without its replay first stores ``learning_starts``
    steps again). ``stat_keys``: the loss's statistics, NaN until training starts."""
    config = algo.config
    samples = store_to_replay(algo.rollouts, algo.replay, config.rollout_fragment_length,
                              [epsilon] * len(algo.rollouts))
    algo.count(samples)
    stats = dict.fromkeys((*stat_keys, "sgd_steps", "learner_samples"), float("nan"))
    beta = replay_beta(config, algo.timesteps_total)
    if config.prioritized_replay:
        stats["prioritized_replay_beta"] = beta
    # A run resumed without its replay (checkpoint_replay false) refills it first.
    if algo.timesteps_total >= algo.replay_empty_at + config.learning_starts:
        debt = algo.sgd_step_debt + samples.env_steps * config.sgd_steps_per_env_step
        steps, algo.sgd_step_debt = divmod(debt, 1.0)
        stats |= train_from_replay(algo.learners, algo.replay, int(steps),
                                   config.train_batch_size, beta)
        broadcast_weights(algo.learners, algo.rollouts)
    return stats


def linear_epsilon(step: int, initial: float, final: float, steps: int) -> float:
    """A value annealed linearly from ``initial`` to ``final`` over ``steps`` env steps
    (DQN's epsilon, prioritized replay's beta)."""
    fraction = min(1.0, step / max(steps, 1))
    return initial + fraction * (final - initial)


def apex_epsilons(num_workers: int, epsilon: float, alpha: float) -> list[float]:
    """Ape-X's fixed per-worker exploration: eps_i = epsilon ** (1 + alpha * i / (N - 1)).
    A lone worker takes the middle of that range, epsilon ** (1 + alpha / 2) (0.016 with the
    defaults): the paper's formula has no value for N = 1, and ``epsilon`` itself (0.4) explores
    so much that its episodes can never show what the greedy policy has learned."""
    if num_workers == 1:
        return [epsilon ** (1 + alpha / 2)]
    return [epsilon ** (1 + alpha * i / (num_workers - 1)) for i in range(num_workers)]


class AsyncReplayLoop:
    """Ape-X's asynchronous driver loop: sampling, storing and training overlap.

    Every rollout worker always has one ``sample_transitions`` call in flight, whose steps go to
    its replay shard; when it returns the driver tells the shard to store them and starts the
    next. The learners always have up to ``max_trains_in_flight`` ``train_replay`` calls queued,
    each fed by one shard (round-robin) with ``batches_per_train`` minibatches; the TD errors go
    back to the shard, which applies them at its next call. Learner 0 posts its weights to every
    rollout rank every ``weight_sync_every`` SGD steps; a rollout worker takes the newest at the
    start of its next call. Nobody waits on a collective.
    """

    def __init__(self, algo: Any, epsilons: list[float], batches_per_train: int = 16,
                 max_trains_in_flight: int = 2) -> None:
        self.algo, self.epsilons = algo, epsilons
        self.config = algo.config
        self.batches_per_train = batches_per_train
        self.max_trains_in_flight = max_trains_in_flight
        self.samples: dict[int, Any] = {}  # rollout index -> future
        self.trains: list[Any] = []
        self.inserts: list[Any] = []
        self.next_shard = 0
        self.stored = [0] * len(algo.replay)  # env steps sent to each shard
        # SGD steps of the training calls that have returned; set at the first step from the
        # count restored with a checkpoint (the learner saved after every call started before)
        self.sgd_done: int | None = None
        self.lags: list[int] = []
        self.weight_ranks = [w.rank for w in algo.rollouts if not w.in_process]

    def _start_sample(self, i: int) -> None:
        worker = self.algo.rollouts[i]
        shard = self.algo.replay[i % len(self.algo.replay)]
        self.samples[i] = worker.call_async("sample_transitions",
                                            self.config.rollout_fragment_length,
                                            self.epsilons[i], replay_dest(worker, shard))

    def _start_train(self, shard: Any) -> None:
        replay, learners = self.algo.replay, self.algo.learners
        rows = max(1, self.config.train_batch_size // len(learners))
        for learner in learners:
            dest = replay_dest(shard, learner)
            sent = shard.call_async("sample", self.batches_per_train, rows, dest,
                                    replay_beta(self.config, self.algo.timesteps_total))
            messages = [sent.result()] if dest is None else None
            dests = {k: replay_dest(learner, s) for k, s in enumerate(replay)}
            post = self.weight_ranks if learner.index == 0 else []
            self.trains.append((shard, learner.call_async(
                "train_replay", [] if dest is None else [shard.rank], messages, dests, post,
                self.config.weight_sync_every)))
        self.algo.sgd_steps_total += self.batches_per_train

    def step(self, min_env_steps: int) -> dict[str, float]:
        """Run until ``min_env_steps`` new env steps have been stored; return the statistics of
        the training calls that finished meanwhile."""
        algo, config = self.algo, self.config
        env_steps, results = 0, []
        if self.sgd_done is None:
            self.sgd_done = algo.sgd_steps_total
        while env_steps < min_env_steps:
            for i in range(len(algo.rollouts)):
                if i not in self.samples and (self._may_sample() or not self.trains):
                    self._start_sample(i)
            # Training is paced to at most sgd_steps_per_env_step of the env steps stored.
            budget = (algo.timesteps_total - config.learning_starts) * \
                config.sgd_steps_per_env_step
            while (len(self.trains) < self.max_trains_in_flight
                   and algo.sgd_steps_total + self.batches_per_train <= budget
                   and (shard := self._next_shard()) is not None):
                self._start_train(shard)
            pending = list(self.samples.values()) + [f for _, f in self.trains]
            wait(pending, num_returns=1)
            for i, future in list(self.samples.items()):
                if future.done():
                    del self.samples[i]
                    env_steps += self._stored(i, future)
            for entry in [e for e in self.trains if e[1].done()]:
                self.trains.remove(entry)
                results.append(self._trained(*entry))
        self.inserts = [f for f in self.inserts if not f.done()]
        stats = dict.fromkeys(DQN_STATS, math.nan) | mean_stats(results)
        stats["sgd_steps_total"] = algo.sgd_steps_total
        if config.prioritized_replay:
            stats["prioritized_replay_beta"] = replay_beta(config, algo.timesteps_total)
        # How many SGD steps older than the learner's (as the driver last heard) the weights
        # were that each sampling call of this iteration used: the cost of the async sync.
        stats["weights_lag_sgd_steps"] = float(np.mean(self.lags)) if self.lags else math.nan
        self.lags = []
        return stats

    def _may_sample(self) -> bool:
        """With ``throttle_sampling``, sampling waits while it is more than one round of calls
        ahead of what the learner has trained on (at ``sgd_steps_per_env_step``)."""
        config, algo = self.config, self.algo
        if not config.throttle_sampling:
            return True
        rounds = len(algo.rollouts) * config.num_envs_per_worker * config.rollout_fragment_length
        covered = config.learning_starts + algo.sgd_steps_total / config.sgd_steps_per_env_step
        return algo.timesteps_total < covered + 2 * rounds

    def _next_shard(self) -> Any:
        """The next shard, round-robin, among those holding a few minibatches' worth of rows
        (a shard that no rollout worker feeds is never asked)."""
        replay = self.algo.replay
        for _ in range(len(replay)):
            k = self.next_shard % len(replay)
            self.next_shard += 1
            if self.stored[k] >= 4 * self.config.train_batch_size:
                return replay[k]
        return None

    def _stored(self, i: int, future: Any) -> int:
        algo = self.algo
        try:
            metrics = future.result()
        except RemoteError as error:
            raise unwrap_env_failure(error) from None
        worker = algo.rollouts[i]
        shard = algo.replay[i % len(algo.replay)]
        if self.weight_ranks:
            self.lags.append(max(0, self.sgd_done - metrics["weights_version"]))
        chunk = metrics.get("chunk")
        self.inserts.append(shard.call_async("insert", [] if chunk else [worker.rank],
                                             [chunk] if chunk else None))
        self.stored[i % len(algo.replay)] += metrics["env_steps"]
        sample = SampleResult()
        add_sample_metrics(sample, metrics)
        if self.epsilons[i] > self.config.metrics_max_epsilon and \
                min(self.epsilons) <= self.config.metrics_max_epsilon:
            # An explorer's episodes say little about the policy: counted, not averaged.
            algo.episodes_total += len(sample.episode_returns)
            sample.episode_returns, sample.episode_lengths = [], []
        algo.count(sample)
        return metrics["env_steps"]

    def _trained(self, shard: Any, future: Any) -> dict[str, float]:
        result = future.result()
        self.sgd_done += result["sgd_steps"]
        updates = [update for _, update in result.pop("priorities")]
        if updates:
            shard.call_async("update_priorities", 0, updates).result()
        if not self.weight_ranks and len(self.algo.rollouts):  # world size 1: no data channel
            weights = self.algo.learners[0].call("get_weights")
            for worker in self.algo.rollouts:
                worker.call("set_weights", weights)
        return result
