"""Every algorithm that samples on rollout ranks, one iteration each on an env group: one
``mpiexec -n 4`` (driver, rollout rank, one group of k = 2 env ranks), one ``mpirl.train`` per
algorithm in the same processes (torch imported once per rank), each with a trajectory dump and
callbacks.

    mpiexec -n 4 python sim_algorithms.py ROOT [ALGO ...]   # no ALGO: every one, and multi-agent

The env is the bundled reaction-diffusion simulation (its Discrete variant for DQN and Ape-X),
counting the steps each rank takes part in. Every rank records what it saw; world rank 0 gathers
the records and prints one line ``RESULT {json}`` that tests/test_sim_algorithms.py asserts on.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from mpi4py import MPI

import mpirl
from mpirl.envs.reaction_diffusion import ReactionDiffusion, ReactionDiffusionDiscrete

#: Short episodes on a coarse grid (split over the group's 2 ranks).
ENV_CONFIG = {"max_steps": 8, "n_points": 8}
COMMON = {"ranks_per_env": 2, "num_envs_per_worker": 1, "print_layout": False,
          "checkpoint_every": 1, "hidden_sizes": [16], "env_config": ENV_CONFIG,
          "callbacks": "sim_algorithms:GroupSteps"}
#: Each algorithm's smallest iteration that still ends episodes on the group.
CONFIGS: dict[str, dict[str, Any]] = {
    "PPO": {"rollout_fragment_length": 16, "num_epochs": 1, "minibatch_size": 16},
    "A2C": {"rollout_fragment_length": 16},
    "IMPALA": {"rollout_fragment_length": 16, "min_steps_per_iteration": 16,
               "train_batch_size": 16},
    "A3C": {"rollout_fragment_length": 16, "min_steps_per_iteration": 16},
    "SAC": {"rollout_fragment_length": 16, "learning_starts": 8, "train_batch_size": 8,
            "sgd_steps_per_env_step": 0.25},
    "DQN": {"rollout_fragment_length": 16, "learning_starts": 8, "train_batch_size": 8,
            "sgd_steps_per_env_step": 0.25},
    "APEX": {"num_replay_shards": 0, "num_learners": 0, "rollout_fragment_length": 16,
             "min_env_steps_per_iteration": 16, "learning_starts": 8, "train_batch_size": 8},
    "ES": {"episodes_per_batch": 2, "train_batch_size": 0, "eval_prob": 0.0,
           "noise_size": 100_000},
    "ARS": {"num_rollouts": 2, "rollouts_used": 1, "eval_prob": 0.0, "noise_size": 100_000},
    "PETS": {"rollout_fragment_length": 16, "initial_random_steps": 8, "cem_population": 8,
             "cem_elites": 2, "cem_iterations": 1, "planning_horizon": 2, "particles": 1,
             "model_max_epochs": 1, "evaluation_interval": 0},
    "MBPO": {"rollout_fragment_length": 16, "initial_random_steps": 8, "model_train_freq": 8,
             "rollout_batch_size": 8, "epoch_length": 16, "sgd_steps_per_env_step": 0.25,
             "train_batch_size": 8, "ensemble_size": 2, "elites": 1,
             "model_hidden_sizes": [8], "model_batch_size": 8, "model_max_epochs": 1,
             "evaluation_interval": 0},
}
DISCRETE = {"DQN", "APEX"}
#: Their episodes are played by perturbed policies: no trajectory dumps (refused).
NO_DUMPS = {"ES", "ARS"}

#: Resumed from their checkpoint for a second iteration: the groups start new episodes.
RESUMED = ("SAC", "ES")

#: The algorithm running now (set by main on every rank before its run).
CURRENT = {"algo": ""}
#: Per algorithm: env steps this rank took part in (as a member of a group), and the hooks that
#: ran here.
STEPS: dict[str, int] = {}
HOOKS: dict[str, dict[str, int]] = {}


class _Counting:
    def step(self, action):
        STEPS[CURRENT["algo"]] = STEPS.get(CURRENT["algo"], 0) + 1
        return super().step(action)


class CountingRD(_Counting, ReactionDiffusion):
    """ReactionDiffusion that counts the steps each rank takes part in."""


class CountingRDDiscrete(_Counting, ReactionDiffusionDiscrete):
    """Its Discrete variant, counting too."""


class GroupSteps(mpirl.Callbacks):
    """Each episode's length as a custom metric; the rollout-side hooks counted on this rank."""

    def _count(self, hook: str, amount: int = 1) -> None:
        hooks = HOOKS.setdefault(CURRENT["algo"], {})
        hooks[hook] = hooks.get(hook, 0) + amount

    def on_episode_end(self, *, episode, worker):
        episode.custom_metrics["group_length"] = float(episode.length)
        self._count("on_episode_end")
        self._count("episode_steps", episode.length)

    def on_sample_end(self, *, worker, batch, metrics):
        self._count("on_sample_end")

    def on_train_result(self, *, algorithm, result):
        self._count("on_train_result")


