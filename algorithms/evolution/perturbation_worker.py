"""ES's and ARS's rollout worker: it perturbs the weights, plays the perturbed policies' episodes
and applies each generation's update on its rollout rank. Torch-free for vector observations.

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
from mpirl.algorithms.evolution.generation_record import (
    UPDATE_ROOT,
    pack_generation,
    summarize_generation,
    update_message,
)
from mpirl.algorithms.evolution.spec import DirectPolicySpec, NumpyDirectPolicy, numpy_unsupported
from mpirl.algorithms.evolution.update_rules import Adam, ars_step, es_step

from mpirl.models.spaces import has_image
from mpirl.models.statistics import RunningMeanStd
from mpirl.runtime.core import RankContext, Worker
from mpirl.runtime.gathered import (
    NO_WEIGHTS,
    answer_through_gather,
    answer_unless_agreed,
    decode_answers,
    send_answer,
    serve_rounds,
)
from mpirl.runtime.ulfm import bcast_bytes, bcast_weights
from mpirl.runtime.waiting import wait_for_all
from mpirl.workers.env_runner import CALLER, EnvRunner, RunnerPolicy, RunnerSettings
from mpirl.workers.env_spec import EnvSpec, EnvWorkerSettings

__all__ = ["PerturbationWorker"]

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


class GenerationEpisodes:
    """One generation's episodes on a rollout rank, in the three calls of
    ``EnvRunner.play_episodes``: which weights an env slot plays next (``start``), the slots'
    actions (``act``) and what a finished episode counts for (``end``); then the rank's record
    of them (``record``). Each pair is two episodes, of theta + sigma*eps and theta - sigma*eps;
    more pairs are drawn while fewer than ``min_steps`` env steps were played."""

    def __init__(self, worker: PerturbationWorker, num_pairs: int, min_steps: int) -> None:
        settings = worker.settings
        self.worker, self.rng, self.min_steps = worker, worker.rng, min_steps
        self.theta, self.noise, self.sigma = worker.theta, worker.noise.noise, \
            settings["noise_stdev"]
        self.offset, self.action_noise_std = settings["offset"], settings["action_noise_std"]
        self.indices: list[int] = []
        self.returns: list[list[float]] = []
        self.lengths: list[list[int]] = []
        self.tasks: list[tuple[int, int]] = []  # the episodes queued, as (pair, sign)
        for _ in range(num_pairs):
            self.add_pair()
        slots = worker.runner.settings.num_envs
        self.params = np.repeat(self.theta[None], slots, 0)  # the weights each slot plays
        self.slot_task: list[tuple[int, int]] = [(-1, 0)] * slots  # (pair, sign); -1 evaluates
        self.eval_returns: list[float] = []
        self.eval_lengths: list[int] = []
        self.delta = RunningMeanStd(worker.filter.mean.shape)
        self.retries: dict[int, int] = {}
        self.abandoned: set[int] = set()
        # Drawn after the pairs' noise indices: the rng's order is part of a seed's run.
        self.evaluations = EvaluationDraws(settings["eval_prob"], self.rng)
        self.steps_played = 0

    def add_pair(self) -> None:
        """Queue a pair: a noise index and its two episodes."""
        self.indices.append(int(self.rng.integers(0, len(self.noise) - self.theta.size + 1)))
        self.returns.append([0.0, 0.0])
        self.lengths.append([0, 0])
        pair = len(self.indices) - 1
        self.tasks.extend([(pair, 0), (pair, 1)])

    def start(self, slot: int) -> bool:
        """Slot ``slot``'s next episode: the unperturbed policy now and then, else the next
        perturbation queued (more pairs until ``min_steps`` were played). False: none left."""
        if not self.tasks and self.steps_played < self.min_steps:
            self.add_pair()  # the pairs queued so far were too short for min_steps
        if not self.tasks:
            return False
        if self.evaluations.next_is_evaluation():
            self.slot_task[slot], row = (-1, 0), self.theta
        else:
            self.slot_task[slot] = self.tasks.pop(0)
            pair, sign = self.slot_task[slot]
            index = self.indices[pair]
            eps = self.noise[index:index + self.theta.size]
            row = self.theta + (self.sigma if sign == 0 else -self.sigma) * eps
        self.params[slot] = row
        return True

    def act(self, slots: list[int], raw: np.ndarray) -> np.ndarray:
        """The actions of ``slots``' weights on their observations ``raw``; the training
        episodes' observations join the statistics' delta, and their Box actions get noise."""
        worker = self.worker
        raw = raw.astype(np.float32, copy=False)
        outputs = worker.population_outputs(self.params[slots], worker.observe(raw))
        training = np.array([self.slot_task[i][0] >= 0 for i in slots])
        if training.any() and worker.normalize_observations:
            self.delta.update(raw[training].astype(np.float64))
        if worker.policy.kind == "box" and self.action_noise_std > 0:
            outputs = outputs + training[:, None] * self.rng.normal(
                0.0, self.action_noise_std, outputs.shape)
        self.steps_played += len(slots)
        return worker.policy.to_actions(outputs)

    def end(self, slot: int, ret: float, length: int, failed: bool) -> None:
        """Slot ``slot``'s episode ended: count its return, or play it again after an env
        failure (a pair that fails too often is left out)."""
        pair, sign = self.slot_task[slot]
        if failed:
            if pair < 0 or pair in self.abandoned:
                return
            self.retries[pair] = self.retries.get(pair, 0) + 1
            if self.retries[pair] <= MAX_PAIR_RETRIES:
                self.tasks.insert(0, (pair, sign))  # played again from a fresh episode
            else:
                # An env that fails every long episode would be retried forever.
                self.abandoned.add(pair)
                self.tasks = [t for t in self.tasks if t[0] != pair]
        elif pair < 0:
            self.eval_returns.append(ret)
            self.eval_lengths.append(length)
        else:
            # ARS's reward shift (offset) applies to training episodes only.
            self.returns[pair][sign] = ret - self.offset * length
            self.lengths[pair][sign] = length

    def record(self, steps: int, failures: int) -> np.ndarray:
        """The rank's record of the generation (``pack_generation``), abandoned pairs left out;
        ``steps`` and ``failures`` are what ``play_episodes`` counted."""
        kept = [j for j in range(len(self.indices)) if j not in self.abandoned]
        return pack_generation(
            [self.indices[j] for j in kept], [self.returns[j] for j in kept],
            [self.lengths[j] for j in kept], self.eval_returns, self.eval_lengths, steps,
            len(self.abandoned), failures, proportional_memory_mb(),
            self.delta if self.worker.normalize_observations else None)


@dataclass(frozen=True, kw_only=True)
class PerturbationWorkerSettings(EnvWorkerSettings):
    """What a perturbation worker is built from; it crosses to each rollout rank once, when the
    worker is spawned. The generations' own settings (noise table, update rule) come later, from
    ``setup_perturbations``."""

    policy: DirectPolicySpec
    """The deterministic policy whose weights it perturbs."""
    normalize_observations: bool = False
    """Normalize vector observations by statistics summed over all ranks (ARS V2)."""

    @classmethod
    def from_config(cls, config: Any, *, env: EnvSpec, policy: DirectPolicySpec,
                    dump: Any = None) -> PerturbationWorkerSettings:
        """The settings of a run with ``config``. ``dump`` is refused on the driver
        (``setup_perturbations``), which says so once: perturbed policies' episodes are no
        dataset."""
        return cls(env=env, policy=policy, **cls.config_values(config),
                   normalize_observations=config.normalize_observations)


class PerturbationWorker(Worker):
    """Evaluates antithetic perturbations of the weights on a rollout rank; applies updates."""

    MESSAGES = ("setup_perturbations", "run_generation", "apply_update", "receive_update",
                "receive_weights", "set_weights", "get_weights", "shared_state",
                "set_shared_state", "save_state", "load_state", "finish_dump",
                "generation_rounds")

    Settings: ClassVar[type[PerturbationWorkerSettings]] = PerturbationWorkerSettings

    def __init__(self, context: RankContext, settings: PerturbationWorkerSettings) -> None:
        super().__init__(context)
        policy = settings.policy
        self.runner = EnvRunner(context, RunnerSettings(
            env=settings.env, num_envs=settings.num_envs, seed=settings.seed,
            max_env_failures=settings.max_env_failures,
            env_failure_window=settings.env_failure_window,
            ranks_per_env=settings.ranks_per_env, env_step_timeout_s=settings.env_step_timeout_s,
            policies=(RunnerPolicy(acting=CALLER, observation_space=policy.observation_space,
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

    def setup_perturbations(self, settings: dict[str, Any]) -> dict[str, Any]:
        """Build the noise table (collective over the rollout ranks) and the optimizer."""
        self.settings = settings
        self.noise = NoiseTable(self.context.role_comm, settings["noise_size"],
                                settings["noise_seed"], self.context.collective_timeout_s)
        self.optimizer = Adam(self.theta.size, settings["stepsize"])
        return {"ranks_on_node": self.noise.ranks_on_node,
                "noise_table_mb": self.noise.noise.nbytes / 2**20}

    # One generation.

    def observe(self, obs_rows: np.ndarray) -> np.ndarray:
        """Observations as the policy takes them: normalized (ARS V2, ES), as float32."""
        if self.normalize_observations:
            obs_rows = self.filter.normalize(obs_rows)
        return obs_rows.astype(np.float32, copy=False)

    def population_outputs(self, params: np.ndarray, obs: np.ndarray) -> np.ndarray:
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
        ``gather_answer`` the driver's copy gathers them (``DriverWeights.gather_answers``,
        ``mpirl.runtime.gathered``). With ``generation``, its number, the call goes on to the
        update (``_generation_then_update``)."""
        if generation is not None:
            return self._generation_then_update(num_pairs, min_steps, generation)
        if gather_answer:
            return answer_through_gather(self.context,
                                         lambda: self.run_generation(num_pairs, min_steps))
        episodes = GenerationEpisodes(self, num_pairs, min_steps)
        steps, failures = self.runner.play_episodes(episodes.start, episodes.act, episodes.end)
        return episodes.record(steps, failures)

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
        broadcast (``DriverWeights.take_generation``): its work per generation does not grow
        with the ranks. Each rank's answer, alike on every rank, is compared in
        ``answer_unless_agreed``. Every rank takes part in all three collectives,
        failed or not, so that none waits on a rank that stopped; a failure is raised after
        them."""
        context, failure = self.context, None
        try:
            record = self.run_generation(num_pairs, min_steps)
        except Exception as error:  # noqa: BLE001 - raised once the collectives are done
            record, failure = None, error
        parts = send_answer(context, record, root=UPDATE_ROOT)
        held = None
        if parts is not None:  # the root
            held = b""
            try:
                records = list(decode_answers(parts[1:]).values())
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
        (``serve_rounds``), and runs as ``run_generation(..., generation=...)`` does.
        Returns ``{"rounds": n}`` once the driver ends them; a generation that failed here is
        raised then."""
        def one_round(header: tuple[int, int, int]) -> Exception | None:
            try:
                self._generation_then_update(*header)
            except Exception as error:  # noqa: BLE001 - serve_rounds raises it (see there)
                return error
            return None

        return serve_rounds(self.context, NO_WEIGHTS, one_round)

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

    def shared_state(self) -> dict[str, Any]:
        """Weights, optimizer and observation statistics: what every rank must hold alike."""
        return {"theta": self.theta.copy(), "optimizer": self.optimizer.state(),
                "filter": self.filter.state()}

    def set_shared_state(self, state: dict[str, Any]) -> str:
        self.applied = None
        self.set_weights(state["theta"])
        self.optimizer.load(state["optimizer"])
        self.filter.mean, self.filter.var, self.filter.count = state["filter"]
        return weights_checksum(self.theta)

    def get_state(self) -> dict[str, Any]:
        return {**self.shared_state(), "rng": self.rng.bit_generator.state,
                "runner": self.runner.get_state()}

    def save_state(self, directory: str, name: str) -> dict[str, Any]:
        """Worker.save_state's entry, plus ``envs_error`` when the environments were not saved
        (env groups, envs that do not pickle): the driver says so, and a resume says why."""
        entry = super().save_state(directory, name)
        if self.runner.envs_error is not None:
            entry["envs_error"] = self.runner.envs_error
        return entry

    def set_state(self, state: dict[str, Any]) -> bool:
        self.set_shared_state(state)
        self.rng.bit_generator.state = state["rng"]
        return self.runner.set_state(state["runner"])

    def memory(self) -> dict[str, float]:
        return {"pss_mb": proportional_memory_mb()}

    def finish_dump(self) -> None:
        return None


def weights_checksum(theta: np.ndarray) -> str:
    """A short fingerprint of a weight vector's bytes (ranks compare theirs)."""
    return f"{zlib.crc32(np.ascontiguousarray(theta).tobytes()):08x}"
