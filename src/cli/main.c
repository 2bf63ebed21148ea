// main.c: lowbit <command> [FILE.cfg] [--set section.key=value ...], launched with mpirun.
// FILE may also be a lowbit checkpoint: its stored configuration is read.
// Rank 0 reads the parameter file and broadcasts its text; every rank parses the same text, so
// every rank reaches the same configuration or the same error.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "lb_autoconf.h"
#include "lb_commit.h"
#include "src/cli/commands.h"
#include "src/cli/run.h"
#include "src/io/files.h"
#include "src/io/checkpoint.h"
#include "src/io/mllog.h"

typedef struct {
    const char *name;
    int (*run)(const lb_config *, lb_comm *);
    const char *help;
    const char *sections;          // the parameter sections it reads (its --help lists them)
    const char *example;
    const char *options;           // its own options beside --set, for its usage line, or NULL
} command;

static const command commands[] = {
    {"train", lb_cmd_train, "pretrain a model on token shards",
     "run model data train checkpoint precision parallel mlperf",
     "lowbit train examples/tiny-moe.cfg --set train.steps=100 --set run.out_dir=runs/short", NULL},
    {"info", lb_cmd_info, "parameters, FLOPs per token and memory of a configuration",
     "run model train precision parallel", "lowbit info examples/tiny-moe.cfg", NULL},
    {"data", lb_cmd_data, "write token shards: the arithmetic corpus or a text file",
     "gen data",
     "lowbit data examples/tiny-moe.cfg --set gen.problems=50000 --set gen.output=data/arith50k",
     NULL},
    {"data tokenize", lb_cmd_data_tokenize,
     "text or JSON-lines files to token shards through a tokenizer.json (files over ranks)",
     "gen data",
     "mpirun -np 2 lowbit data tokenize --set data.tokenizer=tests/data/tok_kjv/tokenizer.json "
     "--set gen.input='corpus/*.jsonl' --set gen.output=data/corpus", NULL},
    {"convert", lb_cmd_convert, "import a Hugging Face checkpoint, or export one",
     "convert model precision",
     "lowbit convert --set convert.input=path/to/hf_model --set convert.output=model.safetensors",
     NULL},
    {"sample", lb_cmd_sample, "generate completions from a checkpoint (prompts or the task)",
     "run model sample gen data precision parallel",
     "lowbit sample --set sample.checkpoint=runs/tiny-moe/checkpoints/step_00000300.safetensors "
     "--prompt 'In the beginning'",
     "[--prompt TEXT ...]   one prompt each (repeatable), instead of sample.prompts"},
    {"rl", lb_cmd_rl, "GRPO on the arithmetic task with the sampler inside the trainer",
     "run model rl sample gen train checkpoint precision parallel mlperf",
     "lowbit rl examples/rl-arith.cfg", NULL},
    {"bench", lb_cmd_bench, "time GEMMs per format, attention and training steps",
     "run model bench train sample rl precision",
     "lowbit bench examples/qwen3-30b-a3b-4l.cfg --set run.backend=cuda --set bench.kind=rollout",
     NULL},
};
#define NCOMMANDS ((int)(sizeof commands / sizeof commands[0]))

// lowbit COMMAND --help: what it does, an example, and the keys it reads with their defaults.
static void command_help(const command *c)
{
    printf("lowbit %s: %s\n\nusage: lowbit %s [FILE.cfg] [--set section.key=value ...]\n",
           c->name, c->help, c->name);
    if (c->options) printf("       lowbit %s ... %s\n", c->name, c->options);
    printf("       mpirun -np N lowbit %s FILE.cfg ...\n\nexample:\n  %s\n\n"
           "keys (section.key, type, default, description; doc/parameters.md has them all):\n",
           c->name, c->example);
    lb_params_text(stdout, c->sections);
}

static void usage(FILE *f)
{
    fprintf(f, "usage: lowbit <command> [FILE.cfg] [--set section.key=value ...] [-v]\n"
               "       mpirun -np N lowbit <command> FILE.cfg ...\n\ncommands:\n");
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        fprintf(f, "  %-14s %s\n", commands[i].name, commands[i].help);
    fprintf(f, "\nlowbit sample --prompt TEXT (repeatable) samples TEXT; sample.prompts = - reads "
               "prompts from stdin.\n");
    fprintf(f, "  %-14s %s\n", "params", "print the parameter reference (doc/parameters.md; "
               "--man: the manual page)");
    fprintf(f, "  %-14s %s\n", "mlperf-check", "check MLPerf logs: keys, values, order "
               "(doc/mlperf.md)");
    fprintf(f, "\n'lowbit COMMAND --help' lists a command's keys and defaults.\n");
    fprintf(f, "\nParameter files: INI sections, '#' comments, key = value; see doc/parameters.md.\n");
}

// lowbit mlperf-check [--strict] LOG...: 0 when every log passes, 1 when one has problems, 2 on
// a usage mistake or an unreadable file.
static int mlperf_check(int argc, char **argv)
{
    int strict = 0, logs = 0, bad = 0;
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--strict")) strict = 1;
        else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            printf("usage: lowbit mlperf-check [--strict] LOG...\n\nChecks MLPerf logs (:::MLLOG "
                   "lines) against the llama31_8b or qwen35_397b_grpo rules (by their "
                   "submission_benchmark): the keys, their values and their order. --strict: also "
                   "the benchmark's fixed sizes, target and evaluation points (doc/mlperf.md).\n");
            return 0;
        } else if (argv[i][0] == '-') {
            fprintf(stderr, "lowbit mlperf-check: unknown option '%s' (--strict)\n", argv[i]);
            return 2;
        }
    }
    for (int i = 0; i < argc; i++) {
        if (argv[i][0] == '-') continue;
        logs++;
        int p = lb_mllog_check(argv[i], strict, stdout);
        if (p < 0) return 2;
        bad |= p > 0;
    }
    if (!logs) {
        fprintf(stderr, "usage: lowbit mlperf-check [--strict] LOG...\n");
        return 2;
    }
    return bad;
}

