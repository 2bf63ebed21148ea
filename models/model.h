// model.h: model definitions and the model object the trainer and sampler drive.
//
// A definition (one file per family, listed in models/registry.c) declares its parameter
// tensors, named as in the Hugging Face checkpoint, and its forward and backward built only
// from kernel-set operations. All parameters live in one contiguous fp32 buffer (llm.c style),
// so the optimizer, gradient norm and checkpoints treat them as one array.
#ifndef LB_MODEL_H
#define LB_MODEL_H

#include <stddef.h>
#include <stdint.h>
#include "kernels/kernels.h"
#include "models/precision/contract.h"
#include "parallel/comm.h"
#include "parallel/dispatcher.h"
#include "parallel/grid.h"
#include "models/precision/linear.h"

// Field names follow Hugging Face's config.json (Qwen3, Qwen3-MoE, Llama).
typedef struct {
    char arch[32];                 // a name in models/registry.c: "qwen3_moe", "qwen3", "llama"
    int vocab_size;
    int hidden_size;
    int num_hidden_layers;
    int num_attention_heads;
    int num_key_value_heads;
    int head_dim;
    int intermediate_size;         // dense SwiGLU MLP (qwen3)
    int num_experts;               // qwen3_moe
    int num_experts_per_tok;
    int moe_intermediate_size;
    int norm_topk_prob;            // renormalise the top-k router weights
    // DeepSeek-V3 / GLM-4.5 MoE (glm4_moe): the first first_k_dense_replace layers have a dense
    // MLP (intermediate_size) in a MoE model; n_shared_experts SwiGLU experts of
    // moe_intermediate_size each (one MLP of their total width) see every token beside the
    // routed ones; the sigmoid router keeps the topk_group best of n_group expert groups and
    // scales the routed weights by routed_scaling_factor; after each optimizer step its
    // selection bias moves by router_bias_update_rate (aux-loss-free balancing).
    int first_k_dense_replace;
    int n_shared_experts;
    int n_group, topk_group;
    double routed_scaling_factor;
    double router_bias_update_rate;
    int attention_bias;            // q, k and v projections with a bias
    int use_qk_norm;               // per-head q/k RMSNorm where the family makes it optional
    double partial_rotary_factor;  // RoPE rotates this share of each head (0 or 1: all of it)
    int max_position_embeddings;
    double rope_theta;
    // RoPE frequency scaling (HF rope_scaling): "default" (none) or "llama3", which divides the
    // low frequencies by rope_factor and blends the middle band (lb_rope_inv_freq_llama3).
    char rope_type[16];
    double rope_factor, rope_low_freq_factor, rope_high_freq_factor;
    int rope_original_max_position_embeddings;
    double rms_norm_eps;
    double router_aux_loss_coef;   // weight of the load-balancing loss (see doc/loss.md)
    double initializer_range;      // std of the normal init of matrices
} lb_model_config;

// A [model] key of the parameter file: a field of lb_model_config, its type, default, range or
// choices and help (src/cli/params.c puts these in the parameter table, so they parse, print
// and get their doc/parameters.md rows like every key). The shared blocks declare theirs, each
// group with the families that read it (lb_block_keys, models/blocks.c); a family declares
// the keys only it reads (lb_model_def.keys). models/registry.c lists them all.
typedef enum { LB_MKEY_INT, LB_MKEY_FLOAT, LB_MKEY_BOOL, LB_MKEY_ENUM } lb_model_key_type;

typedef struct lb_model_def lb_model_def;

typedef struct {
    const char *name;
    lb_model_key_type type;
    size_t offset, size;           // of the field in lb_model_config
    const char *def;               // default, as a parameter file would write it
    double min, max;               // numeric range (inclusive) when min < max
    const char *choices;           // LB_MKEY_ENUM: "a|b|c"
    const char *help;
    // Whether family def reads the key (NULL: every family). Only for the blocks' keys; a
    // family's own keys are its alone.
    int (*reads)(const lb_model_def *def);
} lb_model_key;

#define LB_MODEL_KEY(field, type, def, lo, hi, choices, help, reads)                          \
    { #field, type, offsetof(lb_model_config, field), sizeof(((lb_model_config *)0)->field),   \
      def, lo, hi, choices, help, reads }

// A config.json key only some families have (lb_model_def.hf_config; the keys every family
// has are the shared decoder's, in src/io/convert.c). Import reads it into its field of
// lb_model_config and export writes it, both in the table's order, so a family's Hugging Face
// mapping is data in its own file. models/ knows no JSON: src/io/convert.c walks the tables.
typedef enum {
    LB_HF_INT,                     // an integer >= lo (an int field)
    LB_HF_REAL,                    // a non-negative number (a double field)
    LB_HF_BOOL,                    // true or false (an int field)
    LB_HF_NULL,                    // null, written by export alone
    LB_HF_LAYERS,                  // the leading layers [0, 1, ..., k-1] of an int field k, the
                                   // only dense layers the shared decoder has (Qwen's
                                   // mlp_only_layers: first_k_dense_replace)
} lb_hf_kind;

