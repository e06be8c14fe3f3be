"""The replay buffer: sum-tree sampling, n-step returns at episode ends, memory, uniformity."""

from collections import deque

import gymnasium as gym
import numpy as np
import pytest
from mpirl.algorithms.q_learning.apex_loops import apex_epsilons

from mpirl.data.replay_buffer import OBS_ONLY, ReplayBuffer, ReplaySettings, SumTree
from mpirl.errors import ConfigError

COUNTER_OBS = gym.spaces.Box(-1e9, 1e9, (1,), np.float32)
TWO_ACTIONS = gym.spaces.Discrete(2)


def counter_buffer(capacity=64, streams=1, **settings):
    return ReplayBuffer(capacity, streams, COUNTER_OBS, TWO_ACTIONS, ReplaySettings(**settings))


def add_column(buffer, stream, obs, terminated=(), truncated=(), final=100.0, failed=()):
    """One stream's steps: observation k at step k, reward 1 each."""
    steps = len(obs)
    flags = {name: np.zeros((steps, 1), bool) for name in ("term", "trunc", "fail")}
    for name, rows in (("term", terminated), ("trunc", truncated), ("fail", failed)):
        flags[name][list(rows), 0] = True
    buffer.add(np.array([stream]), np.asarray(obs, np.float32).reshape(steps, 1, 1),
               np.zeros((steps, 1), np.int64), np.ones((steps, 1), np.float32),
               flags["term"], flags["trunc"], np.full((len(truncated), 1), final, np.float32),
               flags["fail"])


def transitions_by_obs(buffer, draws=400):
    batch = buffer.sample(draws)
    return {float(o): (float(r), float(d), float(n)) for o, r, d, n in zip(
        batch["obs"][:, 0], batch["rewards"], batch["discounts"], batch["next_obs"][:, 0],
        strict=True)}


def test_sum_tree_samples_in_proportion_to_priority():
    priorities = np.array([1.0, 2.0, 3.0, 4.0, 0.0, 10.0, 0.5])  # size 7: leaves at two depths
    tree = SumTree(len(priorities))
    tree.update(np.arange(len(priorities)), priorities)
    assert tree.total == pytest.approx(priorities.sum(), rel=1e-3)  # 16-bit codes
    rng = np.random.default_rng(0)
    draws = 200_000
    counts = np.bincount(tree.find(rng.random(draws) * tree.total), minlength=len(priorities))
    expected = priorities / priorities.sum() * draws
    assert counts[4] == 0  # priority 0 is never drawn
    live = expected > 0
    chi2 = (((counts - expected)[live]) ** 2 / expected[live]).sum()
    assert chi2 < 22.5, (counts, expected)  # chi-square, 5 dof, p = 0.0004
    tree.update(np.array([5]), np.array([0.0]))
    assert tree.total == pytest.approx(priorities.sum() - 10.0, rel=1e-3)


def test_sum_tree_over_many_blocks_matches_priorities_and_never_draws_a_zero():
    rng = np.random.default_rng(1)
    size = 1000  # 16 blocks, the last one partly filled
    priorities = rng.lognormal(0.0, 3.0, size) * (rng.random(size) > 0.2)
    tree = SumTree(size)
    tree.update(np.arange(size), priorities)
    live = priorities > 0
    np.testing.assert_allclose(tree[np.arange(size)], priorities, rtol=4e-4)
    assert tree.total == pytest.approx(priorities.sum(), rel=4e-4)
    # Every prefix of the mass, edges included, lands on a leaf with a priority.
    mass = np.concatenate([np.linspace(0, tree.total, 50_000, endpoint=False),
                           [np.nextafter(tree.total, 0)]])
    drawn = tree.find(mass)
    assert live[drawn].all()
    draws = np.bincount(tree.find(rng.random(400_000) * tree.total), minlength=size)
    expected = tree[np.arange(size)] / tree.total * 400_000
    big = expected > 50
    assert np.abs(draws[big] - expected[big]).max() < 5 * np.sqrt(expected[big]).max()
    # Block sums are recomputed, not adjusted: zeroing every leaf leaves exactly nothing.
    tree.update(np.arange(size), np.zeros(size))
    assert tree.total == 0.0


