/* rd_solver: the reaction-diffusion env (mpirl/envs/reaction_diffusion.py, the same maths in
 * rd_core.c) as a solver program beside an mpirl run (MPMD), one env group per ranks_per_env
 * of its processes:
 *
 *     mpiexec -n 2 mpirl train --algo PPO --env mpirl/Solver-v0 \
 *         --config '{"ranks_per_env": 2, "num_envs_per_worker": 1,
 *                    "env_config": {"observation_size": 8, "action_size": 4}}' \
 *         : -n 2 examples/solvers/build/rd_solver
 *
 * (one rollout rank x num_envs_per_worker groups x ranks_per_env ranks = the 2 after ':')
 *
 * env_config may set any key of ReactionDiffusion (n_points, nu, lam, ...); observation_size
 * must be num_sensors and action_size num_actuators. For tests, env_config may also ask for a
 * fault at a given step (hang_at, wrong_size_at, nan_at, fail_at, exit_at: solver_faults.h). */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>

#include "mpirl_solver.h"
#include "rd_core.h"
#include "solver_faults.h"

/* The config's keys over rd_config_defaults, read the same on every process. */
static void read_config(const mpirl_solver *s, rd_config *c) {
    rd_config_defaults(c);
    c->n_points = (int)mpirl_config_long(s, "n_points", c->n_points);
    c->nu = mpirl_config_double(s, "nu", c->nu);
    c->lam = mpirl_config_double(s, "lam", c->lam);
    c->num_actuators = (int)mpirl_config_long(s, "num_actuators", c->num_actuators);
    c->actuator_width = mpirl_config_double(s, "actuator_width", c->actuator_width);
    c->num_sensors = (int)mpirl_config_long(s, "num_sensors", c->num_sensors);
    c->a_max = mpirl_config_double(s, "a_max", c->a_max);
    c->control_cost = mpirl_config_double(s, "control_cost", c->control_cost);
    c->dt = mpirl_config_double(s, "dt", c->dt);
    c->max_steps = (int)mpirl_config_long(s, "max_steps", c->max_steps);
    c->init_amplitude = mpirl_config_double(s, "init_amplitude", c->init_amplitude);
}

int main(int argc, char **argv) {
    mpirl_solver *s;
    /* 0 on an early END too: mpirl's rank 0 reports the run's code (mpirl_finalize). */
    if (mpirl_init(&argc, &argv, &s) != 0) return mpirl_finalize(s);
    rd_config config;
    read_config(s, &config);
    char error[256];
    if (mpirl_obs_size(s) != config.num_sensors || mpirl_action_size(s) != config.num_actuators) {
        snprintf(error, sizeof error, "rd_solver has %d sensors and %d actuators: set env_config "
                 "observation_size %d and action_size %d (got %d and %d)", config.num_sensors,
                 config.num_actuators, config.num_sensors, config.num_actuators,
                 mpirl_obs_size(s), mpirl_action_size(s));
        mpirl_fail(s, error);
        return mpirl_finalize(s);
    }
    rd_sim *sim = rd_create(mpirl_group_comm(s), &config, error, sizeof error);
    if (!sim) {
        mpirl_fail(s, error);
        return mpirl_finalize(s);
    }
    solver_faults faults;
    solver_faults_read(s, "rd_solver", &faults);
    double *action = calloc((size_t)config.num_actuators, sizeof(double));
    double *obs = calloc((size_t)config.num_sensors, sizeof(double));
    double reward = 0.0;
    int truncated = 0, command;
    long seed, step = 0;
    while ((command = mpirl_next(s, action, &seed)) != MPIRL_END) {
        if (command == MPIRL_RESET) {
            rd_reset(sim, seed, seed != -1, obs);
            mpirl_send(s, obs, 0.0, 0, 0);
        } else {
            rd_step(sim, action, obs, &reward, &truncated);
            if (solver_faults_send(&faults, s, ++step, obs, reward, 0, truncated)) break;
        }
    }
    free(action);
    free(obs);
    rd_free(sim);
    return mpirl_finalize(s);
}
