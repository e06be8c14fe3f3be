"""ES's and ARS's operators, run on the driver, and their plans' state.

One generation (``evaluate_generation``): every rollout worker evaluates its share of antithetic
pairs; their records (noise indices, returns, observation statistics) are summed up
(``summarize_generation``) into the update, which every worker applies itself. The driver then
checks that every worker reports the same weights checksum (``check_same_weights``) and counts the
generation's episodes (``count_generation``). Where the answers gather (``mpirl.runtime.gathered``),
all of it is one call per rank: the records gather at rollout worker 0, which makes the update and
broadcasts it over the weights communicator, and the ranks compare their answers in an allreduce.
Rank 0 only joins those collectives and takes the update's summary: its work per generation does not
grow with the ranks but for sending the call. Otherwise (under ULFM) each call answers alone, the
driver makes the update and sends it to rollout worker 0, which broadcasts it. A rollout rank lost
under ULFM drops its pairs for that generation and the run goes on with the others.
"""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass
from typing import Any

from mpirl.algorithms.evolution.generation_record import summarize_generation, update_message
from mpirl.algorithms.evolution.spec import DirectPolicySpec

from mpirl.errors import ConfigError, MpirlError, RankLost
from mpirl.execution.contract import PlanState
from mpirl.execution.operators import (
    discard_lost_rollouts,
    settle_gathered,
    weights_comm_collective,
)
from mpirl.execution.standing_rounds import StandingRounds, rounds_may_stand
from mpirl.models.encoders import model_options
from mpirl.models.torch_model import build_torch_model
from mpirl.runtime.dispatch import call_all
from mpirl.runtime.gathered import decode_answers, gathers_answers

__all__ = ["RULE_DEFAULTS", "EvolutionState", "Generation", "check_evolution_config",
           "check_same_weights", "count_generation", "direct_policy_spec", "evaluate_generation",
           "generation_stats", "setup_perturbations"]

#: The settings of one update rule that the other's config lacks (ARS has no L2 term; ES uses
#: every pair and no reward offset); the rest come from EvolutionConfig and the algorithm.
RULE_DEFAULTS = {"l2_coeff": 0.0, "rollouts_used": 0, "offset": 0.0}


class DivergedWeights(MpirlError):
    """Ranks that should hold identical weights after an update do not."""


def direct_policy_spec(observation_space: Any, action_space: Any, config: Any
                       ) -> DirectPolicySpec:
    """The deterministic policy that ES and ARS perturb."""
    return DirectPolicySpec(observation_space, action_space, tuple(config.hidden_sizes),
                            config.activation, model_options(config))


def check_evolution_config(config: Any, env: Any) -> None:
    """Before anything starts: the policy can be built for the env's spaces, and the noise table
    holds a perturbation of every weight."""
    weights = build_torch_model(direct_policy_spec(*env.spaces(), config)).num_weights()
    if config.noise_size < weights:
        raise ConfigError(f"noise_size {config.noise_size} is smaller than the policy's "
                          f"{weights} weights; make it at least 10x larger "
                          f"(--config '{{\"noise_size\": {10 * weights}}}')")


class EvolutionState(PlanState):
    """What ES's and ARS's plans keep: whether the rollout ranks were brought to one shared
    state this session, and the size of their noise table. The shared state itself (weights,
    optimizer, observation statistics) lives on the rollout ranks, which checkpoint it; before a
    checkpoint, rollout worker 0's weights go to the driver's copy (learner 0's file, which
    ``mpirl evaluate`` and ``export`` read)."""

    def __init__(self, trainer: Any, noise_table_mb: float) -> None:
        self.trainer = trainer
        self.noise_table_mb = noise_table_mb
        self.synced = False

    def settle(self) -> None:
        self.trainer.learners[0].call("set_weights", self.trainer.rollouts[0].call("get_weights"))

    def sync_workers(self) -> None:
        """Once a session: workers added on resume (or restored from different files) take
        worker 0's weights, optimizer and statistics. Weights cross ranks only here."""
        if self.synced:
            return
        rollouts = self.trainer.rollouts
        shared = rollouts[0].call("shared_state")
        _results([w.call_async("set_shared_state", shared) for w in list(rollouts)[1:]])
        self.synced = True


