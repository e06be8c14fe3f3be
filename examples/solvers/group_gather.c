/* group_gather.c: the one MPI call the Fortran example makes, in C. The Open MPI wheel of the
 * venv has mpi.h and mpicc but no Fortran bindings (no `use mpi`), so a Fortran solver built
 * against it reaches MPI through a small C helper like this one; with a site MPI's mpif90 the
 * example could call MPI_Gatherv itself.
 *
 * Gathers each rank's block (count doubles, in rank order) into out on rank 0 of comm, a
 * Fortran handle (mpirl_group_comm). Returns MPI's error code.
 */
#include <stdlib.h>

#include <mpi.h>

int group_gather_f(MPI_Fint fortran_comm, const double *block, int count, double *out) {
    MPI_Comm comm = MPI_Comm_f2c(fortran_comm);
    int size;
    MPI_Comm_size(comm, &size);
    int *counts = malloc(sizeof(int) * (size_t)size), *firsts = malloc(sizeof(int) * (size_t)size);
    MPI_Allgather(&count, 1, MPI_INT, counts, 1, MPI_INT, comm);
    for (int r = 0; r < size; r++) firsts[r] = r == 0 ? 0 : firsts[r - 1] + counts[r - 1];
    int error = MPI_Gatherv(block, count, MPI_DOUBLE, out, counts, firsts, MPI_DOUBLE, 0, comm);
    free(counts);
    free(firsts);
    return error;
}

/* This rank's rank and the size of comm. */
void group_rank_size_f(MPI_Fint fortran_comm, int *rank, int *size) {
    MPI_Comm comm = MPI_Comm_f2c(fortran_comm);
    MPI_Comm_rank(comm, rank);
    MPI_Comm_size(comm, size);
}
