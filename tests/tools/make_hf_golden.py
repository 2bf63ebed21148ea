#!/usr/bin/env python3
"""Golden data for lowbit's Hugging Face parity test (tests/test_hf_parity.c).

Builds tiny random Qwen3-MoE, dense Qwen3 and Llama (3.1: llama3 RoPE scaling, no q/k norm)
models with transformers (float32, eager attention, eager experts), saves them with
save_pretrained, and records for one fixed batch, independently of lowbit:

  logits  (b*t, V)   the model's logits (no labels passed, so no internal label shift)
  ce      mean cross-entropy of logits vs targets over targets != -100
  aux     MoE only: SUM over MoE layers of the per-layer Switch loss E * sum_j f_j * P_j,
          f_j = share of the n*k top-k assignments that chose expert j,
          P_j = mean softmax probability of expert j over the layer's n tokens
  loss    ce + router_aux_loss_coef * aux
  grad.<name>  d loss / d parameter for a few parameters, named as lowbit names them
          (fused MoE experts: gate_up_proj (E, 2F, C) gate rows first, down_proj (E, C, F);
          dense MLP: gate_up_proj.weight (2F, C) gate rows first, down_proj.weight (C, F))

Outputs (kept small, committed):
  tests/data/hf_qwen3_moe/        config.json, model.safetensors (save_pretrained),
                                  golden.safetensors
  tests/data/hf_qwen3_moe_fused/  config.json, model.safetensors with the fused expert layout
                                  (the in-memory state_dict: mlp.experts.gate_up_proj/down_proj)
  tests/data/hf_qwen3/            config.json, model.safetensors, golden.safetensors
  tests/data/hf_llama/            the same for LlamaForCausalLM with rope_scaling llama3 (an
                                  original context of 32, so that at the batch's 12 positions
                                  every band of the scaling matters: kept, blended, divided)
  tests/data/hf_glm4_moe/         the same for Glm4MoeForCausalLM (GLM-4.5's MoE, DeepSeek-V3's
                                  router): 3 layers, the first dense (first_k_dense_replace 1),
                                  attention biases, q/k norm, partial rotary 0.5, 8 routed
                                  experts in 4 groups (top-2 groups, top-2 experts), one shared
                                  expert, routed scaling 2.5, a random selection bias; no aux
                                  loss (loss = ce)
  tests/data/st_python.safetensors  a small file of F32/BF16/F16/I32 tensors for test_safetensors
  tests/data/hf_glm4_router.safetensors  transformers' Glm4MoeTopkRouter (the DeepSeek-V3
                                  sigmoid router: selection-only bias, group-limited top-k,
                                  routed scaling factor) on random rows, for the
                                  router_sigmoid op: per variant V (renorm, plain) V.logits,
                                  V.bias, V.idx (as F32), V.weight, V.dweight and V.dlogits
                                  (d sum(dweight * weight) / d logits); sizes in the metadata

Usage:
  python3 tests/tools/make_hf_golden.py [--out tests/data] [--only glm4_moe]
  python3 tests/tools/make_hf_golden.py --check-export DIR [--golden FILE] [--tol 1e-5]
      loads DIR with transformers and compares its logits on the golden batch with the golden
      logits (max|a-b| / max|ref|); exits non-zero on mismatch.
"""
import argparse
import json
import os
import shutil
import sys

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

SEED = 1234
B, T = 2, 12
VOCAB = 96
MATRIX_STD = 0.15   # large enough that attention and routing are far from uniform
EMBED_STD = 0.5


def common_config():
    return dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=96, max_position_embeddings=128,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False, attention_bias=False, use_sliding_window=False,
        initializer_range=0.02, dtype="float32")


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


