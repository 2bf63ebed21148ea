// pipeline_schedule.h: pipeline parallelism's schedule and its stage-to-stage messages
// (Megatron-Core's pipeline_parallel/schedules.py and p2p_communication.py; doc/parallel.md).
// The schedule knows no model: a stage is driven through the callbacks of lb_pipeline_stage.
#ifndef LB_PIPELINE_SCHEDULE_H
#define LB_PIPELINE_SCHEDULE_H

#include <stddef.h>
#include "kernels/kernels.h"
#include "parallel/comm.h"

// One pipeline stage. Every activation slot holds one micro-batch of the same shape, so one
// message size serves every exchange of hidden states a stage passes on, and one every
// gradient coming back.
typedef struct {
    lb_comm *comm;                 // the pipeline group, backend memory (MPI or NCCL)
    lb_backend *be;
    int stage, stages;             // this stage (its rank in comm), the number of stages
    int first, last;               // holds the embedding / the loss
    void *ctx;                     // the caller's, passed to every callback
    // Makes activation slot i current and its buffers ready for a micro-batch (a stage
    // receives its input into them before the forward).
    void (*use_slot)(void *ctx, int slot);
    // The current slot's buffers ready, the slot unchanged.
    void (*prepare)(void *ctx);
    // Micro-batch j's forward into the current slot (its input already there on a later
    // stage); its backward from the gradient of its output (received into grad() on an
    // earlier stage), leaving the gradient of its input in grad().
    void (*forward)(void *ctx, int j);
    void (*backward)(void *ctx);
    // The current slot's input hidden states, output hidden states, and gradient buffer.
    float *(*input)(void *ctx);
    float *(*output)(void *ctx);
    float *(*grad)(void *ctx);
    size_t (*floats)(void *ctx);        // 32-bit words of hidden states a message (slot ready)
    size_t (*grad_floats)(void *ctx);   // floats of a gradient message (slot ready)
} lb_pipeline_stage;

// Megatron's recv_forward and send_forward, for forward-only chains (validation): the input
// hidden states from the previous stage into the current slot (readied; not on the first
// stage), and the output to the next (after the backend's writes; not on the last).
void lb_pipeline_recv_forward(const lb_pipeline_stage *s);
void lb_pipeline_send_forward(const lb_pipeline_stage *s);

// One step's M micro-batches on this stage: with one stage, forward and backward of each in
// turn (Megatron's forward_backward_no_pipelining); else the 1F1B schedule
// (forward_backward_pipelining_without_interleaving): stage s runs min(stages - s - 1, M)
// warm-up forwards, then alternates one forward and one backward (each exchange pairs a send
// with a receive, so no stage waits on a stage that waits on it), then drains the remaining
// backwards. At most stages - s micro-batches are in flight; micro-batch j lives in slot
// j mod (warm-up + 1).
void lb_pipeline_forward_backward(const lb_pipeline_stage *s, int M);

#endif
