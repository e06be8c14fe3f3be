/* rd_core.h: the 1-D unstable reaction-diffusion equation of mpirl/envs/reaction_diffusion.py,
 * the same maths in C (bitwise the same trajectory for the same seed and actions, for any k):
 *
 *     u_t = nu u_xx + lam u + sum_i a_i g_i(x)   on [0, pi],  u = 0 at both ends.
 *
 * The n_points interior points are split in contiguous blocks over the ranks of a
 * communicator; each substep swaps one ghost value per side with the neighbours, and the root
 * gathers u to compute the sensors (the observation) and the reward. */
#ifndef RD_CORE_H
#define RD_CORE_H

#include <mpi.h>
#include <stddef.h>
#include <stdint.h>

typedef struct rd_config {
    int n_points;          /* interior grid points (a multiple of the ranks) */
    double nu;             /* diffusion */
    double lam;            /* reaction */
    int num_actuators;     /* Gaussians centred at pi (i + 1/2) / num_actuators */
    double actuator_width; /* their sigma */
    int num_sensors;       /* point sensors near pi (s + 1/2) / num_sensors */
    double a_max;          /* an action of 1 drives an actuator at a_max */
    double control_cost;   /* c in -(||u||^2 dx + c ||a||^2) */
    double dt;             /* one env step, in explicit Euler substeps */
    int max_steps;         /* steps per episode, then truncated */
    double init_amplitude; /* u0 = sum_{n=1..3} b_n sin(n x), b_n ~ U(-amp, amp) */
} rd_config;

typedef struct rd_sim rd_sim;

/* The defaults of reaction_diffusion.py's DEFAULTS. */
void rd_config_defaults(rd_config *config);

/* One step of splitmix64: advances *state, returns its output (as reaction_diffusion.py's). */
uint64_t rd_splitmix64(uint64_t *state);

/* A simulation over comm's ranks (collective; comm is used, not duplicated). Returns NULL and
 * writes a one-line reason to error (error_size bytes) when the config does not fit. */
rd_sim *rd_create(MPI_Comm comm, const rd_config *config, char *error, size_t error_size);

/* Start an episode: from seed when has_seed, else the stream goes on. Collective; the root
 * fills obs (num_sensors doubles), the others may pass NULL. */
void rd_reset(rd_sim *sim, int64_t seed, int has_seed, double *obs);

/* One env step with action (num_actuators values in [-1, 1], clipped; the same on every
 * member). Collective; the root fills obs, *reward and *truncated. */
void rd_step(rd_sim *sim, const double *action, double *obs, double *reward, int *truncated);

/* The root's copy of the whole u after the last reset or step (n_points doubles). */
const double *rd_state(const rd_sim *sim);

void rd_free(rd_sim *sim);

#endif /* RD_CORE_H */
