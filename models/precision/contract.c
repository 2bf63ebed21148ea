// contract.c: resolving [precision] into per-site formats (see contract.h, doc/formats.md).
#include "models/precision/contract.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>
#include "kernels/common.h"

static const char *const role_names[LB_NROLES] = {
    "attn.qkv", "attn.out", "moe.gate_up", "moe.down", "mlp.gate_up", "mlp.down", "router",
    "lm_head"};
static const char *const pass_names[LB_NPASSES] = {"fprop", "dgrad", "wgrad"};
static const char *const format_names[] = {"fp32",  "bf16",  "fp8-block", "mxfp8",
                                            "mxfp4", "nvfp4", "fp8-tensor"};

const char *lb_role_name(lb_role r) { return r < LB_NROLES ? role_names[r] : "?"; }
const char *lb_format_name(lb_format f)
{
    return (unsigned)f < sizeof format_names / sizeof format_names[0] ? format_names[f] : "?";
}

int lb_format_parse(const char *s, lb_format *out)
{
    for (size_t i = 0; i < sizeof format_names / sizeof format_names[0]; i++)
        if (!strcmp(s, format_names[i])) {
            *out = (lb_format)i;
            return 0;
        }
    return -1;
}

static int is_low(lb_format f) { return f != LB_FMT_FP32 && f != LB_FMT_BF16; }
static int is_linear(lb_role r) { return r != LB_ROLE_ROUTER && r != LB_ROLE_LM_HEAD; }
static int is_expert(lb_role r) { return r == LB_ROLE_MOE_GATE_UP || r == LB_ROLE_MOE_DOWN; }

// Splits s at ',' or ';' into trimmed words; calls fn on each; stops at the first failure.
static int each_word(const char *s, int (*fn)(const char *, void *), void *user)
{
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", s);
    for (char *tok = strtok(buf, ",;"); tok; tok = strtok(NULL, ",;")) {
        while (isspace((unsigned char)*tok)) tok++;
        char *end = tok + strlen(tok);
        while (end > tok && isspace((unsigned char)end[-1])) *--end = 0;
        if (*tok && fn(tok, user) != 0) return -1;
    }
    return 0;
}

typedef struct {
    lb_contract *c;
    char *err;
    size_t errlen;
} ctx;

static lb_site *site(lb_contract *c, int l, int r, int p)
{
    return &c->sites[((size_t)l * LB_NROLES + r) * LB_NPASSES + p];
}

static int keep_role(const char *w, void *user)
{
    ctx *x = user;
    for (int r = 0; r < LB_NROLES; r++)
        if (!strcmp(w, role_names[r])) {
            for (int l = 0; l < x->c->layers; l++)
                for (int p = 0; p < LB_NPASSES; p++)
                    if (is_low(site(x->c, l, r, p)->fmt)) site(x->c, l, r, p)->fmt = LB_FMT_BF16;
            return 0;
        }
    snprintf(x->err, x->errlen, "precision.keep_bf16_roles: unknown role '%s' (roles: attn.qkv, "
             "attn.out, moe.gate_up, moe.down, mlp.gate_up, mlp.down, router, lm_head)", w);
    return -1;
}

static int keep_layer(const char *w, void *user)
{
    ctx *x = user;
    char *end;
    long l = strtol(w, &end, 10);
    if (*end || end == w || l >= x->c->layers || l < -x->c->layers) {
        snprintf(x->err, x->errlen, "precision.keep_bf16_layers: '%s' is not a layer index in "
                 "[%d, %d]", w, -x->c->layers, x->c->layers - 1);
        return -1;
    }
    if (l < 0) l += x->c->layers;
    for (int r = 0; r < LB_NROLES; r++)
        for (int p = 0; p < LB_NPASSES; p++)
            if (is_low(site(x->c, (int)l, r, p)->fmt)) site(x->c, (int)l, r, p)->fmt = LB_FMT_BF16;
    return 0;
}

// "role.pass=format", role or pass may be '*'.
static int override(const char *w, void *user)
{
    ctx *x = user;
    char buf[256], *eq, *dot;
    snprintf(buf, sizeof buf, "%s", w);
    if (!(eq = strchr(buf, '=')) || !(dot = strrchr((*eq = 0, buf), '.'))) {
        snprintf(x->err, x->errlen, "precision.overrides: '%s' is not role.pass=format", w);
        return -1;
    }
    *dot = 0;
    const char *role = buf, *pass = dot + 1, *fmt = eq + 1;
    while (isspace((unsigned char)*fmt)) fmt++;
    char *e = dot - 1;
    while (e > buf && isspace((unsigned char)*e)) *e-- = 0;
    lb_format f;
    if (lb_format_parse(fmt, &f) != 0) {
        snprintf(x->err, x->errlen, "precision.overrides: unknown format '%s' in '%s' (formats: "
                 "fp32, bf16, fp8-block, mxfp8, mxfp4, nvfp4)", fmt, w);
        return -1;
    }
    if (f == LB_FMT_FP8_TENSOR) {
        snprintf(x->err, x->errlen, "precision.overrides: '%s': fp8-tensor is a GEMM format, "
                 "not a training one (its one scale depends on every token of the batch, so "
                 "a token's result would depend on the others; doc/formats.md)", w);
        return -1;
    }
    int any = 0;
    for (int r = 0; r < LB_NROLES; r++) {
        if (strcmp(role, "*") && strcmp(role, role_names[r])) continue;
        for (int p = 0; p < LB_NPASSES; p++) {
            if (strcmp(pass, "*") && strcmp(pass, pass_names[p])) continue;
            for (int l = 0; l < x->c->layers; l++) site(x->c, l, r, p)->fmt = f;
            any = 1;
        }
    }
    if (!any) {
        snprintf(x->err, x->errlen, "precision.overrides: '%s' names no site (role one of "
                 "attn.qkv, attn.out, moe.gate_up, moe.down, mlp.gate_up, mlp.down, router, "
                 "lm_head or *; pass one of fprop, dgrad, wgrad or *)", w);
        return -1;
    }
    return 0;
}

