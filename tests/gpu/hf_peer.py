#!/usr/bin/env python3
"""The GPU peer of tests/gpu/run.sh: Hugging Face transformers on the same GGUF.

What a user would otherwise run on the GPU: transformers loads the GGUF (through
the `gguf` package, dequantising the weights to --dtype) and generates greedily
with its static KV cache. Measured the way gpu_bench measures kvcache:

  hf_decode_tokens_per_s_batch<B>  B sequences of --context prompt tokens, then
      --steps greedy tokens each with cache_implementation="static": the time of
      generate(max_new_tokens=steps + 1) minus generate(max_new_tokens=1) (the
      prompt's prefill and first token), median of --reps
  hf_ttft_recompute_<N>_ms  one forward pass over an N-token conversation plus a
      --turn-token new turn, without a cache: what a stateless server does for
      every turn (kvcache's figure is the same turn on a session whose N tokens
      are cached: gpu_bench's ttft_cached_history<N>_ms)

Writes --json (the figures, the versions, the device). Exit status 2 when torch,
transformers, accelerate or gguf is missing (tests/gpu/pack.sh carries the last
two as wheels). Checked on the CPU with torch 2.15 and transformers 5.25.

  python3 tests/gpu/hf_peer.py --model SmolLM2-135M-Instruct.Q4_1.gguf --json hf.json
"""
import argparse
import json
import os
import statistics
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="GGUF file")
    ap.add_argument("--json", required=True, help="output file")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float16", help="float16, bfloat16 or float32")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--history", type=int, default=2000)
    ap.add_argument("--turn", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    try:
        import torch
        import transformers
        import accelerate  # noqa: F401 (transformers needs it to load GGUF)
        import gguf  # noqa: F401 (transformers reads GGUF through it)
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        print(f"hf_peer: {e}", file=sys.stderr)
        return 2

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    model_dir, model_file = os.path.split(os.path.abspath(args.model))
    t0 = time.perf_counter()
    # transformers 4.56 renamed torch_dtype to dtype.
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    dtype_arg = {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}
    model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=model_file, **dtype_arg)
    model = model.to(device).eval()
    load_s = time.perf_counter() - t0
    vocab = model.config.vocab_size

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def timed(fn):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start

    gen = torch.Generator().manual_seed(1)
    out = {
        "benchmark": "hf_peer",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "model": model_file,
        "load_seconds": load_s,
        "settings": {"context": args.context, "steps": args.steps, "history": args.history, "turn": args.turn},
        "metrics": {},
    }
    with torch.inference_mode():
        for batch in [int(b) for b in args.batches.split(",") if b]:
            ids = torch.randint(100, vocab - 1, (batch, args.context), generator=gen).to(device)
            mask = torch.ones_like(ids)

            def generate(n):
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, cache_implementation="static", pad_token_id=0)

            generate(2)  # warm-up: allocations, kernels
            full = [timed(lambda: generate(args.steps + 1)) for _ in range(args.reps)]
            first = [timed(lambda: generate(1)) for _ in range(args.reps)]
            decode_s = max(statistics.median(full) - statistics.median(first), 1e-9)
            out["metrics"][f"hf_decode_tokens_per_s_batch{batch}"] = batch * args.steps / decode_s
            out["metrics"][f"hf_decode_step_ms_batch{batch}"] = decode_s / args.steps * 1e3
            print(f"batch {batch}: {batch * args.steps / decode_s:.1f} tokens/s", flush=True)

        conv = torch.randint(100, vocab - 1, (1, args.history + args.turn), generator=gen).to(device)
        model(input_ids=conv, use_cache=False)  # warm-up
        ttft = statistics.median(
            timed(lambda: model(input_ids=conv, use_cache=False).logits[:, -1].argmax(-1))
            for _ in range(args.reps))
        out["metrics"][f"hf_ttft_recompute_{args.history}_ms"] = ttft * 1e3
        print(f"time to first token, {args.history} + {args.turn} tokens recomputed: {ttft * 1e3:.2f} ms", flush=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
