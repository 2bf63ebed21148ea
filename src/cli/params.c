// params.c: the one table of parameter-file keys. Everything else (parsing, --set, defaults,
// the resolved configuration, doc/parameters.md) is driven by it from src/cli/config.c.
//
// To add a key: add the field to lb_config (src/cli/config.h), add one LB_P line here, in the
// section's block, and run `make doc-params`. The [model] keys but arch are the models': a
// model file or the shared blocks declare them (lb_model_key, models/model.h), and the table
// takes them from the registry where LB_P_MODEL_KEYS stands.
#include <stdlib.h>
#include <string.h>
#include "src/cli/config.h"


// The section and key are the lb_config member names, so a key cannot name the wrong field.
#define LB_P(sec, name, type, def, lo, hi, choices, help)                                     \
    { #sec, #name, type, offsetof(lb_config, sec.name), sizeof(((lb_config *)0)->sec.name),  \
      def, lo, hi, choices, help }

// Where the registry's [model] keys go (a row without a key).
#define LB_P_MODEL_KEYS { "model", NULL, 0, 0, 0, NULL, 0, 0, NULL, NULL }

#define I LB_PARAM_INT
#define U LB_PARAM_U64
#define F LB_PARAM_FLOAT
#define B LB_PARAM_BOOL
#define S LB_PARAM_STRING
#define E LB_PARAM_ENUM
#define BIG 1000000000.0   // upper bound of counts of steps, problems, tokens

