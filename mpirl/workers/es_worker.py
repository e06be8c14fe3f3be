"""Workers of derivative-free search (ES, ARS): perturbation workers on the rollout ranks, and the
driver's copy of the weights.

Each rollout rank keeps the weights, the optimizer state and the observation statistics, and
evaluates antithetic perturbations drawn from a noise table that exists once per node (MPI shared
memory over the node's rollout ranks). What crosses ranks each generation is only, per
perturbation, its noise index and its two returns and lengths (worker -> driver -> worker 0,
then one broadcast from there over the weights communicator to every rank), plus the
observation statistics' delta: never a weight vector. Every rank applies the identical
update, and the driver checks a checksum of the new weights from each.
"""

from __future__ import annotations

import pickle
import zlib
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from mpi4py import MPI

from mpirl.models.search_rules import (
    Adam,
    DirectPolicySpec,
    NumpyDirectPolicy,
    ars_step,
    es_step,
    numpy_unsupported,
)
from mpirl.models.spaces import has_image
from mpirl.models.statistics import RunningMeanStd
from mpirl.runtime import gathered
from mpirl.runtime.core import RankContext, Worker
from mpirl.runtime.gathered import answer_through_gather, answer_unless_agreed
from mpirl.runtime.ulfm import bcast_bytes, bcast_weights
from mpirl.runtime.waiting import wait_for_all
from mpirl.workers.env_runner import SEARCH, EnvRunner, RunnerPolicy, RunnerSettings
from mpirl.workers.env_spec import EnvSpec, EnvWorkerSettings

__all__ = ["PerturbationWorker", "SearchWeights"]

#: Env failures one perturbation's episode may meet before its pair is left out of the update.
MAX_PAIR_RETRIES = 2
#: Noise values generated per call while filling the table (bounds the temporary memory).
_FILL_CHUNK = 1 << 22


class NoiseTable:
    """``size`` float32 standard normals from ``seed``, one copy per node: allocated with
    ``MPI.Win.Allocate_shared`` by the first rank of ``comm``'s node-local split and mapped by
    the others. Collective over ``comm``."""

    def __init__(self, comm: MPI.Comm, size: int, seed: int, timeout_s: float) -> None:
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        first = node.Get_rank() == 0
        self.window = MPI.Win.Allocate_shared(size * 4 if first else 0, 4, comm=node)
        buffer, _ = self.window.Shared_query(0)
        self.noise = np.ndarray(buffer=buffer, dtype=np.float32, shape=(size,))
        if first:
            rng = np.random.default_rng(seed)
            for start in range(0, size, _FILL_CHUNK):
                end = min(size, start + _FILL_CHUNK)
                rng.standard_normal(end - start, dtype=np.float32, out=self.noise[start:end])
        wait_for_all(node, timeout_s, "filling the shared noise table")
        self.ranks_on_node = node.Get_size()
        node.Free()

    def __len__(self) -> int:
        return self.noise.size


def proportional_memory_mb() -> float:
    """This process's proportional set size (PSS), MiB: its private pages plus its share of
    pages it maps with others (a shared noise table counts 1/N on each of N ranks). NaN where
    /proc/self/smaps_rollup is missing."""
    try:
        with open("/proc/self/smaps_rollup") as file:
            fields = dict(line.split(":", 1) for line in file if ":" in line)
        return int(fields["Pss"].split()[0]) / 1024
    except (OSError, KeyError, ValueError):
        return float("nan")


class EvaluationDraws:
    """Which episode starts of a generation play the unperturbed policy: every ``1/p``-th, from
    a random phase (systematic sampling). Of any n starts, floor(np) or ceil(np) evaluate, p of
    them on average. A draw per start (Bernoulli) gives each rank a binomial number of extra
    episodes; the generation waits for the rank that drew the most, and the most of W ranks
    grows with W (at p = 0.1 and 9 starts a rank: 3 or more of 64 ranks, against 2 of 7)."""

    __slots__ = ("p", "phase", "starts")

    def __init__(self, p: float, rng: np.random.Generator) -> None:
        self.p, self.phase, self.starts = p, float(rng.random()), 0

    def next_is_evaluation(self) -> bool:
        before = int(self.starts * self.p + self.phase)
        self.starts += 1
        return int(self.starts * self.p + self.phase) > before