typedef struct {
    const char *name;              // as config.json spells it
    lb_hf_kind kind;
    size_t offset, size;           // of its field in lb_model_config; LB_HF_NO_FIELD: a constant
    double value;                  // the field's value where the key is absent or null (the
                                   // transformers config class's default); a constant's value
    int lo;                        // LB_HF_INT: the least value import takes
    int write_only;                // import leaves the field to another key (or to nothing)
    // Export writes the key right after this one (a shared key or one of the table's); NULL:
    // right after the entry before it. transformers ignores the order; this keeps a family's
    // keys beside the shared ones they go with (tests/data/hf_export holds the texts).
    const char *after;
} lb_hf_key;

#define LB_HF_NO_FIELD ((size_t)-1)
// A key read into its field and written from it.
#define LB_HF_KEY(name, kind, field, value, lo, after)                                          \
    { name, kind, offsetof(lb_model_config, field), sizeof(((lb_model_config *)0)->field),      \
      value, lo, 0, after }
// A field written under one more name (a spelling import reads elsewhere).
#define LB_HF_ALIAS(name, kind, field, after)                                                   \
    { name, kind, offsetof(lb_model_config, field), sizeof(((lb_model_config *)0)->field),      \
      0, 0, 1, after }
// A value export writes for what lowbit does not compute (import refuses other values where it
// reads the key at all: src/io/convert.c's shared refusals).
#define LB_HF_CONST(name, kind, value, after) { name, kind, LB_HF_NO_FIELD, 0, value, 0, 1, after }

#define LB_TENSOR_NAME 96

// How a tensor is cut over the model-parallel ranks (doc/parallel.md). Megatron-Core's names:
// a column-parallel layer splits its output features (dim 0 of an (out, in) weight), a
// row-parallel layer its input features (dim 1). Fused gate/up weights cut each half alike so
// every rank keeps matching gate and up rows. Experts are cut over ep along dim 0 and over
// etp like the dense MLP.
typedef enum {
    LB_SPLIT_NONE,                 // replicated over tp
    LB_SPLIT_COL,                  // (out, in): dim 0 over tp
    LB_SPLIT_COL2,                 // (2f, in): each half of dim 0 over tp
    LB_SPLIT_ROW,                  // (out, in): dim 1 over tp
    LB_SPLIT_EXPERT_COL2,          // (experts, 2f, c): dim 0 over ep, each half of dim 1 over etp
    LB_SPLIT_EXPERT_ROW,           // (experts, c, f): dim 0 over ep, dim 2 over etp
} lb_split;

// Which gradients of a tensor replicated over tp are partial sums (each tp rank saw part of
// the work) and must be summed over tp before the optimizer.
typedef enum {
    LB_TPGRAD_WHOLE,               // every tp rank computes the whole gradient
    LB_TPGRAD_PARTIAL,             // partial always (per-head norm weights: heads are split)
    LB_TPGRAD_PARTIAL_SP,          // partial under sequence parallelism (rows are split)
} lb_tpgrad;

typedef struct {
    char name[LB_TENSOR_NAME];     // e.g. "model.layers.0.self_attn.q_proj.weight"
    int ndim;
    int64_t shape[3];              // this rank's piece (the whole tensor without parallelism)
    size_t offset;                 // in floats, into the parameter buffer
    size_t numel;
    int is_norm;                   // initialised to 1, no weight decay
    int zero_init;                 // initialised to 0, no weight decay (biases)
    int frozen;                    // no gradient, and the optimizer skips it (the router's
                                   // selection bias, moved by lb_decoder_router_bias_update)
    // set by the definition
    lb_split split;
    lb_tpgrad tpgrad;
    int layer;                     // decoder layer; -1 embedding (first stage), L final (last)
    int wgrad_gemm;                // its gradient comes from linear wgrads alone, each writing
                                   // all of it (lb_model_grad_beta)
    // set by the model: the piece this rank holds
    int global;                    // index in the definition's table (init seeds, checkpoints)
    int64_t gshape[3];             // the whole tensor
    int parts[3], index[3], groups[3];   // per dim: pieces, this rank's piece, cut sub-blocks
    int expert;                    // experts: gradients over the expert-data-parallel group
    int tp_sum;                    // gradient summed over tp before the optimizer
    int tp_replicated;             // the same values on every tp rank (counted once in norms)
} lb_tensor;