static const lb_param rows[] = {
    // [run] ------------------------------------------------------------------------------------
    LB_P(run, backend, E, "cpu", 0, 0, "cpu|cuda", "compute backend"),
    LB_P(run, threads, I, "0", 0, 1024, NULL, "CPU threads, 0 = all cores"),
    LB_P(run, device, I, "0", 0, 1023, NULL, "CUDA device ordinal (first device of this rank)"),
    LB_P(run, seed, U, "1234", 0, 0, NULL, "seed of model initialisation and anything random"),
    LB_P(run, out_dir, S, "runs/default", 0, 0, NULL,
         "directory for metrics and checkpoints: one run's (a new run into one that holds a run "
         "is refused unless checkpoint.resume continues it or run.overwrite clears it)"),
    LB_P(run, verbose, B, "false", 0, 0, NULL,
         "print the whole resolved configuration at the start (`-v`); it is always written to "
         "OUT_DIR/config.ini"),
    LB_P(run, overwrite, B, "false", 0, 0, NULL,
         "start over in a run.out_dir that holds a run: its config.ini, metrics, event files, "
         "MLPerf log and checkpoints are removed first"),

    // [model] ----------------------------------------------------------------------------------
    LB_P(model, arch, E, "qwen3_moe", 0, 0, LB_CHOICES_MODELS,
         "model family: the names in models/registry.c"),
    // the models' keys: the shared blocks' and each family's own (models/registry.c)
    LB_P_MODEL_KEYS,

    // [data] -----------------------------------------------------------------------------------
    LB_P(data, train_files, S, "", 0, 0, NULL,
         "glob of training token shards, or a weighted blend \"W1 GLOB1 W2 GLOB2 ...\" as "
         "Megatron's --data-path (doc/data.md)"),
    // Off by default (2026-12-07): shuffling changes the order of every existing run's data
    // and so its checkpoints; a run opts in.
    LB_P(data, shuffle, B, "false", 0, 0, NULL,
         "train on the sequences (windows of train.seq_len+1 tokens) in a seeded order drawn "
         "anew every pass over the data, from run.seed; resumes continue it exactly"),
    LB_P(data, val_files, S, "", 0, 0, NULL, "glob of validation token shards (may be empty; never blended or shuffled)"),
    LB_P(data, tokenizer, S, "", 0, 0, NULL,
         "Hugging Face tokenizer.json (byte-level BPE) for `lowbit data tokenize`; train stores "
         "it in its checkpoints, sample and rl read text through it (default: the checkpoint's)"),

    // [train] ----------------------------------------------------------------------------------
    LB_P(train, steps, I, "100", 1, BIG, NULL, "optimizer steps"),
    LB_P(train, micro_batch, I, "8", 1, 1048576, NULL, "sequences per micro-batch"),
    LB_P(train, seq_len, I, "64", 1, 16777216, NULL, "tokens per sequence"),
    LB_P(train, grad_accum, I, "1", 1, 1048576, NULL,
         "micro-batches per optimizer step, over all data-parallel ranks (divisible by dp)"),
    LB_P(train, lr, F, "0.001", 0, 10, NULL, "peak learning rate"),
    LB_P(train, min_lr, F, "0.0001", 0, 10, NULL, "learning rate at the end of the cosine decay"),
    LB_P(train, warmup_steps, I, "10", 0, BIG, NULL,
         "steps of linear warm-up, then cosine decay to min_lr at steps"),
    LB_P(train, beta1, F, "0.9", 0, 1, NULL, "AdamW first-moment decay (below 1)"),
    LB_P(train, beta2, F, "0.95", 0, 1, NULL, "AdamW second-moment decay (below 1)"),
    LB_P(train, adam_eps, F, "1e-8", 1e-30, 1, NULL,
         "AdamW epsilon (above 0: a parameter that never had a gradient would get 0 / 0)"),
    LB_P(train, weight_decay, F, "0.1", 0, 10, NULL,
         "decoupled weight decay (not applied to norm weights)"),
    LB_P(train, grad_clip, F, "1.0", 0, 1e6, NULL,
         "clip the global gradient norm to this, 0 = off"),
    LB_P(train, val_every, I, "0", 0, BIG, NULL, "validate every N steps, 0 = off"),
    LB_P(train, val_batches, I, "4", 1, 1048576, NULL, "micro-batches per validation"),
    LB_P(train, log_every, I, "1", 0, BIG, NULL, "progress line every N steps, 0 = off"),
    LB_P(train, metrics_file, S, "metrics.jsonl", 0, 0, NULL,
         "JSON-lines metrics, relative to run.out_dir"),
    LB_P(train, adam_moments, E, "fp32", 0, 0, "fp32|bf16",
         "storage of AdamW's moments: bf16 (DeepSeek-V3's) rounds them to nearest even after "
         "each update, which uses their fp32 values; 4 bytes a parameter less to keep and to "
         "move each step. Parameters and gradients stay fp32; checkpoints hold the moments in "
         "fp32 (exact)"),
    LB_P(train, optimizer_offload, F, "0", 0, 1, NULL,
         "share of this rank's AdamW moments kept in host memory and updated there by the CPU "
         "backend (parameters and gradients of that share travel each step)"),
    LB_P(train, ce_chunk, I, "0", 0, BIG, NULL,
         "chunked cross-entropy: the LM head, the loss and the LM head's backward this many "
         "rows at a time, so a micro-batch's (rows, vocab) logits never exist whole; 0 = auto: "
         "the most rows (a multiple of 64) whose logits fit 1 GiB (bf16 logits where the LM "
         "head is bf16 in every pass: 3520 rows for a vocabulary of 151936, 1728 in fp32; more "
         "than any micro-batch has for small vocabularies)"),
    LB_P(train, recompute, E, "none", 0, 0, "none|selective|full",
         "activation recomputation before each decoder layer's backward: selective recomputes "
         "its norms, core attention and SwiGLU, full its whole forward (same bits, less memory)"),

    // [checkpoint] -----------------------------------------------------------------------------
    LB_P(checkpoint, save_every, I, "0", -1, BIG, NULL,
         "save every N steps, 0 = only at the end, -1 = never (benchmarks)"),
    LB_P(checkpoint, save_minutes, F, "0", 0, 1e6, NULL,
         "lowbit train: also save when this many minutes have passed since the run started or "
         "last saved (rank 0's clock decides for every rank), 0 = off"),
    LB_P(checkpoint, keep, I, "2", 1, 1000000, NULL, "keep the last K checkpoints"),
    LB_P(checkpoint, resume, S, "", 0, 0, NULL,
         "\"\" = start fresh, auto = newest checkpoint in run.out_dir, else a checkpoint path"),
    LB_P(checkpoint, init, S, "", 0, 0, NULL,
         "fine-tuning: a checkpoint (lowbit's or a converted one) whose weights a new run starts "
         "from, at step 0 with fresh optimizer moments and data position; [model] is read from "
         "it. A checkpoint to resume (checkpoint.resume) goes first"),

    // [gen] ------------------------------------------------------------------------------------
    LB_P(gen, kind, E, "arithmetic", 0, 0, "arithmetic|text", "what `lowbit data` generates"),
    LB_P(gen, input, S, "", 0, 0, NULL,
         "text file to tokenise (kind = text); `data tokenize`: comma list of globs"),
    LB_P(gen, text_field, S, "text", 0, 0, NULL,
         "`data tokenize`: the field of each JSON line that holds its text"),
    LB_P(gen, eos_token, S, "", 0, 0, NULL,
         "`data tokenize`: token appended to every document (\"\" = none)"),
    LB_P(gen, output, S, "data/arith", 0, 0, NULL,
         "output prefix: PREFIX_train_000.bin, PREFIX_val_000.bin"),
    LB_P(gen, problems, I, "100000", 1, BIG, NULL, "arithmetic problems to generate"),
    LB_P(gen, max_operand, I, "99", 1, 1000000, NULL, "operands are drawn from [0, max_operand]"),
    LB_P(gen, val_fraction, F, "0.05", 0, 0.5, NULL,
         "fraction of the data held out for validation"),
    LB_P(gen, shard_tokens, I, "1000000", 1, BIG, NULL, "tokens per shard file"),
    LB_P(gen, seed, U, "1", 0, 0, NULL, "seed of the generator"),

    // [convert] --------------------------------------------------------------------------------
    LB_P(convert, input, S, "", 0, 0, NULL,
         "Hugging Face directory (import) or lowbit checkpoint (export)"),
    LB_P(convert, output, S, "", 0, 0, NULL, "lowbit checkpoint (import) or directory (export)"),
    LB_P(convert, direction, E, "import", 0, 0, "import|export",
         "import from Hugging Face or export to it"),
    LB_P(convert, dtype, E, "f32", 0, 0, "f32|bf16", "element type of exported tensors"),

    // [precision] ------------------------------------------------------------------------------
    LB_P(precision, recipe, E, "fp32", 0, 0, LB_CHOICES_RECIPES,
         "GEMM formats (doc/formats.md); fp32 is the exact reference"),
    LB_P(precision, backward, E, "default", 0, 0, "default|quantized|dequantized|high",
         "backward GEMMs: in the format, BF16 on dequantized or on original operands"),
    LB_P(precision, wgrad_hadamard, E, "default", 0, 0, "default|none|h16|h32|random16",
         "Walsh-Hadamard on the weight-gradient GEMM's reduction axis"),
    LB_P(precision, stochastic_rounding, B, "false", 0, 0, NULL,
         "stochastic rounding of gradient operands (seeded, deterministic)"),
    LB_P(precision, scale_rule, E, "ceil", 0, 0, "ceil|floor",
         "MX E8M0 block scale: round up (never clips) or the OCP floor rule"),
    LB_P(precision, scale, E, "fp32", 0, 0, "fp32|pow2",
         "fp8-block scales: amax/448 in FP32, or rounded up to a power of two "
         "2^ceil(log2(amax/448)) as UE8M0 scales (exact scale products, nothing clips); pow2 is "
         "refused where no GEMM is fp8-block"),
    LB_P(precision, nvfp4_scale, E, "per-token", 0, 0, "per-token|per-tensor",
         "NVFP4 activations: second-level FP32 scale per token or per tensor"),
    LB_P(precision, nvfp4_weight_blocks, E, "16x16", 0, 0, "1x16|16x16",
         "NVFP4 weight blocks"),
    LB_P(precision, keep_bf16_roles, S, "router,lm_head", 0, 0, NULL,
         "roles kept in BF16 whatever the recipe (comma list)"),
    LB_P(precision, keep_bf16_layers, S, "", 0, 0, NULL,
         "layers kept in BF16, e.g. 0,-1 for the first and last (comma list)"),
    LB_P(precision, overrides, S, "", 0, 0, NULL,
         "per-site formats, e.g. moe.down.wgrad=bf16; attn.qkv.*=mxfp8"),
    LB_P(precision, attention, E, "auto", 0, 0, "auto|fp32|bf16",
         "attention numerics: bf16 inputs on tensor cores or fp32; auto = fp32 for recipe fp32, "
         "else bf16"),

    // [parallel] (doc/parallel.md) ---------------------------------------------------------
    LB_P(parallel, tp, I, "1", 1, 4096, NULL,
         "tensor-parallel size (ranks: tp fastest, then dp, pp)"),
    LB_P(parallel, pp, I, "1", 1, 4096, NULL, "pipeline-parallel size (stages)"),
    LB_P(parallel, ep, I, "1", 1, 4096, NULL, "expert-parallel size; divides model.num_experts"),
    LB_P(parallel, etp, I, "0", 0, 4096, NULL, "expert-tensor-parallel size, 0 = tp"),
    LB_P(parallel, dp, I, "0", 0, 1048576, NULL,
         "data-parallel size, 0 = world / (tp x pp); set, it must match (info plans with it)"),
    LB_P(parallel, sequence_parallel, B, "false", 0, 0, NULL,
         "split activations over the sequence between tensor-parallel blocks (needs tp > 1)"),
    LB_P(parallel, micro_batches, I, "0", 0, 1048576, NULL,
         "micro-batches per step on each data-parallel rank, 0 = train.grad_accum / dp"),
    LB_P(parallel, zero, B, "true", 0, 0, NULL,
         "ZeRO-1 distributed optimizer (reduce-scatter, sharded AdamW, all-gather); "
         "false = all-reduce"),
    LB_P(parallel, deterministic, B, "true", 0, 0, NULL,
         "sum floats over ranks in rank order (bitwise reproducible); false = the library's order"),
    LB_P(parallel, fail_rank, I, "-1", -1, 1048576, NULL,
         "debug: this rank fails at parallel.fail_step (-1 = none)"),
    LB_P(parallel, fail_step, I, "0", 0, BIG, NULL,
         "debug: the step at which parallel.fail_rank fails"),
    LB_P(parallel, fail_mode, E, "die", 0, 0, "die|exit|kill",
         "debug: how it fails: error and MPI_Abort, exit without MPI_Finalize, or SIGKILL"),

    // [bench] ----------------------------------------------------------------------------------
    LB_P(bench, kind, E, "all", 0, 0, "gemm|quant|attention|train|rollout|rl|all",
         "what `lowbit bench` measures (all = gemm, attention and train; quant = one MoE "
         "layer's quantizations per format, against a device copy)"),
    LB_P(bench, warmup, I, "3", 0, 1000, NULL, "untimed repetitions before timing"),
    LB_P(bench, iters, I, "10", 1, 100000, NULL, "timed repetitions"),
    LB_P(bench, m, I, "16384", 1, 1048576, NULL, "dense GEMM rows (tokens)"),
    LB_P(bench, n, I, "4096", 1, 1048576, NULL, "dense GEMM output features"),
    LB_P(bench, k, I, "2048", 1, 1048576, NULL, "dense GEMM reduction length"),
    LB_P(bench, experts, I, "128", 1, 4096, NULL, "grouped GEMM: experts"),
    LB_P(bench, expert_rows, I, "1024", 1, 1048576, NULL, "grouped GEMM: rows per expert"),
    LB_P(bench, formats, S, "fp32,bf16,fp8-block,mxfp8,mxfp4,nvfp4", 0, 0, NULL,
         "GEMM formats to time (comma list; also fp8-tensor)"),
    LB_P(bench, moe_passes, B, "false", 0, 0, NULL,
         "gemm: also the other expert GEMMs of one MoE layer's training step (fprop down, "
         "dgrad, wgrad; quantized formats with their block shapes, bf16 as the layer's calls "
         "on bf16 copies, each backward also as dgrads and wgrads alone, and fprop and dgrad "
         "storing bf16 outputs)"),
    LB_P(bench, attn_batch, I, "4", 1, 65536, NULL, "attention batch"),
    LB_P(bench, attn_seq, I, "4096", 1, 1048576, NULL, "attention sequence length"),
    LB_P(bench, rollout_batch, I, "64", 1, 1048576, NULL,
         "rollout and rl: sequences sampled at once (the [sample] policy, random weights)"),
    LB_P(bench, rollout_prompt, I, "128", 1, 1048576, NULL,
         "rollout and rl: random prompt tokens per sequence"),
    LB_P(bench, rollout_new, I, "256", 1, 1048576, NULL,
         "rollout and rl: tokens generated per sequence (no stop token)"),
    LB_P(bench, rollout_shapes, S, "", 0, 0, NULL,
         "rollout: BATCHxNEW list (e.g. 64x128,256x512) timed in turn on one model, in place "
         "of rollout_batch and rollout_new (the peak memory is then the process's so far)"),

    // [sample] (doc/rl.md) ----------------------------------------------------------------------
    LB_P(sample, checkpoint, S, "", 0, 0, NULL, "checkpoint `lowbit sample` generates from"),
    LB_P(sample, prompts, S, "", 0, 0, NULL,
         "file of prompts, one per line, \"-\" = stdin; \"\" = problems of the arithmetic task "
         "(or --prompt TEXT)"),
    LB_P(sample, problems, I, "16", 1, BIG, NULL, "arithmetic problems to sample (prompts = \"\")"),
    LB_P(sample, split, E, "val", 0, 0, "train|val", "which arithmetic problems: held out or not"),
    LB_P(sample, samples, I, "1", 1, 1000000, NULL, "completions per prompt"),
    LB_P(sample, temperature, F, "1.0", 0.01, 100, NULL,
         "the policy is softmax(logits / temperature); rl trains this policy"),
    LB_P(sample, top_p, F, "1.0", 0.001, 1, NULL,
         "draw from the smallest set holding top_p, 1 = off"),
    LB_P(sample, top_k, I, "0", 0, 16777216, NULL,
         "draw from the top_k tokens, 0 = off, 1 = greedy"),
    LB_P(sample, max_new_tokens, I, "16", 1, 16777216, NULL,
         "completion length limit (a stop token counts)"),
    LB_P(sample, stop_tokens, S, "10", 0, 0, NULL,
         "token ids that end a completion, comma list; unset: the tokenizer's end-of-text "
         "token, 10 (newline) for a byte model"),
    LB_P(sample, slots, I, "32", 1, 1048576, NULL,
         "sequences decoded at once (continuous batching)"),
    LB_P(sample, max_rows, I, "512", 1, 16777216, NULL,
         "tokens per forward call: decode steps plus prompt chunks (>= slots)"),
    LB_P(sample, kv_cache, E, "auto", 0, 0, "auto|fp32|bf16|fp8",
         "KV cache elements; auto = bf16 under bf16 attention, else fp32; fp8 = E4M3 rows "
         "with FP32 scales, and training attends alike"),
    LB_P(sample, seed, U, "1", 0, 0, NULL, "seed of the draws of every (prompt, sample)"),
    LB_P(sample, deterministic, B, "true", 0, 0, NULL,
         "batch-invariant operations: sampler and trainer log-probs bitwise equal"),

    // [rl] (doc/rl.md) --------------------------------------------------------------------------
    LB_P(rl, init, S, "", 0, 0, NULL, "checkpoint RL starts from; also the KL reference"),
    LB_P(rl, steps, I, "50", 1, BIG, NULL, "RL steps: rollout, rewards, update"),
    LB_P(rl, prompts, I, "8", 1, 1048576, NULL, "prompts per step (train split of the task)"),
    LB_P(rl, group, I, "8", 1, 1048576, NULL, "completions per prompt (G)"),
    LB_P(rl, mini_batches, I, "1", 1, 1048576, NULL,
         "optimizer steps per rollout batch; divides prompts x group"),
    LB_P(rl, micro_batch, I, "64", 1, 1048576, NULL, "sequences per training forward"),
    LB_P(rl, eps_low, F, "0.2", 0, 1, NULL, "ratio clip below: 1 - eps_low"),
    LB_P(rl, eps_high, F, "0.28", 0, 10, NULL, "ratio clip above: 1 + eps_high"),
    LB_P(rl, kl_coef, F, "0", 0, 100, NULL, "weight of the k3 KL to rl.init, 0 = off"),
    LB_P(rl, tis_cap, F, "2.0", 0, 1000000, NULL,
         "truncated importance sampling cap on trainer/rollout ratios, 0 = off"),
    LB_P(rl, adv_eps, F, "1e-6", 1e-30, 1, NULL,
         "added to the group std of rewards (above 0: a group of equal rewards would get 0 / 0)"),
    LB_P(rl, rewards, S, "arith_exact,arith_format", 0, 0, NULL,
         "reward functions, summed (comma list; `lowbit rl` lists them on a bad name)"),
    LB_P(rl, format_reward, F, "0.1", -100, 100, NULL,
         "arith_format, answer_format: paid for a well-formed answer"),
    LB_P(rl, reward_regex, S, "", 0, 0, NULL,
         "answer_regex: PCRE2 pattern searched in a completion ({answer}: the reference)"),
    LB_P(rl, reward_command, S, "", 0, 0, NULL,
         "external reward added per completion: JSON lines on stdin, one number a line out"),
    LB_P(rl, reward_batch, I, "1", 1, 1048576, NULL, "completions per run of the reward command"),
    LB_P(rl, reward_workers, I, "4", 1, 1024, NULL, "runs of the reward command at once"),
    LB_P(rl, reward_timeout, F, "60", 0, 1000000, NULL,
         "seconds a run of the reward command may take (then killed), 0 = no limit"),
    LB_P(rl, reward_timeout_value, F, "0", -1000000, 1000000, NULL,
         "the reward of each completion of a run that timed out"),
    LB_P(rl, prompts_file, S, "", 0, 0, NULL,
         "JSON lines of prompts and reference answers to train on; \"\" = the arithmetic task"),
    LB_P(rl, val_file, S, "", 0, 0, NULL,
         "JSON lines of validation prompts; \"\" = rl.val_fraction of rl.prompts_file"),
    LB_P(rl, val_fraction, F, "0.05", 0, 0.9, NULL,
         "share of rl.prompts_file held out for validation when rl.val_file is empty"),
    LB_P(rl, prompt_field, S, "prompt", 0, 0, NULL, "the prompt's key in a line of the file"),
    LB_P(rl, answer_field, S, "answer", 0, 0, NULL, "the reference answer's key"),
    LB_P(rl, chat_template, S, "", 0, 0, NULL,
         "text around {prompt} (\\n: newline; special tokens of data.tokenizer); \"\" = none"),
    LB_P(rl, eval_every, I, "10", 0, BIG, NULL,
         "held-out pass@1/pass@k every N steps (0 = start and end)"),
    LB_P(rl, eval_problems, I, "100", 0, 1000000, NULL,
         "held-out problems per evaluation, 0 = none"),
    LB_P(rl, eval_samples, I, "4", 1, 65536, NULL,
         "samples per held-out problem (the k of pass@k)"),

    // [mlperf] (doc/mlperf.md) ---------------------------------------------------------------
    LB_P(mlperf, enabled, B, "false", 0, 0, NULL,
         "write the MLPerf log (:::MLLOG lines, rank 0): train in llama31_8b's keys, rl in "
         "qwen35_397b_grpo's; evaluate on its schedule and stop at the target"),
    LB_P(mlperf, log_file, S, "mlperf.log", 0, 0, NULL,
         "the MLPerf log, relative to run.out_dir; - = stdout"),
    LB_P(mlperf, submission_org, S, "lowbit", 0, 0, NULL, "submission_org (not empty)"),
    LB_P(mlperf, submission_platform, S, "", 0, 0, NULL,
         "submission_platform; \"\" = RANKSxBACKEND, e.g. 8xcuda"),
    LB_P(mlperf, division, E, "closed", 0, 0, "closed|open", "submission_division"),
    LB_P(mlperf, cache_cleared, B, "false", 0, 0, NULL,
         "the launcher dropped the page cache before the run (logged as cache_clear; lowbit "
         "does not drop it)"),
    LB_P(mlperf, eval_every, I, "0", 0, BIG, NULL,
         "sequences between evaluations, rounded up to a multiple of the global batch; 0 = "
         "the benchmark's (train 12288, rl one step)"),
    LB_P(mlperf, eval_start, I, "-1", -1, BIG, NULL,
         "sequences before the first evaluation, rounded up to a multiple of the global batch; "
         "-1 = the benchmark's (train eval_every, rl batch x ceil(2.5 + 3840 / batch))"),
    LB_P(mlperf, eval_samples, I, "1024", 1, BIG, NULL,
         "train: validation sequences per evaluation, the first of data.val_files (a multiple "
         "of train.micro_batch); rl evaluates rl.eval_problems"),
    LB_P(mlperf, target, F, "0", 0, 1e6, NULL,
         "stop at this quality: train an eval log-perplexity at or below it, rl a held-out "
         "accuracy above it; 0 = the benchmark's (3.3, 0.69)"),
    LB_P(mlperf, val_temperature, F, "0.1", 0.01, 100, NULL,
         "rl: the evaluation's sampling temperature (the benchmark's validation rollouts)"),
    LB_P(mlperf, val_top_p, F, "0.95", 0.001, 1, NULL, "rl: the evaluation's top_p"),
};

