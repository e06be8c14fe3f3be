/* halo.c: the MPI calls rd_solver.f90 makes, in C. The venv's Open MPI wheel has mpi.h and
 * mpicc but no Fortran bindings (no `use mpi`), so the Fortran solver reaches MPI through these
 * few functions bound with iso_c_binding; with a site MPI's mpif90 it would call MPI_Sendrecv
 * and MPI_Gather itself. Communicators cross as Fortran handles (MPI_Comm_c2f / MPI_Comm_f2c).
 * Each call is rd_core.c's, with the same tags, so the trajectories match bit for bit.
 */
#include <mpi.h>

#define HALO_TAG_LEFT 4901
#define HALO_TAG_RIGHT 4902

/* Swap one ghost value per side with the neighbours in comm: ext holds block values with one
 * ghost each side (ext[0] and ext[block + 1]); the ends keep theirs (u = 0 at the walls). */
int halo_exchange_f(MPI_Fint fortran_comm, double *ext, int block) {
    MPI_Comm comm = MPI_Comm_f2c(fortran_comm);
    int k, rank;
    MPI_Comm_size(comm, &k);
    MPI_Comm_rank(comm, &rank);
    if (k == 1) return MPI_SUCCESS;
    int left = rank > 0 ? rank - 1 : MPI_PROC_NULL;
    int right = rank < k - 1 ? rank + 1 : MPI_PROC_NULL;
    int error = MPI_Sendrecv(&ext[1], 1, MPI_DOUBLE, left, HALO_TAG_LEFT, &ext[block + 1], 1,
                             MPI_DOUBLE, right, HALO_TAG_LEFT, comm, MPI_STATUS_IGNORE);
    if (error != MPI_SUCCESS) return error;
    return MPI_Sendrecv(&ext[block], 1, MPI_DOUBLE, right, HALO_TAG_RIGHT, &ext[0], 1, MPI_DOUBLE,
                        left, HALO_TAG_RIGHT, comm, MPI_STATUS_IGNORE);
}

/* Every rank's block (count doubles each) into out on rank 0 of comm, in rank order. */
int block_gather_f(MPI_Fint fortran_comm, const double *block, int count, double *out) {
    return MPI_Gather(block, count, MPI_DOUBLE, out, count, MPI_DOUBLE, 0,
                      MPI_Comm_f2c(fortran_comm));
}

/* This process's rank in comm and comm's size. */
void comm_rank_size_f(MPI_Fint fortran_comm, int *rank, int *size) {
    MPI_Comm comm = MPI_Comm_f2c(fortran_comm);
    MPI_Comm_rank(comm, rank);
    MPI_Comm_size(comm, size);
}

/* For the standalone trajectory mode (no mpirl run): MPI_Init, and COMM_WORLD's handle. */
MPI_Fint world_init_f(void) {
    MPI_Init(NULL, NULL);
    return MPI_Comm_c2f(MPI_COMM_WORLD);
}

void world_finalize_f(void) {
    MPI_Finalize();
}