// The recipes, in the order `lowbit params` and the tests list them: the format of the GEMMs
// they quantize (the others bf16; fp32 keeps everything fp32), whether only the expert layers
// are quantized, and the Hadamard of the weight-gradient GEMM.
typedef struct {
    const char *name;
    lb_format low;
    int experts_only;
    lb_hadamard_size had;
} recipe;
static const recipe recipes[] = {   // indexed by lb_recipe
    {"fp32", LB_FMT_FP32, 0, LB_HAD_NONE},
    {"bf16", LB_FMT_BF16, 0, LB_HAD_NONE},
    {"fp8-block", LB_FMT_FP8_BLOCK, 0, LB_HAD_NONE},
    {"mxfp8", LB_FMT_MXFP8, 0, LB_HAD_NONE},
    {"nvfp4-moe", LB_FMT_NVFP4, 1, LB_HAD_16},
    {"mxfp4", LB_FMT_MXFP4, 0, LB_HAD_16},
};
#define NRECIPES ((int)(sizeof recipes / sizeof recipes[0]))
_Static_assert(NRECIPES == LB_NRECIPES, "the recipe table and lb_recipe list the same recipes");

int lb_recipe_count(void) { return NRECIPES; }

const char *lb_recipe_name(int i) { return i >= 0 && i < NRECIPES ? recipes[i].name : NULL; }

lb_recipe lb_recipe_of(const char *name)
{
    int i = 0;
    while (i < NRECIPES && strcmp(name, recipes[i].name)) i++;
    return (lb_recipe)i;
}

const char *lb_recipe_choices(void)
{
    static char list[128];
    if (!list[0])
        for (int i = 0; i < NRECIPES; i++)
            snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", i ? "|" : "",
                     recipes[i].name);
    return list;
}

int lb_contract_resolve(lb_contract *c, const lb_precision_spec *s, int layers, char *err,
                        size_t errlen)
{
    memset(c, 0, sizeof *c);
    if ((unsigned)s->recipe >= LB_NRECIPES)
        lb_die("lb_contract_resolve: recipe %d is not one of the %d", (int)s->recipe, NRECIPES);
    // recipe defaults: which roles are quantized, to what, and the recipe's Hadamard
    const recipe *r = &recipes[s->recipe];
    lb_format low = r->low, other = r->low == LB_FMT_FP32 ? LB_FMT_FP32 : LB_FMT_BF16;
    int experts_only = r->experts_only;
    lb_hadamard_size had = r->had;
    lb_bwd_mode mode = s->backward == LB_BACKWARD_DEQUANTIZED ? LB_BWD_DEQUANTIZED
                       : s->backward == LB_BACKWARD_HIGH    ? LB_BWD_HIGH
                                                            : LB_BWD_QUANTIZED;
    int random = s->wgrad_hadamard == LB_WGRAD_HAD_RANDOM16;
    switch (s->wgrad_hadamard) {
    case LB_WGRAD_HAD_NONE: had = LB_HAD_NONE; break;
    case LB_WGRAD_HAD_H16: case LB_WGRAD_HAD_RANDOM16: had = LB_HAD_16; break;
    case LB_WGRAD_HAD_H32: had = LB_HAD_32; break;
    case LB_WGRAD_HAD_DEFAULT: break;
    }
    const int pow2 = s->scale_pow2;
    // auto: every recipe but fp32, the exact reference
    int attn_bf16 = s->attention == LB_ATTENTION_AUTO ? s->recipe != LB_RECIPE_FP32
                                                       : s->attention == LB_ATTENTION_BF16;
    c->layers = layers;
    c->attention_bf16 = attn_bf16;
    snprintf(c->recipe, sizeof c->recipe, "%s", r->name);
    c->sites = lb_calloc((size_t)layers * LB_NROLES * LB_NPASSES, sizeof *c->sites);
    for (int l = 0; l < layers; l++)
        for (int r = 0; r < LB_NROLES; r++)
            for (int p = 0; p < LB_NPASSES; p++) {
                lb_site *x = site(c, l, r, p);
                int quantized = is_linear(r) && (!experts_only || is_expert(r));
                x->fmt = quantized ? low : other;
                x->mode = p == LB_PASS_FPROP ? LB_BWD_QUANTIZED : mode;
                x->hadamard = p == LB_PASS_WGRAD ? had : LB_HAD_NONE;
                x->hadamard_random = random;
                x->stochastic = s->stochastic_rounding && p != LB_PASS_FPROP;
                x->scale_rule = s->scale_rule;
                x->scale_pow2 = pow2;
                x->nvfp4_per_token = !s->nvfp4_per_tensor;
                x->nvfp4_weight_2d = s->nvfp4_weight_2d;
            }
    ctx x = {c, err, errlen};
    if (each_word(s->keep_bf16_roles, keep_role, &x) || each_word(s->keep_bf16_layers, keep_layer, &x) ||
        each_word(s->overrides, override, &x)) {
        lb_contract_free(c);
        return -1;
    }
    // A Hadamard only matters where the operands are quantized, power-of-two scales where they
    // are fp8-block.
    int fp8_sites = 0;
    for (int l = 0; l < layers; l++)
        for (int r = 0; r < LB_NROLES; r++)
            for (int p = 0; p < LB_NPASSES; p++) {
                lb_site *y = site(c, l, r, p);
                if (!is_low(y->fmt) || y->mode == LB_BWD_HIGH) y->hadamard = LB_HAD_NONE;
                if (y->fmt != LB_FMT_FP8_BLOCK) y->scale_pow2 = 0;
                fp8_sites += y->fmt == LB_FMT_FP8_BLOCK;
            }
    // As an option of TransformerEngine's Float8BlockScaling recipe alone, pow2 is refused where
    // no GEMM is fp8-block rather than silently doing nothing (decided 2026-12-07,
    // doc/formats.md): MX scales are powers of two already, NVFP4's are UE4M3.
    if (pow2 && !fp8_sites) {
        snprintf(err, errlen, "precision.scale: pow2 rounds fp8-block scales up to powers of "
                 "two, and no GEMM of recipe '%s' (with its overrides) is fp8-block (MXFP8 and "
                 "MXFP4 scales are powers of two already)", r->name);
        lb_contract_free(c);
        return -1;
    }
    return 0;
}

