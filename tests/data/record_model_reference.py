#!/usr/bin/env python3
"""Records reference outputs of llama.cpp and the `gguf` package for the
default model, so that C++ tests can compare against them without Python.

Re-run by anyone (takes about a minute on 2 cores):
    pip install llama-cpp-python gguf numpy        # llama-cpp-python builds llama.cpp
    python3 tests/data/record_model_reference.py [MODEL.gguf]
MODEL defaults to $KVCACHE_MODEL, else
~/.cache/kvcache/models/SmolLM2-135M-Instruct.Q4_1.gguf (scripts/setup.sh puts it there).

Writes, next to this script:
  tokenizer_reference.json  llama.cpp tokenisation (llama_tokenize) of a varied
                            corpus, per-token pieces (llama_token_to_piece) and
                            chat prompts rendered by the GGUF's Jinja template.
  dequant_reference.json    gguf.quants.dequantize of rows of every tensor type
                            in the model file, and of synthetic blocks of the
                            other common types (raw bytes + expected floats).
  llamacpp_greedy.json      for the CPU engine: greedy continuations, first-step
                            top-20 logits and the logits' L2 norm per prompt.
Byte strings are hex; floats are float32 values written exactly.
"""
import ctypes
import hashlib
import importlib.metadata
import json
import os
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT
from gguf import quants

HERE = os.path.dirname(os.path.abspath(__file__))
SEED = 1234


def model_path():
    if len(sys.argv) > 1:
        return sys.argv[1]
    env = os.environ.get("KVCACHE_MODEL")
    if env:
        return env
    return os.path.expanduser("~/.cache/kvcache/models/SmolLM2-135M-Instruct.Q4_1.gguf")


def versions():
    return {p: importlib.metadata.version(p) for p in ("llama-cpp-python", "gguf", "numpy", "jinja2")}


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def floats(a):
    return [float(x) for x in np.asarray(a, dtype=np.float32).ravel()]


# ---------------------------------------------------------------- tokenizer
CORPUS = [
    ("empty", b""),
    ("english", "Hello world! The quick brown fox jumps over the lazy dog.".encode()),
    ("contractions", "I'm sure you're right, they've said it's what we'd do; we'll see. DON'T".encode()),
    ("numbers", "In 2024, 3.14159 and 1,000,000 people paid $12.50 (or 0x1F) each.".encode()),
    ("code_python", b"def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n"),
    ("code_cpp", b"int main() {\n\tstd::vector<int> v{1, 2, 3};\n\tfor (auto& x : v) x *= 2;  // double\n}\n"),
    ("json", b'{"key": [1, 2.5, null], "nested": {"a": "b"}}'),
    ("emoji", "I love pizza \U0001F355\U0001F355 and \U0001F468\u200D\U0001F469\u200D\U0001F467 families \u2764\ufe0f!".encode()),
    ("cjk", "\u4f60\u597d\uff0c\u4e16\u754c\uff01\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3002\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8".encode()),
    ("accents", "Cr\u00e8me br\u00fbl\u00e9e, na\u00efve caf\u00e9, \u0141\u00f3d\u017a, \u00c5ngstr\u00f6m, \u0391\u03b8\u03ae\u03bd\u03b1, \u041c\u043e\u0441\u043a\u0432\u0430".encode()),
    ("arabic_hindi", "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645 \u0968\u0966\u0968\u096a \u0928\u092e\u0938\u094d\u0924\u0947".encode()),
    ("whitespace_runs", b"a  b   c    d\t\te\n\nf \n g\r\n  \n\n\n   end   "),
    ("leading_spaces", b"   leading and trailing   "),
    ("only_spaces", b"     "),
    ("newlines", b"\n\n\n"),
    ("unicode_spaces", "non\u00a0breaking\u2003em\u3000ideographic \u2028line".encode()),
    ("punctuation", b"!!! ??? ... --- ((( ))) @#$%^&*_+=~`|\\ <> [] {} ;:'\""),
    ("apostrophes", b"'s 't 're 've 'm 'll 'd ''' 'x 'S"),
    ("url", b"See https://example.com/path?q=1&r=two#frag or mail@host.org."),
    ("markdown", b"# Title\n\n* item one\n* item **two**\n\n```bash\nls -la\n```\n"),
    ("special_chatml", b"<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"),
    ("special_inline", b"text<|endoftext|>more<|im_end|><repo_name>x<file_sep>"),
    ("special_partial", b"<|im_start <|im_end| <|endoftext|"),
    ("digits_scripts", "\u00bd \u00b2 \u2167 \u0663\u0664 \uff11\uff12 \u2460".encode()),
    ("long_word", b"Pneumonoultramicroscopicsilicovolcanoconiosis antidisestablishmentarianism"),
    ("invalid_utf8", b"ok \xff\xfe bad \xc3 mid \xe2\x82 end"),
    ("control_chars", b"a\x00b\x01c\x7fd\x1be"),
]