// Where this rank sits in the model-parallel grid, and the backend-memory communicators the
// forward and backward use (NULL when the size is 1). Experts are cut over etp, which divides
// tp: the tp group's rows are shared out in tp / etp parts, one per group of etp ranks
// (doc/parallel.md); etp 0 means etp = tp.
typedef struct {
    int tp, tp_rank, sp;           // tensor parallel, sequence parallel
    int ep, ep_rank;               // expert parallel (the expert grid's coordinate)
    int pp, pp_rank;               // pipeline stage
    lb_comm *tp_comm, *ep_comm;
    int etp, etp_rank;             // expert tensor parallel (0: = tp, tp_rank)
    // the expert-tensor-parallel group (the grid's MPI communicator: host messages only, the
    // NVFP4 experts' shared second level, lb_linear.etp); NULL when etp is 1
    lb_comm *etp_comm;
} lb_model_parallel;

typedef struct lb_model lb_model;

// A KV cache for sampling (lb_model_forward_cached): per layer the k and v of `slots`
// sequences of up to `capacity` positions, and room for max_rows new tokens per call.
typedef struct {
    int slots, capacity, max_rows, fp8, bf16;   // bf16: rows of bf16 (lb_kv_layer)
    int logit_rows;                // rows of logits a call may compute (<= max_rows)
    lb_kv_layer *layer;            // (num_hidden_layers) host array of backend caches
    float *logits;                 // (logit_rows, vocab) backend memory: the last call's logits
    const int32_t *tokens, *slot, *pos;   // (n) backend: the last call's rows
    // The rows whose logits the last call computed: NULL, all n in order; else logits row j is
    // row lrows[j] (nl of them, backend memory), the others get no final norm or LM head.
    const int32_t *lrows;
    int nl;
    int32_t *rows_dev, *rows_host; // (3 max_rows) backend and host: one upload a call
    void *acts;                    // definition-private activations for max_rows rows
} lb_kvcache;

// One decoder layer's activation plan (lb_model.plan): the element type of each activation a
// training step stores and the cached forward reads (1 bf16, 0 fp32), decided once from the
// precision contract, the layout and the KV cache kind, and again whenever one of them changes
// (lb_model_def.plan), so the forward, the backward and the buffers ask it instead of deciding
// call by call. Everything else is fp32: the final norm's output and every statistic, v (and
// q and k where not named), the experts' routed outputs, the gradients between ops but
// those named (doc/architecture.md, Memory).
typedef struct {
    uint8_t residual;      // the residual stream: each layer's input and its sum after attention
    uint8_t qk;            // q and k after their norms and RoPE (the bf16 attention's inputs)
    uint8_t qk_in;         // q and k before their norms: the projection's outputs
    uint8_t ln1;           // the attention's input norm
    uint8_t qkv_quant16;   // ln1, and the q/k/v projections quantize it (the cached forward too)
    uint8_t att;           // the attention output, the o projection's input
    uint8_t ln2;           // the feed-forward block's input norm
    uint8_t expert_in;     // gate/up's input rows
    uint8_t gate_up_out;   // gate/up's output, the SwiGLU's input
    uint8_t swiglu_out;    // the SwiGLU's output, down's input
    uint8_t down_dgrad;    // down's input gradient, the SwiGLU backward's
    uint8_t gate_up_dy;    // the gradient gate/up's GEMMs read (bf16 GEMMs alone)
    uint8_t down_dy;       // the gradient down's GEMMs read (bf16 GEMMs alone)
    uint8_t weights_on_h;  // the routed weights applied to the SwiGLU outputs, before down
    uint8_t mlp_gate_up_out;   // a dense model's MLP: gate/up's output, the SwiGLU's input
    uint8_t mlp_swiglu_out;    // ... and the SwiGLU's output, down's input
} lb_layer_plan;

// The plan summed over this stage's layers, for `lowbit info`: each field the number of layers
// (MoE layers for the experts' ones) where that activation is bf16.
typedef struct lb_act_plan {
    int layers;        // of this stage
    int moe_layers;    // of them MoE layers (the experts' fields count those)
    int mlp_layers;    // of them layers with a dense MLP or shared experts (the mlp_ fields')
    int residual;      // the residual stream
    int qk;            // q and k after their norms and RoPE (the bf16 attention's inputs)
    int qk_in;         // q and k before their norms
    int ln1;           // the attention's input norm
    int att;           // the attention output
    int ln2;           // the feed-forward block's input norm
    int expert_in;     // gate/up's input rows
    int gate_up_out;   // gate/up's output, the SwiGLU's input
    int swiglu_out;    // the SwiGLU's output, down's input
    int down_dgrad;    // down's input gradient, the SwiGLU backward's
    int mlp_gate_up_out, mlp_swiglu_out;   // a dense model's MLP's
} lb_act_plan;

