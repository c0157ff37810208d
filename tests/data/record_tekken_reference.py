#!/usr/bin/env python3
"""Records tests/data/tokenizer_tekken_reference.json: llama.cpp's own
llama_tokenize / llama_detokenize with the `tekken` pre-tokenizer (Mistral
Nemo, Mistral Small 3, Pixtral).

No tekken vocabulary ships with llama.cpp, so one is made: every key of
llama.cpp's models/ggml-vocab-llama-bpe.gguf (byte-level BPE, 128256 tokens,
its merges) with tokenizer.ggml.pre = "tekken". llama.cpp then applies its
tekken rules (split regex, ignore_merges, add_bos, clean_spaces = false) with
those merges; llamacpp_tekken_test builds the same file from the same source
with the project's GGUF writer and compares.

The corpus is record_tokenizer_corpus.py's plus texts aimed at where tekken's
regex differs from Llama 3's: no contraction rule, upper/lower-case runs,
single digits, a [\\r\\n/]* tail after punctuation, non-ASCII letters, marks,
and random strings over one character of each class the regex tells apart.
Each text is tokenised with (add_special, parse_special) = (0, 0) and (1, 1); the
(1, 1) ids are detokenised with (remove_special, unparse_special) = (0, 1) and
the (0, 0) ids with (0, 0).

Needs the llama.cpp source and static libraries that tests/bench/build_llamacpp.sh
builds (it compiles tests/data/llamacpp_tokenize.cc against them):
  tests/bench/build_llamacpp.sh && python3 tests/data/record_tekken_reference.py
"""
import json
import os
import random
import struct
import subprocess
import tempfile

import record_tokenizer_corpus as corpus_lib

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "tokenizer_tekken_reference.json")
SOURCE_VOCAB = "llama-bpe"

TEKKEN_EDGE = [
    "don't I'm we'll THEY'RE it's O'Neil's rock'n'roll 'tis y'all", "'s 'S' ''x '1",
    "HelloWorld iPhone HTTPServer XMLHttpRequest McDonald camelCaseVar snake_case SCREAMING_CASE",
    "ÉCOLE École ÀB aÉb AÉB ÜBER über Straße STRASSE ÆØÅ æøå", "ΑΘΗΝΑ Αθήνα ΑθΗνΑ МОСКВА Москва МоСкВа",
    "ǅemal ǈj ǋ Ǆ ʰʲˢ ᵃᵇ ﬁﬂ", "日本語ABCdef中文xyzΩ カタカナABC", "A\u0301BC e\u0301\u0301a \u0301start x\u0308Y",
    "1234567890 3.14159 1,000,000 ２０２４ ٣٤٥ 12ab34 x1y2 v2.0.1 0x1F", "👍🏽Great 🚀launch 😀😀😀 🇫🇷France ❤️Love",
    "  leading", "trailing  ", "   ", "a  b   c    d", "\t\tindent\n\t\tmore", "word \t\n next", " \n \n x",
    "line1\nline2\r\n\r\nline3\n\n\n", "end.\n\n", "slash/\n/path", "http://example.com/a/b?c=d&e=f#g",
    "a//b ///c .//\n//", "// comment\n/* block */\n", "x /\ny", "!?/\r\n/\r\nz", "../../etc/passwd",
    "def foo(x):\n    return x**2  # square\n", "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
    "<div class=\"x\">Hi</div>", "SELECT * FROM t WHERE id=42;", "#include <vector>\nstd::vector<int> v;",
    "The QUICK brown FOX's 2nd jump—over 3 lazy dogs!!!", "a\u00a0B\u3000C\u2028D\x85E\u2009f",
    "€100 £5 ¥ →← «quoted» „so“ ‹x›", "\r\rb", "\r\n \r\n", "<|begin_of_text|>Hello<|eot_id|>World",
    "<|start_header_id|>user<|end_header_id|>\n\nHi there!<|eot_id|>", "[INST] What's up? [/INST]",
    "2024", "don't", "iPhone", "XMLHttpRequest", "AÉB", "NACIÓN", ".\n/x",
    # Words that are tokens the merges do not reach (ignore_merges emits them whole).
    "Về việc hợp tác nhiều điều Việt ngoài nhiên biệt nhiệm nhanh",
    "jeho každ zdrav даже характ практи культу використ ایران değiş ulaş oluştur",
]

TEKKEN_FRAGMENTS = [
    "ABC", "aBc", "Abc", "abC", "É", "ÉCOLE", "école", "Ω", "ω", "ǅ", "ʰ", "ﬁ", "中", "カ", "/", "//", "\n/",
    " /", "/\n", " ", "  ", "\n", "\r\n", "\t", "'s", "'T", "n't", "McD", "2024", "7", " 42", "¹²", "Ⅻ", "🙂",
    "👍🏽", "\u0301", "e\u0301", "?!", " ...", "-", "_", "x_y", "(", ")", "\"", "<|eot_id|>", "—", "\u00a0",
]


