"""Replay: a preallocated NumPy buffer (uniform or prioritized, n-step), local to a replay rank.

Storage. Each environment a rollout worker steps is one *stream*, and every stream owns a
contiguous ring of rows in the buffer's arrays (``obs[stream, row]`` and so on). A row is one step:
its observation, action, reward and a flag byte. The next observation of row ``t`` is simply the
observation of row ``t + 1`` of the same stream, so no observation is stored twice. The only extra
rows are *observation-only* rows: the final observation of an episode cut by a time limit (needed
to bootstrap), and the step of an environment failure. They are never sampled as a start.

n-step returns are computed when sampling, by walking ``n`` rows forward from each sampled row
(vectorized over the batch); a terminal row stops the walk without a bootstrap, an
observation-only row stops it with a bootstrap from that row's observation.

Prioritized replay keeps one ``SumTree`` leaf per row: a 16-bit priority code, plus a float64 sum
and the lowest code per block of 64 rows (about 2.3 bytes per row in all). The importance
weights are normalized by the largest weight any stored row has (that of the lowest priority),
as in Schaul et al. (2016), so that a minibatch's weights do not depend on what else it drew.

What crosses ranks (``mpirl.workers.replay_shard.ReplayShard``): rollout ranks send chunks of
steps straight to a shard rank; a shard sends minibatches straight to a learner rank; the
learner sends TD errors back (each with its tag, ``mpirl.data.tags``). The driver only tells each
rank when to do what; or, streamed (Ape-X's ``fragments_per_call``), a shard serving stores the
chunks as they come and answers the learner's requests itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np

from mpirl.errors import ConfigError

#: Row flags (one byte per row).
TERMINATED = 1
"""The episode ended in a terminal state after this step: no bootstrap."""
OBS_ONLY = 2
"""The row holds only an observation (a truncated episode's final one, or the step at which an
environment failed): never a transition start, and an n-step walk stops and bootstraps here."""


@dataclass(frozen=True)
class ReplaySettings:
    """How a buffer samples; the replay keys of a replay-based algorithm's config."""

    capacity: int = 50_000
    """Rows over all shards (each shard holds capacity / num_shards)."""
    prioritized: bool = False
    """Sample rows in proportion to priority**alpha (else uniformly)."""
    alpha: float = 0.6
    """Prioritization exponent: 0 is uniform."""
    beta: float = 0.4
    """Importance-sampling exponent for the loss weights: 1 corrects the bias fully."""
    priority_eps: float = 1e-6
    """Added to |TD error| so that no row gets priority 0."""
    n_step: int = 1
    """Steps summed into each return before bootstrapping."""
    gamma: float = 0.99
    """Discount factor."""
    frame_stack: int = 0
    """Frames per stacked image observation (Atari's 4, channels first): each row then stores
    only its newest frame and rebuilds the stack from the rows before it. 0 or 1: rows store
    whole observations."""

    @classmethod
    def from_config(cls, config: Any, frame_stack: int = 0) -> ReplaySettings:
        """The replay keys of a replay-based algorithm's config; ``frame_stack``: the env's
        stacked frames per observation (Atari's), stored once each."""
        return cls(config.buffer_size, config.prioritized_replay, config.prioritized_replay_alpha,
                   config.prioritized_replay_beta, config.prioritized_replay_eps,
                   config.n_step, config.gamma, frame_stack)

    def check(self, batch_size: int, num_shards: int = 1) -> None:
        """ConfigError for settings no buffer can work with."""
        if self.alpha < 0:
            raise ConfigError(f"prioritized replay alpha must be >= 0, got {self.alpha}")
        if not 0 <= self.beta <= 1:
            raise ConfigError(f"prioritized replay beta must be in [0, 1], got {self.beta}")
        if self.n_step < 1:
            raise ConfigError(f"n_step must be >= 1, got {self.n_step}")
        if not 0 <= self.gamma <= 1:
            raise ConfigError(f"gamma must be in [0, 1], got {self.gamma}")
        if self.capacity // max(num_shards, 1) < batch_size:
            raise ConfigError(
                f"replay buffer_size {self.capacity} over {max(num_shards, 1)} shard(s) holds "
                f"fewer rows per shard than train_batch_size {batch_size}; raise buffer_size or "
                f"lower train_batch_size")