void lb_contract_free(lb_contract *c)
{
    free(c->sites);
    c->sites = NULL;
}

const lb_site *lb_contract_site(const lb_contract *c, int layer, lb_role role, lb_pass pass)
{
    // The LM head follows the last block: it takes the last layer's entry, so keeping the last
    // layer in BF16 keeps the head too.
    if (role == LB_ROLE_LM_HEAD || layer >= c->layers) layer = c->layers - 1;
    if (layer < 0) layer = 0;
    return &c->sites[((size_t)layer * LB_NROLES + role) * LB_NPASSES + pass];
}

static void site_str(const lb_site *s, lb_pass p, char *buf, size_t len)
{
    static const char *modes[] = {"", "deq", "high"};
    snprintf(buf, len, "%s%s%s%s%s", lb_format_name(s->fmt),
             p != LB_PASS_FPROP && s->mode ? "/" : "", p != LB_PASS_FPROP ? modes[s->mode] : "",
             s->hadamard ? (s->hadamard_random ? "+rh" : "+h") : "",
             s->hadamard ? (s->hadamard == LB_HAD_16 ? "16" : "32") : "");
    if (s->stochastic) snprintf(buf + strlen(buf), len - strlen(buf), "+sr");
    if (s->scale_pow2) snprintf(buf + strlen(buf), len - strlen(buf), "+p2");
}

static int layer_same(const lb_contract *c, int a, int b)
{
    return !memcmp(&c->sites[(size_t)a * LB_NROLES * LB_NPASSES],
                   &c->sites[(size_t)b * LB_NROLES * LB_NPASSES],
                   sizeof(lb_site) * LB_NROLES * LB_NPASSES);
}

void lb_contract_print(const lb_contract *c, unsigned roles, FILE *f)
{
    fprintf(f, "precision   recipe %s (role x pass -> format; /deq, /high: backward mode; "
               "+h16: Hadamard; +sr: stochastic rounding; +p2: power-of-two scales)\n",
            c->recipe);
    fprintf(f, "  attention %s\n", c->attention_bf16 ? "bf16 (bf16 inputs, tensor-core numerics)"
                                                    : "fp32");
    for (int l = 0; l < c->layers; l++) {
        if (l > 0 && layer_same(c, l, l - 1)) continue;
        int last = l;
        while (last + 1 < c->layers && layer_same(c, last + 1, l)) last++;
        fprintf(f, "  layers %d-%d\n", l, last);
        fprintf(f, "    %-12s %-14s %-14s %-14s\n", "role", "fprop", "dgrad", "wgrad");
        for (int r = 0; r < LB_NROLES; r++) {
            if (!(roles >> r & 1)) continue;   // a role the model has not
            char b[3][48];
            for (int p = 0; p < LB_NPASSES; p++)
                site_str(lb_contract_site(c, l, r, p), p, b[p], sizeof b[p]);
            fprintf(f, "    %-12s %-14s %-14s %-14s\n", role_names[r], b[0], b[1], b[2]);
        }
    }
}
