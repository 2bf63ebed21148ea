// cpu.h: internal declarations shared by the files of the CPU reference backend.
//
// Each ops_*.c file keeps its operations static and installs them into the table through one
// lb_cpu_init_* function (ggml style); nothing else in the tree calls them directly.
#ifndef LB_CPU_H
#define LB_CPU_H

#include "kernels/kernels.h"

// Backend-private state (lb_backend.ctx).
typedef struct {
    int threads;    // OpenMP and OpenBLAS threads used by this backend's operations
    float *round;   // gemm's bf16-rounded operand copies (grow-only, ops_basic.c)
    size_t round_n;
    float *c32;     // gemm's fp32 C of a call with a bf16 output (c16; grow-only, ops_basic.c)
    size_t c32_n;
} lb_cpu_ctx;

// Thread count for `num_threads(...)` clauses. Each parallel loop names it explicitly so two
// CPU backends with different thread counts can live in one process.
static inline int lb_cpu_threads(const lb_backend *be)
{
    return ((const lb_cpu_ctx *)be->ctx)->threads;
}

// A bf16 output (lb_gemm_args.c16, lb_gemm_q_args.c16): the call's C is computed in fp32 into
// lb_cpu_c32 (grow-only, at least n floats), then lb_cpu_store_c16 rounds each element once
// into c16 (m, pad8(n)), the pad columns not written (ops_basic.c).
float *lb_cpu_c32(lb_backend *be, size_t n);
void lb_cpu_store_c16(lb_backend *be, uint16_t *c16, const float *c, int m, int n);

// Below this many elements an elementwise loop runs on one thread (start-up would dominate).
// Elementwise results do not depend on the split, so this never changes a number.
#define LB_CPU_PAR_MIN 32768

// --- deterministic GEMM (gemm.c) ---------------------------------------------------------------
// C (m, n) = alpha op(A) op(B) + beta C as lb_gemm_args documents, every element computed in
// one fixed order that depends on k alone (gemm.c states it), so results never depend on m,
// n, the element's position, the thread count or the instruction set.
// isa: LB_CPU_GEMM_AUTO picks the best build of the inner loop this CPU runs; LB_CPU_GEMM_BASE
// forces the baseline build (tests compare the two bitwise).
enum { LB_CPU_GEMM_AUTO = 0, LB_CPU_GEMM_BASE = 1 };
void lb_cpu_gemm_det(const lb_gemm_args *g, int threads, int isa);
// Checks sizes (negative: dies) and handles the calls with no product: m or n == 0 (nothing
// touched), k == 0 or alpha == 0 (C = beta C, beta 0 overwriting NaN). Returns 1 when it did.
int lb_cpu_gemm_trivial(const lb_gemm_args *g);

void lb_cpu_init_basic(lb_backend *be);       // ops_basic.c
void lb_cpu_init_attention(lb_backend *be);   // ops_attention.c
void lb_cpu_init_moe(lb_backend *be);         // ops_moe.c
void lb_cpu_init_optim(lb_backend *be);       // ops_optim.c
void lb_cpu_init_quant(lb_backend *be);       // ops_quant.c
void lb_cpu_init_sample(lb_backend *be);      // ops_sample.c

#endif
