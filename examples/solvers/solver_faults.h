/* solver_faults.h: faults on demand for an example solver, so that tests can meet each way a
 * real solver goes wrong (tests/test_sim_faults.py). Keys of env_config, each a step number N
 * counted from the program's start over all episodes (1: its first STEP; 0 or absent: never):
 *
 *   hang_at N        stop answering at step N: every member sleeps until killed, after one line
 *                    on stderr ("<program>: env group G hangs at step N (hang_at)")
 *   wrong_size_at N  the reply of step N carries observation_size + wrong_size_by numbers
 *                    (wrong_size_by: default 1; negative sends fewer)
 *   nan_at N         the reward is NaN at steps N .. N + nan_steps - 1 (nan_steps: default 1)
 *   fail_at N        mpirl_fail at step N ("<program>: fail_at step N")
 *   exit_at N        the process ends at step N without MPI_Finalize (_exit(3)): a crash
 *
 * fault_group G limits them to env group G (absent: every group). Header-only: include it in
 * one file of the program, which defines _POSIX_C_SOURCE before any header (sleep, _exit). */
#ifndef SOLVER_FAULTS_H
#define SOLVER_FAULTS_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "mpirl_solver.h"

typedef struct solver_faults {
    const char *program;
    long hang_at, wrong_size_at, wrong_size_by, nan_at, nan_steps, fail_at, exit_at;
} solver_faults;

/* The keys of env_config, for this process's group (all 0 when fault_group names another). */
static void solver_faults_read(const mpirl_solver *s, const char *program, solver_faults *f) {
    long group = mpirl_config_long(s, "fault_group", -1);
    int mine = group < 0 || group == mpirl_group(s);
    f->program = program;
    f->hang_at = mine ? mpirl_config_long(s, "hang_at", 0) : 0;
    f->wrong_size_at = mine ? mpirl_config_long(s, "wrong_size_at", 0) : 0;
    f->wrong_size_by = mpirl_config_long(s, "wrong_size_by", 1);
    f->nan_at = mine ? mpirl_config_long(s, "nan_at", 0) : 0;
    f->nan_steps = mpirl_config_long(s, "nan_steps", 1);
    f->fail_at = mine ? mpirl_config_long(s, "fail_at", 0) : 0;
    f->exit_at = mine ? mpirl_config_long(s, "exit_at", 0) : 0;
}

/* Answer step `step` as mpirl_send does, with the faults due at that step. Returns 0, or 1
 * after mpirl_fail (leave the command loop then). Every member of the group calls it. */
static int solver_faults_send(const solver_faults *f, mpirl_solver *s, long step, double *obs,
                              double reward, int terminated, int truncated) {
    if (step == f->exit_at) _exit(3);
    if (step == f->hang_at) {
        int rank;
        MPI_Comm_rank(mpirl_group_comm(s), &rank);
        if (rank == 0) {
            fprintf(stderr, "%s: env group %d hangs at step %ld (hang_at)\n", f->program,
                    mpirl_group(s), step);
            fflush(stderr);
        }
        for (;;) sleep(1);
    }
    if (step == f->fail_at) {
        char message[160];
        snprintf(message, sizeof message, "%s: fail_at step %ld", f->program, step);
        mpirl_fail(s, message);
        return 1;
    }
    if (f->nan_at > 0 && step >= f->nan_at && step < f->nan_at + f->nan_steps) reward = NAN;
    if (step != f->wrong_size_at) return mpirl_send(s, obs, reward, terminated, truncated);
    int size = mpirl_obs_size(s), n = size + (int)f->wrong_size_by;
    double *longer = (double *)calloc((size_t)(n > size ? n : size), sizeof(double));
    memcpy(longer, obs, sizeof(double) * (size_t)size);
    mpirl_send_n(s, longer, n < 0 ? 0 : n, reward, terminated, truncated);
    free(longer);
    return 0;
}

#endif /* SOLVER_FAULTS_H */
