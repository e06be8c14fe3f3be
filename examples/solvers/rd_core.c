/* rd_core.c: see rd_core.h. Every expression below has its twin, in the same order, in
 * mpirl/envs/reaction_diffusion.py: keep them in step (compile without FMA contraction). */
#include "rd_core.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

/* math.pi of Python, the double nearest pi (M_PI is not C99). */
#define RD_PI 3.141592653589793

#define RD_TAG_LEFT 4901
#define RD_TAG_RIGHT 4902

struct rd_sim {
    MPI_Comm comm;
    rd_config c;
    int k, rank, block, first, substeps, t;
    double dx, dx2, h;
    double *ext;       /* this rank's block of u with one ghost value each side */
    double *next;      /* the next substep's block */
    double *shapes;    /* num_actuators x block: g_i at this rank's points */
    double *sines;     /* 3 x block: sin(n x) at this rank's points */
    double *forcing;   /* block */
    double *u_global;  /* n_points, on the root */
    double *a;         /* num_actuators: the scaled action */
    int *sensors;      /* num_sensors grid indices */
    uint64_t rng_state;
};

void rd_config_defaults(rd_config *c) {
    c->n_points = 32;
    c->nu = 1.0;
    c->lam = 2.0;
    c->num_actuators = 4;
    c->actuator_width = 0.2;
    c->num_sensors = 8;
    c->a_max = 2.0;
    c->control_cost = 0.01;
    c->dt = 0.05;
    c->max_steps = 100;
    c->init_amplitude = 0.1;
}