UPDATE_ROOT = 1
"""weights_comm's member (the first rollout rank) that gathers a generation's records, makes
its update and broadcasts it, where the answers gather: rank 0 (member 0) does none of it."""

GENERATION_HEAD = ("pairs", "evaluations", "filter_size", "env_steps", "pairs_abandoned",
                   "env_failures", "pss_mb", "filter_count")
"""The fixed fields that open a rank's generation record (``pack_generation``)."""


def pack_generation(indices: list[int], returns: list[list[float]], lengths: list[list[int]],
                    eval_returns: list[float], eval_lengths: list[int], env_steps: int,
                    pairs_abandoned: int, env_failures: int, pss_mb: float,
                    delta: RunningMeanStd | None) -> np.ndarray:
    """A rank's answer to a generation as one float64 vector: ``GENERATION_HEAD``, then the n
    pairs' noise indices, returns (2n) and lengths (2n), the e evaluation returns and lengths,
    and the observation statistics' delta (mean, variance; none if ``delta`` is None). It
    crosses to rank 0 as raw bytes (``gathered.encode_answer``), and rank 0 reads every rank's
    in a few array operations (``unpack_generations``), not one unpickling per rank. Every
    number is exact in a float64: indices and counts are far below 2**53."""
    size = 0 if delta is None else delta.mean.size
    head = [len(indices), len(eval_returns), size, env_steps, pairs_abandoned, env_failures,
            pss_mb, 0.0 if delta is None else delta.count]
    parts = [head, indices, np.ravel(returns), np.ravel(lengths), eval_returns, eval_lengths]
    if delta is not None:
        parts += [delta.mean.ravel(), delta.var.ravel()]
    return np.concatenate([np.asarray(part, np.float64) for part in parts])


_RECORD_FIELDS = ("indices", "returns", "lengths", "eval_returns", "eval_lengths",
                  "filter_means", "filter_vars")
"""The variable parts of a generation record, in order after its head."""


def unpack_generations(records: list[np.ndarray]) -> dict[str, np.ndarray]:
    """The ranks' records (``pack_generation``), in rank order, as arrays: ``indices`` [N],
    ``returns`` and ``lengths`` [N, 2], ``eval_returns`` and ``eval_lengths``, the
    per-rank ``GENERATION_HEAD`` fields (``env_steps`` and so on, [R]), and the filter
    deltas ``filter_means`` and ``filter_vars`` [R, size]. Each value is labelled with its
    part, and each part is taken in one step: some 30 array operations, whatever the ranks."""
    count, width = len(records), len(GENERATION_HEAD)
    values = np.concatenate(records)
    sizes = np.fromiter(map(len, records), np.int64, count)
    head = values[(np.cumsum(sizes) - sizes)[:, None] + np.arange(width)]
    pairs, evaluations, filter_size = head[:, 0], head[:, 1], head[:, 2]
    spans = np.stack([np.full(count, width), pairs, 2 * pairs, 2 * pairs, evaluations,
                      evaluations, filter_size, filter_size], axis=1).astype(np.int64)
    labels = np.repeat(np.tile(np.arange(len(_RECORD_FIELDS) + 1), count), spans.ravel())
    out = {name: head[:, i] for i, name in enumerate(GENERATION_HEAD)}
    for label, name in enumerate(_RECORD_FIELDS, 1):
        out[name] = values[labels == label]
    out["indices"] = out["indices"].astype(np.int64)
    out["returns"] = out["returns"].reshape(-1, 2)
    out["lengths"] = out["lengths"].astype(np.int64).reshape(-1, 2)
    out["eval_lengths"] = out["eval_lengths"].astype(np.int64)
    size = int(filter_size.max(initial=0))
    out["filter_means"] = out["filter_means"].reshape(count, size)
    out["filter_vars"] = out["filter_vars"].reshape(count, size)
    return out


