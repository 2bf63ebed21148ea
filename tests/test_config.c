// test_config.c: parameter files (src/cli/config.c, src/cli/params.c): the table, defaults, parsing and
// its error messages, --set, cross-key checks, the INI round trip and doc/parameters.md.
#include "tests/testutil.h"
#include "src/cli/config.h"
#include "src/io/files.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#define ERRLEN 1024
// Bytes of lb_config that are parameters (the bookkeeping fields follow them).
#define PARAM_BYTES offsetof(lb_config, source_file)

static int pindex(const char *section, const char *key)
{
    for (int i = 0; i < lb_nparams; i++)
        if (!strcmp(lb_params[i].section, section) && !strcmp(lb_params[i].key, key)) return i;
    ck_abort_msg("no key %s.%s", section, key);
    return -1;
}

static void *fieldp(lb_config *c, const lb_param *p) { return (char *)c + p->offset; }

// The [model] section is the registry's: arch, then every key the shared blocks and
// the families declare (models/registry.c), each at its lb_model_config field, each with a row
// in doc/parameters.md's [model] table; a family's own key is there too.
START_TEST(test_model_keys_from_registry)
{
    int nmodel = 0;
    for (int i = 0; i < lb_nparams; i++) nmodel += !strcmp(lb_params[i].section, "model");
    ck_assert_int_eq(nmodel, 1 + lb_model_key_count());
    ck_assert_int_ge(pindex("model", "arch"), 0);
    size_t n;
    char err[ERRLEN];
    char *doc = lb_read_file(lb_test_src("doc/parameters.md"), &n, err, sizeof err);
    ck_assert_msg(doc, "%s", err);
    char *sec = strstr(doc, "\n## [model]\n");
    ck_assert_ptr_nonnull(sec);
    char *end = strstr(sec + 1, "\n## [");
    if (end) *end = 0;
    for (int i = 0; i < lb_model_key_count(); i++) {
        const lb_model_key *k = lb_model_key_at(i);
        const lb_param *p = &lb_params[pindex("model", k->name)];
        ck_assert_uint_eq(p->offset, offsetof(lb_config, model) + k->offset);
        ck_assert_uint_eq(p->size, k->size);
        ck_assert_str_eq(p->def, k->def);
        char row[128];
        snprintf(row, sizeof row, "\n| `%s` |", k->name);
        ck_assert_msg(strstr(sec, row), "doc/parameters.md has no [model] row for %s", k->name);
    }
    free(doc);
    int own = 0;
    for (int m = 0; m < lb_model_count(); m++)
        for (int j = 0; j < lb_model_at(m)->nkeys; j++, own++)
            ck_assert_int_ge(pindex("model", lb_model_at(m)->keys[j].name), 0);
    ck_assert_int_gt(own, 0);   // glm4_moe's use_qk_norm
    // the help names the families that read a key when not all do
    const lb_param *q = &lb_params[pindex("model", "use_qk_norm")];
    ck_assert_msg(strstr(q->help, "; only glm4_moe"), "%s", q->help);
    q = &lb_params[pindex("model", "num_experts")];
    ck_assert_msg(strstr(q->help, "; only qwen3_moe, glm4_moe"), "%s", q->help);
    ck_assert_ptr_null(strstr(lb_params[pindex("model", "hidden_size")].help, "; only"));
}
END_TEST

// ---------------------------------------------------------------------------------------------
// The table

START_TEST(test_table_wellformed)
{
    ck_assert_int_gt(lb_nparams, 0);
    ck_assert_int_le(lb_nparams, (int)(sizeof(((lb_config *)0)->source_line) / sizeof(int)));
    for (int i = 0; i < lb_nparams; i++) {
        const lb_param *p = &lb_params[i];
        ck_assert_msg(p->help && p->help[0] && !strchr(p->help, '\n'), "%s: help", p->key);
        ck_assert_msg(p->def != NULL, "%s: default", p->key);
        for (int j = 0; j < i; j++)
            ck_assert_msg(strcmp(p->section, lb_params[j].section) ||
                              strcmp(p->key, lb_params[j].key), "%s.%s twice", p->section, p->key);
        // a section's keys are contiguous, so to_ini and the markdown write each section once
        if (i > 0 && strcmp(p->section, lb_params[i - 1].section))
            for (int j = 0; j < i; j++)
                ck_assert_msg(strcmp(p->section, lb_params[j].section), "[%s] split", p->section);
        switch (p->type) {
        case LB_PARAM_INT:
        case LB_PARAM_BOOL: ck_assert_uint_eq(p->size, sizeof(int)); break;
        case LB_PARAM_U64: ck_assert_uint_eq(p->size, sizeof(uint64_t)); break;
        case LB_PARAM_FLOAT: ck_assert_uint_eq(p->size, sizeof(double)); break;
        case LB_PARAM_STRING: ck_assert_uint_gt(p->size, 1); break;
        case LB_PARAM_ENUM: {
            ck_assert_ptr_nonnull(p->choices);
            int has_def = 0;
            for (const char *s = lb_param_choices(p); *s;) {
                size_t w = strcspn(s, "|");
                ck_assert_msg(w > 0 && w < p->size, "%s: choice does not fit", p->key);
                has_def |= w == strlen(p->def) && !strncmp(s, p->def, w);
                s += w + (s[w] == '|');
            }
            ck_assert_msg(has_def, "%s: default not a choice", p->key);
            break;
        }
        }
        if (p->type != LB_PARAM_ENUM) ck_assert_ptr_null(p->choices);
        if (p->type == LB_PARAM_INT || p->type == LB_PARAM_FLOAT)
            ck_assert_msg(p->min < p->max, "%s.%s: numbers need a range", p->section, p->key);
    }
}
END_TEST

// Every byte of the parameter part of lb_config belongs to a key, except alignment padding:
// a field added to lb_config without a table entry fails here.
#define SECTION(name) { #name, offsetof(lb_config, name), sizeof(((lb_config *)0)->name), \
                        __alignof__(((lb_config *)0)->name) }