struct lb_model_def {
    const char *arch;              // the configuration's model.arch and HF config's model_type
    const char *summary;
    // What the shared decoder (models/blocks.h) builds, and what the Hugging Face mapping
    // (src/io/convert.c) reads and writes for this family.
    int moe;                       // routed SwiGLU experts in every layer (else a dense MLP)
    int qk_norm;                   // LB_QK_NORM_*: per-head RMSNorm on q and k before RoPE
    // The MoE router: 0 softmax top-k (Qwen3-MoE, Switch load-balancing loss), 1 the sigmoid
    // router of DeepSeek-V3 / GLM-4.5 (selection bias, group-limited top-k, routed scaling; no
    // auxiliary loss: the bias balances the experts after each step).
    int sigmoid_router;
    int rope_scaling;              // takes rope_type llama3 (HF rope_scaling)
    const char *hf_architecture;   // config.json's "architectures" entry
    // config.json's keys only this family has (lb_hf_key), beside the shared decoder's.
    const lb_hf_key *hf_config;
    int nhf_config;
    // Import checks the configuration with this once hf_config is read, so that what only the
    // definition's check sees (the sigmoid router's shapes) is named against config.json
    // (NULL: the import's own checks suffice; lb_model_create runs check regardless).
    int (*hf_check)(const lb_model_config *, char *err, size_t errlen);
    // The [model] keys only this family reads, beside the shared blocks' (lb_block_keys).
    const lb_model_key *keys;
    int nkeys;
    // Checks the configuration; returns 0, or -1 with a message naming the bad key.
    int (*check)(const lb_model_config *, char *err, size_t errlen);
    // Fills out (may be NULL) and returns the number of parameter tensors.
    int (*tensors)(const lb_model_config *, lb_tensor *out);
    // Activation buffers for micro-batches of (b, t); returns the private state.
    void *(*acts_create)(lb_model *, int b, int t);
    void (*acts_free)(lb_model *, void *acts);
    // Forward over tokens (b, t) (device memory). With targets (b, t) it computes the loss
    // (mean cross-entropy over non-ignored targets + aux) into m->loss and keeps what backward
    // needs; without, it only leaves logits in m->logits.
    void (*forward)(lb_model *, const int32_t *tokens, const int32_t *targets, int b, int t);
    // Accumulates d(loss_scale * loss)/d(params) into m->grads. Needs a forward with targets.
    void (*backward)(lb_model *, float loss_scale);
    // Re-quantizes the weight cache from m->params under m->contract.
    void (*weights_refresh)(lb_model *);
    // The backend bytes weights_refresh's caches take (lb_wcache_bytes summed): for info.
    size_t (*wcache_bytes)(lb_model *);
    // Backward from d loss / d logits already in m->logits (which it overwrites), plus
    // aux_scale times the load-balancing loss; accumulates into m->grads. Needs a forward.
    void (*backward_logits)(lb_model *, float aux_scale);
    // Sampling. Activations for up to max_rows new tokens per cached forward.
    void *(*cached_create)(lb_model *, int max_rows);
    void (*cached_free)(lb_model *, void *acts);
    // n new tokens kv->tokens at (kv->slot, kv->pos): writes their k and v into kv, attends to
    // positions 0..pos of their slot, and leaves logits (n, vocab) in kv->logits, or those of
    // the kv->nl rows kv->lrows when it is set. Every row goes through the same operations as
    // in forward, so its logits are the same bits.
    void (*forward_cached)(lb_model *, lb_kvcache *kv, int n);
    // 1 when forward_cached neither waits for the backend nor talks to other ranks (NULL: 0).
    int (*cached_host_free)(lb_model *);
    // Matmul parameters a token touches (experts counted top-k times), for FLOPs and info.
    int64_t (*active_matmul_params)(const lb_model_config *);
    // Experts each token's router picks in every layer (0: no routed layers): the width of
    // lb_model.route_log's rows.
    int (*route_k)(const lb_model_config *);
    // The activation plan of every layer (num_hidden_layers of them) for the model's contract,
    // layout and KV cache kind (NULL: every activation fp32).
    void (*plan)(const lb_model *, lb_layer_plan *out);
    // After each optimizer step, collective over all (every rank of the job; NULL: this rank
    // alone): what the family moves outside the gradient, e.g. the sigmoid router's selection
    // bias (lb_decoder_router_bias_update). NULL: nothing.
    void (*after_step)(lb_model *, lb_comm *all);
    // Pipeline stages: the (rows, hidden) buffers of the current activations that hold the
    // stage's input hidden states (filled by the caller before forward on a later stage), its
    // output (after forward on an earlier stage), and d loss / d those (input of backward on
    // an earlier stage, output of backward on a later one).
    float *(*stage_input)(lb_model *);
    float *(*stage_output)(lb_model *);
    float *(*stage_grad)(lb_model *);
};