static lb_param *table;
static int ntable;

static lb_param from_model_key(const lb_model_key *k)
{
    static const lb_param_type types[] = {
        [LB_MKEY_INT] = LB_PARAM_INT, [LB_MKEY_FLOAT] = LB_PARAM_FLOAT,
        [LB_MKEY_BOOL] = LB_PARAM_BOOL, [LB_MKEY_ENUM] = LB_PARAM_ENUM};
    lb_param p = {"model", k->name, types[k->type], offsetof(lb_config, model) + k->offset,
                  k->size, k->def, k->min, k->max, k->choices, k->help};
    // the help names the families that read the key, unless all do
    char who[256];
    if (lb_model_key_readers(k, who, sizeof who)[0]) {
        char *h;
        if (asprintf(&h, "%s; only %s", k->help, who) < 0) abort();
        p.help = h;   // the table lives as long as the process
    }
    return p;
}

static void table_build(void)
{
    const int nrows = (int)(sizeof rows / sizeof rows[0]), nk = lb_model_key_count();
    const int slots = (int)(sizeof(((lb_config *)0)->source_line) / sizeof(int));
    table = calloc((size_t)(nrows - 1 + nk), sizeof *table);
    if (!table) abort();
    for (int i = 0; i < nrows; i++) {
        if (rows[i].key) {
            table[ntable++] = rows[i];
            continue;
        }
        for (int j = 0; j < nk; j++) table[ntable++] = from_model_key(lb_model_key_at(j));
    }
    if (ntable > slots) {   // lb_config.source_line has one slot per table entry
        fprintf(stderr, "src/cli/params.c: %d parameters, lb_config.source_line holds %d\n",
                ntable, slots);
        abort();
    }
}

const lb_param *lb_param_table(void)
{
    if (!table) table_build();
    return table;
}

int lb_param_count(void)
{
    if (!table) table_build();
    return ntable;
}
