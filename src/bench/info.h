// info.h: what a configuration costs a rank, as `lowbit info` prints it (src/bench/info.c).
#ifndef LB_INFO_H
#define LB_INFO_H

#include <stddef.h>
#include "models/model.h"
#include "parallel/grid.h"
#include "src/cli/config.h"

// What one rank of a layout holds at a training step's peak: its model piece built on a
// counting backend (nothing is allocated), plus the backend's own (CUDA's scratch and context).
typedef struct {
    size_t weights, opt, acts;     // bytes: parameters (= gradients), optimizer state, activations
    size_t caches;                 // bytes of the weight caches (the contract's bf16 and
                                   // quantized copies, lb_wcache_bytes)
    size_t host;                   // bytes of optimizer state offloaded to host memory
    size_t backend;                // bytes the backend holds of its own (run.backend)
    lb_act_plan plan;              // which activations acts counts in bf16
} lb_rank_memory;

// Rank g of c's layout. 0, or -1 with a message.
int lb_info_rank_memory(const lb_config *c, const lb_grid *g, lb_rank_memory *out, char *err,
                        size_t errlen);
// Its total on run.backend's memory: 2 weights (parameters and gradients) + the rest.
size_t lb_info_rank_total(const lb_rank_memory *m);

#endif
