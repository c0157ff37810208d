#!/usr/bin/env python3
"""Records what llama.cpp's own quantiser and forward pass make of the default
model (SmolLM2-135M-Instruct, Q4_1) re-quantised to the types users deploy, so
that tests/worker/model/requantized_reference_test.cc checks our kernels on
Q4_K_M, Q6_K, Q4_0 and Q8_0 weights without llama.cpp at test time.

Re-run by anyone (about a minute once llama.cpp is built):
    pip install gguf numpy
    python3 tests/data/record_requant_reference.py [MODEL.gguf]
It builds llama.cpp with tests/bench/build_llamacpp.sh (native flavour, the
source the llama-cpp-python sdist vendors), re-quantises MODEL with
`llama-quantize --allow-requantize MODEL OUT TYPE`, compiles
tests/data/llamacpp_logits.cc against it, and records per type:
  tensors  every tensor's type and the first 16 hex digits of the SHA-256 of
           its bytes (the test re-quantises with kvcache-llamacpp-requantize,
           llama.cpp's quantiser code, and checks its file against these);
  prompts  for the prompts of llamacpp_greedy.json (same token ids): llama.cpp's
           48-token greedy continuation, the top-1 minus top-2 logit of every
           step, and the first step's top-20 logits.
Writes tests/data/requant_reference.json.
"""
import hashlib
import json
import os
import subprocess
import sys
import tempfile

import gguf
from llamacpp_build import NativeBuild

HERE = os.path.dirname(os.path.abspath(__file__))
TYPES = ["Q4_K_M", "Q6_K", "Q4_0", "Q8_0"]
GREEDY_TOKENS = 48


def model_path():
    if len(sys.argv) > 1:
        return sys.argv[1]
    return os.environ.get("KVCACHE_MODEL") or os.path.expanduser(
        "~/.cache/kvcache/models/SmolLM2-135M-Instruct.Q4_1.gguf")


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main():
    model = model_path()
    llama = NativeBuild()
    prompts = json.load(open(os.path.join(HERE, "llamacpp_greedy.json")))["prompts"]
    models = []
    with tempfile.TemporaryDirectory() as tmp:
        tool = os.path.join(tmp, "llamacpp_logits")
        llama.compile_logits_tool(tool)
        for qtype in TYPES:
            path = os.path.join(tmp, qtype + ".gguf")
            subprocess.run([os.path.join(llama.bin_dir, "llama-quantize"), "--allow-requantize", model, path, qtype, "2"],
                           check=True, capture_output=True)
            tensors = {t.name: [t.tensor_type.name, hashlib.sha256(t.data.tobytes()).hexdigest()[:16]]
                       for t in gguf.GGUFReader(path).tensors}
            recorded = []
            for p in prompts:
                out = subprocess.run([tool, "--greedy", str(GREEDY_TOKENS), path, ",".join(map(str, p["prompt_ids"]))],
                                     check=True, capture_output=True, text=True).stdout
                g = json.loads(out)
                recorded.append({"name": p["name"], "prompt_ids": p["prompt_ids"],
                                 "generated_ids": g["generated_ids"], "margins": g["margins"],
                                 "stopped_at_eog": g["stopped_at_eog"],
                                 "first_step": {"top20_ids": g["top20_ids"], "top20_logits": g["top20_logits"]}})
            models.append({"type": qtype, "tensors": tensors, "prompts": recorded})
            print(f"{qtype}: {len(tensors)} tensors, {len(recorded)} prompts", file=sys.stderr)
    doc = {"generator": "tests/data/record_requant_reference.py",
           "llama_cpp": llama.version_line(),
           "llama_cpp_python_sdist": llama.version,
           "source_model": os.path.basename(model), "source_sha256": sha256_file(model),
           "settings": "llama.cpp CPU, 1 thread, f16 KV cache, no flash attention, no weight repacking; "
                       "the prompt in one batch, then one token a step",
           "models": models}
    out = os.path.join(HERE, "requant_reference.json")
    with open(out, "w") as f:
        json.dump(doc, f)
        f.write("\n")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