def build(kind):
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                              Qwen3MoeConfig, Qwen3MoeForCausalLM)
    torch.manual_seed(SEED)
    if kind == "llama":
        c = common_config()
        del c["use_sliding_window"]
        c["rope_parameters"] = dict(LLAMA3_ROPE)
        cfg = LlamaConfig(**c, mlp_bias=False)
        cls = LlamaForCausalLM
    elif kind == "moe":
        cfg = Qwen3MoeConfig(**common_config(), num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=32, norm_topk_prob=True,
                             router_aux_loss_coef=0.01, decoder_sparse_step=1, mlp_only_layers=[],
                             output_router_logits=False)
        cls = Qwen3MoeForCausalLM
    else:
        cfg = Qwen3Config(**common_config())
        cls = Qwen3ForCausalLM
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    model = cls(cfg).float()
    randomize(model, torch.Generator().manual_seed(SEED + 1))
    model.eval()
    return model


def randomize(model, g):
    """Random parameters in the model's order: RMSNorm weights around 1, biases (the only other
    1-D parameters) small, the embedding and matrices normal."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1.0 + 0.2 * (torch.rand(p.shape, generator=g) - 0.5) * 2)
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g) * EMBED_STD)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * MATRIX_STD)


def build_glm4_moe():
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM
    torch.manual_seed(SEED)
    c = common_config()
    del c["use_sliding_window"]
    c["num_hidden_layers"] = 3
    c["attention_bias"] = True
    c["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.5}
    cfg = Glm4MoeConfig(**c, moe_intermediate_size=32, num_experts_per_tok=2, n_shared_experts=1,
                        n_routed_experts=8, routed_scaling_factor=2.5, n_group=4, topk_group=2,
                        first_k_dense_replace=1, norm_topk_prob=True, use_qk_norm=True)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    model = Glm4MoeForCausalLM(cfg).float()
    g = torch.Generator().manual_seed(SEED + 4)
    randomize(model, g)
    with torch.no_grad():
        for layer in model.model.layers[cfg.first_k_dense_replace:]:   # the selection bias
            b = layer.mlp.gate.e_score_correction_bias
            b.copy_(0.3 * torch.randn(b.shape, generator=g))
    model.eval()
    return model


def glm4_route_gap(model, tokens):
    """The smallest margin, over MoE layers and tokens, between the k-th and (k+1)-th choice
    score among the kept groups' experts: routing must not be a near tie."""
    gaps = []
    hooks = []
    for layer in model.model.layers[model.config.first_k_dense_replace:]:
        r = layer.mlp.gate

        def hook(mod, inp, out, r=r):
            x = inp[0].reshape(-1, mod.hidden_dim).float()
            s = torch.sigmoid(x @ mod.weight.float().t()) + mod.e_score_correction_bias
            top = torch.topk(s, mod.top_k + 1, dim=-1).values
            gaps.append((top[:, mod.top_k - 1] - top[:, mod.top_k]).min().item())
        hooks.append(r.register_forward_hook(hook))
    with torch.no_grad():
        model(input_ids=tokens)
    for h in hooks:
        h.remove()
    return min(gaps)


def make_glm4_moe(out_dir):
    tokens, targets = batch()
    model = build_glm4_moe()
    d = os.path.join(out_dir, "hf_glm4_moe")
    if os.path.isdir(d):
        shutil.rmtree(d)
    model.save_pretrained(d, safe_serialization=True)
    gap = glm4_route_gap(model, tokens)
    model.zero_grad()
    logits = model(input_ids=tokens).logits.reshape(B * T, -1)
    ce = F.cross_entropy(logits, targets.reshape(-1), ignore_index=-100, reduction="mean")
    ce.backward()
    p = dict(model.named_parameters())
    tensors = {"tokens": tokens.float().contiguous(), "targets": targets.float().contiguous(),
               "logits": logits.detach().contiguous(), "ce": ce.detach().reshape(1).clone(),
               "loss": ce.detach().reshape(1).clone()}
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
             "model.layers.0.self_attn.q_proj.bias", "model.layers.1.self_attn.k_proj.bias",
             "model.layers.2.self_attn.v_proj.bias", "model.layers.0.self_attn.k_norm.weight",
             "model.layers.1.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight",
             "model.layers.1.mlp.gate.weight", "model.layers.2.mlp.gate.weight",
             "model.layers.1.mlp.experts.gate_up_proj", "model.layers.2.mlp.experts.down_proj",
             "model.layers.1.mlp.shared_experts.down_proj.weight",
             "model.layers.2.post_attention_layernorm.weight", "model.norm.weight",
             "lm_head.weight"]
    for n in names:
        tensors["grad." + n] = p[n].grad.detach().clone().contiguous()
    for pre in ("model.layers.0.mlp.", "model.layers.2.mlp.shared_experts."):
        tensors["grad." + pre + "gate_up_proj.weight"] = torch.cat(
            [p[pre + "gate_proj.weight"].grad, p[pre + "up_proj.weight"].grad], dim=0).contiguous()
    meta = {"definitions": DEFINITIONS + " glm4_moe: no aux loss, loss = ce.", "seed": str(SEED),
            "b": str(B), "t": str(T), "min_route_gap": repr(gap),
            "transformers_version": __import__("transformers").__version__,
            "torch_version": torch.__version__}
    save_file(tensors, os.path.join(d, "golden.safetensors"), metadata=meta)
    print(f"hf_glm4_moe: loss {ce.item():.6f}, min gap between the k-th and (k+1)-th choice "
          f"score {gap:.3g}")