uint64_t rd_splitmix64(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static double rd_uniform(uint64_t *state) {
    return (double)(rd_splitmix64(state) >> 11) * (1.0 / 9007199254740992.0);
}

static double gaussian(double d, double width) {
    return exp(-(d * d) / (2.0 * width * width));
}

rd_sim *rd_create(MPI_Comm comm, const rd_config *config, char *error, size_t error_size) {
    int k, rank;
    MPI_Comm_size(comm, &k);
    MPI_Comm_rank(comm, &rank);
    const rd_config *c = config;
    if (c->n_points < 2 || c->num_actuators < 1 || c->num_sensors < 1 || c->max_steps < 1 ||
        !(c->nu > 0) || !(c->dt > 0) || !(c->actuator_width > 0) || !(c->a_max > 0)) {
        snprintf(error, error_size, "reaction-diffusion config out of range: n_points >= 2, "
                 "num_actuators, num_sensors, max_steps >= 1 and nu, dt, actuator_width, a_max "
                 "> 0 are needed");
        return NULL;
    }
    if (c->n_points % k != 0) {
        snprintf(error, error_size, "ReactionDiffusion splits its n_points %d over the group's "
                 "%d ranks: n_points must be a multiple of ranks_per_env %d", c->n_points, k, k);
        return NULL;
    }
    rd_sim *s = calloc(1, sizeof *s);
    s->comm = comm;
    s->c = *c;
    s->k = k;
    s->rank = rank;
    s->block = c->n_points / k;
    s->first = rank * s->block;
    s->dx = RD_PI / (c->n_points + 1);
    s->dx2 = s->dx * s->dx;
    /* Explicit Euler is stable below dx^2 / (2 nu); 0.95 of it leaves a margin. */
    s->substeps = (int)ceil(c->dt / (0.95 * s->dx2 / (2.0 * c->nu)));
    s->h = c->dt / s->substeps;
    int b = s->block, m = c->num_actuators;
    s->ext = calloc((size_t)b + 2, sizeof(double));
    s->next = calloc((size_t)b, sizeof(double));
    s->shapes = malloc(sizeof(double) * (size_t)m * b);
    s->sines = malloc(sizeof(double) * 3 * (size_t)b);
    s->forcing = malloc(sizeof(double) * (size_t)b);
    s->a = malloc(sizeof(double) * (size_t)m);
    s->sensors = malloc(sizeof(int) * (size_t)c->num_sensors);
    s->u_global = rank == 0 ? calloc((size_t)c->n_points, sizeof(double)) : NULL;
    for (int i = 0; i < m; i++) {
        double centre = RD_PI * (i + 0.5) / m;
        for (int j = 0; j < b; j++)
            s->shapes[i * b + j] = gaussian((double)(s->first + j + 1) * s->dx - centre,
                                            c->actuator_width);
    }
    for (int mode = 1; mode <= 3; mode++)
        for (int j = 0; j < b; j++)
            s->sines[(mode - 1) * b + j] = sin((double)(mode * (s->first + j + 1)) * s->dx);
    for (int q = 0; q < c->num_sensors; q++) {
        int index = ((2 * q + 1) * (c->n_points + 1) + c->num_sensors) / (2 * c->num_sensors) - 1;
        s->sensors[q] = index < 0 ? 0 : index > c->n_points - 1 ? c->n_points - 1 : index;
    }
    return s;
}

static void swap_ghosts(rd_sim *s) {
    if (s->k == 1) return;
    int left = s->rank > 0 ? s->rank - 1 : MPI_PROC_NULL;
    int right = s->rank < s->k - 1 ? s->rank + 1 : MPI_PROC_NULL;
    double *ext = s->ext;
    /* Send my first value left and take my right ghost from the right, then the mirror. */
    MPI_Sendrecv(&ext[1], 1, MPI_DOUBLE, left, RD_TAG_LEFT, &ext[s->block + 1], 1, MPI_DOUBLE,
                 right, RD_TAG_LEFT, s->comm, MPI_STATUS_IGNORE);
    MPI_Sendrecv(&ext[s->block], 1, MPI_DOUBLE, right, RD_TAG_RIGHT, &ext[0], 1, MPI_DOUBLE, left,
                 RD_TAG_RIGHT, s->comm, MPI_STATUS_IGNORE);
}

/* The whole u on the root (NULL on the others). */
static const double *gather(rd_sim *s) {
    if (s->k == 1) return s->ext + 1;
    MPI_Gather(s->ext + 1, s->block, MPI_DOUBLE, s->u_global, s->block, MPI_DOUBLE, 0, s->comm);
    return s->rank == 0 ? s->u_global : NULL;
}

static void observe(const rd_sim *s, const double *u, double *obs) {
    for (int q = 0; q < s->c.num_sensors; q++) obs[q] = u[s->sensors[q]];
}

void rd_reset(rd_sim *s, int64_t seed, int has_seed, double *obs) {
    if (has_seed) s->rng_state = (uint64_t)seed;
    double bn[3];
    for (int n = 0; n < 3; n++)
        bn[n] = s->c.init_amplitude * (2.0 * rd_uniform(&s->rng_state) - 1.0);
    double *u = s->ext + 1;
    int b = s->block;
    for (int j = 0; j < b; j++) u[j] = bn[0] * s->sines[j];
    for (int j = 0; j < b; j++) u[j] = u[j] + bn[1] * s->sines[b + j];
    for (int j = 0; j < b; j++) u[j] = u[j] + bn[2] * s->sines[2 * b + j];
    s->t = 0;
    const double *whole = gather(s);
    if (whole && obs) observe(s, whole, obs);
}

void rd_step(rd_sim *s, const double *action, double *obs, double *reward, int *truncated) {
    int b = s->block, m = s->c.num_actuators;
    for (int i = 0; i < m; i++) {
        double v = action[i] < -1.0 ? -1.0 : action[i] > 1.0 ? 1.0 : action[i];
        s->a[i] = v * s->c.a_max;
    }
    for (int j = 0; j < b; j++) {
        double f = s->a[0] * s->shapes[j];
        for (int i = 1; i < m; i++) f = f + s->a[i] * s->shapes[i * b + j];
        s->forcing[j] = f;
    }
    double *ext = s->ext, h = s->h, nu = s->c.nu, lam = s->c.lam, dx2 = s->dx2;
    for (int sub = 0; sub < s->substeps; sub++) {
        swap_ghosts(s);
        for (int j = 0; j < b; j++) {
            double l = ext[j], c = ext[j + 1], r = ext[j + 2];
            s->next[j] = c + h * ((nu * ((l - 2.0 * c) + r)) / dx2 + lam * c + s->forcing[j]);
        }
        for (int j = 0; j < b; j++) ext[j + 1] = s->next[j];
    }
    s->t++;
    const double *u = gather(s);
    if (!u) return;
    double energy = 0.0, effort = 0.0;
    for (int j = 0; j < s->c.n_points; j++) energy += u[j] * u[j];
    for (int i = 0; i < m; i++) effort += s->a[i] * s->a[i];
    if (obs) observe(s, u, obs);
    if (reward) *reward = -(energy * s->dx + s->c.control_cost * effort);
    if (truncated) *truncated = s->t >= s->c.max_steps;
}

const double *rd_state(const rd_sim *s) {
    return s->k == 1 ? s->ext + 1 : s->u_global;
}

void rd_free(rd_sim *s) {
    if (!s) return;
    free(s->ext);
    free(s->next);
    free(s->shapes);
    free(s->sines);
    free(s->forcing);
    free(s->u_global);
    free(s->a);
    free(s->sensors);
    free(s);
}