# Single characters of every class the regex tells apart: ASCII upper and
# lower case, non-ASCII upper / lower / title / modifier / other letters, a
# mark, digits, whitespace (ASCII and not), \r \n, '/', other punctuation.
TEKKEN_CHARS = "aBzQ" + "ÉéΩωǅʰ中" + "\u0301" + "19٣" + " \t\u00a0" + "\r\n" + "/" + ".'_-(" + "🙂"


def tekken_texts():
    texts = [t.encode("utf-8") for t in TEKKEN_EDGE]
    rng = random.Random("tekken")
    for i in range(50):
        parts = [rng.choice(TEKKEN_FRAGMENTS).encode("utf-8") for _ in range(rng.randint(2, 8))]
        if i % 10 == 9:
            parts.insert(rng.randint(0, len(parts)), rng.choice(corpus_lib.INVALID))
        texts.append(b"".join(parts))
    for _ in range(60):
        texts.append("".join(rng.choice(TEKKEN_CHARS) for _ in range(rng.randint(4, 24))).encode("utf-8"))
    return texts


def _skip_value(data, off, vtype):
    """Offset just past a GGUF value of type vtype at off."""
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    if vtype in sizes:
        return off + sizes[vtype]
    if vtype == 8:
        (n,) = struct.unpack_from("<Q", data, off)
        return off + 8 + n
    if vtype == 9:
        etype, n = struct.unpack_from("<IQ", data, off)
        off += 12
        if etype in sizes:
            return off + n * sizes[etype]
        for _ in range(n):
            off = _skip_value(data, off, etype)
        return off
    raise ValueError("unknown GGUF value type %d" % vtype)


def write_tekken_vocab(src, dst):
    """Copies the vocabulary-only GGUF src to dst with tokenizer.ggml.pre = "tekken"."""
    with open(src, "rb") as f:
        data = f.read()
    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", data, 0)
    if magic != b"GGUF" or version != 3 or n_tensors != 0:
        raise ValueError("%s: expected a GGUF v3 file without tensors" % src)
    out = bytearray(data[:24])
    off = 24
    replaced = False
    for _ in range(n_kv):
        start = off
        (klen,) = struct.unpack_from("<Q", data, off)
        key = data[off + 8:off + 8 + klen].decode()
        (vtype,) = struct.unpack_from("<I", data, off + 8 + klen)
        off = _skip_value(data, off + 12 + klen, vtype)
        if key == "tokenizer.ggml.pre":
            assert vtype == 8
            out += data[start:start + 12 + klen] + struct.pack("<Q", 6) + b"tekken"
            replaced = True
        else:
            out += data[start:off]
    if not replaced:
        raise ValueError("%s has no tokenizer.ggml.pre" % src)
    out += b"\0" * (-len(out) % 32)  # data section alignment (no tensors follow)
    with open(dst, "wb") as f:
        f.write(out)


def main():
    texts = corpus_lib.corpus() + tekken_texts()
    modes = [(0, 0), (1, 1)]  # as record_tokenizer_corpus.py; BOS is the only difference the other two make
    with tempfile.TemporaryDirectory() as tmp:
        exe = corpus_lib.build_tool(tmp)
        vocab = os.path.join(tmp, "ggml-vocab-tekken.gguf")
        write_tekken_vocab(os.path.join(corpus_lib.SRC, "models", "ggml-vocab-%s.gguf" % SOURCE_VOCAB), vocab)

        def run(requests):
            return subprocess.run([exe, vocab], input="\n".join(requests) + "\n", capture_output=True, text=True,
                                  check=True).stdout.splitlines()

        res = run(["%d %d %s" % (a, p, t.hex()) for t in texts for a, p in modes])
        ids = [[int(x) for x in line.split()] for line in res]
        assert len(ids) == len(texts) * len(modes)
        requests = []
        for i in range(len(texts)):
            special = ids[i * len(modes) + modes.index((1, 1))]
            plain = ids[i * len(modes) + modes.index((0, 0))]
            requests += ["detok 0 1 " + " ".join(map(str, special)), "detok 0 0 " + " ".join(map(str, plain))]
        res = run(requests)
        assert len(res) == 2 * len(texts)
        detok = [res[2 * i:2 * i + 2] for i in range(len(texts))]
        rng = random.Random("tekken-pieces")
        sample = sorted(set(list(range(0, 300, 11)) + [rng.randrange(128256) for _ in range(40)] +
                            list(range(128000, 128012))))
        pieces = [[i] + pair.split(",") for i, pair in zip(sample, run(["pieces " + " ".join(map(str, sample))])[0].split())]
    out = {
        "llama_cpp": "llama-cpp-python " + corpus_lib.VERSION,
        "vocab": {"source": "models/ggml-vocab-%s.gguf" % SOURCE_VOCAB, "tokenizer.ggml.pre": "tekken",
                  "n_tokens": 128256, "bos_token_id": 128000},
        "texts_hex": [t.hex() for t in texts],
        "modes": [list(m) for m in modes],
        "ids": ids,
        "detok_hex": detok,
        "pieces": pieces,
    }
    lines = json.dumps(out, separators=(",", ":")).replace("],[", "],\n[")
    with open(OUT, "w") as f:
        f.write(lines + "\n")
    print("wrote %s: %d texts x %d modes" % (OUT, len(texts), len(modes)))


if __name__ == "__main__":
    main()
