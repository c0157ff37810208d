#!/usr/bin/env python3
"""Records llama.cpp's logits for the tiny reference models of every supported
architecture (gguf::ArchitectureReferenceModels: Llama 3.1 with rope_freqs,
Qwen 2.5 with Q/K/V biases, Qwen 3 with Q/K norms, and Qwen 2.5 with Q8_0
weights), so that tests/worker/model/arch_reference_test.cc compares our CPU
forward pass with llama.cpp's on the same files without llama.cpp at test time.

Re-run by anyone (a few seconds once llama.cpp is built):
    cmake --build build --target kvcache-tiny-model
    python3 tests/data/record_arch_reference.py [--build_dir build]
It builds llama.cpp with tests/bench/build_llamacpp.sh (native flavour, the
source the llama-cpp-python sdist vendors), compiles tests/data/llamacpp_logits.cc
against it, writes the tiny models with kvcache-tiny-model and records, per
model: the file's SHA-256 (the test checks it, so a changed writer is caught),
the token ids, and llama.cpp's logits at every position.

Writes tests/data/arch_reference.json.
"""
import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile

from llamacpp_build import NativeBuild

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
N_TOKENS = 12
TOP = 20
SEED = 4321


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build_dir", default=os.path.join(ROOT, "build"))
    p.add_argument("--out", default=os.path.join(HERE, "arch_reference.json"))
    args = p.parse_args()

    llama = NativeBuild()
    src = llama.src
    with tempfile.TemporaryDirectory() as tmp:
        tool = os.path.join(tmp, "llamacpp_logits")
        llama.compile_logits_tool(tool)
        writer = os.path.join(args.build_dir, "common/gguf/kvcache-tiny-model")
        paths = subprocess.run([writer, "--out_dir=" + tmp, "--llamacpp_src=" + src], check=True,
                               capture_output=True, text=True).stdout.split()
        models = []
        rng = random.Random(SEED)
        for path in paths:
            name = os.path.basename(path)[: -len(".gguf")]
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            real_vocab = "real_vocab" in name
            # Token ids of the tiny vocabulary's byte and merge tokens (3..322), or
            # of every real vocabulary's first 32,000.
            tokens = [rng.randrange(0, 32000) if real_vocab else rng.randrange(3, 323) for _ in range(N_TOKENS)]
            out = subprocess.run([tool, path, ",".join(map(str, tokens))], check=True, capture_output=True,
                                 text=True).stdout
            ref = json.loads(out)
            entry = {"name": name, "sha256": digest, "tokens": tokens, "n_vocab": ref["n_vocab"]}
            if real_vocab:  # 32k-150k logits a position: keep the top 20 of each
                tops = [sorted(range(len(row)), key=lambda i: -row[i])[:TOP] for row in ref["logits"]]
                entry["top_ids"] = tops
                entry["top_logits"] = [[row[i] for i in top] for row, top in zip(ref["logits"], tops)]
            else:
                entry["logits"] = ref["logits"]
            models.append(entry)
            print(f"{name}: {len(tokens)} tokens, vocab {ref['n_vocab']}", file=sys.stderr)
    doc = {"generator": "tests/data/record_arch_reference.py",
           "llama_cpp": llama.version_line(),
           "llama_cpp_python_sdist": llama.version,
           "models": models}
    with open(args.out, "w") as f:
        json.dump(doc, f)
        f.write("\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