#: Leaves per block of the priority sum tree (see ``SumTree``).
PRIORITY_BLOCK = 64
#: Priorities are stored as 16-bit codes on a log2 scale over [2**-32, 2**32]; code 0 is exactly 0.
_LOG2_LOW, _LOG2_HIGH = -32.0, 32.0
_CODE_STEP = (_LOG2_HIGH - _LOG2_LOW) / 65534
_DECODED = np.concatenate([[0.0], np.exp2(_LOG2_LOW + np.arange(65535) * _CODE_STEP)])
#: The lowest code of a block with no priority above 0 (codes go up to 65535).
_NO_CODE = 1 << 16


def encode_priorities(values: np.ndarray) -> np.ndarray:
    """16-bit codes of non-negative priorities: 0 stays exactly 0, anything else is rounded to
    the nearest of 65,535 log-spaced levels (relative error at most 0.035%) and clipped to
    [2**-32, 2**32]."""
    values = np.asarray(values, np.float64)
    if not np.all(values >= 0):  # also catches NaN
        raise ValueError(f"priorities must be finite and >= 0, got {values[~(values >= 0)][:4]}")
    codes = np.zeros(values.shape, np.uint16)
    live = values > 0
    levels = np.rint((np.log2(values[live]) - _LOG2_LOW) / _CODE_STEP)
    codes[live] = np.clip(levels, 0, 65534).astype(np.uint16) + 1
    return codes


