#!/usr/bin/env python3
"""Records tests/data/tokenizer_llamacpp_corpus.json: llama.cpp's own
llama_tokenize on a corpus of texts (hand-picked edge cases plus seeded random
mixes of scripts, digits, whitespace, contractions, special-token texts and
invalid UTF-8), for the llama.cpp test vocabularies llama-bpe (Llama 3), qwen2,
llama-spm (Llama 2 / Mistral SentencePiece) and gpt-2, each with
(add_special, parse_special) = (false, false) and (true, true); and
llama_token_to_piece for a sample of ids. llamacpp_corpus_test compares.

Needs the llama.cpp source and static libraries that tests/bench/build_llamacpp.sh
builds (it compiles tests/data/llamacpp_tokenize.cc against them):
  tests/bench/build_llamacpp.sh && python3 tests/data/record_tokenizer_corpus.py
"""
import json
import os
import random
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "tokenizer_llamacpp_corpus.json")
VERSION = "0.3.36"
CACHE = os.environ.get("KVCACHE_CACHE_DIR") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvcache")
SRC = os.path.join(CACHE, "llama.cpp", "src-" + VERSION)
BUILD = os.path.join(CACHE, "llama.cpp", VERSION + "-native")
VOCABS = ["llama-bpe", "qwen2", "llama-spm", "gpt-2"]

EDGE = [
    "", " ", "\n", "\r\n", " \r\n\r\n  x", "a\r\rb", "\t\t tab", "   trailing   ",
    "I'M HE'S THEY'RE WE'VE YOU'LL I'D it'S", "'s 's's ''", "1234567 12 3.14159 ١٢٣ ⅫⅣ ²³",
    "<|begin_of_text|>Hi<|eot_id|>", "<|im_start|>user\nhi<|im_end|>\n", "<s>[INST] q [/INST] a</s>",
    "<unk>x</s>y<s>", "<|endoftext|><|endoftext|>", "<|im_start|><|im_start|>assistant",
    "▁already▁escaped ▁", "fn main() { println!(\"{}\", x + 1); }\n\tif a&&b||c {}",
    "Grüße aus Köln — naïve café ŒŸ", "Ελληνικά Русский язык עברית العربية", "日本語のテキストと漢字123",
    "한국어 텍스트", "हिन्दी पाठ", "ภาษาไทย", "😀😶‍🌫️👩‍👩‍👧 🇫🇷 ✅", "e\u0301 a\u0308 combining",
    "\U00011F04\U00011F05 kawi \U00031350 cjk-h", "\u200b\u200d\ufeff zero width", "\u3000ideographic space",
    "a\u00a0b\u2009c\u202fd", "x\x00y\x1fz", "\U0010FFFD private", "\ufffd replacement",
]

FRAGMENTS = [
    "Hello", " world", "  ", "   ", "\n", "\n\n", "\t", "\r\n", " \n ", "'s", "'T", "'Re", "'ll", "'D",
    "123", "4567890", " 42", "3.0", "1,000", "(x)", "!!!", "...", " --", "?", ";:", "@#$%", "[]{}<>",
    "über", "façade", "mañana", "Straße", "Ωμέγα", "Москва", "שלום", "مرحبا", "中文", "日本", "한국",
    "ไทย", "नमस्ते", "🦙", "🚀", "👍🏽", "<|im_start|>", "<|im_end|>", "<|eot_id|>", "<s>", "</s>",
    "<|start_header_id|>", "[INST]", "<0x41>", "▁", "café", "ｆｕｌｌ", "Ⅻ", "½", "x²", "\u0301",
]

INVALID = [b"\xff", b"\xc3", b"\xe2\x82", b"\xf0\x9f\x98", b"\x80\x80", b"\xed\xa0\x80", b"\xc0\xaf"]


def corpus():
    texts = [t.encode("utf-8") for t in EDGE]
    rng = random.Random(16)
    for i in range(60):
        parts = [rng.choice(FRAGMENTS).encode("utf-8") for _ in range(rng.randint(2, 7))]
        if i % 10 == 9:
            parts.insert(rng.randint(0, len(parts)), rng.choice(INVALID))
        texts.append(b"".join(parts))
    return texts


def build_tool(tmp):
    exe = os.path.join(tmp, "llamacpp_tokenize")
    libs = [os.path.join(BUILD, p) for p in ("src/libllama.a", "ggml/src/libggml.a", "ggml/src/libggml-cpu.a",
                                              "ggml/src/libggml-base.a")]
    for lib in libs:
        if not os.path.exists(lib):
            sys.exit("missing %s: run tests/bench/build_llamacpp.sh first" % lib)
    subprocess.check_call(["g++", "-O1", "-std=c++17", os.path.join(HERE, "llamacpp_tokenize.cc"),
                           "-I" + os.path.join(SRC, "include"), "-I" + os.path.join(SRC, "ggml", "include"),
                           "-o", exe] + libs + ["-fopenmp", "-lpthread", "-ldl"])
    return exe


def main():
    texts = corpus()
    modes = [(0, 0), (1, 1)]
    out = {"llama_cpp": "llama-cpp-python " + VERSION, "texts_hex": [t.hex() for t in texts],
           "modes": [list(m) for m in modes], "vocabs": []}
    with tempfile.TemporaryDirectory() as tmp:
        exe = build_tool(tmp)
        for name in VOCABS:
            vocab = os.path.join(SRC, "models", "ggml-vocab-%s.gguf" % name)
            requests = ["%d %d %s" % (a, p, t.hex()) for t in texts for a, p in modes]
            rng = random.Random(name)
            n_vocab = {"llama-bpe": 128256, "qwen2": 151936, "llama-spm": 32000, "gpt-2": 50257}[name]
            sample = sorted(set(list(range(0, 300, 7)) + [rng.randrange(n_vocab) for _ in range(60)] +
                                list(range(n_vocab - 12, n_vocab))))
            requests.append("pieces " + " ".join(map(str, sample)))
            res = subprocess.run([exe, vocab], input="\n".join(requests) + "\n", capture_output=True, text=True,
                                 check=True).stdout.splitlines()
            ids = [[int(x) for x in line.split()] for line in res[:-1]]
            pieces = [[i] + pair.split(",") for i, pair in zip(sample, res[-1].split())]
            out["vocabs"].append({"name": name, "ids": ids, "pieces": pieces})
    lines = json.dumps(out, separators=(",", ":")).replace("],[", "],\n[")
    with open(OUT, "w") as f:
        f.write(lines + "\n")
    print("wrote %s: %d texts x %d modes x %d vocabularies" % (OUT, len(texts), len(modes), len(VOCABS)))


if __name__ == "__main__":
    main()
