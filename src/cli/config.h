// config.h: parameter files. One table (src/cli/params.c) defines every key: section, name, type,
// default, range or choices, and help; doc/parameters.md is generated from it.
#ifndef LB_CONFIG_H
#define LB_CONFIG_H

#include <stddef.h>
#include <stdio.h>
#include "models/precision/contract.h"
#include "models/model.h"
#include "parallel/grid.h"

#define LB_PATH_MAX 512

typedef struct {
    struct {
        char backend[16];          // cpu | cuda
        int threads;               // CPU threads, 0 = all cores
        int device;                // CUDA device ordinal
        uint64_t seed;             // model init and anything random
        char out_dir[LB_PATH_MAX]; // metrics and checkpoints go here
        int verbose;               // print the resolved configuration, not just its file
        int overwrite;             // clear a run.out_dir that holds a run (else refused)
    } run;
    lb_model_config model;
    struct {
        char train_files[LB_PATH_MAX];  // glob of token shards, or "W1 GLOB1 W2 GLOB2 ..."
        int shuffle;                    // training sequences in a seeded order (run.seed)
        char val_files[LB_PATH_MAX];    // glob, may be empty
        char tokenizer[LB_PATH_MAX];    // tokenizer.json (`data tokenize`, text prompts)
    } data;
    struct {
        int steps;                 // optimizer steps
        int micro_batch;           // sequences per micro-batch
        int seq_len;               // tokens per sequence
        int grad_accum;            // micro-batches per optimizer step, all dp ranks together
        double lr, min_lr;
        int warmup_steps;          // linear warm-up, then cosine decay to min_lr at `steps`
        double beta1, beta2, adam_eps, weight_decay;
        double grad_clip;          // global norm, 0 = off
        int val_every, val_batches;
        int log_every;
        char metrics_file[LB_PATH_MAX]; // JSON lines; relative to out_dir
        char adam_moments[8];      // fp32 | bf16: storage of AdamW's moments
        double optimizer_offload;  // share of the optimizer state kept and updated on the host
        int ce_chunk;              // chunked cross-entropy: rows of logits at a time, 0 = all
        char recompute[16];        // activation recomputation: none | selective | full
    } train;
    struct {
        int save_every;            // steps, 0 = only at the end
        double save_minutes;       // also save when this long has passed since the last (0: off)
        int keep;                  // keep the last K checkpoints
        char resume[LB_PATH_MAX];  // "" none, "auto" latest in out_dir, or a path
        char init[LB_PATH_MAX];    // "" none, or a checkpoint whose weights a new run starts from
    } checkpoint;
    struct {
        char kind[16];             // arithmetic | text
        char input[LB_PATH_MAX];   // text file for kind = text; `data tokenize`: globs
        char text_field[64];       // `data tokenize`: the JSON-lines field holding the text
        char eos_token[64];        // `data tokenize`: token after each document, "" none
        char output[LB_PATH_MAX];  // output prefix: PREFIX_train_000.bin, PREFIX_val_000.bin
        int problems;              // arithmetic problems to generate
        int max_operand;           // operands drawn from [0, max_operand]
        double val_fraction;
        int shard_tokens;          // tokens per shard
        uint64_t seed;
    } gen;
    struct {
        char input[LB_PATH_MAX];   // HF directory (import) or lowbit checkpoint (export)
        char output[LB_PATH_MAX];
        char direction[16];        // import | export
        char dtype[8];             // export element type: f32 | bf16
    } convert;
    // Bookkeeping for messages, not parameters (no lb_params entry): the file last parsed into
    // this configuration, and per lb_params[] entry the line of that file that set the key
    // (0: default or --set).
    struct {   // [precision]: its words become lb_precision_spec's enums (lb_config_precision)
        char recipe[16];               // fp32 | bf16 | fp8-block | mxfp8 | nvfp4-moe | mxfp4
        char backward[16];             // default | quantized | dequantized | high
        char wgrad_hadamard[16];       // default | none | h16 | h32 | random16
        int stochastic_rounding;
        char scale_rule[8];            // ceil | floor
        char scale[8];                 // fp32 | pow2
        char nvfp4_scale[16];          // per-token | per-tensor
        char nvfp4_weight_blocks[8];   // 1x16 | 16x16
        char keep_bf16_roles[256];     // comma list of roles kept in BF16
        char keep_bf16_layers[256];    // comma list of layer indices, negative from the end
        char overrides[1024];          // "role.pass=format" items separated by ';' or ','
        char attention[8];             // auto | fp32 | bf16
    } precision;
    struct {
        char kind[16];             // gemm | attention | train | rollout | rl | all
        int warmup, iters;         // untimed and timed repetitions
        int m, n, k;               // dense GEMM C (m, n) = A (m, k) B (n, k)^T
        int experts, expert_rows;  // grouped GEMM: experts x rows, k -> n
        char formats[128];         // GEMM formats to time (comma list)
        int moe_passes;            // also the other five expert GEMMs of a training step's layer
        int attn_batch, attn_seq;  // attention shape; heads and head_dim from [model]
        int rollout_batch, rollout_prompt, rollout_new;   // sampler: sequences, tokens each
        char rollout_shapes[256];  // rollout: "BxN,..." batches and new tokens, one model
    } bench;
    lb_parallel_config parallel;   // the process grid and data parallelism (parallel/grid.h)
    struct {                       // the sampler (`sample`, and `rl`'s rollouts): doc/rl.md
        char checkpoint[LB_PATH_MAX];   // weights `lowbit sample` reads
        char prompts[LB_PATH_MAX]; // file of prompts, one per line; "" = arithmetic problems
        int problems;              // arithmetic problems to sample (prompts = "")
        char split[8];             // train | val: which arithmetic problems
        int samples;               // completions per prompt
        double temperature;        // the policy is softmax(logits / temperature)
        double top_p;              // nucleus truncation of the draw, 1 = off
        int top_k;                 // top-k truncation of the draw, 0 = off
        int max_new_tokens;        // completion length limit
        char stop_tokens[64];      // comma list of token ids that end a completion
        int slots;                 // sequences decoded at once (continuous batching)
        int max_rows;              // tokens per forward call
        char kv_cache[8];          // auto | fp32 | bf16 | fp8
        uint64_t seed;             // the draws of every (prompt, sample)
        int deterministic;         // batch-invariant operations (sampler = trainer bit for bit)
    } sample;
    struct {                       // `lowbit rl`: GRPO (doc/rl.md)
        char init[LB_PATH_MAX];    // checkpoint RL starts from (and the KL reference)
        int steps;                 // RL steps (rollout + update)
        int prompts;               // prompts per step
        int group;                 // completions per prompt (G)
        int mini_batches;          // optimizer steps per rollout batch
        int micro_batch;           // sequences per training forward
        double eps_low, eps_high;  // clip range [1 - eps_low, 1 + eps_high]
        double kl_coef;            // k3 KL to the reference, 0 = off
        double tis_cap;            // truncated importance sampling cap, 0 = off
        double adv_eps;            // added to the group std
        char rewards[128];         // comma list of reward functions (src/rl/reward.c)
        double format_reward;      // what arith_format pays
        char reward_regex[256];    // answer_regex's PCRE2 pattern
        char reward_command[LB_PATH_MAX];   // external reward: JSON lines in, numbers out
        int reward_batch;          // completions a run
        int reward_workers;        // its runs at once
        double reward_timeout;     // seconds a run may take, 0 = no limit
        double reward_timeout_value;   // the reward of a completion whose run timed out
        char prompts_file[LB_PATH_MAX];   // JSON lines of prompts and answers, "" = arithmetic
        char val_file[LB_PATH_MAX];       // its validation prompts, "" = rl.val_fraction of it
        double val_fraction;       // share of prompts_file held out when val_file is empty
        char prompt_field[64];     // the prompt's key in a line
        char answer_field[64];     // the reference answer's key
        char chat_template[256];   // text around {prompt}, "" = the prompt alone
        int eval_every;            // offline evaluation every N steps (0 = start and end)
        int eval_problems;         // held-out problems per evaluation
        int eval_samples;          // k of pass@k
    } rl;
    struct {                       // the MLPerf log (doc/mlperf.md)
        int enabled;
        char log_file[LB_PATH_MAX];     // relative to out_dir; "-" = stdout
        char submission_org[128];
        char submission_platform[128];  // "" = WORLDxBACKEND
        char division[8];          // closed | open
        int cache_cleared;         // the launcher dropped the page cache (cache_clear)
        int eval_every;            // sequences between evaluations, 0 = the benchmark's
        int eval_start;            // sequences before the first, -1 = the benchmark's
        int eval_samples;          // validation sequences per evaluation (train)
        double target;             // 0 = the benchmark's
        double val_temperature, val_top_p;   // rl: the evaluation's draws
    } mlperf;
    char source_file[LB_PATH_MAX];
    int source_line[192];
    // per lb_params[] entry: 1 when a file or --set gave the key (lb_config_is_set)
    unsigned char key_set[192];
    char command[2048];            // the command line that made this configuration (config.ini)
    // `lowbit sample --prompt TEXT ...`: the prompts of the command line (argv's strings; not a
    // parameter, no file holds them)
    const char **prompt;
    int nprompt;
} lb_config;