def test_priority_codes_keep_zero_and_relative_precision():
    values = np.array([0.0, 1e-12, 2.5e-4, 1.0, 3.7, 1e6, 1e12, np.inf])
    decoded = SumTree(8)
    decoded.update(np.arange(8), values)
    got = decoded[np.arange(8)]
    assert got[0] == 0.0
    np.testing.assert_allclose(got[2:6], values[2:6], rtol=3.5e-4)
    assert got[1] == pytest.approx(2.0 ** -32, rel=1e-3)  # clipped to the lowest level
    assert got[6] == got[7] == pytest.approx(2.0 ** 32, rel=1e-3)  # and to the highest
    with pytest.raises(ValueError, match="finite and >= 0"):
        decoded.update(np.array([0]), np.array([np.nan]))


def test_n_step_returns_stop_at_terminations_and_bootstrap_at_truncations():
    buffer = counter_buffer(n_step=3, gamma=0.5)
    # Steps 0-2 end in a terminal state at step 2; steps 3-5 are cut by a time limit at step 5
    # (final observation 100); steps 6-7 follow. 0.5 is exact in float32.
    add_column(buffer, 0, range(8), terminated=[2], truncated=[5])
    seen = transitions_by_obs(buffer)
    assert seen[0.0] == (1.75, 0.0, 3.0)    # 1 + .5 + .25, no bootstrap past the terminal
    assert seen[1.0][:2] == (1.5, 0.0)
    assert seen[2.0][:2] == (1.0, 0.0)
    assert seen[3.0] == (1.75, 0.125, 100.0)  # bootstrap from the final observation, gamma^3
    assert seen[4.0] == (1.5, 0.25, 100.0)
    assert seen[5.0] == (1.0, 0.5, 100.0)
    # Step 6 lacks a third following row and step 7 any: not sampled yet; the final observation
    # row never starts a transition.
    assert set(seen) == {0.0, 1.0, 2.0, 3.0, 4.0, 5.0}
    add_column(buffer, 0, [8, 9])
    seen = transitions_by_obs(buffer)
    assert seen[6.0] == (1.75, 0.125, 9.0)
    assert {7.0, 8.0, 9.0, 100.0}.isdisjoint(seen)  # 7 needs rows 8, 9 and 10


def test_final_observations_of_several_columns_come_in_step_major_order():
    # What a rollout worker sends: the final observations of the truncated steps only, ordered
    # by step, then by env. Column 1 is cut at step 0 and column 0 at step 1, so the first final
    # observation (200) is column 1's.
    buffer = counter_buffer(n_step=1, gamma=0.5, streams=2)
    obs = np.array([[0, 10], [1, 11], [2, 12]], np.float32).reshape(3, 2, 1)
    truncated = np.array([[False, True], [True, False], [False, False]])
    buffer.add(np.array([0, 1]), obs, np.zeros((3, 2), np.int64), np.ones((3, 2), np.float32),
               np.zeros((3, 2), bool), truncated, np.array([[200.0], [100.0]], np.float32))
    seen = transitions_by_obs(buffer)
    assert seen[1.0] == (1.0, 0.5, 100.0) and seen[10.0] == (1.0, 0.5, 200.0)


def test_one_step_returns_and_streams_continue_across_chunks():
    buffer = counter_buffer(n_step=1, gamma=0.9, streams=2)
    add_column(buffer, 0, [0, 1])
    add_column(buffer, 1, [50, 51, 52])
    add_column(buffer, 0, [2, 3])  # stream 0 goes on where it stopped
    seen = transitions_by_obs(buffer)
    assert seen[1.0] == (1.0, pytest.approx(0.9), 2.0)  # across the chunk boundary
    assert seen[50.0][2] == 51.0 and seen[51.0][2] == 52.0
    assert set(seen) == {0.0, 1.0, 2.0, 50.0, 51.0}