START_TEST(test_table_covers_struct)
{
    static const struct { const char *name; size_t off, size, align; } sections[] = {
        SECTION(run), SECTION(model), SECTION(data), SECTION(train), SECTION(checkpoint),
        SECTION(gen), SECTION(convert), SECTION(precision), SECTION(bench), SECTION(parallel),
        SECTION(sample), SECTION(rl), SECTION(mlperf),
    };
    size_t end = 0;
    int seen = 0;
    for (size_t s = 0; s < sizeof sections / sizeof sections[0]; s++) {
        ck_assert_msg(sections[s].off >= end && sections[s].off - end < sections[s].align,
                      "bytes %zu..%zu before [%s] belong to no section", end, sections[s].off,
                      sections[s].name);
        size_t pos = sections[s].off;
        for (int i = 0; i < lb_nparams; i++) {   // the section's keys are in field order
            const lb_param *p = &lb_params[i];
            if (strcmp(p->section, sections[s].name)) continue;
            seen++;
            size_t align = p->type == LB_PARAM_INT || p->type == LB_PARAM_BOOL ? _Alignof(int)
                         : p->type == LB_PARAM_U64 ? _Alignof(uint64_t)
                         : p->type == LB_PARAM_FLOAT ? _Alignof(double) : 1;
            ck_assert_msg(p->offset >= pos, "%s.%s overlaps or is out of order", p->section,
                          p->key);
            ck_assert_msg(p->offset - pos < align && p->offset % align == 0,
                          "bytes %zu..%zu before %s.%s belong to no key", pos, p->offset,
                          p->section, p->key);
            pos = p->offset + p->size;
        }
        end = sections[s].off + sections[s].size;
        ck_assert_msg(pos <= end && end - pos < sections[s].align,
                      "bytes %zu..%zu at the end of [%s] belong to no key", pos, end,
                      sections[s].name);
    }
    ck_assert_int_eq(seen, lb_nparams);
    ck_assert_uint_eq(end, PARAM_BYTES);
}
END_TEST

// ---------------------------------------------------------------------------------------------
// Defaults

START_TEST(test_defaults_match_table)
{
    lb_config c;
    memset(&c, 0x5a, sizeof c);
    lb_config_defaults(&c);
    // each default, read here independently of the setter
    for (int i = 0; i < lb_nparams; i++) {
        const lb_param *p = &lb_params[i];
        void *f = fieldp(&c, p);
        switch (p->type) {
        case LB_PARAM_INT: ck_assert_int_eq(*(int *)f, (int)strtol(p->def, NULL, 10)); break;
        case LB_PARAM_U64: ck_assert_uint_eq(*(uint64_t *)f, strtoull(p->def, NULL, 10)); break;
        case LB_PARAM_FLOAT:
            ck_assert_msg(*(double *)f == strtod(p->def, NULL), "%s", p->key);
            break;
        case LB_PARAM_BOOL: ck_assert_int_eq(*(int *)f, !strcmp(p->def, "true")); break;
        case LB_PARAM_STRING:
        case LB_PARAM_ENUM: ck_assert_str_eq((char *)f, p->def); break;
        }
        ck_assert_int_eq(c.source_line[i], 0);
    }
    ck_assert_str_eq(c.source_file, "");

    // the documented defaults
    ck_assert_str_eq(c.run.backend, "cpu");
    ck_assert_int_eq(c.run.threads, 0);
    ck_assert_int_eq(c.run.device, 0);
    ck_assert_uint_eq(c.run.seed, 1234);
    ck_assert_str_eq(c.run.out_dir, "runs/default");
    ck_assert_str_eq(c.model.arch, "qwen3_moe");
    ck_assert_int_eq(c.model.vocab_size, 256);
    ck_assert_int_eq(c.model.hidden_size, 128);
    ck_assert_int_eq(c.model.num_hidden_layers, 4);
    ck_assert_int_eq(c.model.num_attention_heads, 4);
    ck_assert_int_eq(c.model.num_key_value_heads, 2);
    ck_assert_int_eq(c.model.head_dim, 32);
    ck_assert_int_eq(c.model.intermediate_size, 512);
    ck_assert_int_eq(c.model.num_experts, 4);
    ck_assert_int_eq(c.model.num_experts_per_tok, 2);
    ck_assert_int_eq(c.model.moe_intermediate_size, 256);
    ck_assert_int_eq(c.model.norm_topk_prob, 1);
    ck_assert_int_eq(c.model.max_position_embeddings, 4096);
    ck_assert(c.model.rope_theta == 1000000.0);
    ck_assert(c.model.rms_norm_eps == 1e-6);
    ck_assert(c.model.router_aux_loss_coef == 0.001);
    ck_assert(c.model.initializer_range == 0.02);
    ck_assert_str_eq(c.data.train_files, "");
    ck_assert_str_eq(c.data.val_files, "");
    ck_assert_int_eq(c.train.steps, 100);
    ck_assert_int_eq(c.train.micro_batch, 8);
    ck_assert_int_eq(c.train.seq_len, 64);
    ck_assert_int_eq(c.train.grad_accum, 1);
    ck_assert(c.train.lr == 0.001);
    ck_assert(c.train.min_lr == 0.0001);
    ck_assert_int_eq(c.train.warmup_steps, 10);
    ck_assert(c.train.beta1 == 0.9);
    ck_assert(c.train.beta2 == 0.95);
    ck_assert(c.train.adam_eps == 1e-8);
    ck_assert(c.train.weight_decay == 0.1);
    ck_assert(c.train.grad_clip == 1.0);
    ck_assert_int_eq(c.train.val_every, 0);
    ck_assert_int_eq(c.train.val_batches, 4);
    ck_assert_int_eq(c.train.log_every, 1);
    ck_assert_str_eq(c.train.metrics_file, "metrics.jsonl");
    ck_assert_int_eq(c.checkpoint.save_every, 0);
    ck_assert_int_eq(c.checkpoint.keep, 2);
    ck_assert_str_eq(c.checkpoint.resume, "");
    ck_assert_str_eq(c.gen.kind, "arithmetic");
    ck_assert_str_eq(c.gen.input, "");
    ck_assert_str_eq(c.gen.output, "data/arith");
    ck_assert_int_eq(c.gen.problems, 100000);
    ck_assert_int_eq(c.gen.max_operand, 99);
    ck_assert(c.gen.val_fraction == 0.05);
    ck_assert_int_eq(c.gen.shard_tokens, 1000000);
    ck_assert_uint_eq(c.gen.seed, 1);
    ck_assert_str_eq(c.convert.input, "");
    ck_assert_str_eq(c.convert.output, "");
    ck_assert_str_eq(c.convert.direction, "import");
    ck_assert_str_eq(c.convert.dtype, "f32");

    // defaults are a valid configuration, and every default text is accepted by --set
    char err[ERRLEN] = "";
    ck_assert_msg(lb_config_validate(&c, err, sizeof err) == 0, "%s", err);
    lb_config d = c;
    for (int i = 0; i < lb_nparams; i++) {
        char a[700];
        snprintf(a, sizeof a, "%s.%s=%s", lb_params[i].section, lb_params[i].key, lb_params[i].def);
        ck_assert_msg(lb_config_set(&d, a, err, sizeof err) == 0, "%s", err);
    }
    // the same values, now given: a default that depends on others yields to them
    ck_assert(!lb_config_is_set(&c, "sample", "stop_tokens"));
    ck_assert(lb_config_is_set(&d, "sample", "stop_tokens"));
    memset(d.key_set, 0, sizeof d.key_set);
    ck_assert(memcmp(&c, &d, sizeof c) == 0);
}
END_TEST