class SumTree:
    """Sampling in proportion to ``size`` priorities, in about 2.3 bytes per leaf.

    Each leaf is a 16-bit code (``encode_priorities``); leaves are grouped in blocks of
    ``PRIORITY_BLOCK`` and only the blocks' sums sit in a float64 binary tree (node 1 the root,
    node i's children 2i and 2i+1, block b at node ``num_blocks + b``; any number of blocks, the
    leaves of the tree then sit at two depths). A float64 tree over every leaf would cost 16 bytes
    per leaf, half again a 29-byte CartPole transition. A block's sum is recomputed from its
    decoded leaves whenever one of them changes, so sums never drift. Sampling descends the tree
    to a block, then takes a cumulative sum over that block's 64 leaves; both are vectorized over
    the batch. Each block also keeps its lowest non-zero code (codes grow with the priority), so
    the lowest priority above 0 is the least of those.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.num_blocks = max(1, math.ceil(size / PRIORITY_BLOCK))
        self.codes = np.zeros(self.num_blocks * PRIORITY_BLOCK, np.uint16)
        self.sums = np.zeros(2 * self.num_blocks, np.float64)
        self.block_min_codes = np.full(self.num_blocks, _NO_CODE, np.int32)

    @property
    def total(self) -> float:
        return float(self.sums[1])

    @property
    def min_priority(self) -> float:
        """The lowest stored priority above 0 (0.0 while every priority is 0): a scan of the
        blocks' lowest codes, 1/64 of the leaves, cheap beside a minibatch."""
        code = int(self.block_min_codes.min())
        return 0.0 if code == _NO_CODE else float(_DECODED[code])

    def nbytes(self) -> int:
        return self.codes.nbytes + self.sums.nbytes + self.block_min_codes.nbytes

    def __getitem__(self, leaves: np.ndarray) -> np.ndarray:
        """The stored (rounded) priorities of ``leaves``."""
        return _DECODED[self.codes[np.asarray(leaves)]]

    def _block_cumsums(self, blocks: np.ndarray) -> np.ndarray:
        return _DECODED[self.codes.reshape(self.num_blocks, PRIORITY_BLOCK)[blocks]].cumsum(1)

    def update(self, leaves: np.ndarray, values: np.ndarray) -> None:
        """Set ``leaves`` (indices 0..size-1) to ``values`` and refresh their blocks' sums."""
        leaves = np.asarray(leaves, np.int64)
        self.codes[leaves] = encode_priorities(values)
        self._refresh(np.unique(leaves // PRIORITY_BLOCK))

    def _refresh(self, blocks: np.ndarray) -> None:
        # The last cumulative sum, not np.sum: ``find`` compares against the same cumsum.
        nodes = blocks + self.num_blocks
        self.sums[nodes] = self._block_cumsums(blocks)[:, -1]
        codes = self.codes.reshape(self.num_blocks, PRIORITY_BLOCK)[blocks].astype(np.int32)
        self.block_min_codes[blocks] = np.where(codes == 0, _NO_CODE, codes).min(1)
        nodes = np.unique(nodes // 2)
        nodes = nodes[nodes >= 1]
        while nodes.size:
            self.sums[nodes] = self.sums[2 * nodes] + self.sums[2 * nodes + 1]
            nodes = np.unique(nodes // 2)
            nodes = nodes[nodes >= 1]

    def find(self, mass: np.ndarray) -> np.ndarray:
        """The leaf where each prefix sum ``mass`` (in [0, total)) falls."""
        mass = np.array(mass, np.float64)
        nodes = np.ones(mass.shape, np.int64)
        inner = nodes < self.num_blocks
        while inner.any():
            current = nodes[inner]
            left = self.sums[2 * current]
            right = mass[inner] >= left
            mass[inner] -= left * right
            nodes[inner] = 2 * current + right
            inner = nodes < self.num_blocks
        blocks = nodes - self.num_blocks
        cumsums = self._block_cumsums(blocks)
        offset = np.count_nonzero(cumsums <= mass[..., None], axis=-1)
        # Rounding in the descent can leave a residual at or past the block's sum: take the last
        # leaf with a priority then, never a zero one after it.
        last = np.argmax(cumsums >= cumsums[..., -1:], axis=-1)
        return blocks * PRIORITY_BLOCK + np.minimum(offset, last)

    def get_state(self) -> np.ndarray:
        return self.codes[:self.size]

    def set_state(self, codes: np.ndarray) -> None:
        self.codes[:self.size] = codes
        self._refresh(np.arange(self.num_blocks))


class FrameStackStore:
    """What rebuilds stacked frames from rows that hold one frame each.

    A stacked observation (K frames of C channels, oldest first) usually shares K - 1 frames
    with the row before it. Row i then keeps only its newest frame, and ``depth[i]`` (0 to
    K - 1) says how many rows before it hold its older frames; a stack that reaches back past
    an episode's first row repeats that row's frame, as a reset fills the stack. A row whose
    stack fits neither (rows lost between blocks, a wrapper that pads otherwise) is kept whole
    in ``whole``, and so are the rows whose window would reach it. Every stack is checked
    against its rebuild when written, so what comes out is exactly what went in."""

    def __init__(self, streams: int, length: int, shape: tuple[int, ...], stack: int) -> None:
        self.stack, self.channels = stack, shape[0] // stack
        self.depth = np.zeros((streams, length), np.uint8)
        #: (stream, row) -> its whole stack, for rows the newest frames cannot rebuild.
        self.whole: dict[tuple[int, int], np.ndarray] = {}
        #: Per stream: the last stack written, and the newest frames of the rows before the next
        #: one that continue without a break (at most stack - 1).
        self.last: list[np.ndarray | None] = [None] * streams
        self.chain: list[list[np.ndarray]] = [[] for _ in range(streams)]

    @staticmethod
    def fits(shape: tuple[int, ...], dtype: Any, stack: int) -> bool:
        return stack > 1 and len(shape) == 3 and shape[0] % stack == 0 and dtype == np.uint8

    def nbytes(self) -> int:
        return self.depth.nbytes + sum(v.nbytes for v in self.whole.values())

    def write(self, stream: int, rows: np.ndarray, obs: np.ndarray) -> np.ndarray:
        """Record how to rebuild each of ``obs`` (whole stacks, about to go to ``rows``); return
        the newest frame of each, what the rows store."""
        c, k = self.channels, self.stack
        for row in rows:
            self.whole.pop((stream, int(row)), None)
        for row, stacked in zip(rows, obs, strict=True):
            previous, chain = self.last[stream], self.chain[stream]
            if previous is None or not np.array_equal(stacked[:-c], previous[c:]):
                chain.clear()  # a break: a reset, or rows lost between blocks
            newest = stacked[-c:]
            depth = next((d for d in (len(chain), 0) if np.array_equal(
                stacked, self._padded(chain[len(chain) - d:], newest))), None)
            if depth is None:
                self.whole[(stream, int(row))] = stacked.copy()
            self.depth[stream, row] = depth or 0
            chain.append(newest.copy())
            del chain[:-(k - 1)]
            self.last[stream] = stacked.copy()
        return obs[:, -c:]

    def _padded(self, older: list[np.ndarray], newest: np.ndarray) -> np.ndarray:
        window = [*older, newest]
        return np.concatenate([window[0]] * (self.stack - len(window)) + window)

    def rebuild(self, stream: np.ndarray, row: np.ndarray, frames: np.ndarray,
                length: int) -> np.ndarray:
        """The stacked observations of rows ``(stream, row)``."""
        k = self.stack
        depth = self.depth[stream, row].astype(np.int64)
        parts = []
        for j in range(k):  # oldest first: frame j comes from min(k - 1 - j, depth) rows back
            back = np.minimum(k - 1 - j, depth)
            parts.append(frames[stream, (row - back) % length])
        out = np.concatenate(parts, axis=1)
        for i, key in enumerate(zip(stream.tolist(), row.tolist(), strict=True)):
            whole = self.whole.get(key)
            if whole is not None:
                out[i] = whole
        return out

    def get_state(self) -> dict[str, Any]:
        return {"depth": self.depth, "whole": self.whole, "last": self.last,
                "chain": self.chain}

    def set_state(self, state: dict[str, Any]) -> None:
        self.depth[...] = state["depth"]
        self.whole = dict(state["whole"])
        self.last = list(state["last"])
        self.chain = [list(frames) for frames in state["chain"]]


class ReplayBuffer:
    """Rows of steps from ``num_streams`` environments, ``capacity`` rows in all.

    ``add`` takes a ``[T, N]`` block of steps of N streams; ``sample`` returns a minibatch of
    n-step transitions with ``obs, actions, rewards, discounts, next_obs, weights`` and the
    ``indices`` and ``generations`` that ``update_priorities`` needs to find the rows again.
    """

    def __init__(self, capacity: int, num_streams: int, observation_space: gym.Space,
                 action_space: gym.Space, settings: ReplaySettings, seed: int = 0) -> None:
        if num_streams < 1:
            raise ConfigError(f"a replay buffer needs at least one stream, got {num_streams}")
        self.settings = settings
        self.num_streams = num_streams
        self.length = max(2, math.ceil(capacity / num_streams))  # rows per stream
        s, n = num_streams, self.length
        shape = tuple(observation_space.shape)
        stacked = FrameStackStore.fits(shape, observation_space.dtype, settings.frame_stack)
        # With frame stacks each row holds one frame; FrameStackStore keeps what rebuilds them.
        row_shape = (shape[0] // settings.frame_stack, *shape[1:]) if stacked else shape
        self.obs = np.zeros((s, n, *row_shape), observation_space.dtype)
        self.frames = FrameStackStore(s, n, shape, settings.frame_stack) if stacked else None
        self.actions = np.zeros((s, n, *action_space.shape), action_space.dtype)
        self.rewards = np.zeros((s, n), np.float32)
        self.flags = np.zeros((s, n), np.uint8)
        self.written = np.zeros(s, np.int64)  # rows ever written per stream
        self.tree = SumTree(s * n) if settings.prioritized else None
        self.max_priority = 1.0
        self.rng = np.random.default_rng(seed)

    # Size and memory.

    @property
    def capacity(self) -> int:
        return self.num_streams * self.length

    def __len__(self) -> int:
        return int(np.minimum(self.written, self.length).sum())

    def nbytes(self) -> int:
        """Bytes of every array the buffer holds (the sum tree included)."""
        arrays = [self.obs, self.actions, self.rewards, self.flags, self.written]
        return (sum(a.nbytes for a in arrays) + (0 if self.tree is None else self.tree.nbytes())
                + (0 if self.frames is None else self.frames.nbytes()))

    # Writing.

    def add(self, streams: np.ndarray, obs: np.ndarray, actions: np.ndarray,
            rewards: np.ndarray, terminated: np.ndarray, truncated: np.ndarray,
            final_obs: np.ndarray | None = None, failed: np.ndarray | None = None,
            cut: np.ndarray | None = None, active: np.ndarray | None = None) -> int:
        """Append a ``[T, N]`` block: column j continues stream ``streams[j]``.

        ``final_obs`` holds one observation per truncated step, in row-major ``(t, j)`` order
        (what a rollout worker sends: no ``[T, N]`` block that is mostly unused); each is the
        observation to bootstrap from after its step;
        ``failed[t, j]`` marks a step at which the environment failed (not a transition);
        ``cut[j]`` says stream j's previous rows do not continue into this block (its envs were
        reset, or rows between were lost), so its last row loses its transition; ``active[t, j]``
        (None: all) says whether stream j's agent acted at step t (a multi-agent slot between
        its agents' episodes did not): only those steps are rows. Returns the rows written."""
        steps, columns = rewards.shape
        failed = np.zeros_like(terminated) if failed is None else failed
        flags = np.where(terminated, TERMINATED, 0).astype(np.uint8)
        flags[failed] = OBS_ONLY
        # Where each truncated step's final observation sits in final_obs.
        final_at = np.cumsum(truncated.reshape(-1)).reshape(truncated.shape) - 1
        written = 0
        for j in range(columns):
            stream = int(streams[j])
            if cut is not None and cut[j] and self.written[stream]:
                last = (self.written[stream] - 1) % self.length
                self._set_flags(stream, np.array([last]), OBS_ONLY)
            col_obs, col_act = obs[:, j], actions[:, j]
            col_rew, col_flags = rewards[:, j], flags[:, j]
            col_ends, col_final_at = truncated[:, j] & ~failed[:, j], final_at[:, j]
            if active is not None and not active[:, j].all():
                acted = active[:, j]
                col_obs, col_act, col_rew, col_flags = (
                    col_obs[acted], col_act[acted], col_rew[acted], col_flags[acted])
                col_ends, col_final_at = col_ends[acted], col_final_at[acted]
            ends = np.flatnonzero(col_ends)
            if ends.size:
                # One observation-only row after each truncated step holds its final observation.
                at = ends + 1
                col_obs = np.insert(col_obs, at, final_obs[col_final_at[ends]], axis=0)
                col_act = np.insert(col_act, at, np.zeros_like(col_act[:1]), axis=0)
                col_rew = np.insert(col_rew, at, 0.0)
                col_flags = np.insert(col_flags, at, OBS_ONLY)
            written += self._write(stream, col_obs, col_act, col_rew, col_flags)
        return written

    def _write(self, stream: int, obs, actions, rewards, flags) -> int:
        count = len(rewards)
        if count > self.length:  # only the newest rows fit
            obs, actions, rewards, flags = obs[-self.length:], actions[-self.length:], \
                rewards[-self.length:], flags[-self.length:]
            self.written[stream] += count - self.length
            count = self.length
        rows = (self.written[stream] + np.arange(count)) % self.length
        if self.frames is not None:
            obs = self.frames.write(stream, rows, obs)
        self.obs[stream, rows] = obs
        self.actions[stream, rows] = actions
        self.rewards[stream, rows] = rewards
        self.flags[stream, rows] = flags
        self.written[stream] += count
        if self.tree is not None:
            priority = np.where(flags & OBS_ONLY, 0.0, self.max_priority)
            self.tree.update(stream * self.length + rows, priority)
        return count

    def _set_flags(self, stream: int, rows: np.ndarray, flag: int) -> None:
        self.flags[stream, rows] |= flag
        if self.tree is not None and flag & OBS_ONLY:
            self.tree.update(stream * self.length + rows, np.zeros(len(rows)))

    # Sampling.

    def sample(self, batch_size: int, beta: float | None = None) -> dict[str, np.ndarray]:
        """``batch_size`` n-step transitions (uniformly, or by priority with importance weights
        ``weights`` = (N P(i))**-beta divided by the largest such weight of any row this buffer
        holds, i.e. (min priority / priority)**beta; all 1 when uniform)."""
        if len(self) == 0:
            raise ValueError("cannot sample from an empty replay buffer")
        beta = self.settings.beta if beta is None else beta
        stream = np.empty(batch_size, np.int64)
        row = np.empty(batch_size, np.int64)
        todo = np.arange(batch_size)
        for _ in range(100):
            s, r = self._draw(len(todo), stratified=len(todo) == batch_size)
            ok = self._is_start(s, r)
            stream[todo[ok]], row[todo[ok]] = s[ok], r[ok]
            todo = todo[~ok]
            if not todo.size:
                break
        else:
            raise ValueError("the replay buffer holds no complete transition yet")
        batch = self._transitions(stream, row)
        leaves = stream * self.length + row
        if self.tree is not None:
            # (N P(i))**-beta / max_j (N P(j))**-beta: N and the total cancel out.
            weights = (self.tree.min_priority / self.tree[leaves]) ** beta
            batch["weights"] = weights.astype(np.float32)
        else:
            batch["weights"] = np.ones(batch_size, np.float32)
        batch["indices"] = leaves
        batch["generations"] = self._generation(stream, row)
        return batch

    def _draw(self, count: int, stratified: bool) -> tuple[np.ndarray, np.ndarray]:
        if self.tree is not None:
            total = self.tree.total
            if stratified:  # one draw per equal slice of the mass: lower variance
                mass = (np.arange(count) + self.rng.random(count)) * (total / count)
            else:
                mass = self.rng.random(count) * total
            leaves = self.tree.find(np.minimum(mass, np.nextafter(total, 0)))
            return leaves // self.length, leaves % self.length
        filled = np.minimum(self.written, self.length)
        stream = self.rng.choice(self.num_streams, size=count, p=filled / filled.sum())
        offset = (self.rng.random(count) * filled[stream]).astype(np.int64)
        row = (self.written[stream] - filled[stream] + offset) % self.length
        return stream, row

    def _rows_after(self, stream: np.ndarray, row: np.ndarray) -> np.ndarray:
        """How many newer rows stream ``stream`` holds after ``row``."""
        return (self.written[stream] - 1 - row) % self.length

    def _generation(self, stream: np.ndarray, row: np.ndarray) -> np.ndarray:
        """The global position of each row in its stream: tells a row from its overwriter."""
        return self.written[stream] - 1 - self._rows_after(stream, row)

    def _is_start(self, stream: np.ndarray, row: np.ndarray) -> np.ndarray:
        """Rows that start a complete n-step transition (its rows are all written)."""
        ok = (self.flags[stream, row] & OBS_ONLY) == 0
        ok &= self._generation(stream, row) >= 0
        if self.frames is not None:  # the rows its stack is rebuilt from are still held
            ok &= self.frames.depth[stream, row] <= self.length - 1 - self._rows_after(stream,
                                                                                       row)
        after = self._rows_after(stream, row)
        live = ok.copy()  # walk still going
        for k in range(self.settings.n_step):
            flags = self.flags[stream, (row + k) % self.length]
            live &= (k == 0) | ((flags & OBS_ONLY) == 0)
            ended = live & ((flags & TERMINATED) != 0)
            live &= ~ended
            ok &= ~live | (after >= k + 1)  # a bootstrap row must exist
        return ok

    def _transitions(self, stream: np.ndarray, row: np.ndarray) -> dict[str, np.ndarray]:
        gamma = self.settings.gamma
        size = len(row)
        returns = np.zeros(size, np.float32)
        discount = np.ones(size, np.float32)
        boot = row.copy()
        live = np.ones(size, bool)
        for k in range(self.settings.n_step):
            r = (row + k) % self.length
            flags = self.flags[stream, r]
            if k:
                stop = live & ((flags & OBS_ONLY) != 0)  # bootstrap from this observation
                live &= ~stop
            returns += np.where(live, discount * self.rewards[stream, r], 0.0)
            discount = np.where(live, discount * gamma, discount)
            boot = np.where(live, (r + 1) % self.length, boot)
            terminal = live & ((flags & TERMINATED) != 0)
            discount[terminal] = 0.0
            live &= ~terminal
        return {"obs": self._observations(stream, row), "actions": self.actions[stream, row],
                "rewards": returns, "discounts": discount,
                "next_obs": self._observations(stream, boot)}

    def _observations(self, stream: np.ndarray, row: np.ndarray) -> np.ndarray:
        if self.frames is None:
            return self.obs[stream, row]
        return self.frames.rebuild(stream, row, self.obs, self.length)

    # Priorities.

    def update_priorities(self, indices: np.ndarray, generations: np.ndarray,
                          td_errors: np.ndarray) -> int:
        """Set the priorities of sampled rows from their TD errors; rows overwritten since they
        were sampled are left alone. Returns the rows updated."""
        if self.tree is None:
            return 0
        stream, row = indices // self.length, indices % self.length
        same = self._generation(stream, row) == generations
        priority = (np.abs(td_errors[same]) + self.settings.priority_eps) ** self.settings.alpha
        if priority.size:
            self.max_priority = max(self.max_priority, float(priority.max()))
            self.tree.update(indices[same], priority)
        return int(same.sum())

    # Checkpoints.

    def get_state(self) -> dict[str, Any]:
        state = {"obs": self.obs, "actions": self.actions, "rewards": self.rewards,
                 "flags": self.flags, "written": self.written, "max_priority": self.max_priority,
                 "rng": self.rng.bit_generator.state}
        if self.frames is not None:
            state["frames"] = self.frames.get_state()
        if self.tree is not None:
            state["priority_codes"] = self.tree.get_state()
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        if state["obs"].shape != self.obs.shape:
            raise ConfigError(f"the checkpoint's replay shard has shape {state['obs'].shape[:2]} "
                              f"(streams, rows); this run's has {self.obs.shape[:2]}")
        if (self.frames is None) != ("frames" not in state):
            raise ConfigError("the checkpoint's replay shard stores frame stacks differently "
                              "(atari_frame_stack changed); resume with the run's setting")
        for key in ("obs", "actions", "rewards", "flags", "written"):
            getattr(self, key)[...] = state[key]
        if self.frames is not None:
            self.frames.set_state(state["frames"])
        self.max_priority = state["max_priority"]
        self.rng.bit_generator.state = state["rng"]
        if self.tree is not None:
            if "priority_codes" in state:
                self.tree.set_state(state["priority_codes"])
            elif "tree" in state:  # saved before priorities were coded: float64 leaves
                self.tree.update(np.arange(self.capacity), state["tree"][self.capacity:])
            else:  # saved uniform, resumed prioritized: every stored row at the top priority
                rows = np.arange(self.capacity)
                live = (self.flags.reshape(-1) & OBS_ONLY) == 0
                self.tree.update(rows, np.where(live, self.max_priority, 0.0))


def stream_of(worker_index: int, num_shards: int, num_envs: int) -> np.ndarray:
    """The streams of a rollout worker's environments in its shard (worker i feeds shard
    i mod num_shards)."""
    base = (worker_index // max(num_shards, 1)) * num_envs
    return base + np.arange(num_envs)