struct lb_model {
    lb_model_config cfg;
    const lb_model_def *def;
    lb_backend *be;
    lb_model_parallel par;
    int layer_begin, layer_end;    // this pipeline stage's decoder layers
    int first_stage, last_stage;   // holds the embedding / the final norm, LM head and loss
    int ntensors;
    lb_tensor *tensors;            // host array: this rank's pieces, in the definition's order
    int nglobal;
    lb_tensor *gtensors;           // the definition's whole tensors (offsets into a whole copy)
    size_t gparams;                // floats of the whole model
    // The buffer holds two regions, each padded to a multiple of an alignment (lb_model_align):
    // [0] tensors reduced over the data-parallel group, [1] experts, reduced over the
    // expert-data-parallel group. Padding stays zero.
    size_t region_begin[2], region_len[2];
    size_t nparams;                // region_len[0] + region_len[1]
    float *params;                 // (nparams) backend memory
    float *grads;                  // (nparams) backend memory
    // Per tensor: lb_model_zero_grad left this wgrad_gemm tensor's gradient unzeroed, so its
    // first write must overwrite (lb_model_grad_beta).
    uint8_t *grad_fresh;           // (ntensors) host
    int b, t;                      // shape the activations were made for
    void *acts;                    // definition-private activations
    float *logits;                 // backend memory, valid after forward: the logits of this
                                   // rank's rows (b*t, or b*t / tp under sequence parallelism),
                                   // (rows, vocab) fp32; a forward with targets: of a chunk of
                                   // them (lb_model_ce_rows), in bf16 (rows, pad8(vocab))
                                   // where lb_model_logits16
    size_t logit_cap;              // bytes m->logits holds
    int32_t *tokens, *targets;     // (b*t) backend copies used by forward/backward
    // Pipeline parallelism keeps several micro-batches in flight: each slot holds one set of
    // the six fields above (lb_model_use_slot).
    struct lb_model_slot {
        int b, t;
        void *acts;
        float *logits;
        size_t logit_cap;
        int32_t *tokens, *targets;
    } slot[8];
    int cur_slot;
    // results of the last forward with targets
    float loss;                    // ce_loss + router_aux_loss_coef * aux_loss
    float ce_loss;                 // mean over counted tokens
    float aux_loss;                // sum over MoE layers of the Switch loss (as Megatron)
    int ntokens;                   // targets counted in ce_loss
    int target_count;              // targets >= 0 in the last forward's host array (all rows)
    // precision: the contract every GEMM asks, and the weight cache the forward reads
    lb_contract contract;
    lb_linear lin;
    lb_wcache *wcache;             // (ntensors), used for the matrices of linear layers
    int wcache_stale;              // parameters changed since the cache was built
    // Attention reads k (after RoPE) and v through E4M3 (fp8-block rows, as the fp8 KV cache
    // stores them; straight-through gradient), so training matches an fp8-cache sampler.
    int kv_fp8;
    // (num_hidden_layers) the activation plan (lb_model_def.plan), made again whenever the
    // contract or the KV cache kind changes.
    lb_layer_plan *plan;
    // New caches keep fp32 rows even where bf16 ones would serve (sample.kv_cache = fp32).
    int kv_fp32;
    // Activation recomputation (lb_model_set_recompute): LB_RECOMPUTE_SELECTIVE recomputes a
    // layer's norms, core attention and SwiGLU before its backward; LB_RECOMPUTE_FULL keeps
    // only each layer's input and runs its whole forward again.
    int recompute;
    // Chunked cross-entropy (lb_model_set_ce_chunk): a forward with targets makes its LM head
    // and loss this many rows at a time; 0 = auto (lb_model_ce_rows).
    int ce_chunk;
    // Set by lb_model_forward_train for its forward: the LM head's backward runs in it, chunk
    // by chunk, with this loss scale (the decoder's acts record that it ran).
    int head_bwd;
    float head_scale;
    // Log-probabilities (lb_model_forward_logprobs and the sampler): backend scratch
    float *lp_loss, *lp_w;         // (lp_cap) per-row losses, per-row backward weights
    int32_t *lp_targets;           // (lp_cap)
    int lp_cap;
    float lp_inv_temp;             // the last forward_logprobs' 1 / temperature
    // NULL, or host memory (layers of this stage, rows, route_k) where the next forwards (the
    // training forward and the cached one) write each routed layer's top-k choices of their
    // rows, as router_topk_fwd orders them: the sampler's and the trainer's routes, compared
    // by lowbit rl (routing_agreement). The layers copy them to route_dev (backend memory) and
    // one download after the forward brings them all (lb_model_route_stage).
    int32_t *route_log;
    int32_t *route_dev;
    size_t route_cap;              // route_dev's int32 capacity
    // Definition-private: the tensor indices of each layer of this stage by role, built by the
    // definition on first use (a fixed-place lookup); freed with the model.
    int *layer_tensors;
    // The sigmoid router's expert loads since the last bias update: (num_hidden_layers, E)
    // host, this stage's layers' rows summed over the micro-batches' backwards (NULL until the
    // first); lb_decoder_router_bias_update sums them over the ranks and moves the biases.
    double *expert_load;
    // MoE health (lb_model_moe_stats_begin): NULL while not collecting, else (num_hidden_layers,
    // E + 2) host: per layer the tokens each expert got, the sum of the rows' router entropies
    // and the rows counted.
    double *moe_stats;
};

