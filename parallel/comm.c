// comm.c: the MPI world communicator. Every MPI call is checked; a failure names the call and
// ends the whole job through MPI_Abort.
#include "parallel/comm.h"

#include <mpi.h>
#include <stdlib.h>
#include "kernels/common.h"

#define MPI_CHECK(call)                                                       \
    do {                                                                      \
        int rc_ = (call);                                                     \
        if (rc_ != MPI_SUCCESS) {                                             \
            char msg_[MPI_MAX_ERROR_STRING];                                  \
            int len_ = 0;                                                     \
            MPI_Error_string(rc_, msg_, &len_);                               \
            lb_die_at(__FILE__, __LINE__, "%s failed: %s", #call, msg_);      \
        }                                                                     \
    } while (0)

static void abort_job(int code)
{
    int up = 0, down = 0;
    MPI_Initialized(&up);
    MPI_Finalized(&down);
    if (up && !down) {
        int size = 1;
        MPI_Comm_size(MPI_COMM_WORLD, &size);
        if (size > 1) MPI_Abort(MPI_COMM_WORLD, code ? code : 1);
        MPI_Finalize();   // alone: a clean exit with the code, no abort banner
    }
}

void lb_comm_init(lb_comm *c, int *argc, char ***argv)
{
    MPI_CHECK(MPI_Init(argc, argv));
    // Errors come back as codes so MPI_CHECK can report file:line before aborting.
    MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
    MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &c->rank));
    MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &c->size));
    MPI_Comm *w = lb_malloc(sizeof *w);
    *w = MPI_COMM_WORLD;
    c->mpi_comm = w;
    lb_set_abort_hook(abort_job);
}

void lb_comm_finalize(lb_comm *c)
{
    free(c->mpi_comm);
    c->mpi_comm = NULL;
    lb_set_abort_hook(NULL);
    MPI_CHECK(MPI_Finalize());
}

void lb_comm_bcast(lb_comm *c, void *buf, size_t bytes, int root)
{
    // MPI counts are int: send in chunks so large buffers work.
    const size_t chunk = (size_t)1 << 30;
    for (size_t off = 0; off < bytes; off += chunk) {
        size_t len = bytes - off < chunk ? bytes - off : chunk;
        MPI_CHECK(MPI_Bcast((char *)buf + off, (int)len, MPI_BYTE, root,
                            *(MPI_Comm *)c->mpi_comm));
    }
}

double lb_comm_allreduce_sum(lb_comm *c, double x)
{
    double out = 0.0;
    MPI_CHECK(MPI_Allreduce(&x, &out, 1, MPI_DOUBLE, MPI_SUM, *(MPI_Comm *)c->mpi_comm));
    return out;
}

void lb_comm_barrier(lb_comm *c) { MPI_CHECK(MPI_Barrier(*(MPI_Comm *)c->mpi_comm)); }