def setup_perturbations(trainer: Any, rule: str, **settings: Any) -> EvolutionState:
    """Give every rollout worker its noise table and update rule; the plan's state."""
    if trainer.dump_index is not None:
        raise ConfigError(f"{trainer.name} does not write trajectory dumps (its episodes are "
                          f"played by perturbed policies); leave --dump-trajectories off")
    c = trainer.config
    full = {**RULE_DEFAULTS, "noise_size": c.noise_size, "noise_seed": c.noise_seed,
            "action_noise_std": c.action_noise_std, "eval_prob": c.eval_prob, **settings,
            "rule": rule}
    first = [f.result() for f in trainer.rollouts.call_async("setup_perturbations", full)][0]
    return EvolutionState(trainer, first["noise_table_mb"])


def _results(futures: list) -> list[tuple[int, Any]]:
    """(worker index, result) of each future whose rank was not lost."""
    done = []
    for i, future in enumerate(futures):
        try:
            done.append((i, future.result()))
        except RankLost:
            continue  # its pairs are dropped; discard_lost takes the worker out below
    return done


def _standing_generation(workers: list, learner: Any, header: tuple[int, int, int]
                         ) -> tuple[bytes, list[tuple[int, Any]]]:
    """``_generation_update`` for the rollout ranks' standing ``generation_rounds`` calls
    (``mpirl.execution.standing_rounds``): the generation starts with the driver's copy's
    broadcast of ``header``; a rank whose generation failed ends the rounds, and its error is
    raised."""
    rounds = StandingRounds.of(workers, learner, "generation_rounds")
    message, agreed, answer = rounds.start("take_generation", header)
    if agreed:
        applied = [(0, answer)]
    else:
        answers = decode_answers(answer)
        applied = sorted((rounds.index_of[rank], value) for rank, value in answers.items()
                         if value is not None)
        if len(applied) < len(workers):
            rounds.failed(sorted(rank for rank, value in answers.items() if value is None))
    if not message:
        raise AssertionError("a generation's update was empty and no call failed")
    return message, applied


def _generation_update(futures: list, workers: list, learner: Any
                       ) -> tuple[bytes, list[tuple[int, Any]]]:
    """Rank 0's half of a generation's calls (``PerturbationWorker._generation_then_update``):
    the update rollout worker 0 made and broadcast, and the calls' answers. When all agree,
    their one answer settles every call: rank 0 decodes one answer per generation, not one per
    rank. If they differ, each answer comes from the gather (so differing checksums are seen);
    if a call failed, its error is raised here, from its own answer."""
    message, agreed, answer = learner.call("take_generation")
    if agreed:
        for future in futures:
            future.settle(answer)
        applied = [(0, answer)]
    else:
        applied = sorted(settle_gathered(workers, futures, answer).items())
    if not message:
        raise AssertionError("a generation's update was empty and no call failed")
    return message, applied


@dataclass
class Generation:
    """One generation as the driver saw it: the update every rank applied (its ``message``),
    the ranks' answers to it (``applied``: worker index, answer), and its ``summary`` (pairs,
    returns, observation statistics, episodes; ``summarize_generation``)."""

    message: bytes
    applied: list[tuple[int, Any]]
    summary: dict[str, Any]