// lb_model_def.qk_norm: none, always, or where the configuration's use_qk_norm says (GLM-4.5,
// whose config.json key is in its hf_config).
enum { LB_QK_NORM_NONE = 0, LB_QK_NORM_ALWAYS, LB_QK_NORM_OPTIONAL };

// Whether layers of this configuration have per-head q/k norms (lb_model_def.qk_norm).
int lb_model_qk_norm(const lb_model_def *def, const lb_model_config *c);
// Whether decoder layer l of this configuration has a routed MoE block (else a dense MLP).
int lb_model_layer_moe(const lb_model_def *def, const lb_model_config *c, int l);
// The family's work after an optimizer step (lb_model_def.after_step), on every rank after
// lb_optimizer_step: collective over all where the family has any.
void lb_model_after_step(lb_model *m, lb_comm *all);

// MoE health for the metrics: from lb_model_moe_stats_begin to lb_model_moe_stats_end, each
// training backward adds, per MoE layer of this stage, the tokens its rows sent to each expert
// and the entropy of the router's distribution over the experts for each row (the softmax
// router's probabilities; the sigmoid router's scores normalised to sum 1), in nats. In the
// backward, as the balancing loads, so recomputation and forwards without a step count nothing.
void lb_model_moe_stats_begin(lb_model *m);
// The rows of a micro-batch whose entropy is taken, at most (evenly spaced).
#define LB_MOE_STATS_ROWS 4096
// Sums them over `all` (every rank of the job; NULL: this rank alone; collective) and writes
// for every decoder layer l (num_hidden_layers entries): load_max[l] and load_min[l], the most
// and the fewest tokens an expert got over the mean per expert (1 and 1 when balanced), and
// entropy[l], the mean entropy over the rows (log E when uniform); NaN for a layer without
// routed experts. Each token is counted by as many ranks as hold its rows (a tp or etp group),
// alike for all, so the ratios and the mean are the job's. Stops collecting.
void lb_model_moe_stats_end(lb_model *m, lb_comm *all, double *load_max, double *load_min,
                            double *entropy);

// Registry (models/registry.c).
const lb_model_def *lb_model_lookup(const char *arch);
int lb_model_count(void);
const lb_model_def *lb_model_at(int i);   // 0 <= i < lb_model_count(), the registry's order
// The registry's names joined by '|' ("qwen3_moe|qwen3|llama"): model.arch's choices.
const char *lb_model_arch_choices(void);
// Every [model] key but arch (the registry's choice itself): the shared blocks' and each
// family's own, each name once, in the order of their lb_model_config fields.
// 0 <= i < lb_model_key_count().
int lb_model_key_count(void);
const lb_model_key *lb_model_key_at(int i);
// The families that read key k, joined by ", " into buf; "" when every family does.
const char *lb_model_key_readers(const lb_model_key *k, char *buf, size_t n);

// Model object (models/model.c).
lb_model *lb_model_create(const lb_model_config *cfg, lb_backend *be, char *err, size_t errlen);
// This rank's piece of the model (par NULL: everything). The shapes must divide (the layout
// checks in parallel/grid.c say so first); -1 with a message otherwise.
lb_model *lb_model_create_parallel(const lb_model_config *cfg, lb_backend *be,
                                   const lb_model_parallel *par, char *err, size_t errlen);
// This rank's place in grid g (parallel/grid.h) with the backend-memory communicators of its
// tensor- and expert-parallel groups (NULL where the size is 1).
lb_model_parallel lb_model_parallel_of(const lb_grid *g, lb_comm *tp, lb_comm *ep);
// The tensor table of the rank at `par` (its pieces, offsets unset). malloc'd; *n its length.
lb_tensor *lb_model_pieces(const lb_model_config *cfg, const lb_model_parallel *par, int *n,
                           char *err, size_t errlen);