typedef enum { LB_PARAM_INT, LB_PARAM_U64, LB_PARAM_FLOAT, LB_PARAM_BOOL, LB_PARAM_STRING,
               LB_PARAM_ENUM } lb_param_type;

typedef struct {
    const char *section, *key;
    lb_param_type type;
    size_t offset;                 // into lb_config
    size_t size;                   // bytes of the field (strings: buffer size)
    const char *def;               // default, as it would be written in a file
    double min, max;               // numeric range (inclusive) when min < max
    const char *choices;           // LB_PARAM_ENUM: "a|b|c", LB_CHOICES_MODELS or _RECIPES
    const char *help;
} lb_param;

// The choices of model.arch: the registry's names (lb_model_arch_choices), read through
// lb_param_choices.
extern const char lb_choices_models[];
#define LB_CHOICES_MODELS lb_choices_models
// The choices of precision.recipe: the contract's recipe table (lb_recipe_choices).
extern const char lb_choices_recipes[];
#define LB_CHOICES_RECIPES lb_choices_recipes
// p->choices, with LB_CHOICES_MODELS and LB_CHOICES_RECIPES resolved.
const char *lb_param_choices(const lb_param *p);

// The table: src/cli/params.c's rows with the registry's [model] keys in their place (built
// on first use). lb_params[i] and lb_nparams read it.
const lb_param *lb_param_table(void);
int lb_param_count(void);
#define lb_params (lb_param_table())
#define lb_nparams (lb_param_count())