int main(int argc, char **argv)
{
    lb_comm comm;
    lb_comm_init(&comm, &argc, &argv);
    int rc = 1;
    char err[2048];
    const char **prompts = NULL;   // --prompt's texts
    if (argc < 2 || !strcmp(argv[1], "help") || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        if (comm.rank == 0) usage(argc < 2 ? stderr : stdout);
        rc = argc < 2 ? 2 : 0;
        goto out;
    }
    if (!strcmp(argv[1], "--version")) {
        if (comm.rank == 0) printf("lowbit %s (commit %s)\n", PACKAGE_VERSION, LB_GIT_COMMIT);
        rc = 0;
        goto out;
    }
    if (!strcmp(argv[1], "params")) {   // doc/parameters.md, or (--man) lowbit.1
        if (comm.rank == 0 && argc > 2 && !strcmp(argv[2], "--man")) {
            lb_command_doc docs[NCOMMANDS];
            for (int i = 0; i < NCOMMANDS; i++)
                docs[i] = (lb_command_doc){commands[i].name, commands[i].help, commands[i].example};
            lb_params_man(stdout, docs, NCOMMANDS);
        } else if (comm.rank == 0) {
            lb_params_markdown(stdout);
        }
        rc = 0;
        goto out;
    }
    if (!strcmp(argv[1], "mlperf-check")) {   // reads logs, not a configuration
        rc = comm.rank == 0 ? mlperf_check(argc - 2, argv + 2) : 0;
        goto out;
    }
    const command *cmd = NULL;
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        if (!strcmp(argv[1], commands[i].name)) cmd = &commands[i];
    int first = 2;                 // the first argument after the command's name
    if (cmd && cmd->run == lb_cmd_data && argc > 2 && !strcmp(argv[2], "tokenize")) {
        for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
            if (commands[i].run == lb_cmd_data_tokenize) cmd = &commands[i];
        first = 3;
    }
    if (!cmd) {
        if (comm.rank == 0) {
            fprintf(stderr, "lowbit: unknown command '%s'\n", argv[1]);
            usage(stderr);
        }
        rc = 2;
        goto out;
    }
    for (int a = first; a < argc; a++)
        if (!strcmp(argv[a], "--help") || !strcmp(argv[a], "-h")) {
            if (comm.rank == 0) command_help(cmd);
            rc = 0;
            goto out;
        }

    lb_config cfg;
    lb_config_defaults(&cfg);
    prompts = calloc((size_t)argc, sizeof *prompts);
    if (!prompts) goto out;
    int i = first;
    if (i < argc && strncmp(argv[i], "--", 2) != 0) {
        // FILE: a parameter file, or a lowbit checkpoint, whose stored configuration (its run's
        // config.ini) is read instead: `lowbit info step_00000300.safetensors`
        size_t len = strlen(argv[i]);
        int ck = len > 12 && !strcmp(argv[i] + len - 12, ".safetensors");
        char *text = ck ? lb_checkpoint_config(argv[i], err, sizeof err)
                        : lb_read_everywhere(&comm, argv[i], 0, err, sizeof err);
        if (!text || lb_config_parse(&cfg, text, argv[i], err, sizeof err) != 0) {
            if (comm.rank == 0) fprintf(stderr, "%s\n", err);
            free(text);
            goto out;
        }
        free(text);
        i++;
    }
    for (; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-v") || !strcmp(a, "--verbose")) a = "run.verbose=true";
        else if (!strcmp(a, "--set") && i + 1 < argc) a = argv[++i];
        else if (!strncmp(a, "--set=", 6)) a += 6;
        else if (!strcmp(a, "--prompt") && i + 1 < argc && cmd->run == lb_cmd_sample) {
            prompts[cfg.nprompt++] = argv[++i];
            continue;
        } else {
            if (comm.rank == 0)
                fprintf(stderr, "lowbit: unexpected argument '%s' (expected --set "
                        "section.key=value%s)\n",
                        a, cmd->run == lb_cmd_sample ? " or --prompt TEXT" : "");
            rc = 2;
            goto out;
        }
        if (lb_config_set(&cfg, a, err, sizeof err) != 0) {
            if (comm.rank == 0) fprintf(stderr, "%s\n", err);
            goto out;
        }
    }
    for (int a = 0, o = 0; a < argc && o < (int)sizeof cfg.command - 1; a++)   // provenance
        o += snprintf(cfg.command + o, sizeof cfg.command - o, "%s%s", a ? " " : "",
                      a ? argv[a] : "lowbit");
    if (lb_config_validate(&cfg, err, sizeof err) != 0) {
        if (comm.rank == 0) fprintf(stderr, "%s\n", err);
        goto out;
    }
    cfg.prompt = prompts;
    rc = cmd->run(&cfg, &comm);
out:
    free(prompts);
    lb_comm_finalize(&comm);
    return rc;
}
