/* rd_trajectory: one fixed trajectory of the reaction-diffusion core, for comparing with the
 * Python env (tests/programs/rd_trajectories.py) at any k:
 *
 *     mpiexec -n k ./build/rd_trajectory [seed [steps]]
 *
 * Resets from seed, steps with rd_trajectory_action(t), resets once more without a seed (the
 * stream goes on) halfway, and prints on the root one line per reset or step:
 * "reset|step t reward obs..." with %.17g. */
#include <stdio.h>
#include <stdlib.h>

#include "rd_core.h"

/* The deterministic action sequence; tests/programs/rd_trajectories.py has the same. */
static double rd_trajectory_action(int t, int i) {
    return (double)((7 * t + 3 * i) % 11 - 5) / 5.0;
}

static void print_line(const char *what, int t, double reward, const double *obs, int n) {
    printf("%s %d %.17g", what, t, reward);
    for (int q = 0; q < n; q++) printf(" %.17g", obs[q]);
    printf("\n");
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    long long seed = argc > 1 ? atoll(argv[1]) : 12345;
    int steps = argc > 2 ? atoi(argv[2]) : 40;
    rd_config config;
    rd_config_defaults(&config);
    char error[256];
    rd_sim *sim = rd_create(MPI_COMM_WORLD, &config, error, sizeof error);
    if (!sim) {
        if (rank == 0) fprintf(stderr, "rd_trajectory: %s\n", error);
        MPI_Finalize();
        return 2;
    }
    double obs[64], action[64], reward = 0.0;
    int truncated = 0;
    rd_reset(sim, seed, 1, obs);
    if (rank == 0) print_line("reset", 0, 0.0, obs, config.num_sensors);
    for (int t = 0; t < steps; t++) {
        if (t == steps / 2) {
            rd_reset(sim, -1, 0, obs);
            if (rank == 0) print_line("reset", t, 0.0, obs, config.num_sensors);
        }
        for (int i = 0; i < config.num_actuators; i++) action[i] = rd_trajectory_action(t, i);
        rd_step(sim, action, obs, &reward, &truncated);
        if (rank == 0) print_line("step", t, reward, obs, config.num_sensors);
    }
    rd_free(sim);
    MPI_Finalize();
    return 0;
}