void lb_config_defaults(lb_config *c);
// Key p's value in c as parameter-file text (unquoted) into out (n bytes).
void lb_param_format(const lb_config *c, const lb_param *p, char *out, size_t n);
// Parses INI text (the contents of file `fname`, used in messages) over c.
// Returns 0, or -1 with "fname:line: message" in err.
int lb_config_parse(lb_config *c, const char *text, const char *fname, char *err, size_t errlen);
// Applies "section.key=value". Returns 0, or -1 with "--set section.key: message" in err.
int lb_config_set(lb_config *c, const char *assignment, char *err, size_t errlen);
// Cross-key checks (heads divisible by kv heads, ...). -1 with a message naming the keys.
int lb_config_validate(const lb_config *c, char *err, size_t errlen);
// The shapes a layout splits, checked before any work (no world needed; lb_config_validate's
// part for [parallel]): heads and kv heads and the dense FFN by tp, experts by ep, the expert
// FFN by etp, layers by pp, the sequence by tp under sequence parallelism. 0 = not used by the
// model (skipped).
typedef struct {
    int layers, heads, kv_heads, experts, ffn, moe_ffn, vocab, seq_len;
} lb_config_shapes;
// Returns 0, or -1 with a message; keys[0], keys[1] name the parameter-file keys involved
// (for the file:line of the message).
int lb_config_check_shapes(const lb_parallel_config *pc, const lb_config_shapes *s,
                           const char *keys[2], char *err, size_t errlen);
// Whether a file or --set gave section.key, or it holds its default: a default that depends on
// other things (sample.stop_tokens on the tokenizer) yields to a value given, whatever it is.
int lb_config_is_set(const lb_config *c, const char *section, const char *key);
// The enumerated keys the models take as enums: train.recompute (LB_RECOMPUTE_*),
// sample.kv_cache and [precision]'s, from their strings (which lb_config_parse checked against
// the choices).
int lb_config_recompute(const lb_config *c);
lb_kv_kind lb_config_kv_cache(const lb_config *c);
// [precision] as the contract takes it: each word as its enum, the lists as they are.
lb_precision_spec lb_config_precision(const lb_config *c);
// The resolved configuration as INI text (every key), parseable by lb_config_parse. malloc'd.
char *lb_config_to_ini(const lb_config *c);
// doc/parameters.md, generated from the table.
void lb_params_markdown(FILE *f);
// The keys of the named sections (space-separated, "" for all), one line each: key, type,
// default, range or choices, description (a command's --help).
void lb_params_text(FILE *f, const char *sections);
// The manual page lowbit(1) in roff: the commands (name, purpose, example) and every key.
typedef struct {
    const char *name, *purpose, *example;
} lb_command_doc;
void lb_params_man(FILE *f, const lb_command_doc *cmds, int ncmds);

#endif