def test_a_shard_joins_a_workers_consecutive_chunks_and_cuts_at_a_lost_one():
    """Chunks carry the worker's count of chunks sent: one that follows the last stored continues
    its streams (a restored run's first chunk, too); one after a gap (a chunk in flight at a
    checkpoint, lost) does not join rows that were never consecutive."""
    import socket

    from mpi4py import MPI

    from mpirl.runtime.core import RankContext
    from mpirl.runtime.layout import Layout
    from mpirl.workers.replay_shard import ReplayShard, ReplayShardSettings

    context = RankContext(0, "replay", 0, 1, Layout().resolve(1), None, MPI.COMM_SELF, None,
                          socket.gethostname(), "cpu")
    settings = ReplayShardSettings(capacity=64, num_streams=1, observation_space=COUNTER_OBS,
                                   action_space=TWO_ACTIONS,
                                   replay=ReplaySettings(n_step=1, gamma=0.9), num_shards=1,
                                   num_envs=1, seed=0)
    shard = ReplayShard(context, settings)

    def chunk(seq, obs):
        steps = len(obs)
        return {"worker": 0, "seq": seq, "obs": np.asarray(obs, np.float32).reshape(steps, 1, 1),
                "actions": np.zeros((steps, 1), np.int64),
                "rewards": np.ones((steps, 1), np.float32),
                "terminated": np.zeros((steps, 1), bool), "truncated": np.zeros((steps, 1), bool),
                "final_obs": np.zeros((0, 1), np.float32), "failed": np.zeros((steps, 1), bool)}

    shard.insert([], [chunk(0, [0, 1]), chunk(1, [2, 3])])
    restored = ReplayShard(context, settings)
    restored.set_state(shard.get_state())
    restored.insert([], [chunk(2, [4, 5]), chunk(4, [40, 41])])  # chunk 3 never arrived
    seen = transitions_by_obs(restored.buffer)
    assert seen[1.0][2] == 2.0 and seen[3.0][2] == 4.0  # joined, across the restore too
    assert 5.0 not in seen  # its successor was lost: no transition to 40
    assert seen[40.0][2] == 41.0


def test_a_failed_step_is_no_transition_but_bootstraps_the_one_before():
    buffer = counter_buffer(n_step=3, gamma=0.5)
    add_column(buffer, 0, range(6), failed=[2])
    seen = transitions_by_obs(buffer)
    assert seen[0.0] == (1.5, 0.25, 2.0)  # stops at the failed step's observation
    assert 2.0 not in seen


def test_uniform_sampling_is_uniform_over_complete_rows():
    buffer = counter_buffer(capacity=1000, n_step=1)
    add_column(buffer, 0, range(101))  # 100 complete transitions
    counts = np.bincount(buffer.sample(50_000)["obs"][:, 0].astype(int), minlength=101)
    assert counts[100] == 0
    expected = 500
    chi2 = ((counts[:100] - expected) ** 2 / expected).sum()
    assert chi2 < 160, chi2  # chi-square, 99 dof, p ~ 0.0001


def test_the_ring_keeps_the_newest_rows():
    buffer = counter_buffer(capacity=10, n_step=1)
    add_column(buffer, 0, range(25))
    assert len(buffer) == 10
    assert sorted(transitions_by_obs(buffer)) == [float(k) for k in range(15, 24)]


def test_prioritized_sampling_follows_td_errors_and_ignores_overwritten_rows():
    buffer = counter_buffer(capacity=100, n_step=1, prioritized=True, alpha=1.0,
                            priority_eps=0.0)
    add_column(buffer, 0, range(11))
    batch = buffer.sample(10)
    # Row k gets priority k + 1 (every row is updated: the tree starts at max priority 1).
    everything = np.arange(10)
    buffer.update_priorities(everything, everything, everything + 1.0)
    obs = buffer.sample(55_000)["obs"][:, 0].astype(int)
    frequency = np.bincount(obs, minlength=10) / len(obs)
    np.testing.assert_allclose(frequency, (everything + 1) / 55, atol=0.006)
    weights = buffer.sample(64)["weights"]
    assert weights.max() == pytest.approx(1.0) and weights.min() > 0
    # A stale update (the generation no longer matches) is dropped.
    assert buffer.update_priorities(batch["indices"][:1], batch["generations"][:1] + 1,
                                    np.array([1e6])) == 0