def batch():
    g = torch.Generator().manual_seed(SEED + 2)
    tokens = torch.randint(0, VOCAB, (B, T + 1), generator=g)
    targets = tokens[:, 1:].clone()
    tokens = tokens[:, :T].contiguous()
    targets[0, 3] = -100          # ignored positions: excluded from the mean and the gradient
    targets[1, 7] = -100
    targets[1, 11] = -100
    return tokens, targets


def switch_aux(router_logits, e, k):
    """Sum over layers of E * sum_j f_j P_j (per-layer Switch loss, lowbit's definition)."""
    total = 0.0
    min_gap = float("inf")
    for lg in router_logits:
        probs = torch.softmax(lg.float(), dim=-1)                  # (n, E)
        top = torch.topk(probs, k + 1 if k < e else k, dim=-1)
        if k < e:   # margin between the k-th and (k+1)-th choice: routing must not be a near tie
            min_gap = min(min_gap, (top.values[:, k - 1] - top.values[:, k]).min().item())
        idx = top.indices[:, :k]
        n = probs.shape[0]
        counts = torch.zeros(e).scatter_add_(0, idx.reshape(-1), torch.ones(n * k))
        f = counts / (n * k)
        p = probs.mean(dim=0)
        total = total + e * torch.sum(f * p)
    return total, min_gap


def run(model, tokens, targets):
    is_moe = hasattr(model.config, "num_experts")
    model.zero_grad()
    out = model(input_ids=tokens, output_router_logits=True) if is_moe else model(input_ids=tokens)
    logits = out.logits.reshape(B * T, -1)
    ce = F.cross_entropy(logits, targets.reshape(-1), ignore_index=-100, reduction="mean")
    res = {"logits": logits, "ce": ce}
    if is_moe:
        aux, gap = switch_aux(out.router_logits, model.config.num_experts,
                              model.config.num_experts_per_tok)
        res.update(aux=aux, min_route_gap=gap, hf_aux=out.aux_loss)
        loss = ce + model.config.router_aux_loss_coef * aux
    else:
        loss = ce
    res["loss"] = loss
    loss.backward()
    return res


def grads(model, is_moe, qk_norm=True):
    p = dict(model.named_parameters())
    out = {}
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
             "model.layers.0.input_layernorm.weight",
             "model.layers.1.self_attn.o_proj.weight", "model.norm.weight", "lm_head.weight"]
    names += ["model.layers.0.self_attn.k_norm.weight"] if qk_norm else \
        ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.self_attn.v_proj.weight",
         "model.layers.1.post_attention_layernorm.weight"]
    if is_moe:
        names += ["model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.gate_up_proj",
                  "model.layers.0.mlp.experts.down_proj", "model.layers.1.mlp.gate.weight",
                  "model.layers.1.mlp.experts.gate_up_proj"]
    for n in names:
        out["grad." + n] = p[n].grad.detach().clone()
    if not is_moe:   # lowbit fuses the dense gate/up projections: gate rows first, then up
        for layer in (0, 1):
            pre = f"model.layers.{layer}.mlp."
            out["grad." + pre + "gate_up_proj.weight"] = torch.cat(
                [p[pre + "gate_proj.weight"].grad, p[pre + "up_proj.weight"].grad], dim=0)
        out["grad.model.layers.0.mlp.down_proj.weight"] = \
            p["model.layers.0.mlp.down_proj.weight"].grad.detach().clone()
    return out


