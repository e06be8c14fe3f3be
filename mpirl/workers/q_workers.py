"""The Q-learning workers.

* ``TransitionWorker``: a ``RolloutWorker`` that acts epsilon-greedily and sends its steps
  (observations, actions, rewards, terminations, truncations with final observations) straight to
  a replay shard rank, not to a learner. It takes new weights either from the synchronous
  broadcast or, asynchronously, from the newest weights message learner 0 posted to it.
* ``QLearner``: a ``Learner`` that receives minibatches from replay shard ranks, takes one
  (allreduced) SGD step per minibatch against a target network, and sends the TD errors back to
  the shard each minibatch came from.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

from mpirl.data.replay_buffer import (
    INSERT_TAG,
    PRIORITY_TAG,
    SAMPLE_TAG,
    WEIGHTS_TAG,
)
from mpirl.runtime.core import RankContext
from mpirl.workers.env_guard import EPISODE_DROPPED, FAILURES
from mpirl.workers.learner import Learner, minibatch_rows
from mpirl.workers.rollout import RolloutWorker


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
            # Replay holds what training sees; episode returns stay the env's.
            obs[t], actions[t], rewards[t] = self.obs, action, self.trained_rewards(reward)
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
                self.episode_ended(i, returns, lengths)
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
        self.report_custom_metrics(metrics, None)
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
    #: Data-channel tags of minibatches in and TD errors out (a multi-agent policy's differ).
    sample_tag, priority_tag = SAMPLE_TAG, PRIORITY_TAG

    def __init__(self, context: RankContext, *args: Any, **kwargs: Any) -> None:
        super().__init__(context, *args, **kwargs)
        self.target = copy.deepcopy(self.policy).requires_grad_(False)
        # SAC has no such key: its soft update (tau) runs after every step.
        self.target_update_freq = getattr(self.loss_config, "target_network_update_freq", 1)
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
            received += self.context.data_channel.recv_each(sources, self.sample_tag)
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
                self.context.data_channel.isend(update, dest, self.priority_tag)
        if self.context.data_channel is not None:
            self.context.data_channel.flush()
        if post_weights_to and post_every and self.updates - self.posted >= post_every:
            flat = self.policy.get_flat_weights()
            for rank in post_weights_to:
                self.context.data_channel.isend((self.updates, flat), rank, WEIGHTS_TAG)
            self.posted = self.updates
        stats = {k: v / max(steps, 1) for k, v in totals.items()}
        result = stats | {"sgd_steps": steps, "priorities": returned,
                          "num_target_updates": self.updates // self.target_update_freq}
        if received and received[-1].get("batches"):
            self.learned_on(received[-1]["batches"][-1], result)
        return result

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