def test_checkpoint_state_round_trips():
    buffer = counter_buffer(n_step=2, prioritized=True)
    add_column(buffer, 0, range(20), truncated=[7])
    copy = counter_buffer(n_step=2, prioritized=True)
    copy.set_state(buffer.get_state())
    for a, b in ((buffer.obs, copy.obs), (buffer.flags, copy.flags),
                 (buffer.tree.codes, copy.tree.codes), (buffer.tree.sums, copy.tree.sums)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(buffer.sample(32)["obs"], copy.sample(32)["obs"])
    assert np.count_nonzero(copy.flags[0] & OBS_ONLY) == 1  # the final-observation row


@pytest.mark.parametrize("obs_space, limit", [
    (gym.spaces.Box(-np.inf, np.inf, (4,), np.float32), 1.1),        # CartPole
    (gym.spaces.Box(0, 255, (84, 84, 4), np.uint8), 1.1),              # Atari frames
])
@pytest.mark.parametrize("prioritized", [False, True])
def test_memory_per_transition_is_within_ten_percent_of_its_raw_bytes(obs_space, limit,
                                                                       prioritized):
    capacity = 4096
    buffer = ReplayBuffer(capacity, 4, obs_space, TWO_ACTIONS,
                          ReplaySettings(prioritized=prioritized))
    # One observation, action, reward and termination flag per transition: the next
    # observation is the following row's.
    raw = obs_space.shape and np.prod(obs_space.shape) * obs_space.dtype.itemsize
    raw = raw + TWO_ACTIONS.dtype.itemsize + 4 + 1
    assert buffer.nbytes() / capacity <= limit * raw


def test_bad_settings_are_config_errors():
    with pytest.raises(ConfigError, match="alpha must be >= 0"):
        ReplaySettings(alpha=-0.1).check(32)
    with pytest.raises(ConfigError, match="fewer rows per shard than train_batch_size 64"):
        ReplaySettings(capacity=100).check(64, num_shards=2)


def test_apex_epsilons_span_the_papers_range():
    eps = apex_epsilons(8, 0.4, 7.0)
    assert eps[0] == pytest.approx(0.4) and eps[-1] == pytest.approx(0.4 ** 8)
    assert all(a > b for a, b in zip(eps, eps[1:], strict=False))
    assert apex_epsilons(1, 0.4, 7.0) == [0.4 ** 4.5]


def _stacked_episodes(rng, steps, stack=4, size=6):
    """Observations as a frame-stacking wrapper makes them (a reset fills the stack with its
    first frame), with terminations, truncations (whose final observations continue the
    stack) and their flags, one column."""
    frames = deque(maxlen=stack)
    obs, final, terminated, truncated = [], [], [], []

    def frame():
        return rng.integers(0, 256, (1, size, size), dtype=np.uint8)

    def reset():
        first = frame()
        for _ in range(stack):
            frames.append(first)

    reset()
    for _ in range(steps):
        obs.append(np.concatenate(frames))
        frames.append(frame())
        end = rng.random()
        terminated.append(end < 0.05)
        truncated.append(0.05 <= end < 0.08)
        if truncated[-1]:
            final.append(np.concatenate(frames))
        if terminated[-1] or truncated[-1]:
            reset()
    final = np.stack(final) if final else np.zeros((0, stack, size, size), np.uint8)
    return np.stack(obs), final, np.array(terminated), np.array(truncated)


@pytest.mark.parametrize("n_step", [1, 3])
def test_frame_stacks_are_stored_once_and_rebuilt_exactly(n_step):
    rng = np.random.default_rng(0)
    space = gym.spaces.Box(0, 255, (4, 6, 6), np.uint8)
    buffers = [ReplayBuffer(200, 1, space, TWO_ACTIONS, ReplaySettings(n_step=n_step,
                                                                     frame_stack=stack))
               for stack in (0, 4)]
    plain, stacked = buffers
    assert stacked.frames is not None and stacked.obs.shape[2:] == (1, 6, 6)
    for block in range(12):  # the ring wraps; one block comes after lost rows (a cut)
        obs, final, terminated, truncated = _stacked_episodes(rng, 50)
        if block == 7:
            obs = obs[5:]
            terminated, truncated = terminated[5:], truncated[5:]
            final = final[-int(truncated.sum()):] if truncated.any() else final[:0]
        for buffer in buffers:
            buffer.add(np.array([0]), obs[:, None], np.zeros((len(obs), 1), np.int64),
                       np.ones((len(obs), 1), np.float32), terminated[:, None],
                       truncated[:, None], final if len(final) else None,
                       cut=np.array([block == 7]))
    rows = np.arange(plain.length)
    streams = np.zeros_like(rows)
    both = plain._is_start(streams, rows) & stacked._is_start(streams, rows)
    assert both.sum() > 0.9 * stacked._is_start(streams, rows).sum() > 100
    expected = plain._transitions(streams[both], rows[both])
    rebuilt = stacked._transitions(streams[both], rows[both])
    for key in ("obs", "next_obs", "rewards", "discounts"):
        np.testing.assert_array_equal(rebuilt[key], expected[key])
    # A row whose older frames are overwritten is never drawn.
    assert not stacked._is_start(streams, rows)[stacked.frames.depth[0] >
                                                 plain.length - 1 - plain._rows_after(
                                                     streams, rows)].any()
    # Bytes per transition: about one frame (36 bytes here), not four.
    assert stacked.nbytes() < 0.45 * plain.nbytes()
    copy = ReplayBuffer(200, 1, space, TWO_ACTIONS, ReplaySettings(n_step=n_step, frame_stack=4))
    copy.set_state(stacked.get_state())
    np.testing.assert_array_equal(copy._transitions(streams[both], rows[both])["obs"],
                                  expected["obs"])
