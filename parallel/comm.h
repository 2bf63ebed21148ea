// comm.h: the collective interface. This first version is the MPI world communicator in host
// memory; the NCCL implementation and the process grid (tp, ep, dp, pp) extend it.
#ifndef LB_COMM_H
#define LB_COMM_H

#include <stddef.h>

typedef struct {
    int rank, size;
    void *mpi_comm;                // MPI_Comm *
} lb_comm;

// MPI_Init, and installs MPI_Abort as the fatal-error hook so a failing rank ends the job.
void lb_comm_init(lb_comm *c, int *argc, char ***argv);
void lb_comm_finalize(lb_comm *c);
void lb_comm_bcast(lb_comm *c, void *buf, size_t bytes, int root);
// Sum of one double over all ranks.
double lb_comm_allreduce_sum(lb_comm *c, double x);
void lb_comm_barrier(lb_comm *c);

#endif
