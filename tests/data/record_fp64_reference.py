#!/usr/bin/env python3
"""Records an exact (float64, unquantised activations) first-step reference for
the prompts of llamacpp_greedy.json, to check the engine's forward pass math
independently of llama.cpp's own rounding.

Weights are dequantised with the `gguf` package; the forward pass is a plain
numpy Llama (RMSNorm, NORM RoPE on adjacent pairs, GQA causal attention, SwiGLU,
tied output). Writes tests/data/fp64_reference.json with the top-20 token ids and
logits of the first step of every prompt.

Re-run:  pip install gguf numpy && python3 tests/data/record_fp64_reference.py [MODEL]
"""
import json
import os
import sys

import gguf
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else os.environ.get(
        "KVCACHE_MODEL", os.path.expanduser("~/.cache/kvcache/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}

    def field(key):
        f = reader.fields[key]
        return f.parts[f.data[0]][0]

    n_layer = int(field("llama.block_count"))
    n_head = int(field("llama.attention.head_count"))
    n_kv = int(field("llama.attention.head_count_kv"))
    n_embd = int(field("llama.embedding_length"))
    eps = float(field("llama.attention.layer_norm_rms_epsilon"))
    base = float(field("llama.rope.freq_base"))
    hd = n_embd // n_head
    cache = {}

    def weight(name):
        if name not in cache:
            t = tensors[name]
            cache[name] = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
        return cache[name]

    def rms(v, w):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * w

    greedy = json.load(open(os.path.join(HERE, "llamacpp_greedy.json")))
    out = []
    for p in greedy["prompts"]:
        ids = p["prompt_ids"]
        n = len(ids)
        emb = weight("token_embd.weight")
        x = emb[ids]
        inv = base ** (-np.arange(0, hd, 2) / hd)
        ang = np.arange(n)[:, None] * inv[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

        def rope(v):
            a, b = v[..., 0::2], v[..., 1::2]
            r = np.empty_like(v)
            r[..., 0::2] = a * cos - b * sin
            r[..., 1::2] = a * sin + b * cos
            return r

        mask = np.triu(np.full((n, n), -np.inf), 1)
        for l in range(n_layer):
            w = lambda s: weight(f"blk.{l}.{s}.weight")
            xn = rms(x, w("attn_norm"))
            q = rope((xn @ w("attn_q").T).reshape(n, n_head, hd))
            k = rope((xn @ w("attn_k").T).reshape(n, n_kv, hd))
            v = (xn @ w("attn_v").T).reshape(n, n_kv, hd)
            att = np.zeros((n, n_head, hd))
            for h in range(n_head):
                g = h // (n_head // n_kv)
                s = q[:, h, :] @ k[:, g, :].T / np.sqrt(hd) + mask
                s = np.exp(s - s.max(-1, keepdims=True))
                att[:, h, :] = (s / s.sum(-1, keepdims=True)) @ v[:, g, :]
            x = x + att.reshape(n, n_head * hd) @ w("attn_output").T
            xn = rms(x, w("ffn_norm"))
            gate, up = xn @ w("ffn_gate").T, xn @ w("ffn_up").T
            x = x + ((gate / (1 + np.exp(-gate))) * up) @ w("ffn_down").T
        logits = rms(x[-1], weight("output_norm.weight")) @ emb.T
        top = np.argsort(-logits, kind="stable")[:20]
        out.append({"name": p["name"], "top20_ids": [int(i) for i in top],
                    "top20_logits": [float(v) for v in logits[top]]})
        print(p["name"], "done", file=sys.stderr)
    with open(os.path.join(HERE, "fp64_reference.json"), "w") as f:
        json.dump({"model": os.path.basename(path), "gguf_version": "0.19.0", "prompts": out}, f, indent=1)


if __name__ == "__main__":
    main()