def dumped(directory: str) -> dict[str, Any]:
    """What the run's trajectory dump holds."""
    dataset = mpirl.open_dataset(directory)
    episodes = list(dataset.iterate_episodes())
    return {"episodes": dataset.num_episodes, "steps": dataset.total_steps,
            "obs_rows": sorted({len(e.observations) for e in episodes}),
            "obs_width": sorted({e.observations.shape[1] for e in episodes})}


def multiagent(root: str, comm: MPI.Comm) -> dict[str, Any] | None:
    """A multi-agent run on SimulationAgents (one reaction-diffusion simulation, an agent per
    actuator) composing PPO and SAC on ``comm``: a driver and a rollout rank that steps its
    simulation in-process (ranks_per_env 0)."""
    config = {"env_config": {"simulation": "mpirl/ReactionDiffusion-v0", **ENV_CONFIG},
              "num_envs_per_worker": 1, "rollout_fragment_length": 16, "num_epochs": 1,
              "minibatch_size": 16, "hidden_sizes": [16], "print_layout": False,
              "checkpoint_every": 1,
              "multiagent": {"policies": {"ppo": {}, "sac": {
                  "algo": "SAC", "learning_starts": 8, "train_batch_size": 8}},
                  "policy_mapping": {"actuator_[01]": "ppo", "actuator_[23]": "sac"}}}
    row = mpirl.train("PPO", "mpirl.envs.simulation_agents:SimulationAgents", config=config,
                      stop={"training_iteration": 1}, seed=0, run_dir=f"{root}/multiagent",
                      progress="off", comm=comm)
    return None if row is None else {key: row.get(key) for key in (
        "iteration", "timesteps_total", "episodes_total", "agent_steps_total/ppo",
        "agent_steps_total/sac", "episode_len_mean/ppo", "episode_len_mean/sac")}


def main() -> None:
    import sim_algorithms as shared  # the module the callbacks spec loads, not __main__

    world = MPI.COMM_WORLD
    root, algos = sys.argv[1], sys.argv[2:] or list(CONFIGS)
    record: dict[str, Any] = {"rank": world.Get_rank(), "rows": {}, "errors": {},
                              "cpu_s": {}}
    for algo in algos:
        shared.CURRENT["algo"] = algo
        env = "sim_algorithms:" + ("CountingRDDiscrete" if algo in DISCRETE else "CountingRD")
        dump = None if algo in NO_DUMPS else f"{root}/{algo}-dump"
        config = {**COMMON, **CONFIGS[algo], **({"dump_trajectories": dump} if dump else {})}
        start = time.process_time()
        try:
            row = mpirl.train(algo, env, config=config, stop={"training_iteration": 1},
                              seed=0, run_dir=f"{root}/{algo}", progress="off")
        except mpirl.MpirlError as error:
            record["errors"][algo] = f"{type(error).__name__}: {error}"
            continue
        record["cpu_s"][algo] = round(time.process_time() - start, 2)
        if row is not None:
            record["rows"][algo] = {key: row.get(key) for key in (
                "iteration", "timesteps_total", "episodes_total", "custom/group_length_mean")}
            if dump:
                record["rows"][algo]["dump"] = dumped(dump)
    for algo in [algo for algo in RESUMED if algo in algos and algo not in record["errors"]]:
        shared.CURRENT["algo"] = algo + "-resumed"
        env = "sim_algorithms:" + ("CountingRDDiscrete" if algo in DISCRETE else "CountingRD")
        try:
            row = mpirl.train(algo, env, stop={"training_iteration": 2}, resume=f"{root}/{algo}",
                              progress="off")
        except mpirl.MpirlError as error:
            record["errors"][algo + "-resumed"] = f"{type(error).__name__}: {error}"
            continue
        if row is not None:
            record["rows"][algo + "-resumed"] = {key: row.get(key) for key in (
                "iteration", "timesteps_total", "episodes_total")}
    if not sys.argv[2:]:
        # On world ranks 0 and 1 only: two more rollout ranks would add their start-up and
        # nothing else to check.
        pair = world.Split(0 if world.Get_rank() < 2 else MPI.UNDEFINED, key=world.Get_rank())
        if pair != MPI.COMM_NULL:
            record["multiagent"] = multiagent(root, pair)
    record.update(steps=shared.STEPS, hooks=shared.HOOKS)
    # Rank 0 waits for the others without spinning a core.
    barrier = world.Ibarrier()
    while not barrier.Test():
        time.sleep(0.01)
    records = world.gather(record, root=0)
    if world.Get_rank() == 0:
        print("RESULT " + json.dumps(records), flush=True)


if __name__ == "__main__":
    main()
