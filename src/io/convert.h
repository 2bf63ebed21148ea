// convert.h: Hugging Face checkpoints (config.json + safetensors) to and from lowbit models.
//
// Import reads model.safetensors, or the shards named by model.safetensors.index.json, and
// accepts both expert layouts: the hub's per-expert keys (mlp.experts.E.{gate,up,down}_proj.weight)
// and transformers 5's fused in-memory tensors (mlp.experts.gate_up_proj, mlp.experts.down_proj).
// Export writes the per-expert hub layout, which every transformers version loads.
#ifndef LB_CONVERT_H
#define LB_CONVERT_H

#include <stddef.h>
#include "models/model.h"

// config.json in dir -> cfg. Unsupported features (sliding window, attention bias, dense-only
// MoE layers, rope scaling, ...) are refused. Returns 0, or -1 with "DIR/config.json: problem".
int lb_hf_read_config(const char *dir, lb_model_config *cfg, char *err, size_t errlen);

// Loads the weights in dir into m (a model built from dir's configuration). Every lowbit tensor
// must be found with its shape, and every tensor in the files must be used. Returns 0, or -1
// with "FILE: tensor 'name': problem".
int lb_hf_load(lb_model *m, const char *dir, char *err, size_t errlen);

// Writes dir/config.json and dir/model.safetensors (metadata format "pt"), each atomically,
// creating dir. dtype: "f32" or "bf16" (round to nearest even). tokenizer_json (the model's
// tokenizer.json text, or NULL): also dir/tokenizer.json, those bytes as they are, and
// dir/generation_config.json with its end-of-text (and beginning-of-text) token ids.
int lb_hf_export(const lb_model *m, const char *dir, const char *dtype,
                 const char *tokenizer_json, char *err, size_t errlen);

#endif