CHATS = [
    ("chat_no_system", [{"role": "user", "content": "What is the capital of France?"}]),
    ("chat_with_system", [{"role": "system", "content": "You are a terse assistant."},
                          {"role": "user", "content": "Name three primes."}]),
    ("chat_multi_turn", [{"role": "user", "content": "Hi!"},
                         {"role": "assistant", "content": "Hello! How can I help?"},
                         {"role": "user", "content": "Tell me a joke about cats."}]),
    ("chat_unicode", [{"role": "user", "content": "Translate \u4f60\u597d and \U0001F44B into English."}]),
]


def render_chat(template_text, messages, add_generation_prompt):
    import jinja2
    env = jinja2.Environment(loader=jinja2.BaseLoader())
    return env.from_string(template_text).render(messages=messages,
                                                 add_generation_prompt=add_generation_prompt)


def record_tokenizer(path, reader):
    from llama_cpp import Llama
    import llama_cpp
    llm = Llama(model_path=path, vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)

    def piece(tok, special):
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_token_to_piece(vocab, tok, buf, 256, 0, special)
        assert 0 <= n <= 256, n
        return buf.raw[:n]

    template = bytes(reader.fields["tokenizer.chat_template"].parts[-1]).decode()
    cases = []
    corpus = list(CORPUS)
    chats = []
    for name, messages in CHATS:
        rendered = render_chat(template, messages, True)
        chats.append({"name": name, "messages": messages, "add_generation_prompt": True,
                      "rendered_hex": rendered.encode().hex()})
        corpus.append((name, rendered.encode()))
    # A 2 KB mixed paragraph to exercise longer inputs.
    corpus.append(("mixed_long", b" ".join(t for _, t in CORPUS[1:12]) * 2))
    for name, text in corpus:
        for parse_special in (True, False):
            ids = llm.tokenize(text, add_bos=True, special=parse_special)
            cases.append({
                "name": name,
                "text": text.decode("utf-8", errors="replace"),
                "text_hex": text.hex(),
                "add_special": True,
                "parse_special": parse_special,
                "ids": ids,
                "detok_special_hex": b"".join(piece(t, True) for t in ids).hex(),
                "detok_plain_hex": b"".join(piece(t, False) for t in ids).hex(),
            })
    # Per-token pieces of a spread of ids, including all control tokens.
    n_vocab = llm.n_vocab()
    sample = sorted(set(list(range(0, 300)) + list(range(0, n_vocab, 997)) + [n_vocab - 1]))
    pieces = [{"id": t, "special_hex": piece(t, True).hex(), "plain_hex": piece(t, False).hex()}
              for t in sample]
    return {"bos": llm.token_bos(), "eos": llm.token_eos(), "n_vocab": n_vocab,
            "chat_template": template, "chats": chats, "cases": cases, "pieces": pieces}


# ---------------------------------------------------------------- dequantisation
def record_dequant(reader):
    rows = []
    picks = {
        "token_embd.weight": [0, 1, 17, 1000, 49151],
        "blk.0.attn_q.weight": [0, 575],
        "blk.0.attn_k.weight": [7],
        "blk.29.ffn_down.weight": [3],
        "blk.0.attn_norm.weight": [0],
        "output_norm.weight": [0],
    }
    by_name = {t.name: t for t in reader.tensors}
    for name, row_ids in picks.items():
        t = by_name[name]
        ne0 = int(t.shape[0])
        qtype = QT(int(t.tensor_type))
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        row_bytes = ne0 // block * size
        raw = np.asarray(t.data).view(np.uint8).reshape(-1)
        for r in row_ids:
            chunk = raw[r * row_bytes:(r + 1) * row_bytes]
            vals = quants.dequantize(chunk, qtype)
            rows.append({"tensor": name, "type": qtype.name, "row": r, "n": ne0,
                         "raw_sha256": hashlib.sha256(chunk.tobytes()).hexdigest(),
                         "values": floats(vals)})

    rng = np.random.default_rng(SEED)
    synthetic = []

    def random_f16(n, lo_exp=-12, hi_exp=2):
        mag = np.exp2(rng.uniform(lo_exp, hi_exp, n)) * rng.choice([-1, 1], n)
        return mag.astype(np.float16).view(np.uint16)

    def random_blocks(qtype, n_blocks):
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
        # Overwrite the f16 scale fields with finite values (random bits could
        # be inf/NaN, which is valid input but compares badly).
        f16_fields = {QT.Q4_0: [0], QT.Q4_1: [0, 2], QT.Q5_0: [0], QT.Q5_1: [0, 2],
                      QT.Q8_0: [0], QT.Q4_K: [0, 2], QT.Q5_K: [0, 2], QT.Q6_K: [208]}[qtype]
        for off in f16_fields:
            raw[:, off:off + 2] = random_f16(n_blocks).view(np.uint8).reshape(n_blocks, 2)
        return raw

    def add(qtype, kind, raw):
        raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
        vals = quants.dequantize(raw, qtype)
        synthetic.append({"type": qtype.name, "kind": kind, "n": int(vals.size),
                          "raw_hex": raw.tobytes().hex(), "values": floats(vals)})

    x = (rng.standard_normal(512) * 0.5).astype(np.float32)
    x[7] = 0.0
    x[100] = 3.75
    for qtype in (QT.F16, QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0):
        add(qtype, "quantized", quants.quantize(x.reshape(1, -1), qtype))
    # Raw random bit patterns: all plain f16/bf16 values except inf/NaN.
    bits = rng.integers(0, 1 << 16, 512, dtype=np.uint16)
    f16 = bits[((bits >> 10) & 0x1F) != 0x1F][:256]
    add(QT.F16, "random_bits", f16.view(np.uint8))
    bf16 = bits[((bits >> 7) & 0xFF) != 0xFF][:256]
    add(QT.BF16, "random_bits", bf16.view(np.uint8))
    for qtype in (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0):
        add(qtype, "random_bits", random_blocks(qtype, 8))
    for qtype in (QT.Q4_K, QT.Q5_K, QT.Q6_K):
        add(qtype, "random_bits", random_blocks(qtype, 2))
    return {"model_rows": rows, "synthetic": synthetic}


