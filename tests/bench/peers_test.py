#!/usr/bin/python3
"""bench/peers' models are cai's: the same weights give the logits of transformers' GPT-2 and
Llama as tests/host/interop/torch_reference.py computes them (which cai's own export is checked
against), and the parameter count bench/run.py expects of cai's model. The DDP and ZeRO peers
then train a small Llama with grouped-query attention in bf16 on two ranks. Needs PyTorch
(/usr/bin/python3 from python3-torch)."""
import argparse
import sys
import unittest
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "bench" / "peers"))
sys.path.insert(0, str(ROOT / "tests" / "host" / "interop"))
import benchlib  # noqa: E402
import ddp_gpt2_torch as peer  # noqa: E402
import run  # noqa: E402
import torch_reference  # noqa: E402


def hf_gpt2_name(name):
    """transformers' name of a peer GPT-2 parameter and whether it is stored transposed
    (Conv1D keeps [in, out])."""
    table = {"qkv": "attn.c_attn", "proj": "attn.c_proj", "fc": "mlp.c_fc", "down": "mlp.c_proj"}
    parts = name.split(".")
    if parts[0] == "blocks":
        module = table.get(parts[2], parts[2])
        return f"transformer.h.{parts[1]}.{module}.{parts[3]}", parts[2] in table and parts[3] == "weight"
    return "transformer." + name, False


def hf_llama_name(name):
    table = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
             "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
             "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
             "down": "mlp.down_proj"}
    parts = name.split(".")
    if parts[0] == "blocks":
        return f"model.layers.{parts[1]}.{table[parts[2]]}.{parts[3]}", False
    return {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
            "lm_head.weight": "lm_head.weight"}[name], False


def job(**sizes):
    return argparse.Namespace(**dict(dict(vocab_size=97, n_ctx=24, n_layer=2, n_head=4,
                                          n_kv_head=0, n_embd=64), **sizes))


class PeersTest(unittest.TestCase):
    def check(self, args, hf_name, cfg, forward):
        torch.manual_seed(3)
        model = peer.make_model(args)
        self.assertEqual(sum(p.numel() for p in model.parameters()), run.params(args))
        hf = {}
        with torch.no_grad():
            for name, p in model.named_parameters():
                # Norm weights away from 1, so that a norm's weight in the wrong place shows.
                p.copy_(torch.randn_like(p) * 0.05 + (1.0 if p.dim() == 1 else 0.0))
                key, transposed = hf_name(name)
                hf[key] = p.detach().t().clone() if transposed else p.detach().clone()
        if args.kind == "gpt2":
            hf["transformer.wpe.weight"] = hf["transformer.wpe.weight"][: args.n_ctx]
        tokens = torch.randint(0, args.vocab_size, (2, 20))
        with torch.no_grad():
            ours = model(tokens)
            theirs = forward(hf, cfg, tokens)
        self.assertEqual(ours.shape, theirs.shape)
        self.assertLess((ours - theirs).abs().max().item(), 1e-5)
        # bf16 autocast computes the same model, within bf16's rounding.
        with torch.no_grad(), peer.compute_precision(argparse.Namespace(precision="bf16")):
            rounded = model(tokens)
        self.assertEqual(rounded.dtype, torch.bfloat16)
        self.assertLess((rounded.float() - theirs).abs().max().item(),
                        0.05 * theirs.abs().max().item())

    def test_Gpt2_SameLogitsAsTransformersLayout(self):
        args = job(kind="gpt2")
        cfg = dict(n_embd=64, n_head=4, n_layer=2, layer_norm_epsilon=1e-5)
        self.check(args, hf_gpt2_name, cfg, torch_reference.gpt2_logits)

    def test_LlamaWithGroupedQueryAttention_SameLogitsAsTransformersLayout(self):
        args = job(kind="llama", n_kv_head=2)
        cfg = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                   num_hidden_layers=2, rms_norm_eps=1e-5, rope_theta=10000.0)
        self.check(args, hf_llama_name, cfg, torch_reference.llama_logits)

    def test_DdpAndZeroPeers_TrainLlamaInBf16OnTwoRanks(self):
        args = argparse.Namespace(nproc=2, steps=2, global_batch=4, seq_len=16, kind="llama",
                                  vocab_size=97, n_ctx=16, n_layer=2, n_head=4, n_kv_head=2,
                                  n_embd=64, precision="bf16", timeout=120)
        for script in ("ddp_gpt2_torch.py", "zero_gpt2_torch.py"):
            result = benchlib.run_peer(args, benchlib.peer_command(args, script))
            self.assertEqual(result["params"], run.params(args), script)
            self.assertGreater(result["tokens_per_s"], 0, script)

    def test_GptOnlyPeer_RefusesLlamaByName(self):
        import subprocess
        done = subprocess.run([sys.executable, str(ROOT / "bench" / "peers" / "tp_gpt2_torch.py"),
                               "--model", "llama"], capture_output=True, text=True)
        self.assertNotEqual(done.returncode, 0)
        self.assertIn("invalid choice: 'llama'", done.stderr)


if __name__ == "__main__":
    unittest.main()