DEFINITIONS = (
    "logits: (b*t, vocab) float32 logits of the HF model on tokens (no labels given, so no "
    "label shift). ce: mean F.cross_entropy(logits, targets, ignore_index=-100). aux: SUM over "
    "MoE layers of the per-layer Switch loss E * sum_j f_j * P_j with f_j the share of the n*k "
    "top-k assignments choosing expert j and P_j the mean softmax probability of expert j over "
    "the layer's n tokens. loss = ce + router_aux_loss_coef * aux. grad.<name>: d loss / d "
    "parameter, lowbit names (fused experts gate_up_proj (E,2F,C) gate rows first, down_proj "
    "(E,C,F); dense gate_up_proj.weight (2F,C) gate rows first). tokens/targets stored as F32.")


def make(out_dir):
    tokens, targets = batch()
    for kind, sub in (("moe", "hf_qwen3_moe"), ("dense", "hf_qwen3"), ("llama", "hf_llama")):
        model = build(kind)
        d = os.path.join(out_dir, sub)
        if os.path.isdir(d):
            shutil.rmtree(d)
        model.save_pretrained(d, safe_serialization=True)
        res = run(model, tokens, targets)
        is_moe = kind == "moe"
        tensors = {
            "tokens": tokens.float().contiguous(),
            "targets": targets.float().contiguous(),
            "logits": res["logits"].detach().contiguous(),
            "ce": res["ce"].detach().reshape(1).clone(),
            "loss": res["loss"].detach().reshape(1).clone(),
        }
        meta = {"definitions": DEFINITIONS, "seed": str(SEED), "b": str(B), "t": str(T),
                "transformers_version": __import__("transformers").__version__,
                "torch_version": torch.__version__}
        if is_moe:
            tensors["aux"] = res["aux"].detach().reshape(1)
            meta["hf_aux_loss"] = repr(float(res["hf_aux"].detach()))
            meta["hf_aux_loss_definition"] = (
                "transformers' load_balancing_loss_func: routing over all layers concatenated, "
                "E * sum_j (top-k counts_j / (layers*n)) * (summed probs_j / (layers*n)); "
                "documentation only, lowbit uses the per-layer sum in 'aux'")
            meta["min_route_gap"] = repr(res["min_route_gap"])
            print(f"{sub}: min gap between k-th and (k+1)-th router prob "
                  f"{res['min_route_gap']:.3g}")
        for n, g in grads(model, is_moe, kind != "llama").items():
            tensors[n] = g.contiguous()
        save_file(tensors, os.path.join(d, "golden.safetensors"), metadata=meta)
        line = f"{sub}: loss {res['loss'].item():.6f} ce {res['ce'].item():.6f}"
        if is_moe:
            line += f" aux {res['aux'].item():.6f} hf_aux {float(res['hf_aux'].detach()):.6f}"
        print(line)
        if is_moe:
            # The fused layout as transformers holds it in memory (and as some converters write
            # it); the importer must accept it as well as save_pretrained's per-expert keys.
            fd = os.path.join(out_dir, "hf_qwen3_moe_fused")
            if os.path.isdir(fd):
                shutil.rmtree(fd)
            os.makedirs(fd)
            shutil.copy(os.path.join(d, "config.json"), fd)
            sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
            assert "model.layers.0.mlp.experts.gate_up_proj" in sd
            save_file(sd, os.path.join(fd, "model.safetensors"), metadata={"format": "pt"})
            with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
                keys = list(f.keys())
            print("save_pretrained expert keys:", [k for k in keys if ".experts." in k][:3], "...")

    # A small file from Python's safetensors for the reader test: every float dtype the reader
    # converts, an integer tensor it must refuse to convert, and metadata.
    x = torch.tensor([[1.0, -2.5, 3.14159265, 1e-3], [65504.0, -0.0, 1.0 / 3.0, 7.0]])
    st = {
        "a.f32": x,
        "b.bf16": x.to(torch.bfloat16),
        "c.f16": x.to(torch.float16),
        "d.i32": torch.arange(6, dtype=torch.int32).reshape(2, 3),
        "e.scalar": torch.tensor(2.5),
    }
    save_file(st, os.path.join(out_dir, "st_python.safetensors"),
              metadata={"source": "make_hf_golden.py", "note": "reader test"})