def summarize_generation(records: list[np.ndarray]) -> dict[str, Any]:
    """What a generation's update and its statistics need of the ranks' records, in rank
    order: the pairs' noise ``indices`` and ``returns``, the summed ``filter_delta`` (flat mean,
    variance, count), the evaluation episodes, and totals. Its size grows with the pairs and
    evaluation episodes, not with the ranks' other fields. Made by the update's root where the
    answers gather (``PerturbationWorker._generation_then_update``), else by the driver."""
    found = unpack_generations(records)
    delta = RunningMeanStd(found["filter_means"].shape[1:])
    delta.merge_stacked(found["filter_count"], found["filter_means"], found["filter_vars"])
    lengths = found["lengths"]
    return {"indices": found["indices"], "returns": found["returns"],
            "filter_delta": (delta.mean, delta.var, delta.count),
            "len_mean": float(lengths.mean()) if lengths.size else float("nan"),
            "eval_returns": found["eval_returns"].tolist(),
            "eval_lengths": found["eval_lengths"].tolist(),
            "env_steps": int(found["env_steps"].sum()),
            "env_failures": int(found["env_failures"].sum()),
            "pairs_abandoned": int(found["pairs_abandoned"].sum()),
            "pss_mb": float(found["pss_mb"].sum()),
            "record_bytes": int(records[0].nbytes) if records else 0}


def update_message(generation: int, summary: dict[str, Any]) -> bytes:
    """The update every rank applies (``PerturbationWorker._take_update_message``): the
    generation's number and its ``summarize_generation``."""
    return pickle.dumps((generation, summary), protocol=5)


@dataclass(frozen=True, kw_only=True)
class SearchWorkerSettings(EnvWorkerSettings):
    """What a perturbation worker is built from; it crosses to each rollout rank once, when the
    worker is spawned. The search's own settings (noise table, update rule) come later, from
    ``setup_search``."""

    policy: DirectPolicySpec
    """The deterministic policy whose weights it perturbs."""
    normalize_observations: bool = False
    """Normalize vector observations by statistics summed over all ranks (ARS V2)."""

    @classmethod
    def from_config(cls, config: Any, *, env: EnvSpec, policy: DirectPolicySpec,
                    dump: Any = None) -> SearchWorkerSettings:
        """The settings of a run with ``config``. ``dump`` is refused on the driver
        (``setup_search``), which says so once: perturbed policies' episodes are no dataset."""
        return cls(env=env, policy=policy, **cls.config_values(config),
                   normalize_observations=config.normalize_observations)


