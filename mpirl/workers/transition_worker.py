"""The epsilon-greedy rollout worker of the Q-learning algorithms (DQN, Ape-X; SAC acts with it
too). It sends its steps (observations, actions, rewards, terminations, truncations with final
observations) straight to a replay shard rank, not to a learner, and takes new weights either
from the synchronous broadcast or, asynchronously, from the newest weights message learner 0
posted to it. With a Q network ``NumpyQPolicy`` can run, its rank never imports torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpirl.data.replay_buffer import INSERT_TAG, WEIGHTS_TAG
from mpirl.runtime.core import RankContext
from mpirl.workers.env_guard import EPISODE_DROPPED, FAILURES
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