// ---------------------------------------------------------------------------------------------
// Parsing good files

START_TEST(test_parse_good)
{
    const char *text =
        "\xEF\xBB\xBF# a comment line\n"
        "; another comment line\n"
        "[run]\n"
        "backend = cuda   # inline comment\n"
        "threads=3\n"
        "\tdevice   =   1\t; inline comment with ';'\r\n"
        "seed = 18446744073709551615\n"
        "out_dir = runs/a#b;c   # '#' and ';' without a blank before are data\n"
        "\n"
        "[model]   # comment after a header\n"
        "  arch = qwen3\n"
        "    hidden_size = 64\n"       // indented: a key, not a continuation of arch
        "norm_topk_prob = off\n"
        "rope_theta = 1e4\n"
        "rms_norm_eps: 1e-5\n"         // inih also takes ':'
        "[checkpoint]\n"
        "resume = \"\"   # quotes make the empty string visible\n"
        "[gen]\n"
        "output = \"#hash\"\n"
        "input =\n"
        "[train]\n"
        "lr = 3e-4\n"
        "steps = +50";                 // no final newline
    lb_config c;
    lb_config_defaults(&c);
    snprintf(c.checkpoint.resume, sizeof c.checkpoint.resume, "x");
    char err[ERRLEN] = "";
    ck_assert_msg(lb_config_parse(&c, text, "good.cfg", err, sizeof err) == 0, "%s", err);
    ck_assert_str_eq(c.run.backend, "cuda");
    ck_assert_int_eq(c.run.threads, 3);
    ck_assert_int_eq(c.run.device, 1);
    ck_assert_uint_eq(c.run.seed, UINT64_MAX);
    ck_assert_str_eq(c.run.out_dir, "runs/a#b;c");
    ck_assert_str_eq(c.model.arch, "qwen3");
    ck_assert_int_eq(c.model.hidden_size, 64);
    ck_assert_int_eq(c.model.norm_topk_prob, 0);
    ck_assert(c.model.rope_theta == 1e4);
    ck_assert(c.model.rms_norm_eps == 1e-5);
    ck_assert_str_eq(c.checkpoint.resume, "");
    ck_assert_str_eq(c.gen.output, "#hash");
    ck_assert_str_eq(c.gen.input, "");
    ck_assert(c.train.lr == 3e-4);
    ck_assert_int_eq(c.train.steps, 50);
    ck_assert_int_eq(c.train.micro_batch, 8);   // untouched keys keep their value
    // bookkeeping for messages
    ck_assert_str_eq(c.source_file, "good.cfg");
    ck_assert_int_eq(c.source_line[pindex("run", "backend")], 4);
    ck_assert_int_eq(c.source_line[pindex("run", "device")], 6);
    ck_assert_int_eq(c.source_line[pindex("model", "hidden_size")], 12);
    ck_assert_int_eq(c.source_line[pindex("train", "steps")], 23);
    ck_assert_int_eq(c.source_line[pindex("train", "micro_batch")], 0);

    // booleans in every spelling, case-insensitive
    const char *yes[] = {"true", "yes", "on", "1", "TRUE", "Yes"};
    const char *no[] = {"false", "no", "off", "0", "False", "OFF"};
    for (int i = 0; i < 6; i++) {
        char t[128];
        snprintf(t, sizeof t, "[model]\nnorm_topk_prob = %s\n", yes[i]);
        ck_assert_msg(lb_config_parse(&c, t, "b.cfg", err, sizeof err) == 0, "%s", err);
        ck_assert_int_eq(c.model.norm_topk_prob, 1);
        snprintf(t, sizeof t, "[model]\nnorm_topk_prob = %s\n", no[i]);
        ck_assert_msg(lb_config_parse(&c, t, "b.cfg", err, sizeof err) == 0, "%s", err);
        ck_assert_int_eq(c.model.norm_topk_prob, 0);
    }
    // an empty file, and a file of comments, change nothing but the source name
    lb_config before = c;
    ck_assert_int_eq(lb_config_parse(&c, "", "b.cfg", err, sizeof err), 0);
    ck_assert_int_eq(lb_config_parse(&c, "# nothing\n\n   ; here\n", "b.cfg", err, sizeof err), 0);
    ck_assert(memcmp(&c, &before, sizeof c) == 0);
}
END_TEST

// A long comment is fine: the limit is on what inih sees, and line numbers stay right.
START_TEST(test_parse_long_comment)
{
    char text[2000];
    char dots[601];
    memset(dots, '.', 600);
    dots[600] = 0;
    snprintf(text, sizeof text, "# %s\n[train]\nsteps = 7   # %s\nlr = x\n", dots, dots);
    lb_config c;
    lb_config_defaults(&c);
    char err[ERRLEN] = "";
    ck_assert_int_eq(lb_config_parse(&c, text, "c.cfg", err, sizeof err), -1);
    ck_assert_str_eq(err, "c.cfg:4: train.lr: 'x' is not a number");
    snprintf(text, sizeof text, "# %s\n[train]\nsteps = 7   # %s\n", dots, dots);
    ck_assert_int_eq(lb_config_parse(&c, text, "c.cfg", err, sizeof err), 0);
    ck_assert_int_eq(c.train.steps, 7);
    ck_assert_int_eq(c.source_line[pindex("train", "steps")], 3);
}
END_TEST

// ---------------------------------------------------------------------------------------------
// Parse errors: exact messages; the configuration is left as it was