def evaluate_generation(trainer: Any, num_pairs: int, min_steps: int) -> Generation:
    """Evaluate ``num_pairs`` antithetic pairs and at least ``min_steps`` env steps over the
    rollout workers, and have every rank apply the update they make."""
    workers = list(trainer.rollouts)
    learner, generation = trainer.learners[0], trainer.iteration + 1
    share, steps_share = math.ceil(num_pairs / len(workers)), math.ceil(min_steps / len(workers))
    # Where the answers can gather (mpirl.runtime.gathered), one call per rank takes the whole
    # generation, its update included, and none answers with a message of its own.
    gather = gathers_answers(workers)
    if gather and rounds_may_stand(workers):
        message, applied = _standing_generation(workers, learner,
                                                (share, steps_share, generation))
        return Generation(message, applied, pickle.loads(message)[1])
    if gather:
        futures = call_all(workers, "run_generation", share, steps_share, generation=generation)
        message, applied = _generation_update(futures, workers, learner)
        return Generation(message, applied, pickle.loads(message)[1])
    results = _results([w.call_async("run_generation", share, steps_share) for w in workers])
    discard_lost_rollouts(trainer.learners, trainer.rollouts)
    if not results:
        raise MpirlError("every rollout rank was lost during a generation")
    summary = summarize_generation([record for _, record in results])
    message = update_message(generation, summary)
    if all(w.in_process for w in trainer.rollouts):
        applied = _results([w.call_async("apply_update", summary["indices"], summary["returns"],
                                         summary["filter_delta"])
                            for w in trainer.rollouts])
    else:
        # Not one message per rank: the update holds every rank's pairs, so sending it to each
        # would cost rank 0 O(W^2) bytes, and rooting the broadcast at rank 0 would cost it
        # O(W log W) in a binomial tree. Rank 0 sends it to rollout worker 0 alone, which is
        # the root of a broadcast over weights_comm, in which rank 0 only receives.
        applied = weights_comm_collective(trainer.learners, trainer.rollouts, "take_update",
                                          "receive_update", what="the update",
                                          first_receive_args=(message,))
    return Generation(message, applied, summary)


def check_same_weights(generation: Generation, number: int) -> None:
    """``DivergedWeights`` unless every rank that applied generation ``number``'s update
    reports the same checksum of its new weights."""
    checksums = {r["checksum"] for _, r in generation.applied}
    if len(checksums) > 1:
        raise DivergedWeights(
            f"the rollout ranks' weights differ after the update of iteration {number} "
            f"(checksums {sorted(checksums)}): they applied the same update and should be "
            f"bit-identical. Run every rank on the same kind of CPU and the same NumPy build.")


def count_generation(trainer: Any, generation: Generation) -> None:
    """Add a generation to the run's counters: its env steps and failures, its episodes (the
    perturbed ones only counted, the evaluation episodes in the window), and its observation
    statistics to the run's filter."""
    summary = generation.summary
    mean, var, count = summary["filter_delta"]
    if trainer.obs_filter is not None and mean.size:
        shape = trainer.obs_filter.mean.shape
        trainer.obs_filter.merge(mean.reshape(shape), var.reshape(shape), count)
    trainer.timesteps_total += summary["env_steps"]
    trainer.num_env_failures += summary["env_failures"]
    trainer.episodes_total += 2 * len(summary["indices"]) + len(summary["eval_returns"])
    trainer.returns.extend(summary["eval_returns"])
    trainer.lengths.extend(summary["eval_lengths"])


def generation_stats(generation: Generation, evolution: EvolutionState) -> dict[str, float]:
    """A generation's row: its perturbed episodes, its update, and what it cost."""
    summary, applied = generation.summary, generation.applied
    indices, returns = summary["indices"], summary["returns"]
    update_stats = applied[0][1] if applied else {}
    # What crossed between the driver and one rank this generation, both ways: its results, the
    # update message and the update's answer. None of it grows with the number of weights. The
    # first rank's stands for all (each runs the same share of pairs).
    bytes_per_rank = (summary["record_bytes"] + len(generation.message)
                      + (len(pickle.dumps(applied[0][1], protocol=5)) if applied else 0))
    # Every pair may have been abandoned to env failures: no update, and no returns to show.
    return {"perturbed_return_mean": float(returns.mean()) if returns.size else math.nan,
            "perturbed_return_max": float(returns.max()) if returns.size else math.nan,
            "perturbed_len_mean": summary["len_mean"],
            "pairs_this_iter": len(indices),
            "pairs_abandoned_this_iter": summary["pairs_abandoned"],
            "evaluation_episodes_this_iter": len(summary["eval_returns"]),
            "grad_norm": update_stats.get("grad_norm", math.nan),
            "update_ratio": update_stats.get("update_ratio", math.nan),
            "noise_table_mb": evolution.noise_table_mb,
            "bytes_per_rank_per_generation": bytes_per_rank,
            # the noise table counts once per node in the sum, not once per rank
            "rollout_pss_mb_total": summary["pss_mb"]}
