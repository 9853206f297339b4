"""PyTorch's side of the interop test: GPT2LMHeadModel and LlamaForCausalLM as transformers
computes them (written here, since transformers is not packaged in Debian), loaded from the
safetensors `cai export` wrote (read with a JSON header and torch.frombuffer, the safetensors
package is not packaged either), run on cai's batch; loss and every gradient must match cai's
within 1e-5.

usage: torch_reference.py HF_DIR CAI_RESULT.safetensors
"""
import json
import math
import os
import struct
import sys

import torch
import torch.nn.functional as F

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "F64": torch.float64, "I64": torch.int64}


def read_safetensors(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    data = bytearray(blob[8 + n:])
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        begin, end = e["data_offsets"]
        dtype = DTYPES[e["dtype"]]
        if end == begin:
            out[name] = torch.empty(e["shape"], dtype=dtype)
            continue
        t = torch.frombuffer(data, dtype=dtype, count=(end - begin) // torch.empty(0, dtype=dtype).element_size(),
                             offset=begin)
        out[name] = t.reshape(e["shape"]).clone()
    return out


def read_weights(hf_dir):
    index_path = os.path.join(hf_dir, "model.safetensors.index.json")
    with open(index_path) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    weights = {}
    for name in files:
        weights.update(read_safetensors(os.path.join(hf_dir, name)))
    return weights


def causal_attention(q, k, v):
    t = q.size(-2)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    mask = torch.ones(t, t, dtype=torch.bool).triu(1)
    return torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v


def gpt2_logits(w, cfg, tokens):
    """transformers' GPT2LMHeadModel: Conv1D weights [in, out], gelu_new, lm_head tied."""
    e, heads = cfg["n_embd"], cfg["n_head"]
    eps = cfg["layer_norm_epsilon"]
    B, T = tokens.shape

    def conv1d(x, prefix):  # x @ W + b
        return torch.addmm(w[prefix + ".bias"], x.view(-1, x.size(-1)),
                           w[prefix + ".weight"]).view(*x.shape[:-1], -1)

    def ln(x, prefix):
        return F.layer_norm(x, (e,), w[prefix + ".weight"], w[prefix + ".bias"], eps)

    def split(x):
        return x.view(B, T, heads, e // heads).transpose(1, 2)

    h = w["transformer.wte.weight"][tokens] + w["transformer.wpe.weight"][torch.arange(T)]
    for i in range(cfg["n_layer"]):
        p = "transformer.h.%d" % i
        q, k, v = conv1d(ln(h, p + ".ln_1"), p + ".attn.c_attn").split(e, dim=2)
        a = causal_attention(split(q), split(k), split(v)).transpose(1, 2).reshape(B, T, e)
        h = h + conv1d(a, p + ".attn.c_proj")
        m = F.gelu(conv1d(ln(h, p + ".ln_2"), p + ".mlp.c_fc"), approximate="tanh")
        h = h + conv1d(m, p + ".mlp.c_proj")
    h = ln(h, "transformer.ln_f")
    return h @ w["transformer.wte.weight"].t()


def llama_logits(w, cfg, tokens):
    """transformers' LlamaForCausalLM: RMSNorm in fp32, rotate_half rotary embedding with
    inv_freq = 1 / theta^(2i/d) in fp32, repeat_kv for grouped-query attention, SwiGLU."""
    e, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = e // heads
    eps = cfg["rms_norm_eps"]
    B, T = tokens.shape

    def rms(x, name):
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return w[name] * xf.to(x.dtype)

    def linear(x, prefix):
        return F.linear(x, w[prefix + ".weight"], w.get(prefix + ".bias"))

    def rotate_half(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, x1), dim=-1)

    inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = torch.outer(torch.arange(T).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()

    def repeat_kv(x):
        n_rep = heads // kv
        if n_rep == 1:
            return x
        b, k_heads, t, hd = x.shape
        return x[:, :, None, :, :].expand(b, k_heads, n_rep, t, hd).reshape(b, k_heads * n_rep, t, hd)

    h = w["model.embed_tokens.weight"][tokens]
    for i in range(cfg["num_hidden_layers"]):
        p = "model.layers.%d" % i
        x = rms(h, p + ".input_layernorm.weight")
        q = linear(x, p + ".self_attn.q_proj").view(B, T, heads, d).transpose(1, 2)
        k = linear(x, p + ".self_attn.k_proj").view(B, T, kv, d).transpose(1, 2)
        v = linear(x, p + ".self_attn.v_proj").view(B, T, kv, d).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        a = causal_attention(q, repeat_kv(k), repeat_kv(v)).transpose(1, 2).reshape(B, T, e)
        h = h + linear(a, p + ".self_attn.o_proj")
        x = rms(h, p + ".post_attention_layernorm.weight")
        m = F.silu(linear(x, p + ".mlp.gate_proj")) * linear(x, p + ".mlp.up_proj")
        h = h + linear(m, p + ".mlp.down_proj")
    return F.linear(rms(h, "model.norm.weight"), w["lm_head.weight"])


def main():
    hf_dir, cai_path = sys.argv[1], sys.argv[2]
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    w = {k: v.requires_grad_(True) for k, v in read_weights(hf_dir).items()}
    cai = read_safetensors(cai_path)
    forward = gpt2_logits if cfg["model_type"] == "gpt2" else llama_logits
    logits = forward(w, cfg, cai["tokens"])
    # transformers shifts labels = tokens by one inside the model; cai's targets are already
    # the next tokens, so the loss is taken on them directly, with PyTorch's ignore_index -100.
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), cai["targets"].reshape(-1),
                           ignore_index=-100)
    loss.backward()
    worst = abs(loss.item() - cai["loss"].item())
    print("%s loss: torch %.9f cai %.9f" % (cfg["model_type"], loss.item(), cai["loss"].item()))
    failed = worst > 1e-5
    for name, p in w.items():
        g = cai.get("grad." + name)
        if g is None:
            print("no cai gradient for %s" % name)
            failed = True
            continue
        diff = (p.grad - g).abs().max().item()
        worst = max(worst, diff)
        if diff > 1e-5:
            print("gradient of %s differs by %.3g" % (name, diff))
            failed = True
    print("largest difference %.3g over the loss and %d gradients: %s" %
          (worst, len(w), "MISMATCH" if failed else "match"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