class PerturbationWorker(Worker):
    """Evaluates antithetic perturbations of the weights on a rollout rank; applies updates."""

    MESSAGES = ("setup_search", "run_generation", "apply_update", "receive_update",
                "receive_weights", "set_weights", "get_weights", "search_state",
                "set_search_state", "save_state", "load_state", "finish_dump",
                "generation_rounds")

    Settings: ClassVar[type[SearchWorkerSettings]] = SearchWorkerSettings

    def __init__(self, context: RankContext, settings: SearchWorkerSettings) -> None:
        super().__init__(context)
        policy = settings.policy
        self.runner = EnvRunner(context, RunnerSettings(
            env=settings.env, num_envs=settings.num_envs, seed=settings.seed,
            max_env_failures=settings.max_env_failures,
            env_failure_window=settings.env_failure_window,
            policies=(RunnerPolicy(acting=SEARCH, observation_space=policy.observation_space,
                                   action_space=policy.action_space),)))
        self.seed = self.runner.seed
        self.where = self.runner.where
        # Vector observations: the population's forward pass in NumPy, and no torch in this
        # process (about 60 MB instead of 300). The weights arrive from the driver.
        if numpy_unsupported(policy) is None:
            self.policy: Any = NumpyDirectPolicy(policy)
            self.theta = np.zeros(self.policy.num_weights(), np.float32)
        else:
            import torch

            torch.set_num_threads(settings.torch_threads)
            from mpirl.models.torch_model import build_torch_model

            self.policy = build_torch_model(policy)
            self.theta = self.policy.get_flat_weights()
        # Images are scaled inside the model, never normalized.
        self.normalize_observations = settings.normalize_observations and not has_image(
            policy.observation_space)
        self.obs_shape = policy.observation_space.shape
        self.filter = RunningMeanStd(self.obs_shape)
        self.rng = np.random.default_rng(self.seed)
        self.noise: NoiseTable | None = None
        self.settings: dict[str, Any] = {}
        self.optimizer: Adam | None = None
        self.applied: tuple[int, dict[str, Any]] | None = None  # (generation, its answer)

    @property
    def env_failures(self) -> int:
        return self.runner.env_failures

    def setup_search(self, settings: dict[str, Any]) -> dict[str, Any]:
        """Build the noise table (collective over the rollout ranks) and the optimizer."""
        self.settings = settings
        self.noise = NoiseTable(self.context.role_comm, settings["noise_size"],
                                settings["noise_seed"], self.context.collective_timeout_s)
        self.optimizer = Adam(self.theta.size, settings["stepsize"])
        return {"ranks_on_node": self.noise.ranks_on_node,
                "noise_table_mb": self.noise.noise.nbytes / 2**20}

    # One generation.

    def _observe(self, obs_rows: np.ndarray) -> np.ndarray:
        if self.normalize_observations:
            obs_rows = self.filter.normalize(obs_rows)
        return obs_rows.astype(np.float32, copy=False)

    def _population_outputs(self, params: np.ndarray, obs: np.ndarray) -> np.ndarray:
        """Outputs ``[K, out]`` of the weight vectors ``params [K, P]`` on ``obs [K, ...]``."""
        if isinstance(self.policy, NumpyDirectPolicy):
            return self.policy.population_outputs(params, obs)
        import torch  # loaded already: the torch policy was built with it

        with torch.no_grad():
            return self.policy.population_outputs(torch.from_numpy(params),
                                                  torch.from_numpy(obs)).numpy()

    def run_generation(self, num_pairs: int, min_steps: int, gather_answer: bool = False,
                       generation: int | None = None) -> np.ndarray:
        """Evaluate ``num_pairs`` antithetic pairs (more, until ``min_steps`` env steps were
        played), one whole episode each, on the worker's envs in parallel; ``eval_prob`` of the
        episodes started play the unperturbed policy instead (``EvaluationDraws``). Returns the
        pairs' noise indices, returns and lengths, the evaluation episodes, and the delta of the
        observation statistics, as one record (``pack_generation``); no weights. With
        ``gather_answer`` the driver's copy gathers them (``SearchWeights.gather_answers``,
        ``mpirl.runtime.gathered``). With ``generation``, its number, the call goes on to the
        update (``_generation_then_update``)."""
        if generation is not None:
            return self._generation_then_update(num_pairs, min_steps, generation)
        if gather_answer:
            return answer_through_gather(self.context,
                                         lambda: self.run_generation(num_pairs, min_steps))
        s, theta, noise = self.settings, self.theta, self.noise.noise
        size, sigma = theta.size, s["noise_stdev"]
        indices: list[int] = []
        returns: list[list[float]] = []
        lengths: list[list[int]] = []
        tasks: list[tuple[int, int]] = []

        def add_pair() -> None:
            indices.append(int(self.rng.integers(0, len(noise) - size + 1)))
            returns.append([0.0, 0.0])
            lengths.append([0, 0])
            tasks.extend([(len(indices) - 1, 0), (len(indices) - 1, 1)])

        for _ in range(num_pairs):
            add_pair()
        k = self.runner.settings.num_envs
        params = np.repeat(theta[None], k, 0)
        slot_task: list[tuple[int, int]] = [(-1, 0)] * k  # (pair, sign); (-1, 0) evaluates
        eval_returns: list[float] = []
        eval_lengths: list[int] = []
        delta = RunningMeanStd(self.filter.mean.shape)
        box = self.policy.kind == "box"
        retries: dict[int, int] = {}
        abandoned: set[int] = set()
        evaluations = EvaluationDraws(s["eval_prob"], self.rng)
        played = {"steps": 0}

        def start(i: int) -> bool:
            """Slot ``i``'s next episode: the unperturbed policy now and then, else the next
            perturbation queued (more pairs until ``min_steps`` were played)."""
            if not tasks and played["steps"] < min_steps:
                add_pair()  # the pairs queued so far were too short for min_steps
            if not tasks:
                return False
            if evaluations.next_is_evaluation():
                slot_task[i], row = (-1, 0), theta
            else:
                slot_task[i] = tasks.pop(0)
                pair, sign = slot_task[i]
                eps = noise[indices[pair]:indices[pair] + size]
                row = theta + (sigma if sign == 0 else -sigma) * eps
            params[i] = row
            return True

        def act(slots: list[int], raw: np.ndarray) -> np.ndarray:
            raw = raw.astype(np.float32, copy=False)
            outputs = self._population_outputs(params[slots], self._observe(raw))
            training = np.array([slot_task[i][0] >= 0 for i in slots])
            if training.any() and self.normalize_observations:
                delta.update(raw[training].astype(np.float64))
            if box and s["action_noise_std"] > 0:
                outputs = outputs + training[:, None] * self.rng.normal(
                    0.0, s["action_noise_std"], outputs.shape)
            played["steps"] += len(slots)
            return self.policy.to_actions(outputs)

        def end(i: int, ret: float, length: int, failed: bool) -> None:
            pair, sign = slot_task[i]
            if failed:
                if pair < 0 or pair in abandoned:
                    return
                retries[pair] = retries.get(pair, 0) + 1
                if retries[pair] <= MAX_PAIR_RETRIES:
                    tasks.insert(0, (pair, sign))  # played again from a fresh episode
                else:
                    # An env that fails every long episode would be retried forever.
                    abandoned.add(pair)
                    tasks[:] = [t for t in tasks if t[0] != pair]
            elif pair < 0:
                eval_returns.append(ret)
                eval_lengths.append(length)
            else:
                # ARS's reward shift (offset) applies to training episodes only.
                returns[pair][sign] = ret - s["offset"] * length
                lengths[pair][sign] = length

        steps, failures = self.runner.play_episodes(start, act, end)
        kept = [j for j in range(len(indices)) if j not in abandoned]
        return pack_generation([indices[j] for j in kept], [returns[j] for j in kept],
                               [lengths[j] for j in kept], eval_returns, eval_lengths, steps,
                               len(abandoned), failures, proportional_memory_mb(),
                               delta if self.normalize_observations else None)

    def apply_update(self, indices: np.ndarray, returns: np.ndarray,
                     filter_delta: tuple | None) -> dict[str, Any]:
        """Apply the generation's update (every rank the same inputs, so the same weights);
        merge the observation statistics' summed delta. Returns a checksum of the new weights
        and the update's statistics."""
        s = self.settings
        if len(indices):
            if s["rule"] == "es":
                self.theta, stats = es_step(self.theta, indices, returns, self.noise.noise,
                                            self.optimizer, s["l2_coeff"])
            else:
                self.theta, stats = ars_step(self.theta, indices, returns, self.noise.noise,
                                             s["stepsize"], s["rollouts_used"])
        else:
            stats = {}
        if filter_delta is not None and self.normalize_observations:
            mean, var, count = filter_delta  # flat, as the ranks' records carry them
            self.filter.merge(np.reshape(mean, self.obs_shape), np.reshape(var, self.obs_shape),
                              count)
        self.policy.set_flat_weights(self.theta)
        return {"checksum": weights_checksum(self.theta), **stats}

    def _generation_then_update(self, num_pairs: int, min_steps: int, generation: int) -> Any:
        """A whole generation in one call, where the answers gather. The records gather at
        weights_comm's member ``UPDATE_ROOT`` (rollout worker 0), which makes the update
        (``summarize_generation``) and broadcasts it over weights_comm; it is empty when some
        rank failed. Rank 0 joins the gather with nothing and takes the update from the
        broadcast (``SearchWeights.take_generation``): its work per generation does not grow
        with the ranks. Each rank's answer, alike on every rank, is compared in
        ``gathered.answer_unless_agreed``. Every rank takes part in all three collectives,
        failed or not, so that none waits on a rank that stopped; a failure is raised after
        them."""
        context, failure = self.context, None
        try:
            record = self.run_generation(num_pairs, min_steps)
        except Exception as error:  # noqa: BLE001 - raised once the collectives are done
            record, failure = None, error
        parts = gathered.send_answer(context, record, root=UPDATE_ROOT)
        held = None
        if parts is not None:  # the root
            held = b""
            try:
                records = list(gathered.decode_answers(parts[1:]).values())
                if all(r is not None for r in records):
                    held = update_message(generation, summarize_generation(records))
            except Exception as error:  # noqa: BLE001 - as above
                failure = failure or error
        message = bcast_bytes(context.weights_comm, held, context.collective_timeout_s,
                              "the update broadcast")
        answer: dict[str, Any] | None = None
        if failure is None:
            answer = {}  # if no update came: another rank failed, and its answer says why
            try:
                if message:
                    answer = self._take_update_message(message)
            except Exception as error:  # noqa: BLE001 - as above
                answer, failure = None, error
        return answer_unless_agreed(context, answer, failure)

    def generation_rounds(self) -> dict[str, int]:
        """Standing generations (``mpirl.execution.standing_rounds``): each starts with the
        driver's copy's broadcast of ``(num_pairs, min_steps, generation)``, no weights
        (``gathered.serve_rounds``), and runs as ``run_generation(..., generation=...)`` does.
        Returns ``{"rounds": n}`` once the driver ends them; a generation that failed here is
        raised then."""
        def one_round(header: tuple[int, int, int]) -> Exception | None:
            try:
                self._generation_then_update(*header)
            except Exception as error:  # noqa: BLE001 - serve_rounds raises it (see there)
                return error
            return None

        return gathered.serve_rounds(self.context, gathered.NO_WEIGHTS, one_round)

    def receive_update(self, message: bytes | None = None) -> dict[str, Any]:
        """Take the generation's update in a broadcast over weights_comm and apply it. One rank
        (rollout worker 0) gets ``message`` in its call and is the broadcast's root, so rank 0
        sends the update once, not once per rank, and forwards none of it. A generation's update
        broadcast again, after a rank died during the first try, is applied once. (Where the
        answers gather, the update comes in the generation's call instead:
        ``_generation_then_update``.)"""
        message = bcast_bytes(self.context.weights_comm, message,
                              self.context.collective_timeout_s, "the update broadcast")
        return self._take_update_message(message)

    def _take_update_message(self, message: bytes) -> dict[str, Any]:
        generation, update = pickle.loads(message)
        if self.applied is None or self.applied[0] != generation:
            self.applied = (generation, self.apply_update(
                update["indices"], update["returns"], update["filter_delta"]))
        return self.applied[1]

    # Weights and state.

    def receive_weights(self) -> None:
        """Take part in the weight broadcast from the driver's copy (a collective)."""
        bcast_weights(self.context.weights_comm, self.theta, self.context.collective_timeout_s)
        self.policy.set_flat_weights(self.theta)

    def set_weights(self, flat: np.ndarray) -> None:
        self.theta = np.array(flat, np.float32)
        self.policy.set_flat_weights(self.theta)

    def get_weights(self) -> np.ndarray:
        return self.theta.copy()

    def search_state(self) -> dict[str, Any]:
        """Weights, optimizer and observation statistics: what every rank must hold alike."""
        return {"theta": self.theta.copy(), "optimizer": self.optimizer.state(),
                "filter": self.filter.state()}

    def set_search_state(self, state: dict[str, Any]) -> str:
        self.applied = None
        self.set_weights(state["theta"])
        self.optimizer.load(state["optimizer"])
        self.filter.mean, self.filter.var, self.filter.count = state["filter"]
        return weights_checksum(self.theta)

    def get_state(self) -> dict[str, Any]:
        return {**self.search_state(), "rng": self.rng.bit_generator.state,
                "runner": self.runner.get_state()}

    def set_state(self, state: dict[str, Any]) -> bool:
        self.set_search_state(state)
        self.rng.bit_generator.state = state["rng"]
        return self.runner.set_state(state["runner"])

    def memory(self) -> dict[str, float]:
        return {"pss_mb": proportional_memory_mb()}

    def finish_dump(self) -> None:
        return None


