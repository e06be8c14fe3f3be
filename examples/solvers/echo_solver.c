/* echo_solver.c: the smallest solver, for tests and the coupling benchmark.
 *
 * Its observation is a known function of the action and the step, computed in blocks over the
 * env group's ranks and gathered on the root, so a test can check every number that crosses:
 *     after RESET(seed):   obs[i] = seed + 0.5 i            (seed -1: 0), reward 0
 *     after STEP t (1, 2, ...) with action a:
 *                          obs[i] = a[i % A] + 1000 t + i,  reward = t + sum(a)
 *     truncated when t == episode_length (env_config; 0: never), never terminated.
 * The observation size is the run's observation_size (env_config), the action size its
 * action_size. env_config "fail_at": n calls mpirl_fail at step n (a test of the error path);
 * "step_s": every rank sleeps that many seconds per STEP (a solver's fixed cost per step, on
 * cores of its own: benchmarks/simulations.py's groups).
 *
 * Build: mpicc -I$(python -m mpirl.envs.solver --include) echo_solver.c \
 *            $(python -m mpirl.envs.solver --source) -o echo_solver
 * Run:   mpiexec -n 1 mpirl train --env mpirl.envs.simulation:Solver ... : -n 2 ./echo_solver
 * "--no-init S" (a test of the start-up deadline): MPI_Init, then sleep S seconds without
 * calling mpirl_init.
 */
#define _POSIX_C_SOURCE 200809L /* nanosleep under -std=c99 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "mpirl_solver.h"

int main(int argc, char **argv) {
    if (argc > 2 && strcmp(argv[1], "--no-init") == 0) {
        /* An MPI program that forgot mpirl_init. (One that never calls MPI_Init at all holds
         * up every process's MPI_Init under Open MPI: its launcher reports that one.) */
        MPI_Init(&argc, &argv);
        sleep((unsigned)atoi(argv[2]));
        MPI_Finalize();
        return 0;
    }
    mpirl_solver *s;
    if (mpirl_init(&argc, &argv, &s) != 0) {
        int rank;
        MPI_Comm_rank(mpirl_solver_comm(s), &rank);
        if (rank == 0) /* the run said why; this line tells the tests the code arrived */
            fprintf(stderr, "echo_solver: the run ended before it began (exit code %d)\n",
                    mpirl_exit_code(s));
        return mpirl_finalize(s);
    }

    MPI_Comm group = mpirl_group_comm(s);
    int rank, k;
    MPI_Comm_rank(group, &rank);
    MPI_Comm_size(group, &k);
    int n_obs = mpirl_obs_size(s), n_act = mpirl_action_size(s);
    long episode_length = mpirl_config_long(s, "episode_length", 0);
    long fail_at = mpirl_config_long(s, "fail_at", 0);
    double step_s = mpirl_config_double(s, "step_s", 0.0);
    struct timespec step_sleep = {(time_t)step_s, (long)((step_s - (double)(time_t)step_s) * 1e9)};

    /* This rank's block of the observation: [first, first + counts[rank]). */
    int *counts = malloc(sizeof(int) * (size_t)k), *firsts = malloc(sizeof(int) * (size_t)k);
    for (int r = 0; r < k; r++) {
        counts[r] = n_obs / k + (r < n_obs % k ? 1 : 0);
        firsts[r] = r == 0 ? 0 : firsts[r - 1] + counts[r - 1];
    }
    double *block = malloc(sizeof(double) * (size_t)(counts[rank] + 1));
    double *obs = malloc(sizeof(double) * (size_t)n_obs + 1);
    double *action = malloc(sizeof(double) * (size_t)n_act);
    long seed = -1, t = 0;
    int command;
    while ((command = mpirl_next(s, action, &seed)) != MPIRL_END) {
        double reward = 0.0;
        if (command == MPIRL_RESET) {
            t = 0;
            for (int j = 0; j < counts[rank]; j++)
                block[j] = (seed >= 0 ? (double)seed : 0.0) + 0.5 * (firsts[rank] + j);
        } else {
            t++;
            if (fail_at > 0 && t == fail_at) {
                char message[100];
                snprintf(message, sizeof message, "echo_solver: fail_at step %ld", t);
                mpirl_fail(s, message);
                break;
            }
            if (step_s > 0.0) nanosleep(&step_sleep, NULL);
            for (int j = 0; j < counts[rank]; j++) {
                int i = firsts[rank] + j;
                block[j] = action[i % n_act] + 1000.0 * (double)t + (double)i;
            }
            reward = (double)t;
            for (int j = 0; j < n_act; j++) reward += action[j];
        }
        MPI_Gatherv(block, counts[rank], MPI_DOUBLE, obs, counts, firsts, MPI_DOUBLE, 0, group);
        mpirl_send(s, obs, reward, 0, episode_length > 0 && t >= episode_length);
    }
    free(counts);
    free(firsts);
    free(block);
    free(obs);
    free(action);
    return mpirl_finalize(s);
}
