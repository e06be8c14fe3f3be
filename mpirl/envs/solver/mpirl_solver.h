/* mpirl_solver.h: couple an MPI solver (C, C++ or, through mpirl.f90, Fortran) to an mpirl run.
 *
 * The solver runs as its own program beside the run (MPMD):
 *     mpiexec -n 3 mpirl train --env mpirl.envs.simulation:Solver ... : -n 8 ./solver
 * Its processes form env groups of ranks_per_env ranks each; one group is one environment
 * instance, with its domain decomposed over the group's communicator. Per step the group's root
 * receives one message (the action) and sends one back (observation, reward, done flags): the
 * protocol of mpirl/runtime/sim_link.py, whose numbers this file repeats.
 *
 *     mpirl_solver *s;
 *     if (mpirl_init(&argc, &argv, &s) != 0) return mpirl_finalize(s);
 *     MPI_Comm group = mpirl_group_comm(s);      // decompose the domain over this
 *     double action[A]; long seed; int command;
 *     while ((command = mpirl_next(s, action, &seed)) != MPIRL_END) {
 *         if (command == MPIRL_RESET) { ...start an episode from seed... }
 *         else { ...advance one env step with action... }
 *         mpirl_send(s, obs, reward, terminated, truncated);   // the root's values count
 *     }
 *     return mpirl_finalize(s);
 *
 * Build: mpicc -I$(python -m mpirl.envs.solver --include) solver.c $(python -m mpirl.envs.solver
 * --source). Every wait polls (no core spins at 100% between steps).
 */
#ifndef MPIRL_SOLVER_H
#define MPIRL_SOLVER_H

#include <mpi.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MPIRL_PROTOCOL_MAGIC 0x6d70726cL
#define MPIRL_PROTOCOL_VERSION 1

/* What mpirl_next returns. */
enum { MPIRL_RESET = 1, MPIRL_STEP = 2, MPIRL_END = 3 };

typedef struct mpirl_solver mpirl_solver;

/* Initialize MPI (unless the program did), introduce this process to the run, wait for its
 * group's setup. Returns 0, or MPIRL_END when the run ended before it began (then leave with
 * mpirl_finalize's code; mpirl_exit_code says the run's). Collective over every solver
 * process. A solver at world rank 0 (mpirl must come first), a setup of another protocol
 * version, or groups that do not match ranks_per_env: one line on stderr, MPI_Abort(2).
 * SIGUSR1, SIGUSR2 and SIGTERM, unless the program set handlers for them first, are ignored
 * from here on: they are mpirl's stop requests (checkpoint, then END), which launchers pass to
 * every process of the job. */
int mpirl_init(int *argc, char ***argv, mpirl_solver **solver);

/* This env instance's ranks (k = ranks_per_env of them). */
MPI_Comm mpirl_group_comm(const mpirl_solver *solver);
/* The solver program's own ranks, every group's (for whatever the program shares). */
MPI_Comm mpirl_solver_comm(const mpirl_solver *solver);
int mpirl_group(const mpirl_solver *solver);        /* this group's index in the run */
int mpirl_num_groups(const mpirl_solver *solver);
int mpirl_obs_size(const mpirl_solver *solver);     /* doubles mpirl_send sends */
int mpirl_action_size(const mpirl_solver *solver);  /* doubles mpirl_next fills (1: Discrete) */
long mpirl_seed(const mpirl_solver *solver);        /* the run's seed for this group */
int mpirl_exit_code(const mpirl_solver *solver);    /* after MPIRL_END: the run's exit code
                                                      (0: a normal end; 2 after mpirl_fail) */

/* env_config as the run gave it: the JSON text, or one number by key (fallback if absent). */
const char *mpirl_config_json(const mpirl_solver *solver);
double mpirl_config_double(const mpirl_solver *solver, const char *key, double fallback);
long mpirl_config_long(const mpirl_solver *solver, const char *key, long fallback);

/* Wait for the next command; collective over the group. Fills action (every member) for
 * MPIRL_STEP, seed (-1: none) for MPIRL_RESET. Returns MPIRL_RESET, MPIRL_STEP or MPIRL_END. */
int mpirl_next(mpirl_solver *solver, double *action, long *seed);

/* Answer the last RESET or STEP: only the group's root sends; the others return at once. */
int mpirl_send(mpirl_solver *solver, const double *obs, double reward, int terminated,
               int truncated);

/* mpirl_send with the observation's length n, for a solver whose observation length comes
 * from its own data (a mesh, a sensor list): n numbers from obs are sent as they are, so that
 * a length other than mpirl_obs_size ends the run with one line naming both sizes, instead of
 * mpirl_send reading past the end of obs or leaving numbers out. */
int mpirl_send_n(mpirl_solver *solver, const double *obs, int n, double reward, int terminated,
                 int truncated);

/* Report a failure the run should end on (exit 2, naming this group and the message), then
 * leave as after MPIRL_END (mpirl_next returns MPIRL_END from now on). Call it on every
 * member of the group (the root sends the REPLY with ERROR_SEQ and the one-line message; the
 * others only stop). Returns 2. */
int mpirl_fail(mpirl_solver *solver, const char *message);

/* Free the solver's communicators; MPI_Finalize if mpirl_init began MPI. Returns the exit
 * code to leave with: 0, also after a run that failed or mpirl_fail. mpirl's rank 0 exits
 * last with the run's code, so mpiexec reports it; a solver that left first with a non-zero
 * code would have Open MPI kill mpirl's ranks before they say why. */
int mpirl_finalize(mpirl_solver *solver);

#ifdef __cplusplus
}
#endif

#endif /* MPIRL_SOLVER_H */
