#!/usr/bin/env python3
"""llama.cpp baseline for engine_bench: decode and prefill tokens/s on the same GGUF.

Usage: llamacpp_baseline.py MODEL.gguf SPEC.json
SPEC: {"threads": 2, "decode_prompt": [ids], "decode_tokens": 128,
       "prefill_prompt": [ids], "reps": 3}
Prints one JSON object: decode_tokens_per_s (greedy, argmax of the logits, timed
from the first generated token to the last, like engine_bench), prefill_tokens_per_s
(one eval of the prefill prompt, n_batch = its length), version. Best of `reps`.
Exit status 2 when llama_cpp cannot be imported.
"""
import json
import sys
import time


def main():
    try:
        import llama_cpp
        import numpy as np
    except ImportError as e:  # the caller leaves the llama.cpp ratios out
        print(json.dumps({"error": f"import failed: {e}"}))
        return 2
    model, spec_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    threads = int(spec["threads"])
    dec_prompt, n_dec = spec["decode_prompt"], int(spec["decode_tokens"])
    pre_prompt, reps = spec["prefill_prompt"], int(spec.get("reps", 3))
    n_ctx = max(len(pre_prompt), len(dec_prompt) + n_dec) + 16
    llm = llama_cpp.Llama(model_path=model, n_threads=threads, n_threads_batch=threads,
                          n_ctx=n_ctx, n_batch=max(512, len(pre_prompt)),
                          n_ubatch=max(512, len(pre_prompt)), verbose=False)
    n_vocab = llm.n_vocab()

    def argmax():
        logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))
        return int(np.argmax(logits))

    best_dec = 0.0
    for _ in range(reps):
        llm.reset()
        llm.eval(dec_prompt)
        tok = argmax()  # first generated token
        start = time.perf_counter()
        for _ in range(n_dec - 1):
            llm.eval([tok])
            tok = argmax()
        best_dec = max(best_dec, (n_dec - 1) / (time.perf_counter() - start))

    best_pre = 0.0
    for _ in range(reps):
        llm.reset()
        start = time.perf_counter()
        llm.eval(pre_prompt)
        argmax()
        best_pre = max(best_pre, len(pre_prompt) / (time.perf_counter() - start))

    print(json.dumps({"decode_tokens_per_s": best_dec, "prefill_tokens_per_s": best_pre,
                      "version": getattr(llama_cpp, "__version__", "?"),
                      "system_info": llama_cpp.llama_print_system_info().decode(errors="replace")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
