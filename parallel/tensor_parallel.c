// tensor_parallel.c: the conjugate operators of tensor and sequence parallelism (see
// tensor_parallel.h, doc/parallel.md).
#include "parallel/tensor_parallel.h"

static int alone(const lb_comm *tp) { return !tp || tp->size == 1; }

void lb_tp_reduce(lb_backend *be, lb_comm *tp, int sp, float *part, float *out, int n, int c)
{
    if (alone(tp)) return;
    be->sync(be);   // the backend's writes are complete before the communicator reads
    if (sp) lb_comm_reduce_scatter(tp, part, out, (size_t)n / tp->size * c, LB_F32);
    else lb_comm_all_reduce(tp, part, out, (size_t)n * c, LB_F32);
    lb_comm_sync(tp);
}

void lb_tp_gather(lb_backend *be, lb_comm *tp, int sp, const float *mine, float *full, int n,
                  int c)
{
    if (!sp) return;
    be->sync(be);
    lb_comm_all_gather(tp, mine, full, (size_t)n / tp->size * c, LB_F32);
    lb_comm_sync(tp);
}

void lb_tp_all_reduce(lb_backend *be, lb_comm *tp, float *x, size_t count)
{
    if (alone(tp)) return;
    be->sync(be);
    lb_comm_all_reduce(tp, x, x, count, LB_F32);
    lb_comm_sync(tp);
}