// Re-lays the buffers so that region r is padded to a multiple of align[r] floats; keeps the
// parameter values (the gradients are zeroed).
void lb_model_align(lb_model *m, const size_t align[2]);
// Element j of piece t is element lb_tensor_global_index(t, j) of the whole tensor.
size_t lb_tensor_global_index(const lb_tensor *t, size_t j);
// Copies piece t out of a whole tensor (host), or into one.
void lb_tensor_take(const lb_tensor *t, const float *whole, float *piece);
void lb_tensor_put(const lb_tensor *t, const float *piece, float *whole);
// Makes the current slot's activations for micro-batches (b, t) (forward does it too; a later
// pipeline stage needs them to receive its input first).
void lb_model_prepare(lb_model *m, int b, int t);
// Pipeline parallelism: selects activation slot s (0..7) for the next forward/backward.
void lb_model_use_slot(lb_model *m, int s);
// The stage's boundary buffers (backend memory), see lb_model_def: the hidden states' 32-bit
// words (rows x hidden floats, or where the residual stream is bf16 rows of pad8(hidden) bf16
// values, two to a word), and their gradient's floats (rows x hidden).
size_t lb_model_stage_floats(const lb_model *m);
size_t lb_model_stage_grad_floats(const lb_model *m);
float *lb_model_stage_input(lb_model *m);
float *lb_model_stage_output(lb_model *m);
float *lb_model_stage_grad(lb_model *m);
void lb_model_free(lb_model *m);
// Normal(0, initializer_range) for matrices, ones for norm weights; same on every backend.
void lb_model_init_params(lb_model *m, uint64_t seed);
// tokens/targets are HOST arrays (b*t); targets may be NULL. Returns m->loss.
float lb_model_forward(lb_model *m, const int32_t *tokens, const int32_t *targets, int b, int t);
// The forward of a training step whose backward, lb_model_backward(m, loss_scale) with the same
// loss_scale, follows: the last stage runs the LM head's backward inside it, chunk by chunk
// (ce_chunk), so a chunk's logits are made once and no (rows, vocab) logits outlive it. The
// gradients are the bits of lb_model_forward then lb_model_backward wherever that runs
// unchunked. targets required. Returns m->loss.
float lb_model_forward_train(lb_model *m, const int32_t *tokens, const int32_t *targets, int b,
                             int t, float loss_scale);
// Where a forward of n rows copies a routed layer's top-k choices while route_log is set:
// (layers of this stage, n, route_k) in backend memory, grown as needed.
int32_t *lb_model_route_stage(lb_model *m, size_t n);
void lb_model_backward(lb_model *m, float loss_scale);
// Starts accumulating a new set of gradients. The gradients of wgrad_gemm tensors are not
// zeroed but marked fresh: their first GEMM of the next backward overwrites them (beta 0), which
// saves a pass of zeros and the GEMM epilogues' reads of them. Every backward ends with the
// gradients whole (lb_model_grad_settle), so readers of m->grads need not care.
void lb_model_zero_grad(lb_model *m);
// The beta for a wgrad GEMM writing all of the gradient of the tensor holding dw (a pointer into
// m->grads): 0 for its first write since lb_model_zero_grad, 1 after (accumulate).
float lb_model_grad_beta(lb_model *m, const float *dw);
// Zeroes the gradients still fresh (no backward wrote them); the backward entry points call it.
void lb_model_grad_settle(lb_model *m);
// Sets the precision contract (the default is fp32, the exact reference). -1 with a message.
int lb_model_set_precision(lb_model *m, const lb_precision_spec *spec, uint64_t seed,
                           char *err, size_t errlen);
// Call after the parameters change (optimizer step, load): the next forward re-quantizes the
// weight cache once. step feeds stochastic rounding and random Hadamard signs.
void lb_model_params_changed(lb_model *m, uint64_t step);
// Rebuilds the weight cache now if it is stale (the forward does this itself).
void lb_model_refresh_weights(lb_model *m);
// The optimizer's way to write the weight cache's bf16 copies as it updates (AdamW's p16).
// lb_model_b16_run: the run of parameters from begin (before end) that ends at *run_end and
// has one bf16 destination: a whole tensor whose cache keeps its bf16 copy in the parameters'
// own layout (rows that need no padding), returned; or a stretch with none, NULL.
// lb_model_b16_written, after lb_model_params_changed: that run's copy holds the new values,
// so the next refresh does not round the tensor again.
uint16_t *lb_model_b16_run(lb_model *m, size_t begin, size_t end, size_t *run_end);
void lb_model_b16_written(lb_model *m, size_t begin, size_t end);
const lb_tensor *lb_model_find(const lb_model *m, const char *name);

// --- sampling and RL (doc/rl.md) -------------------------------------------------------------
// The policy is softmax(logits / temperature). Sampler and trainer compute log-probabilities
// with the same two operations (lb_model_temper, then cross_entropy_fwd in lb_model_nll_dev),
// on logits that the forward and the cached forward give bitwise alike.
// logit_rows (1 .. max_rows): the most rows a call computes logits for (the sampler's: one
// per slot at most; lb_model_forward_cached needs max_rows).
lb_kvcache *lb_kvcache_create(lb_model *m, int slots, int capacity, int max_rows,
                              int logit_rows);
// The bytes of such a cache's k and v (every layer, this rank's kv heads, in the elements
// lb_model_set_kv_cache chose) and its logits rows: the bulk of lb_kvcache_create's allocations.
size_t lb_kvcache_bytes(const lb_model *m, int slots, int capacity, int logit_rows);
void lb_kvcache_free(lb_model *m, lb_kvcache *kv);
// tokens, slot, pos (n <= max_rows) host arrays, checked; see lb_model_def.forward_cached.
void lb_model_forward_cached(lb_model *m, lb_kvcache *kv, const int32_t *tokens,
                             const int32_t *slot, const int32_t *pos, int n);