def make_glm4_router(out_dir):
    """transformers' Glm4MoeTopkRouter on random rows (its logits recorded and differentiated)."""
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
    g = torch.Generator().manual_seed(SEED + 3)
    n, c, e, k, ng, tg, scale = 64, 32, 16, 4, 4, 2, 2.5
    tensors = {}
    for name, renorm in (("renorm", True), ("plain", False)):
        cfg = Glm4MoeConfig(hidden_size=c, n_routed_experts=e, num_experts_per_tok=k, n_group=ng,
                            topk_group=tg, routed_scaling_factor=scale, norm_topk_prob=renorm)
        r = Glm4MoeTopkRouter(cfg).float()
        with torch.no_grad():
            r.weight.copy_(torch.randn(r.weight.shape, generator=g))
            r.e_score_correction_bias.copy_(0.3 * torch.randn(e, generator=g))
        x = torch.randn(n, c, generator=g)
        logits, weight, idx = r(x)
        logits.retain_grad()
        dweight = torch.randn(weight.shape, generator=g)
        (weight * dweight).sum().backward()
        tensors.update({f"{name}.logits": logits.detach(), f"{name}.bias":
                        r.e_score_correction_bias.detach().clone(), f"{name}.idx": idx.float(),
                        f"{name}.weight": weight.detach(), f"{name}.dweight": dweight,
                        f"{name}.dlogits": logits.grad.detach()})
    meta = {"n": str(n), "e": str(e), "k": str(k), "n_group": str(ng), "topk_group": str(tg),
            "scale": repr(scale), "transformers_version": __import__("transformers").__version__,
            "definitions": "Glm4MoeTopkRouter.forward: logits, topk_weights, topk_indices "
                           "(unsorted); dlogits = d sum(dweight * weight) / d logits"}
    save_file({k2: v.contiguous() for k2, v in tensors.items()},
              os.path.join(out_dir, "hf_glm4_router.safetensors"), metadata=meta)
    print("hf_glm4_router: written")


def check_export(export_dir, golden, tol):
    from transformers import AutoModelForCausalLM
    with open(os.path.join(export_dir, "config.json")) as f:
        mtype = json.load(f)["model_type"]
    if golden is None:
        here = os.path.dirname(os.path.abspath(__file__))
        sub = {"qwen3_moe": "hf_qwen3_moe", "qwen3": "hf_qwen3", "llama": "hf_llama",
               "glm4_moe": "hf_glm4_moe"}[mtype]
        golden = os.path.join(here, "..", "data", sub, "golden.safetensors")
    model = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    with safe_open(golden, "pt") as f:
        tokens = f.get_tensor("tokens").long()
        ref = f.get_tensor("logits")
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.reshape(ref.shape)
    err = (logits - ref).abs().max().item() / ref.abs().max().item()
    ok = err <= tol and torch.isfinite(logits).all().item()
    print(f"{export_dir} ({mtype}): max|logits - golden| / max|golden| = {err:.3e} "
          f"(tol {tol:g}): {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "..", "data"))
    ap.add_argument("--check-export", metavar="DIR")
    ap.add_argument("--golden", help="golden.safetensors (default: by the model type)")
    ap.add_argument("--tol", type=float, default=1e-5)
    ap.add_argument("--only", choices=["glm4_moe"],
                    help="make only this kind's data (the others' stay as committed)")
    a = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    if a.check_export:
        sys.exit(check_export(a.check_export, a.golden, a.tol))
    if a.only != "glm4_moe":
        make(os.path.normpath(a.out))
        make_glm4_router(os.path.normpath(a.out))
    make_glm4_moe(os.path.normpath(a.out))


if __name__ == "__main__":
    main()
