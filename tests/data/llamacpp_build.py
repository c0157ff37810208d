"""Shared by the recorders that run llama.cpp itself (record_arch_reference.py,
record_requant_reference.py): the native llama.cpp build of
tests/bench/build_llamacpp.sh, tests/data/llamacpp_logits.cc compiled against
it, and its version line."""
import os
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
LIBS = ["src/libllama.a", "ggml/src/libggml.a", "ggml/src/libggml-cpu.a", "ggml/src/libggml-base.a"]


class NativeBuild:
    """build_llamacpp.sh native (built once, cached): bin_dir, build, src, version."""

    def __init__(self):
        self.bin_dir = subprocess.run([os.path.join(ROOT, "tests/bench/build_llamacpp.sh"), "native"], check=True,
                                      capture_output=True, text=True).stdout.strip().splitlines()[-1]
        self.build = os.path.dirname(self.bin_dir)
        self.version = os.path.basename(self.build).split("-")[0]  # the llama-cpp-python sdist's
        self.src = os.path.join(os.path.dirname(self.build), "src-" + self.version)

    def compile_logits_tool(self, out):
        """Compiles tests/data/llamacpp_logits.cc into `out`."""
        subprocess.run(["g++", "-O2", "-std=c++17", os.path.join(HERE, "llamacpp_logits.cc"),
                        "-I" + os.path.join(self.src, "include"), "-I" + os.path.join(self.src, "ggml/include"),
                        "-o", out] + [os.path.join(self.build, lib) for lib in LIBS]
                       + ["-fopenmp", "-lpthread", "-ldl"], check=True)

    def version_line(self):
        """llama-server --version's first line ("" when it prints nothing)."""
        info = subprocess.run([os.path.join(self.bin_dir, "llama-server"), "--version"], capture_output=True,
                              text=True)
        text = (info.stdout + info.stderr).strip()
        return text.splitlines()[0] if text else ""
