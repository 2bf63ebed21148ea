// pipeline_schedule.c: the 1F1B schedule and the stage-to-stage messages (see
// pipeline_schedule.h, doc/parallel.md).
#include "parallel/pipeline_schedule.h"

void lb_pipeline_recv_forward(const lb_pipeline_stage *s)
{
    if (s->first) return;
    s->prepare(s->ctx);
    lb_comm_recv(s->comm, s->input(s->ctx), s->floats(s->ctx), LB_F32, s->stage - 1);
    lb_comm_sync(s->comm);
}

void lb_pipeline_send_forward(const lb_pipeline_stage *s)
{
    if (s->last) return;
    s->be->sync(s->be);   // the backend's writes are complete before the communicator reads
    lb_comm_send(s->comm, s->output(s->ctx), s->floats(s->ctx), LB_F32, s->stage + 1);
    lb_comm_sync(s->comm);
}

// Micro-batch j with `warm` warm-up forwards lives in slot j mod (warm + 1): at most warm + 1
// are in flight, and j's slot is free again by the time j + warm + 1 starts.
static void use_slot(const lb_pipeline_stage *s, int j, int warm)
{
    s->use_slot(s->ctx, j % (warm + 1));
}

void lb_pipeline_forward_backward(const lb_pipeline_stage *s, int M)
{
    const int pp = s->stages, r = s->stage;
    void *ctx = s->ctx;
    if (pp == 1) {
        for (int j = 0; j < M; j++) {
            s->forward(ctx, j);
            s->backward(ctx);
        }
        return;
    }
    const int warm = pp - r - 1 < M ? pp - r - 1 : M;
    lb_backend *be = s->be;
    lb_comm *ppc = s->comm;
    for (int j = 0; j < warm; j++) {
        use_slot(s, j, warm);
        lb_pipeline_recv_forward(s);
        s->forward(ctx, j);
        lb_pipeline_send_forward(s);
    }
    if (warm < M) {
        use_slot(s, warm, warm);
        lb_pipeline_recv_forward(s);
    }
    for (int i = 0; i < M - warm; i++) {
        int f = warm + i;
        use_slot(s, f, warm);
        s->forward(ctx, f);
        float *y = s->last ? NULL : s->output(ctx);
        use_slot(s, i, warm);
        // every slot holds one shape: len words of hidden states, glen of gradient
        const size_t len = s->floats(ctx), glen = s->grad_floats(ctx);
        if (y) {   // send_forward_recv_backward: this output, the gradient of micro-batch i
            be->sync(be);
            lb_comm_send_recv(ppc, y, len, r + 1, s->grad(ctx), glen, r + 1, LB_F32);
            lb_comm_sync(ppc);
        }
        s->backward(ctx);
        if (s->first) continue;
        float *dx = s->grad(ctx);
        be->sync(be);
        if (i == M - warm - 1) {   // send_backward
            lb_comm_send(ppc, dx, glen, LB_F32, r - 1);
        } else {   // send_backward_recv_forward: i's input gradient, the next forward's input
            use_slot(s, f + 1, warm);
            lb_comm_send_recv(ppc, dx, glen, r - 1, s->input(ctx), len, r - 1, LB_F32);
        }
        lb_comm_sync(ppc);
    }
    for (int i = M - warm; i < M; i++) {   // cool-down: the last backwards
        use_slot(s, i, warm);
        const size_t len = s->grad_floats(ctx);
        lb_comm_recv(ppc, s->grad(ctx), len, LB_F32, r + 1);   // recv_backward
        lb_comm_sync(ppc);
        s->backward(ctx);
        if (!s->first) {   // send_backward
            be->sync(be);
            lb_comm_send(ppc, s->grad(ctx), len, LB_F32, r - 1);
            lb_comm_sync(ppc);
        }
    }
}