static const struct { const char *text, *msg; } parse_errors[] = {
    // unknown keys and sections, with suggestions
    {"[train]\nlerning_rate = 0.1\n",
     "t.cfg:2: unknown key 'lerning_rate' in [train] (did you mean 'lr'?)"},
    {"[model]\nhiden_size = 3\n",
     "t.cfg:2: unknown key 'hiden_size' in [model] (did you mean 'hidden_size'?)"},
    {"[train]\nLR = 0.1\n", "t.cfg:2: unknown key 'LR' in [train] (did you mean 'lr'?)"},
    {"[train]\n\nseed = 3\n",
     "t.cfg:3: unknown key 'seed' in [train] (did you mean '[run] seed'?)"},
    {"[run]\nmax_steps = 3\n",
     "t.cfg:2: unknown key 'max_steps' in [run] (did you mean '[train] steps'?)"},
    {"[train]\nfrobnicate = 1\n", "t.cfg:2: unknown key 'frobnicate' in [train]"},
    {"[train]\nwarmup = 1\n",
     "t.cfg:2: unknown key 'warmup' in [train] (did you mean 'warmup_steps'?)"},
    {"[run]\nthread = 1\n", "t.cfg:2: unknown key 'thread' in [run] (did you mean 'threads'?)"},
    {"[trian]\nlr = 1\n", "t.cfg:1: unknown section [trian] (did you mean [train]?)"},
    {"[training]\n", "t.cfg:1: unknown section [training] (did you mean [train]?)"},
    {"# x\n[zzz]\n",
     "t.cfg:2: unknown section [zzz] (sections: run, model, data, train, checkpoint, gen, "
     "convert, precision, parallel, bench, sample, rl, mlperf)"},
    {"lr = 0.1\n", "t.cfg:1: key 'lr' is outside any [section] (did you mean '[train] lr'?)"},
    {"\nfrobnicate = 1\n", "t.cfg:2: key 'frobnicate' is outside any [section]"},
    // syntax
    {"[train\n", "t.cfg:1: missing ']' in section header"},
    {"[train] steps = 3\n", "t.cfg:1: unexpected ' steps = 3' after section header"},
    {"[train]\nlr 0.1\n",
     "t.cfg:2: expected 'key = value', '[section]' or a comment, not 'lr 0.1'"},
    {"[train]\n = 5\n", "t.cfg:2: missing key name before '='"},
    {"[run]\nout_dir = \"abc\n", "t.cfg:2: run.out_dir: unterminated '\"' in value"},
    // numbers
    {"[train]\nsteps = 12x\n", "t.cfg:2: train.steps: '12x' is not an integer"},
    {"[train]\nsteps = 1e3\n", "t.cfg:2: train.steps: '1e3' is not an integer"},
    {"[train]\nsteps =\n", "t.cfg:2: train.steps: '' is not an integer"},
    {"[train]\nsteps = 0\n", "t.cfg:2: train.steps: '0' is out of range [1, 1000000000]"},
    {"[train]\nsteps = 99999999999999999999\n",
     "t.cfg:2: train.steps: '99999999999999999999' is out of range [1, 1000000000]"},
    {"[run]\nthreads = -1\n", "t.cfg:2: run.threads: '-1' is out of range [0, 1024]"},
    {"[train]\nlr = 0.1.2\n", "t.cfg:2: train.lr: '0.1.2' is not a number"},
    {"[train]\nlr = 1e999\n", "t.cfg:2: train.lr: '1e999' is not a finite number"},
    {"[train]\nlr = nan\n", "t.cfg:2: train.lr: 'nan' is not a finite number"},
    {"[train]\nlr = -0.5\n", "t.cfg:2: train.lr: '-0.5' is out of range [0, 10]"},
    {"[gen]\nval_fraction = 0.6\n", "t.cfg:2: gen.val_fraction: '0.6' is out of range [0, 0.5]"},
    {"[model]\nrms_norm_eps = 0\n",
     "t.cfg:2: model.rms_norm_eps: '0' is out of range [1e-12, 1]"},
    {"[run]\nseed = -1\n", "t.cfg:2: run.seed: '-1' is not an unsigned integer"},
    {"[run]\nseed = 18446744073709551616\n",
     "t.cfg:2: run.seed: '18446744073709551616' does not fit in 64 bits"},
    // booleans and choices
    {"[model]\nnorm_topk_prob = maybe\n",
     "t.cfg:2: model.norm_topk_prob: 'maybe' is not a boolean (true/false, yes/no, on/off, 1/0)"},
    {"[run]\nbackend = gpu\n", "t.cfg:2: run.backend: 'gpu' is not one of cpu|cuda"},
    {"[convert]\ndtype = fp16\n", "t.cfg:2: convert.dtype: 'fp16' is not one of f32|bf16"},
    // duplicates, also across two headers of the same section
    {"[train]\nlr = 0.1\n\nlr = 0.2\n", "t.cfg:4: key 'lr' in [train] already set on line 2"},
    {"[train]\nsteps = 5\n[run]\nthreads = 1\n[train]\n  steps = 5\n",
     "t.cfg:6: key 'steps' in [train] already set on line 2"},
    // the first error wins, whoever finds it
    {"[train]\nsteps = x\n[bogus]\n", "t.cfg:2: train.steps: 'x' is not an integer"},
    {"[bogus]\n[train]\nsteps = x\n", "t.cfg:1: unknown section [bogus] (sections: run, model, "
                                     "data, train, checkpoint, gen, convert, precision, parallel, "
                                     "bench, sample, rl, mlperf)"},
    {"[train]\nsteps = x\nlr = y\n", "t.cfg:2: train.steps: 'x' is not an integer"},
};

START_TEST(test_parse_errors)
{
    for (size_t k = 0; k < sizeof parse_errors / sizeof parse_errors[0]; k++) {
        lb_config c, before;
        lb_config_defaults(&c);
        before = c;
        char err[ERRLEN] = "";
        int rc = lb_config_parse(&c, parse_errors[k].text, "t.cfg", err, sizeof err);
        ck_assert_msg(rc == -1, "case %zu accepted: %s", k, parse_errors[k].text);
        ck_assert_str_eq(err, parse_errors[k].msg);
        ck_assert_msg(memcmp(&c, &before, sizeof c) == 0, "case %zu changed the config", k);
    }
}
END_TEST

// inih splits lines longer than its buffer; we report them instead.
START_TEST(test_parse_long_line)
{
    char text[1000], path[301];
    memset(path, 'x', 300);
    path[300] = 0;
    snprintf(text, sizeof text, "[run]\nout_dir = %s\n", path);
    lb_config c;
    lb_config_defaults(&c);
    char err[ERRLEN] = "";
    ck_assert_int_eq(lb_config_parse(&c, text, "t.cfg", err, sizeof err), -1);
    ck_assert_str_eq(err, "t.cfg:2: line is 310 characters long without comments; the limit is "
                          "197 (inih's INI_MAX_LINE)");
    // exactly at the limit is fine
    path[197 - 10] = 0;
    snprintf(text, sizeof text, "[run]\nout_dir = %s\n", path);
    ck_assert_msg(lb_config_parse(&c, text, "t.cfg", err, sizeof err) == 0, "%s", err);
    ck_assert_uint_eq(strlen(c.run.out_dir), 187);
}
END_TEST

// ---------------------------------------------------------------------------------------------
// --set