// The same from rows (3 n) in backend memory: the tokens, then their slots, then their
// positions, valid already (the sampler uploads them with its random numbers in one copy).
// lrows: NULL (logits for every row), or the nl rows (backend memory, each in [0, n)) whose
// logits the caller reads, in kv->logits' first nl rows: the sampler's, so that prefill rows
// cost no LM head.
void lb_model_forward_cached_dev(lb_model *m, lb_kvcache *kv, const int32_t *rows, int n,
                                 const int32_t *lrows, int nl);
// lb_model_forward_cached_dev in pieces, for a caller that records the queued work as a
// graph (the sampler's decode step): _queue queues the forward's operations only (no weight
// refresh: lb_model_refresh_weights before it; the routes staged in backend memory, not
// fetched: lb_model_route_fetch after it, with m->route_log set).
void lb_model_forward_cached_queue(lb_model *m, lb_kvcache *kv, const int32_t *rows, int n,
                                   const int32_t *lrows, int nl);
void lb_model_route_fetch(lb_model *m, int n);
// 1 when the cached forward queues all its work without waiting for the backend or other
// ranks (no collective; every MoE layer's experts on gemm_experts), so a graph can record it
// (a backend op may still wait inside: graph_record finds that out).
int lb_model_cached_host_free(lb_model *m);
// logits (n, vocab) backend memory *= inv_temp (nothing when inv_temp is 1).
void lb_model_temper(lb_model *m, float *logits, int n, float inv_temp);
// nll (n) backend memory = cross_entropy_fwd = -log softmax(logits_i)[targets[i]], 0 where
// targets[i] < 0; targets (n) backend memory (the sampler's drawn tokens, still on the device).
void lb_model_nll_dev(lb_model *m, const float *logits, const int32_t *targets, int n,
                      float *nll);
// Training forward over tokens (b, t) and the log-probs lp (b*t, host) of targets (b*t, host;
// negative = not a response token) under softmax(logits * inv_temp).
void lb_model_forward_logprobs(lb_model *m, const int32_t *tokens, const int32_t *targets,
                               int b, int t, float inv_temp, float *lp);
// After lb_model_forward_logprobs: accumulates d(sum_i dlp[i] * lp_i + aux_scale * AUX) /
// d params into m->grads. dlp (b*t) host.
void lb_model_backward_logprobs(lb_model *m, const float *dlp, float aux_scale);
// Chunked cross-entropy: rows of logits a forward with targets makes at a time (0 = all).
// Forwards without targets (log-probabilities) still make every row's logits. Before the first
// forward.
void lb_model_set_ce_chunk(lb_model *m, int rows);
// Rows of logits a forward with targets of `rows` rows makes at a time: ce_chunk where set;
// else (0, auto) the most rows, a multiple of 64, whose logits fit LB_CE_CHUNK_BYTES (for
// small vocabularies more rows than any micro-batch has); at most rows.
#define LB_CE_CHUNK_BYTES ((size_t)1 << 30)
int lb_model_ce_rows(const lb_model *m, int rows);
// Whether a forward with targets stores its logits in bf16 (the LM head is bf16 in every pass:
// lb_linear_plain16), and the bytes of one row of those logits.
int lb_model_logits16(const lb_model *m);
// This stage's activation plan summed over its layers (lb_act_plan); all zeros for a
// definition without one.
void lb_model_act_plan(const lb_model *m, lb_act_plan *p);
size_t lb_model_logit_row_bytes(const lb_model *m);
enum { LB_RECOMPUTE_NONE = 0, LB_RECOMPUTE_SELECTIVE, LB_RECOMPUTE_FULL };
// Activation recomputation (LB_RECOMPUTE_*; the configuration's train.recompute, parsed there).
// Applies to activations made after the call.
void lb_model_set_recompute(lb_model *m, int how);
// Turns the fp8 KV numerics (m->kv_fp8) on or off for the training forward and new caches.
void lb_model_set_kv_fp8(lb_model *m, int on);
// The KV cache's elements (sample.kv_cache, parsed by the configuration): LB_KV_AUTO (bf16
// rows when the contract's attention runs in bf16, which rounds k and v to bf16 anyway, else
// fp32), LB_KV_FP32, LB_KV_BF16 (bf16 attention only) or LB_KV_FP8 (lb_model_set_kv_fp8).
// After lb_model_set_precision. -1 with a message for a bf16 cache under fp32 attention.
typedef enum { LB_KV_AUTO = 0, LB_KV_FP32, LB_KV_BF16, LB_KV_FP8 } lb_kv_kind;
int lb_model_set_kv_cache(lb_model *m, lb_kv_kind kind, char *err, size_t errlen);
// Whether a cache made now stores bf16 rows (see lb_kv_layer).
int lb_model_kv_bf16(const lb_model *m);
int64_t lb_model_active_params(const lb_model *m);
// Megatron's count: 6 x active matmul parameters + causal attention (6 * layers * t * hq * d).
double lb_model_flops_per_token(const lb_model_config *cfg, int seq_len);

#endif