@dataclass(frozen=True, kw_only=True)
class SearchWeightsSettings:
    """What the driver's copy of the weights is built from."""

    policy: DirectPolicySpec
    seed: int
    """Torch's seed for the first weights, which every rollout rank then takes."""
    zero_init: bool = False
    """Start from all-zero weights (ARS)."""

    @classmethod
    def from_config(cls, config: Any, *, policy: DirectPolicySpec, loss: None = None
                    ) -> SearchWeightsSettings:
        """The settings of a run with ``config``; derivative-free, it takes no ``loss``."""
        return cls(policy=policy, seed=config.seed, zero_init=getattr(config, "zero_init", False))


class SearchWeights(Worker):
    """The driver's copy of the weights (in its process): the first weights, broadcast to the
    rollout ranks at start-up, and, before each checkpoint, rollout worker 0's current ones, so
    that ``learner_0.pkl`` holds the policy that ``mpirl evaluate`` and ``export`` read."""

    MESSAGES = ("broadcast_weights", "take_update", "take_generation", "get_weights",
                "set_weights", "save_state", "load_state", "histograms", "end_rounds")

    Settings: ClassVar[type[SearchWeightsSettings]] = SearchWeightsSettings

    def __init__(self, context: RankContext, settings: SearchWeightsSettings) -> None:
        super().__init__(context)
        import torch

        from mpirl.models.torch_model import build_torch_model

        torch.manual_seed(settings.seed)
        self.policy = build_torch_model(settings.policy)
        self.generation_waits, self.update_waits = gathered.RoundWaits(), gathered.RoundWaits()
        if settings.zero_init:
            self.policy.set_flat_weights(np.zeros(self.policy.num_weights(), np.float32))

    def broadcast_weights(self) -> None:
        bcast_weights(self.context.weights_comm, self.policy.get_flat_weights(),
                      self.context.collective_timeout_s)

    def take_update(self) -> None:
        """The driver's part in the update's broadcast over weights_comm, in which it only
        receives (its copy of the weights is refreshed only before checkpoints), from
        ``PerturbationWorker.receive_update``."""
        bcast_bytes(self.context.weights_comm, None, self.context.collective_timeout_s,
                    "the update broadcast")

    def take_generation(self, round_header: Any = None) -> tuple[bytes, bool, Any]:
        """The driver's part in a generation's call (``PerturbationWorker.
        _generation_then_update``): it joins the gather of the records with nothing, takes the
        update the root broadcasts, and is the root of the ranks' comparison of their answers.
        Returns the update (b"" when a rank failed) and ``(True, the answer)`` if the answers
        agreed, else ``(False, their answers gathered)`` (``gathered.agreed_or_gathered``).
        With ``round_header`` it first starts the generation of the ranks' standing
        ``generation_rounds`` calls."""
        context = self.context
        if round_header is not None:
            gathered.start_round(context, round_header, gathered.NO_WEIGHTS)
        gathered.gather_answers(context, self.generation_waits, root=UPDATE_ROOT)
        message = bcast_bytes(context.weights_comm, None, context.collective_timeout_s,
                              "the update broadcast")
        return (message, *gathered.agreed_or_gathered(context, self.update_waits))

    def end_rounds(self) -> None:
        """End the rollout ranks' standing ``generation_rounds`` calls: an empty header."""
        gathered.start_round(self.context, None, gathered.NO_WEIGHTS)

    def get_weights(self) -> np.ndarray:
        return self.policy.get_flat_weights()

    def set_weights(self, flat: np.ndarray) -> None:
        self.policy.set_flat_weights(flat)

    def get_state(self) -> dict[str, Any]:
        return {"weights": self.policy.get_flat_weights()}

    def set_state(self, state: dict[str, Any]) -> None:
        self.policy.set_flat_weights(state["weights"])

    def histograms(self) -> dict[str, np.ndarray]:
        return {f"weights/{name}": p.detach().numpy().reshape(-1)
                for name, p in self.policy.named_parameters()}


def weights_checksum(theta: np.ndarray) -> str:
    """A short fingerprint of a weight vector's bytes (ranks compare theirs)."""
    return f"{zlib.crc32(np.ascontiguousarray(theta).tobytes()):08x}"