START_TEST(test_set)
{
    lb_config c;
    lb_config_defaults(&c);
    char err[ERRLEN] = "";
    ck_assert_int_eq(lb_config_parse(&c, "[train]\nlr = 0.01\n", "s.cfg", err, sizeof err), 0);
    ck_assert_int_eq(c.source_line[pindex("train", "lr")], 2);
    ck_assert_msg(lb_config_set(&c, "train.lr=0.5", err, sizeof err) == 0, "%s", err);
    ck_assert(c.train.lr == 0.5);
    ck_assert_int_eq(c.source_line[pindex("train", "lr")], 0);   // no longer from the file
    ck_assert_msg(lb_config_set(&c, " train.steps = 7 ", err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(c.train.steps, 7);
    ck_assert_msg(lb_config_set(&c, "checkpoint.resume=auto", err, sizeof err) == 0, "%s", err);
    ck_assert_str_eq(c.checkpoint.resume, "auto");
    ck_assert_msg(lb_config_set(&c, "checkpoint.resume=", err, sizeof err) == 0, "%s", err);
    ck_assert_str_eq(c.checkpoint.resume, "");
    ck_assert_msg(lb_config_set(&c, "run.out_dir=\"a=b c\"", err, sizeof err) == 0, "%s", err);
    ck_assert_str_eq(c.run.out_dir, "a=b c");
    ck_assert_msg(lb_config_set(&c, "run.backend=cuda", err, sizeof err) == 0, "%s", err);
    ck_assert_str_eq(c.run.backend, "cuda");
    ck_assert_msg(lb_config_set(&c, "model.norm_topk_prob=no", err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(c.model.norm_topk_prob, 0);
    ck_assert_msg(lb_config_set(&c, "gen.seed=42", err, sizeof err) == 0, "%s", err);
    ck_assert_uint_eq(c.gen.seed, 42);
    ck_assert_uint_eq(c.run.seed, 1234);
}
END_TEST

START_TEST(test_set_errors)
{
    char long_set[700];
    snprintf(long_set, sizeof long_set, "run.out_dir=%0600d", 0);
    const struct { const char *set, *msg; } cases[] = {
        {"train.lr", "--set train.lr: missing '=' (expected section.key=value)"},
        {"lr=0.1", "--set lr: missing section (expected section.key=value; did you mean "
                   "'train.lr'?)"},
        {"trian.lr=0.1", "--set trian.lr: unknown section 'trian' (did you mean 'train.lr'?)"},
        {"zzz.lr=0.1", "--set zzz.lr: unknown section 'zzz' (sections: run, model, data, train, "
                       "checkpoint, gen, convert, precision, parallel, bench, sample, rl, "
                       "mlperf)"},
        {"train.lerning_rate=0.1",
         "--set train.lerning_rate: unknown key 'lerning_rate' in [train] (did you mean "
         "'train.lr'?)"},
        {"train.seed=1",
         "--set train.seed: unknown key 'seed' in [train] (did you mean 'run.seed'?)"},
        {"train.frobnicate=1", "--set train.frobnicate: unknown key 'frobnicate' in [train]"},
        {"=3", "--set =3: missing section.key before '=' (expected section.key=value)"},
        {".lr=3", "--set .lr: missing section (expected section.key=value; did you mean "
                  "'train.lr'?)"},
        {"train.=3", "--set train.: missing key after '.' (expected section.key=value)"},
        {"train.steps=abc", "--set train.steps: 'abc' is not an integer"},
        {"train.steps=0", "--set train.steps: '0' is out of range [1, 1000000000]"},
        {"train.lr=fast", "--set train.lr: 'fast' is not a number"},
        {"model.norm_topk_prob=2", "--set model.norm_topk_prob: '2' is not a boolean "
                                   "(true/false, yes/no, on/off, 1/0)"},
        {"run.backend=gpu", "--set run.backend: 'gpu' is not one of cpu|cuda"},
        {long_set, "--set run.out_dir: value is 600 characters long, at most 511 fit"},
        {"run.out_dir=a #b", "--set run.out_dir: '#' after a blank would start a comment in a "
                             "parameter file"},
        {"run.out_dir=a\nb", "--set run.out_dir: control character in value"},
        {"run.out_dir=\"a", "--set run.out_dir: unterminated '\"' in value"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        lb_config c, before;
        lb_config_defaults(&c);
        before = c;
        char err[ERRLEN] = "";
        ck_assert_msg(lb_config_set(&c, cases[k].set, err, sizeof err) == -1, "accepted: %s",
                      cases[k].set);
        ck_assert_str_eq(err, cases[k].msg);
        ck_assert_msg(memcmp(&c, &before, sizeof c) == 0, "%s changed the config", cases[k].set);
    }
}
END_TEST

// ---------------------------------------------------------------------------------------------
// Round trip through lb_config_to_ini

// Gives every key a value other than its default (strings with characters a file treats
// specially), as code or a checkpoint might.
static void non_default(lb_config *c)
{
    lb_config_defaults(c);
    static const char *strings[] = {
        "runs/with spaces/a;b#c=d:e", "#starts with a hash", "\"quoted\"", "  blanks around  ",
        ";semicolon", "x\"", "glob/*.bin", "\"", "tab\tinside",
    };
    int s = 0;
    for (int i = 0; i < lb_nparams; i++) {
        const lb_param *p = &lb_params[i];
        void *f = fieldp(c, p);
        switch (p->type) {
        case LB_PARAM_INT: {
            int v = (int)(p->min + (p->max - p->min) / 3);
            *(int *)f = v == *(int *)f ? v + 1 : v;
            break;
        }
        case LB_PARAM_U64: *(uint64_t *)f = UINT64_MAX - (uint64_t)i; break;
        case LB_PARAM_FLOAT: *(double *)f = p->min + (p->max - p->min) * 0.3183098861837907; break;
        case LB_PARAM_BOOL: *(int *)f = !*(int *)f; break;
        case LB_PARAM_STRING:
            memset(f, 0, p->size);
            strcpy(f, strings[s++ % (int)(sizeof strings / sizeof strings[0])]);
            break;
        case LB_PARAM_ENUM: {
            const char *choices = lb_param_choices(p), *last = strrchr(choices, '|') + 1;
            memset(f, 0, p->size);
            if (strcmp(last, p->def)) strcpy(f, last);
            else snprintf(f, p->size, "%.*s", (int)strcspn(choices, "|"), choices);
            break;
        }
        }
    }
    c->train.lr = 0.1 + 0.2;   // not the shortest decimal of anything nearby
    c->train.min_lr = 1e-300;
    c->model.rms_norm_eps = 1.0000000000000002e-12;   // next double above the minimum
}

START_TEST(test_round_trip)
{
    lb_config c, d, def;
    non_default(&c);
    lb_config_defaults(&def);
    for (int i = 0; i < lb_nparams; i++) {
        const lb_param *p = &lb_params[i];
        ck_assert_msg(memcmp(fieldp(&c, p), fieldp(&def, p), p->size) != 0,
                      "%s.%s kept its default", p->section, p->key);
    }
    char *ini = lb_config_to_ini(&c);
    ck_assert_ptr_nonnull(ini);
    lb_config_defaults(&d);
    char err[ERRLEN] = "";
    ck_assert_msg(lb_config_parse(&d, ini, "resolved.cfg", err, sizeof err) == 0, "%s\n%s", err,
                  ini);
    ck_assert_msg(memcmp(&c, &d, PARAM_BYTES) == 0, "round trip differs:\n%s", ini);
    // every key once, in table order, under its section
    const char *pos = ini;
    for (int i = 0; i < lb_nparams; i++) {
        char want[96];
        if (i == 0 || strcmp(lb_params[i].section, lb_params[i - 1].section)) {
            snprintf(want, sizeof want, "[%s]\n", lb_params[i].section);
            pos = strstr(pos, want);
            ck_assert_msg(pos != NULL, "no %s in order", want);
        }
        snprintf(want, sizeof want, "\n%s = ", lb_params[i].key);
        pos = strstr(pos, want);
        ck_assert_msg(pos != NULL, "no %s.%s in order", lb_params[i].section, lb_params[i].key);
    }
    free(ini);

    // the defaults too, and readable numbers
    ini = lb_config_to_ini(&def);
    ck_assert_ptr_nonnull(ini);
    ck_assert_ptr_nonnull(strstr(ini, "\nlr = 0.001\n"));
    ck_assert_ptr_nonnull(strstr(ini, "\nrms_norm_eps = 1e-06\n"));
    ck_assert_ptr_nonnull(strstr(ini, "\nnorm_topk_prob = true\n"));
    ck_assert_ptr_nonnull(strstr(ini, "\nseed = 1234\n"));
    lb_config_defaults(&d);
    ck_assert_int_eq(lb_config_set(&d, "train.steps=5", err, sizeof err), 0);
    ck_assert_msg(lb_config_parse(&d, ini, "resolved.cfg", err, sizeof err) == 0, "%s", err);
    ck_assert(memcmp(&def, &d, PARAM_BYTES) == 0);
    free(ini);
}
END_TEST

// ---------------------------------------------------------------------------------------------
// doc/parameters.md

START_TEST(test_markdown)
{
    char *md = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&md, &len);
    ck_assert_ptr_nonnull(f);
    lb_params_markdown(f);
    fclose(f);
    ck_assert(!strncmp(md, "# Parameters\n", 13));
    ck_assert_ptr_nonnull(strstr(md, "`lowbit params`"));
    ck_assert_ptr_nonnull(strstr(md, "do not edit"));
    for (int i = 0; i < lb_nparams; i++) {
        const lb_param *p = &lb_params[i];
        char want[160];
        snprintf(want, sizeof want, "\n## [%s]\n", p->section);
        ck_assert_msg(strstr(md, want), "no section %s", p->section);
        // the key's row, under its section's heading, with its default and help
        const char *head = strstr(md, want), *next = strstr(head + 1, "\n## [");
        snprintf(want, sizeof want, "\n| `%s` | ", p->key);
        const char *row = strstr(head, want);
        ck_assert_msg(row != NULL && (!next || row < next), "no row for %s.%s", p->section,
                      p->key);
        const char *eol = strchr(row + 1, '\n');
        char line[512];
        snprintf(line, sizeof line, "%.*s", (int)(eol - row - 1), row + 1);
        snprintf(want, sizeof want, "`%s`", p->def[0] ? p->def : "\"\"");
        ck_assert_msg(strstr(line, want), "row %s lacks default %s", line, want);
        ck_assert_msg(strstr(line, p->help) || strchr(p->help, '|'), "row %s lacks help", line);
    }
    // a range and the choices appear in their rows
    ck_assert_ptr_nonnull(strstr(md, "| `threads` | int | `0` | [0, 1024] |"));
    ck_assert_ptr_nonnull(strstr(md, "| `backend` | enum | `cpu` | `cpu`, `cuda` |"));
    free(md);
}
END_TEST

// ---------------------------------------------------------------------------------------------
// Cross-key checks

static void expect_invalid(const lb_config *c, const char *msg)
{
    char err[ERRLEN] = "";
    ck_assert_int_eq(lb_config_validate(c, err, sizeof err), -1);
    ck_assert_str_eq(err, msg);
}

static void expect_shape_error(lb_parallel_config pc, lb_config_shapes s, const char *msg,
                               const char *k0, const char *k1)
{
    const char *keys[2];
    char err[512] = "";
    ck_assert_int_eq(lb_config_check_shapes(&pc, &s, keys, err, sizeof err), -1);
    ck_assert_str_eq(err, msg);
    ck_assert_str_eq(keys[0], k0);
    ck_assert_str_eq(keys[1], k1);
}

START_TEST(test_shape_errors)
{
    // layers, heads, kv heads, experts, ffn, moe ffn, vocab, seq_len
    lb_config_shapes moe = {4, 4, 2, 4, 0, 256, 256, 64};
    const char *keys[2];
    char err[512];
    lb_parallel_config ok = lb_test_parallel(2, 2, 4, 0);
    ck_assert_msg(lb_config_check_shapes(&ok, &moe, keys, err, sizeof err) == 0, "%s", err);
    expect_shape_error(lb_test_parallel(1, 1, 3, 0), moe,
                       "model.num_experts (4) is not divisible by parallel.ep (3): every "
                       "expert-parallel rank holds the same number of experts",
                       "model.num_experts", "parallel.ep");
    expect_shape_error(lb_test_parallel(4, 1, 1, 0), moe,
                       "model.num_key_value_heads (2) is not divisible by parallel.tp (4): tensor "
                       "parallelism splits the key/value heads",
                       "model.num_key_value_heads", "parallel.tp");
    lb_config_shapes h6 = moe;
    h6.heads = 6;
    expect_shape_error(lb_test_parallel(4, 1, 1, 0), h6,
                       "model.num_attention_heads (6) is not divisible by parallel.tp (4): tensor "
                       "parallelism splits the query heads",
                       "model.num_attention_heads", "parallel.tp");
    expect_shape_error(lb_test_parallel(1, 3, 1, 0), moe,
                       "model.num_hidden_layers (4) is not divisible by parallel.pp (3): every "
                       "pipeline stage holds the same number of layers",
                       "model.num_hidden_layers", "parallel.pp");
    lb_config_shapes f = moe;
    f.moe_ffn = 100;
    expect_shape_error(lb_test_parallel(1, 1, 1, 8), f,
                       "model.moe_intermediate_size (100) is not divisible by parallel.etp (8): "
                       "expert tensor parallelism splits each expert",
                       "model.moe_intermediate_size", "parallel.etp");
    lb_config_shapes v = moe;   // the embedding and LM head are replicated over tp
    v.vocab = 255;
    lb_parallel_config t2 = lb_test_parallel(2, 1, 1, 0);
    ck_assert_int_eq(lb_config_check_shapes(&t2, &v, keys, err, sizeof err), 0);
    lb_parallel_config sp = lb_test_parallel(1, 1, 1, 0);
    sp.sequence_parallel = 1;
    expect_shape_error(sp, moe,
                       "parallel.sequence_parallel needs parallel.tp > 1 (it splits the "
                       "tensor-parallel group's activations over the sequence)",
                       "parallel.sequence_parallel", "parallel.tp");
    sp.tp = 2;
    lb_config_shapes odd = moe;
    odd.seq_len = 63;
    expect_shape_error(sp, odd,
                       "train.seq_len (63) is not divisible by parallel.tp (2): sequence "
                       "parallelism splits the sequence", "train.seq_len", "parallel.tp");
    lb_parallel_config fr = lb_test_parallel(1, 1, 1, 0);
    fr.fail_rank = 1;
    expect_shape_error(fr, moe,
                       "parallel.fail_rank and parallel.fail_step go together (rank 1, step 0): "
                       "set both to make a rank fail on purpose, or neither",
                       "parallel.fail_rank", "parallel.fail_step");
}
END_TEST

// The enum parameters read as enums: each choice's index is the enum value of that name.
START_TEST(test_enum_values)
{
    lb_config c;
    char err[256];
    const struct { const char *set; int want; } recompute[] = {
        {"train.recompute=none", LB_RECOMPUTE_NONE},
        {"train.recompute=selective", LB_RECOMPUTE_SELECTIVE},
        {"train.recompute=full", LB_RECOMPUTE_FULL}};
    const struct { const char *set; lb_kv_kind want; } kv[] = {
        {"sample.kv_cache=auto", LB_KV_AUTO}, {"sample.kv_cache=fp32", LB_KV_FP32},
        {"sample.kv_cache=bf16", LB_KV_BF16}, {"sample.kv_cache=fp8", LB_KV_FP8}};
    for (size_t i = 0; i < sizeof recompute / sizeof recompute[0]; i++) {
        lb_config_defaults(&c);
        ck_assert_msg(lb_config_set(&c, recompute[i].set, err, sizeof err) == 0, "%s", err);
        ck_assert_int_eq(lb_config_recompute(&c), recompute[i].want);
    }
    for (size_t i = 0; i < sizeof kv / sizeof kv[0]; i++) {
        lb_config_defaults(&c);
        ck_assert_msg(lb_config_set(&c, kv[i].set, err, sizeof err) == 0, "%s", err);
        ck_assert_int_eq(lb_config_kv_cache(&c), kv[i].want);
    }
    // [precision]: each word as its enum (the spec's field read back by name)
    const struct { const char *set; const char *field; int want; } prec[] = {
        {"precision.recipe=fp32", "recipe", LB_RECIPE_FP32},
        {"precision.recipe=bf16", "recipe", LB_RECIPE_BF16},
        {"precision.recipe=fp8-block", "recipe", LB_RECIPE_FP8_BLOCK},
        {"precision.recipe=mxfp8", "recipe", LB_RECIPE_MXFP8},
        {"precision.recipe=nvfp4-moe", "recipe", LB_RECIPE_NVFP4_MOE},
        {"precision.recipe=mxfp4", "recipe", LB_RECIPE_MXFP4},
        {"precision.backward=default", "backward", LB_BACKWARD_DEFAULT},
        {"precision.backward=quantized", "backward", LB_BACKWARD_QUANTIZED},
        {"precision.backward=dequantized", "backward", LB_BACKWARD_DEQUANTIZED},
        {"precision.backward=high", "backward", LB_BACKWARD_HIGH},
        {"precision.wgrad_hadamard=default", "wgrad_hadamard", LB_WGRAD_HAD_DEFAULT},
        {"precision.wgrad_hadamard=none", "wgrad_hadamard", LB_WGRAD_HAD_NONE},
        {"precision.wgrad_hadamard=h16", "wgrad_hadamard", LB_WGRAD_HAD_H16},
        {"precision.wgrad_hadamard=h32", "wgrad_hadamard", LB_WGRAD_HAD_H32},
        {"precision.wgrad_hadamard=random16", "wgrad_hadamard", LB_WGRAD_HAD_RANDOM16},
        {"precision.scale_rule=ceil", "scale_rule", LB_SCALE_CEIL},
        {"precision.scale_rule=floor", "scale_rule", LB_SCALE_FLOOR},
        {"precision.scale=fp32", "scale", 0}, {"precision.scale=pow2", "scale", 1},
        {"precision.nvfp4_scale=per-token", "nvfp4_scale", 0},
        {"precision.nvfp4_scale=per-tensor", "nvfp4_scale", 1},
        {"precision.nvfp4_weight_blocks=1x16", "nvfp4_weight_blocks", 0},
        {"precision.nvfp4_weight_blocks=16x16", "nvfp4_weight_blocks", 1},
        {"precision.attention=auto", "attention", LB_ATTENTION_AUTO},
        {"precision.attention=fp32", "attention", LB_ATTENTION_FP32},
        {"precision.attention=bf16", "attention", LB_ATTENTION_BF16}};
    for (size_t i = 0; i < sizeof prec / sizeof prec[0]; i++) {
        lb_config_defaults(&c);
        ck_assert_msg(lb_config_set(&c, prec[i].set, err, sizeof err) == 0, "%s", err);
        const lb_precision_spec s = lb_config_precision(&c);
        const char *f = prec[i].field;
        int got = !strcmp(f, "recipe")           ? (int)s.recipe
                  : !strcmp(f, "backward")       ? (int)s.backward
                  : !strcmp(f, "wgrad_hadamard") ? (int)s.wgrad_hadamard
                  : !strcmp(f, "scale_rule")     ? (int)s.scale_rule
                  : !strcmp(f, "scale")          ? s.scale_pow2
                  : !strcmp(f, "nvfp4_scale")    ? s.nvfp4_per_tensor
                  : !strcmp(f, "nvfp4_weight_blocks") ? s.nvfp4_weight_2d
                                                      : (int)s.attention;
        ck_assert_msg(got == prec[i].want, "%s: %d, want %d", prec[i].set, got, prec[i].want);
    }
    // the parameter table's defaults: the fp32 recipe, its lists as the table gives them
    lb_config_defaults(&c);
    const lb_precision_spec d = lb_config_precision(&c);
    ck_assert_int_eq(d.recipe, LB_RECIPE_FP32);
    ck_assert_int_eq(d.nvfp4_weight_2d, 1);
    ck_assert_str_eq(d.keep_bf16_roles, "router,lm_head");
    // an unknown word stops at the parameter table, naming the key
    lb_config_defaults(&c);
    ck_assert_int_eq(lb_config_set(&c, "precision.recipe=fp7", err, sizeof err), -1);
    ck_assert_msg(strstr(err, "precision.recipe"), "%s", err);
}
END_TEST

START_TEST(test_validate)
{
    lb_config c;
    char err[ERRLEN] = "";
    // the line of the key that a file set
    lb_config_defaults(&c);
    ck_assert_int_eq(lb_config_parse(&c, "[model]\nmax_position_embeddings = 128\n[train]\n"
                                         "seq_len = 256\n", "v.cfg", err, sizeof err), 0);
    expect_invalid(&c, "v.cfg:4: train.seq_len (256) exceeds model.max_position_embeddings (128)");
    // --set took seq_len away from the file: the other key's line
    ck_assert_int_eq(lb_config_set(&c, "train.seq_len=512", err, sizeof err), 0);
    expect_invalid(&c, "v.cfg:2: train.seq_len (512) exceeds model.max_position_embeddings (128)");
    // neither key from the file: the file name
    lb_config_defaults(&c);
    ck_assert_int_eq(lb_config_parse(&c, "[run]\nthreads = 2\n", "v.cfg", err, sizeof err), 0);
    ck_assert_int_eq(lb_config_set(&c, "train.seq_len=5000", err, sizeof err), 0);
    expect_invalid(&c, "v.cfg: train.seq_len (5000) exceeds model.max_position_embeddings (4096)");
    // no file at all
    lb_config_defaults(&c);
    c.train.seq_len = 8192;
    expect_invalid(&c, "train.seq_len (8192) exceeds model.max_position_embeddings (4096)");

    lb_config_defaults(&c);
    c.train.min_lr = 0.01;
    expect_invalid(&c, "train.min_lr (0.01) exceeds train.lr (0.001)");
    lb_config_defaults(&c);
    c.train.warmup_steps = 200;
    expect_invalid(&c, "train.warmup_steps (200) exceeds train.steps (100): add --set "
                       "train.warmup_steps=100 or fewer");
    lb_config_defaults(&c);
    c.train.micro_batch = 1048576;
    c.train.seq_len = 4096;
    expect_invalid(&c, "train.micro_batch * train.seq_len = 4294967296 tokens, more than an int "
                       "holds (2147483647)");
    lb_config_defaults(&c);
    ck_assert_int_eq(lb_config_parse(&c, "[model]\nnum_attention_heads = 6\n"
                                         "num_key_value_heads = 4\n", "h.cfg", err, sizeof err), 0);
    expect_invalid(&c, "h.cfg:2: model.num_attention_heads (6) is not a multiple of "
                       "model.num_key_value_heads (4)");
    // layouts that cannot split the model stop here, before any rank does work
    lb_config_defaults(&c);
    ck_assert_int_eq(lb_config_parse(&c, "[parallel]\nep = 3\n", "p.cfg", err, sizeof err), 0);
    expect_invalid(&c, "p.cfg:2: model.num_experts (4) is not divisible by parallel.ep (3): every "
                       "expert-parallel rank holds the same number of experts");
    lb_config_defaults(&c);
    ck_assert_int_eq(lb_config_parse(&c, "[model]\nnum_hidden_layers = 3\n[parallel]\npp = 2\n",
                                     "p.cfg", err, sizeof err), 0);
    expect_invalid(&c, "p.cfg:2: model.num_hidden_layers (3) is not divisible by parallel.pp (2): "
                       "every pipeline stage holds the same number of layers");
    lb_config_defaults(&c);
    c.parallel.tp = 4;
    expect_invalid(&c, "model.num_key_value_heads (2) is not divisible by parallel.tp (4): tensor "
                       "parallelism splits the key/value heads");
    lb_config_defaults(&c);
    c.train.grad_accum = 6;
    c.parallel.micro_batches = 4;
    expect_invalid(&c, "train.grad_accum (6) is not a multiple of parallel.micro_batches (4): "
                       "grad_accum = micro_batches x dp");
    lb_config_defaults(&c);
    c.train.beta1 = 1;
    expect_invalid(&c, "train.beta1 must be below 1");
    lb_config_defaults(&c);
    c.train.beta2 = 1;
    expect_invalid(&c, "train.beta2 must be below 1");

    // per-key rules hold for a configuration filled by code
    lb_config_defaults(&c);
    c.run.threads = 5000;
    expect_invalid(&c, "run.threads: 5000 is out of range [0, 1024]");
    lb_config_defaults(&c);
    snprintf(c.run.backend, sizeof c.run.backend, "gpu");
    expect_invalid(&c, "run.backend: 'gpu' is not one of cpu|cuda");
    lb_config_defaults(&c);
    c.train.lr = INFINITY;
    expect_invalid(&c, "train.lr: inf is not a finite number");
    lb_config_defaults(&c);
    c.model.norm_topk_prob = 2;
    expect_invalid(&c, "model.norm_topk_prob: 2 is not a boolean (0 or 1)");
    lb_config_defaults(&c);
    memset(c.gen.output, 'a', sizeof c.gen.output);
    expect_invalid(&c, "gen.output: value is not terminated");
}
END_TEST

static Suite *config_suite(void)
{
    Suite *s = suite_create("config");
    TCase *tc = tcase_create("config");
    tcase_add_test(tc, test_table_wellformed);
    tcase_add_test(tc, test_model_keys_from_registry);
    tcase_add_test(tc, test_table_covers_struct);
    tcase_add_test(tc, test_defaults_match_table);
    tcase_add_test(tc, test_parse_good);
    tcase_add_test(tc, test_parse_long_comment);
    tcase_add_test(tc, test_parse_errors);
    tcase_add_test(tc, test_parse_long_line);
    tcase_add_test(tc, test_set);
    tcase_add_test(tc, test_set_errors);
    tcase_add_test(tc, test_round_trip);
    tcase_add_test(tc, test_markdown);
    tcase_add_test(tc, test_validate);
    tcase_add_test(tc, test_enum_values);
    tcase_add_test(tc, test_shape_errors);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) { return lb_test_run(config_suite()); }
