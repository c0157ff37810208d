#!/usr/bin/env python3
"""Renders a fixed set of conversations with Python's jinja2 through the real
chat template strings in tests/data/chat_templates/*.jinja and writes
tests/data/chat_template_reference.json, which chat_template_test compares the
C++ renderers against.

The environment is the one Hugging Face transformers' apply_chat_template uses:
ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True), the
loopcontrols extension, raise_exception() and a tojson filter. strftime_now is
NOT defined, so templates that fall back to a fixed date when it is missing
(Llama 3.2: "26 Jul 2024") render deterministically; tools, enable_thinking
and date_string are never passed.

Usage:
  python3 tests/data/record_chat_template_reference.py          # rewrite the JSON
  python3 tests/data/record_chat_template_reference.py --check  # exit 1 if it differs
"""
import json
import os
import sys

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

HERE = os.path.dirname(os.path.abspath(__file__))
TEMPLATES = os.path.join(HERE, "chat_templates")
OUT = os.path.join(HERE, "chat_template_reference.json")

# name -> (template file, bos_token, eos_token): the token texts of the
# vocabulary each family ships.
TEMPLATE_FILES = {
    "smollm2": ("smollm2-135m-instruct.jinja", "<|im_start|>", "<|im_end|>"),
    "qwen2-vocab": ("qwen2-vocab-gguf.jinja", "<|endoftext|>", "<|endoftext|>"),
    "qwen2.5": ("qwen2.5-7b-instruct.jinja", "<|endoftext|>", "<|im_end|>"),
    "qwen3": ("qwen3-0.6b.jinja", "<|endoftext|>", "<|im_end|>"),
    "llama-3": ("meta-llama-3-8b-instruct.jinja", "<|begin_of_text|>", "<|eot_id|>"),
    "llama-3-llamacpp-test": ("llama-3-llamacpp-test.jinja", "<|begin_of_text|>", "<|eot_id|>"),
    "llama-3.1": ("llama-3.1-8b-instruct.jinja", "<|begin_of_text|>", "<|eot_id|>"),
    "llama-3.2": ("llama-3.2-3b-instruct.jinja", "<|begin_of_text|>", "<|eot_id|>"),
    "mistral-v0": ("mistral-7b-instruct-v0.2-pre-v1.jinja", "<s>", "</s>"),
    "mistral-v1": ("mistral-v1.jinja", "<s>", "</s>"),
    "mistral-v3": ("mistral-large-instruct-2407-v3.jinja", "<s>", "</s>"),
    "mistral-v3-tekken": ("mistral-nemo-instruct-2407.jinja", "<s>", "</s>"),
    "mistral-v7": ("mistral-large-instruct-2411-v7.jinja", "<s>", "</s>"),
}


def m(role, content):
    return {"role": role, "content": content}


CONVERSATIONS = [
    ("one user", [m("user", "Hello")]),
    ("system and turns", [m("system", "You are terse."), m("user", "Hi"),
                          m("assistant", "Hello! How can I help?"), m("user", "What is 2+2?")]),
    ("padded content", [m("user", "  padded question \n"), m("assistant", "  reply with spaces  "),
                        m("user", "\tnext\n")]),
    ("system then user", [m("system", "  S  "), m("user", "U")]),
    ("system last user", [m("system", "Sys"), m("user", "a"), m("assistant", "b"), m("user", "c")]),
    ("system ends on assistant", [m("system", "Sys"), m("user", "a"), m("assistant", "b")]),
    ("two users", [m("user", "u1"), m("user", "u2")]),
    ("assistant first", [m("assistant", "first"), m("user", "then")]),
    ("mid system", [m("user", "a"), m("assistant", "b"), m("system", "new rules"), m("user", "c")]),
    ("system only", [m("system", "Only a system prompt")]),
    ("unicode and markers", [m("user", "Gr\u00fc\u00dfe \U0001f999 <|im_start|> [INST] <s>"),
                             m("assistant", "\u00e7a va\n\nline two")]),
    ("thinking history", [m("user", "q1"), m("assistant", "<think>\nreasoning one\n</think>\n\nanswer one"),
                          m("user", "q2"), m("assistant", "<think>r2</think>a2")]),
    ("thinking last", [m("user", "q1"), m("assistant", "<think>\nonly reasoning\n</think>\n\n\nfinal")]),
    ("empty content", [m("user", ""), m("assistant", ""), m("user", " ")]),
]


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def make_env():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env


def render_all():
    env = make_env()
    out = {"templates": []}
    conversations = [{"name": label, "messages": messages} for label, messages in CONVERSATIONS]
    for name, (fname, bos, eos) in TEMPLATE_FILES.items():
        with open(os.path.join(TEMPLATES, fname), encoding="utf-8") as f:
            source = f.read()
        tmpl = env.from_string(source)
        cases = []
        for index, (label, messages) in enumerate(CONVERSATIONS):
            for gen in (True, False):
                case = {"conversation": index, "add_generation_prompt": gen}
                try:
                    case["text"] = tmpl.render(messages=messages, add_generation_prompt=gen,
                                               bos_token=bos, eos_token=eos)
                except jinja2.exceptions.TemplateError as e:
                    case["error"] = str(e)
                cases.append(case)
        out["templates"].append({"name": name, "file": fname, "bos_token": bos, "eos_token": eos,
                                 "cases": cases})
    # One case per line keeps the file small and its diffs readable.
    lines = []
    for t in out["templates"]:
        head = {k: v for k, v in t.items() if k != "cases"}
        lines.append(json.dumps(head, ensure_ascii=False, sort_keys=True)[:-1] + ', "cases": [')
        lines.append(",\n".join(json.dumps(c, ensure_ascii=False, sort_keys=True) for c in t["cases"]))
        lines.append("]}")
    body = ",\n".join("\n".join(lines[i:i + 3]) for i in range(0, len(lines), 3))
    convs = ",\n".join(json.dumps(c, ensure_ascii=False, sort_keys=True) for c in conversations)
    return '{"conversations": [\n' + convs + '\n],\n"templates": [\n' + body + "\n]}\n"


def main():
    text = render_all()
    if "--check" in sys.argv[1:]:
        with open(OUT, encoding="utf-8") as f:
            if f.read() != text:
                print("chat_template_reference.json differs from a fresh jinja2 rendering; "
                      "rerun tests/data/record_chat_template_reference.py", file=sys.stderr)
                return 1
        print("chat_template_reference.json matches jinja2 %s" % jinja2.__version__)
        return 0
    with open(OUT, "w", encoding="utf-8") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
