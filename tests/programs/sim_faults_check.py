"""SimEnvs (the rollout side of mpirl's env groups) against a real solver program, without an
mpirl run around it:

    mpiexec -n 1 python sim_faults_check.py CONFIG STEPS [TIMEOUT_S [MAX_FAILURES]] \\
        : -n K examples/solvers/build/rd_solver

joins the apps, drives the solver's processes as groups of one through ``SimEnvs`` (CONFIG: the
env_config JSON, with observation_size and action_size), resets, takes STEPS zero-action steps
in each group (several groups: whichever is ready, as a rollout rank steps them), then ends the
solvers with END as a run's driver does. Prints ``RESULT {json}``: the steps (rounds) taken,
the env failures seen, and the error that ended it (its class and message), if any.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from mpirl.envs.simulation import solver_spaces
from mpirl.errors import MpirlError
from mpirl.runtime import apps
from mpirl.workers.env_guard import FAILURES
from mpirl.workers.sim_envs import LinkedGroup, SimEnvs


def main() -> None:
    config = json.loads(sys.argv[1])
    steps = int(sys.argv[2])
    timeout_s = float(sys.argv[3]) if len(sys.argv) > 3 else 10.0
    max_failures = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    solvers = apps.join_apps(30.0)
    link = apps.solver_link()
    observation_space, action_space = solver_spaces(config)
    groups = [LinkedGroup(g, g, (g,), f"env group {g} (solver rank {g})")
              for g in range(solvers)]
    result: dict = {"steps": 0, "failures": 0, "error": None}
    code = 0
    envs = SimEnvs(link, groups, observation_space, action_space, config, seed=0,
                   num_groups=solvers, timeout_s=timeout_s, backoff=None, where="the check",
                   max_failures=max_failures)
    try:
        envs.reset()
        actions = np.zeros((solvers, *action_space.shape))
        while True:
            if solvers == 1:
                if result["steps"] == steps:
                    break
                *_, infos = envs.step(actions)
            else:  # until every group has taken STEPS steps, each on its own clock
                if (envs.seqs >= steps).all() and not envs.in_flight.any():
                    break
                idle = ~envs.in_flight & (envs.seqs < steps)
                envs.start(np.flatnonzero(idle), actions[idle])
                *_, infos = envs.finish(envs.wait_ready())
            result["steps"] += 1
            result["failures"] += int(np.sum(infos.get(FAILURES, 0)))
    except MpirlError as error:
        result["error"] = [type(error).__name__, str(error)]
        code = error.exit_code
    finally:
        if result["error"] is None:
            envs.close()
        apps.end_solvers(code)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