# ---------------------------------------------------------------- greedy (engine)
GREEDY_PROMPTS = [
    ("chat_capital", "chat", [{"role": "user", "content": "What is the capital of France?"}]),
    ("chat_story", "chat", [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]),
    ("chat_system", "chat", [{"role": "system", "content": "You are a helpful math tutor."},
                             {"role": "user", "content": "Explain what a prime number is."}]),
    ("chat_multi", "chat", [{"role": "user", "content": "Hi!"},
                            {"role": "assistant", "content": "Hello! How can I help you today?"},
                            {"role": "user", "content": "List three fruits and their colors."}]),
    ("raw_text", "raw", "The history of the Roman Empire"),
    ("raw_code", "raw", "def quicksort(arr):\n"),
]


def last_logits(llm):
    # With logits_all=False llama-cpp-python no longer copies logits into
    # llm.scores; read the last position straight from the context.
    n_vocab = llm.n_vocab()
    ptr = llm._ctx.get_logits()  # the batch had logits only for its last token
    return np.ctypeslib.as_array(ptr, shape=(n_vocab,)).astype(np.float32).copy()


def record_greedy(path, template):
    from llama_cpp import Llama
    llm = Llama(model_path=path, n_ctx=2048, logits_all=False, n_threads=2, seed=0,
                verbose=False)
    out = []
    for name, kind, prompt in GREEDY_PROMPTS:
        text = render_chat(template, prompt, True) if kind == "chat" else prompt
        toks = llm.tokenize(text.encode(), add_bos=True, special=True)
        llm.reset()
        llm.eval(toks)
        logits = last_logits(llm)
        top = np.argsort(-logits, kind="stable")[:20]
        first = {"top20_ids": [int(i) for i in top], "top20_logits": floats(logits[top]),
                 "l2_norm": float(np.linalg.norm(logits.astype(np.float64)))}
        gen = []
        margins = []  # top-1 minus top-2 logit at each generated step
        stopped = False
        for _ in range(48):
            nxt = int(np.argmax(logits))
            top2 = np.partition(logits, -2)[-2:]
            margins.append(float(abs(top2[1] - top2[0])))
            gen.append(nxt)
            if llm.token_is_eog(nxt) if hasattr(llm, "token_is_eog") else nxt == llm.token_eos():
                stopped = True
                break
            llm.eval([nxt])
            logits = last_logits(llm)
        out.append({"name": name, "kind": kind, "prompt_text": text, "prompt_ids": toks,
                    "generated_ids": gen, "margins": floats(np.array(margins)),
                    "stopped_at_eog": stopped,
                    "generated_text": llm.detokenize(gen).decode("utf-8", errors="replace"),
                    "first_step": first})
    return out


def main():
    path = model_path()
    if not os.path.exists(path):
        sys.exit(f"model {path} not found: run scripts/setup.sh first")
    reader = gguf.GGUFReader(path)
    meta = {"model": os.path.basename(path), "model_sha256": sha256(path),
            "versions": versions(), "recorder": "tests/data/record_model_reference.py"}

    tok = record_tokenizer(path, reader)
    with open(os.path.join(HERE, "tokenizer_reference.json"), "w") as f:
        json.dump({"meta": meta, **tok}, f, ensure_ascii=True, indent=None)
    deq = record_dequant(reader)
    with open(os.path.join(HERE, "dequant_reference.json"), "w") as f:
        json.dump({"meta": meta, **deq}, f, indent=None)
    greedy = record_greedy(path, tok["chat_template"])
    with open(os.path.join(HERE, "llamacpp_greedy.json"), "w") as f:
        json.dump({"meta": meta, "settings": {"n_ctx": 2048, "n_threads": 2, "seed": 0,
                                              "sampling": "greedy argmax, llama.cpp CPU",
                                              "add_bos": "per vocab (SmolLM2: none)",
                                              "parse_special": True},
                   "prompts": greedy}, f, indent=1)
    for n in ("tokenizer_reference.json", "dequant_reference.json", "llamacpp_greedy.json"):
        print(n, os.path.getsize(os.path.join(HERE, n)), "bytes")


if __name__ == "__main__":
    main()
