// comm_impl.h: what the implementations of the collective interface share (not for callers):
// the checked-call macro for MPI and the MPI communicator behind an lb_comm.
#ifndef LB_COMM_IMPL_H
#define LB_COMM_IMPL_H

#include <mpi.h>
#include "kernels/common.h"
#include "parallel/comm.h"

// Errors come back as codes (MPI_ERRORS_RETURN on every communicator), so each call can report
// where it failed before lb_die ends the job through MPI_Abort.
#define LB_MPI_CHECK(call)                                                    \
    do {                                                                      \
        int rc_ = (call);                                                     \
        if (rc_ != MPI_SUCCESS) {                                             \
            char msg_[MPI_MAX_ERROR_STRING];                                  \
            int len_ = 0;                                                     \
            MPI_Error_string(rc_, msg_, &len_);                               \
            lb_die_at(__FILE__, __LINE__, "%s failed: %s", #call, msg_);      \
        }                                                                     \
    } while (0)

// Largest number of elements one MPI call or one staging buffer of a deterministic reduction
// handles (lb_comm_mpi_set_piece).
extern size_t lb_comm_piece;

static inline MPI_Comm lb_comm_mpi(const lb_comm *c) { return *(const MPI_Comm *)c->mpi_comm; }

#endif
