#!/usr/bin/env python3
"""Multi-round QA load benchmark (issue #10), after vLLM production-stack's and
LMCache's multi-round QA.

Workload: --users conversations of --rounds rounds each. Every conversation starts
with the same system prompt (about --system_tokens tokens), then the user's own
notes (about --user_context_tokens tokens, as LMCache's benchmark gives each user a
private document), and grows its own history: each round adds a user question of --question_tokens MIN,MAX tokens and
the answer (--answer_tokens, greedy, generation past EOS). New users arrive at
--qps (one every 1/qps seconds); a user sends its next round as soon as its
previous answer ends plus --think_time. Requests are FULL_CONTEXT: the client
resends the whole history every round, as OpenAI-style clients do, so the server
has to find the cached prefix itself (the session id is a hint for placement).

Targets: a kvcache router (--target=router, default) or one worker
(--target=worker) over gRPC, or an OpenAI-compatible HTTP server (--openai_url,
e.g. llama-cpp-python's `python3 -m llama_cpp.server`) for a baseline. A
kvcache router's own HTTP API (--http_listen) is such a server too:
`--openai_url=http://HOST:PORT/v1 --openai_ignore_eos` (the session id goes in
`user`, its affinity key), so kvcache and llama.cpp can be measured on the same
client path.

Metrics (all client-measured unless noted):
  ttft      time to first token: request sent -> first token received
  itl       inter-token latency: gap between consecutive streamed tokens
  e2e       request sent -> stream finished
  request_throughput_per_s = completed requests / run wall time
  output_tokens_per_s      = generated tokens / run wall time
  cache_hit_ratio          = sum(usage.cached_tokens) / sum(usage.prompt_tokens)
                             (server-reported; n/a when the server reports none)
  errors                   requests that failed (incomplete: cut by --duration)

Output: a text table on stdout, a progress line on stderr, and with --json PATH
{"benchmark", "metrics", "baseline", "ratio", "notes", "machine"} as every
kvcache benchmark writes (common/bench_json.h). `--combine` merges the per-mode
files of tests/bench/multi_round_qa.sh into one report with ratios.

Needs grpcio and grpcio-tools (gRPC targets): stubs are generated from proto/ at
start into a temporary folder.
"""

import argparse
import json
import os
import platform
import random
import shutil
import socket
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PROTO_DIR = os.path.join(HERE, "..", "..", "proto")

# Common English words: SmolLM2's tokenizer encodes each (with its leading space)
# as about one token, so N words make a prompt of about N tokens.
WORDS = """time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government number night
point home water room mother area money story fact month lot right study book eye job word business issue
side kind head house service friend father power hour game line end member law car city community name
president team minute idea kid body information back parent face others level office door health person
art war history party result change morning reason research girl guy moment air teacher force education
foot boy age policy music market sense nation plan college interest death experience effect use class
control care field development role effort rate heart drug show leader light voice wife police mind price
report decision son view relationship town road arm difference value building action model season society
tax director position player record paper space ground form event official matter center couple site
project activity star table need court oil situation cost industry figure street image phone data picture
practice piece land product doctor wall patient worker news test movie north love support technology step
baby computer type attention film tree source organization hair window evidence population site river
garden bridge mountain island forest ocean valley desert village castle harbor station library museum""".split()


def words(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def percentile(values, p):
    """Nearest-rank percentile (p in [0, 100]); None for no values."""
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(round(p / 100.0 * len(s) + 0.5)) - 1))
    return s[k]


class Result:
    __slots__ = ("user", "round", "ok", "incomplete", "error", "ttft", "itls", "e2e", "generated", "prompt",
                 "cached", "server_ttft", "worker", "sent")

    def __init__(self, user, rnd):
        self.user, self.round = user, rnd
        self.ok, self.incomplete, self.error = False, False, None
        self.ttft, self.itls, self.e2e, self.generated = None, [], None, 0
        self.prompt = self.cached = self.server_ttft = None
        self.worker = None
        self.sent = None  # seconds after the run started


# ----------------------------------------------------------------------------- gRPC

def load_stubs(proto_dir, stubs_dir):
    from grpc_tools import protoc
    well_known = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    rc = protoc.main(["grpc_tools.protoc", f"-I{proto_dir}", f"-I{well_known}", f"--python_out={stubs_dir}",
                      f"--grpc_python_out={stubs_dir}", "kvcache/v1/common.proto", "kvcache/v1/worker.proto",
                      "kvcache/v1/router.proto"])
    if rc != 0:
        raise RuntimeError(f"protoc failed on {proto_dir}")
    sys.path.insert(0, stubs_dir)
    from kvcache.v1 import common_pb2, router_pb2_grpc, worker_pb2_grpc
    return common_pb2, router_pb2_grpc, worker_pb2_grpc


class GrpcClient:
    def __init__(self, args, stubs_dir):
        import grpc
        self.grpc = grpc
        self.pb, router_grpc, worker_grpc = load_stubs(args.proto_dir, stubs_dir)
        if args.tls_ca:
            with open(args.tls_ca, "rb") as f:
                creds = grpc.ssl_channel_credentials(root_certificates=f.read())
            self.channel = grpc.secure_channel(args.address, creds)
        else:
            self.channel = grpc.insecure_channel(args.address)
        try:
            grpc.channel_ready_future(self.channel).result(timeout=10)
        except grpc.FutureTimeoutError:
            # Exit code 2, as kvcache-cli's other subcommands answer an unreachable server.
            print(f"multi_round_qa.py: cannot reach {args.target} at {args.address}", file=sys.stderr)
            sys.exit(2)
        self.wait_ready(args.address)
        self.stub = (router_grpc.KvCacheStub(self.channel) if args.target == "router"
                     else worker_grpc.WorkerStub(self.channel))
        self.metadata = [("authorization", f"Bearer {args.token}")] if args.token else []
        self.answer_tokens = args.answer_tokens

    def wait_ready(self, address, timeout=60.0):
        """Waits for grpc.health.v1 `readiness` SERVING (a router is ready once it
        has healthy workers). The messages are encoded by hand: health.proto's
        package `grpc` clashes with grpcio's module name."""
        check = self.channel.unary_unary("/grpc.health.v1.Health/Check")
        request = b"\x0a\x09readiness"  # HealthCheckRequest{service: "readiness"}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if check(request, timeout=5) == b"\x08\x01":  # {status: SERVING}
                    return
            except self.grpc.RpcError:
                pass
            time.sleep(0.1)  # an external process's readiness: no event to wait on
        sys.exit(f"multi_round_qa.py: {address} not ready within {timeout:.0f}s")

    def run(self, session_id, messages, timeout, res):
        pb = self.pb
        req = pb.GenerateRequest(
            session_id=session_id, mode=pb.FULL_CONTEXT,
            input=pb.Input(chat=pb.ChatMessages(messages=[pb.ChatMessage(role=r, content=c) for r, c in messages])),
            sampling=pb.SamplingParams(max_tokens=self.answer_tokens, ignore_eos=True))
        text = []
        start = time.perf_counter()
        last = None
        try:
            for msg in self.stub.Generate(req, metadata=self.metadata, timeout=timeout):
                now = time.perf_counter()
                if msg.HasField("token"):
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itls.append(now - last)
                    last = now
                    res.generated += 1
                    text.append(msg.token.text)
                elif msg.HasField("final"):
                    u = msg.final.usage
                    res.prompt, res.cached = u.prompt_tokens, u.cached_tokens
                    res.server_ttft = u.time_to_first_token_us / 1e6
                    res.worker = msg.final.worker_id
            res.e2e = time.perf_counter() - start
            res.ok = True
        except self.grpc.RpcError as e:
            res.error = f"{e.code().name}: {e.details()}"
            res.incomplete = e.code() == self.grpc.StatusCode.DEADLINE_EXCEEDED
        return "".join(text)


# ----------------------------------------------------------------------------- OpenAI HTTP

class OpenAiClient:
    """Streams /v1/chat/completions (Server-Sent Events)."""

    def __init__(self, args):
        self.url = args.openai_url.rstrip("/") + "/chat/completions"
        self.model = args.openai_model
        self.answer_tokens = args.answer_tokens
        # No ignore_eos in the OpenAI API: ban the end tokens instead, so every
        # answer has --answer_tokens tokens as on the gRPC targets.
        self.logit_bias = {str(t): -100 for t in args.openai_ban_tokens}
        # vLLM's extension, which kvcache's HTTP API takes too (it refuses logit_bias).
        self.ignore_eos = args.openai_ignore_eos
        self.token = args.token

    def run(self, session_id, messages, timeout, res):
        body = {"model": self.model, "messages": [{"role": r, "content": c} for r, c in messages],
                "max_tokens": self.answer_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "user": session_id}
        if self.ignore_eos:
            body["ignore_eos"] = True
        else:
            body.update({"logit_bias": self.logit_bias, "logit_bias_type": "input_ids"})
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=headers)
        text = []
        start = time.perf_counter()
        last = None
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                for raw in resp:
                    line = raw.decode("utf-8", "replace").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    now = time.perf_counter()
                    usage = chunk.get("usage")
                    if usage:
                        res.prompt = usage.get("prompt_tokens")
                        details = usage.get("prompt_tokens_details") or {}
                        if "cached_tokens" in details:
                            res.cached = details["cached_tokens"]
                    for choice in chunk.get("choices", []):
                        piece = (choice.get("delta") or {}).get("content")
                        if piece is None:
                            continue
                        if last is None:
                            res.ttft = now - start
                        else:
                            res.itls.append(now - last)
                        last = now
                        res.generated += 1
                        text.append(piece)
            res.e2e = time.perf_counter() - start
            res.ok = True
        except (urllib.error.URLError, OSError, ValueError) as e:
            res.error = f"{type(e).__name__}: {e}"
            res.incomplete = isinstance(e, socket.timeout) or "timed out" in str(e)
        return "".join(text)


# ----------------------------------------------------------------------------- load

class Run:
    def __init__(self, args, client):
        self.args, self.client = args, client
        rng = random.Random(args.seed)
        self.system = ("You are a helpful assistant answering questions about the following notes. " +
                       words(rng, args.system_tokens))
        qmin, qmax = args.question_tokens
        # Every user's questions are fixed up front: the same workload in every mode.
        self.questions = [[f"Question {r + 1}: " + words(rng, rng.randint(qmin, qmax)) + "?"
                           for r in range(args.rounds)] for _ in range(args.users)]
        # Each user's private notes open its first question.
        for qs in self.questions:
            if args.user_context_tokens > 0 and qs:
                qs[0] = "My notes: " + words(rng, args.user_context_tokens) + "\n" + qs[0]
        self.results = []
        self.lock = threading.Lock()
        self.started_users = 0
        self.finished_users = 0
        self.stop_at = None
        self.run_id = f"{os.getpid():x}{int(time.time()) & 0xffff:04x}"

    def user(self, u):
        history = [("system", self.system)]
        for r in range(self.args.rounds):
            left = self.stop_at - time.monotonic()
            if left <= 0:
                break
            history.append(("user", self.questions[u][r]))
            res = Result(u, r)
            res.sent = time.monotonic() - self.t0
            answer = self.client.run(f"mrqa-{self.run_id}-u{u}", history, min(self.args.timeout, left), res)
            with self.lock:
                self.results.append(res)
            if not res.ok:
                break  # a failed conversation stops: its history is unknown
            history.append(("assistant", answer))
            if self.args.think_time > 0:
                time.sleep(self.args.think_time)
        with self.lock:
            self.finished_users += 1

    def progress(self, done, label):
        interactive = sys.stderr.isatty()
        total = self.args.users * self.args.rounds
        last_print = 0.0
        while True:
            finished = done.wait(0.5)
            with self.lock:
                n = len(self.results)
                errors = sum(1 for r in self.results if not r.ok and not r.incomplete)
                started, finished_users = self.started_users, self.finished_users
            elapsed = time.monotonic() - self.t0
            line = (f"[{label}] {elapsed:6.1f}s users {started}/{self.args.users} started "
                    f"{finished_users} done | requests {n}/{total} | errors {errors}")
            if interactive:
                sys.stderr.write("\r" + line + "\033[K")
                sys.stderr.flush()
            elif finished or elapsed - last_print >= 10:
                sys.stderr.write(line + "\n")
                last_print = elapsed
            if finished:
                if interactive:
                    sys.stderr.write("\n")
                return

    def go(self):
        self.t0 = time.monotonic()
        self.stop_at = self.t0 + self.args.duration
        done = threading.Event()
        prog = threading.Thread(target=self.progress, args=(done, self.args.label), daemon=True)
        prog.start()
        threads = []
        interval = 1.0 / self.args.qps if self.args.qps > 0 else 0.0
        for u in range(self.args.users):
            delay = self.t0 + u * interval - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            if time.monotonic() >= self.stop_at:
                break
            t = threading.Thread(target=self.user, args=(u,), daemon=True)
            t.start()
            threads.append(t)
            with self.lock:
                self.started_users += 1
        for t in threads:
            t.join()
        self.wall = time.monotonic() - self.t0
        done.set()
        prog.join()


def summarize(run, grpc_target):
    rs = run.results
    ok = [r for r in rs if r.ok]
    ms = lambda v: None if v is None else v * 1000.0  # noqa: E731
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [x for r in ok for x in r.itls]
    e2e = [r.e2e for r in ok]
    m = {
        "requests": len(ok),
        "errors": sum(1 for r in rs if not r.ok and not r.incomplete),
        "incomplete": sum(1 for r in rs if not r.ok and r.incomplete),
        "users": run.args.users,
        "rounds": run.args.rounds,
        "wall_s": run.wall,
        "ttft_p50_ms": ms(percentile(ttft, 50)),
        "ttft_p90_ms": ms(percentile(ttft, 90)),
        "ttft_p99_ms": ms(percentile(ttft, 99)),
        "itl_p50_ms": ms(percentile(itl, 50)),
        "itl_p99_ms": ms(percentile(itl, 99)),
        "itl_p99_over_p50": (percentile(itl, 99) / percentile(itl, 50)) if itl and percentile(itl, 50) else None,
        "e2e_p50_ms": ms(percentile(e2e, 50)),
        "e2e_p99_ms": ms(percentile(e2e, 99)),
        "request_throughput_per_s": len(ok) / run.wall if run.wall > 0 else 0.0,
        "output_tokens_per_s": sum(r.generated for r in ok) / run.wall if run.wall > 0 else 0.0,
    }
    prompts = [r.prompt for r in ok if r.prompt is not None]
    if prompts:
        m["prompt_tokens_mean"] = sum(prompts) / len(prompts)
    with_cache = [r for r in ok if r.prompt and r.cached is not None]
    if with_cache and len(with_cache) == len(ok):
        m["cache_hit_ratio"] = sum(r.cached for r in with_cache) / sum(r.prompt for r in with_cache)
    if grpc_target:
        st = [r.server_ttft for r in ok if r.server_ttft is not None]
        m["server_ttft_p50_ms"] = ms(percentile(st, 50))
    notes = {}
    if "cache_hit_ratio" not in m:
        notes["cache_hit_ratio"] = "n/a: the server's usage reports no cached tokens"
    first_errors = sorted({r.error for r in rs if r.error})[:3]
    if first_errors:
        notes["errors"] = " | ".join(first_errors)
    workers = sorted({r.worker for r in ok if r.worker})
    if workers:
        notes["workers"] = ",".join(workers)
    return {k: v for k, v in m.items() if v is not None}, notes


def machine():
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"hostname": socket.gethostname(), "logical_cpus": str(os.cpu_count()), "cpu_model": cpu,
            "python": platform.python_version()}


def fmt(v, key):
    if v is None:
        return "n/a"
    if key in ("requests", "errors", "incomplete", "users", "rounds"):
        return str(int(v))
    return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"


def write_json(path, benchmark, metrics, baseline, ratio, notes, run_id=None):
    report = {"benchmark": benchmark, "metrics": metrics, "baseline": baseline, "ratio": ratio, "notes": notes,
              "machine": machine()}
    if run_id:
        report["run_id"] = run_id
    with open(path, "w") as f:
        json.dump(report, f, indent=2, sort_keys=True)
        f.write("\n")


# ----------------------------------------------------------------------------- combine

TABLE_KEYS = ["ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "itl_p99_over_p50",
              "e2e_p50_ms", "e2e_p99_ms",
              "request_throughput_per_s", "output_tokens_per_s", "cache_hit_ratio", "prompt_tokens_mean", "requests",
              "errors", "incomplete"]
PER_MODE_KEYS = ["ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "itl_p99_over_p50", "e2e_p50_ms",
                 "request_throughput_per_s", "output_tokens_per_s", "cache_hit_ratio", "requests", "errors"]
# (key, lower is better) compared between affinity and every other mode of a shape.
COMPARED = [("ttft_p50_ms", True), ("ttft_p99_ms", True), ("itl_p50_ms", True), ("itl_p99_ms", True),
            ("output_tokens_per_s", False)]


def write_requests(path, run):
    """One line per request, in the order they finished: what a percentile hides."""
    ms = lambda v: None if v is None else round(v * 1000.0, 3)  # noqa: E731
    with open(path, "w") as f:
        for r in run.results:
            f.write(json.dumps({
                "run_id": run.args.run_id, "user": r.user, "round": r.round, "sent_s": round(r.sent, 3),
                "ok": r.ok, "error": r.error, "ttft_ms": ms(r.ttft), "server_ttft_ms": ms(r.server_ttft),
                "e2e_ms": ms(r.e2e), "itl_max_ms": ms(max(r.itls)) if r.itls else None,
                "generated": r.generated, "prompt_tokens": r.prompt, "cached_tokens": r.cached,
                "worker": r.worker}) + "\n")


def combine(pairs, json_path):
    """`pairs`: ["a/affinity=a.json", ...] (SHAPE/MODE=FILE, or MODE=FILE for one
    unnamed shape). Writes multi_round_qa.json: every mode's figures under
    SHAPE_MODE_, and for each shape affinity against every other mode, as
    other ÷ affinity for latencies and affinity ÷ other for throughput (> 1:
    affinity is better), favourable or not. Refuses reports of different runs."""
    modes = {}
    for p in pairs:
        name, _, path = p.partition("=")
        with open(path) as f:
            modes[name] = json.load(f)
    run_ids = {rep.get("run_id") for rep in modes.values()}
    if len(run_ids) != 1 or None in run_ids:
        sys.exit(f"multi_round_qa.py: refusing to combine reports of different runs (run ids {sorted(map(str, run_ids))})")
    metrics, baseline, ratio, notes = {}, {}, {}, {}
    shapes = {}
    for name, rep in modes.items():
        shape, _, mode = name.rpartition("/")
        shapes.setdefault(shape, {})[mode] = rep["metrics"]
        prefix = f"{shape}_{mode}" if shape else mode
        for k in PER_MODE_KEYS:
            if k in rep["metrics"]:
                metrics[f"{prefix}_{k}"] = rep["metrics"][k]
        for k, v in rep.get("notes", {}).items():
            notes[f"{prefix}_{k}"] = v
    for shape, by_mode in shapes.items():
        # The gRPC affinity run, or (a run over HTTP only) affinity_http.
        ref = "affinity" if "affinity" in by_mode else "affinity_http"
        aff = by_mode.get(ref)
        if not aff:
            continue
        for mode, m in by_mode.items():
            if mode == ref:
                continue
            for key, lower_better in COMPARED:
                a, b = aff.get(key), m.get(key)
                if not a or not b:
                    continue
                name = f"{shape + '_' if shape else ''}affinity_vs_{mode}_{key.removesuffix('_ms')}"
                ratio[name] = b / a if lower_better else a / b
                if mode != ref:
                    baseline[f"{shape + '_' if shape else ''}{mode}_{key}"] = b
    for shape, by_mode in shapes.items():
        print(f"== shape {shape or '-'} ==")
        print_table({mode: {"metrics": m} for mode, m in by_mode.items()})
    for k, v in sorted(ratio.items()):
        print(f"{k:56s} {v:8.2f}")
    if json_path:
        write_json(json_path, "multi_round_qa", metrics, baseline, ratio, notes, run_id=run_ids.pop())
        print(f"wrote {json_path}")


def print_table(modes):
    names = list(modes)
    width = max(12, *(len(n) for n in names))
    print(f"{'metric':26s}" + "".join(f"{n:>{width + 2}s}" for n in names))
    for k in TABLE_KEYS:
        print(f"{k:26s}" + "".join(f"{fmt(modes[n]['metrics'].get(k), k):>{width + 2}s}" for n in names))


# ----------------------------------------------------------------------------- main

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default="127.0.0.1:7000", help="gRPC host:port of the router or worker")
    p.add_argument("--target", choices=["router", "worker"], default="router")
    p.add_argument("--openai_url", default=None, help="OpenAI-compatible base URL (e.g. http://127.0.0.1:8000/v1)")
    p.add_argument("--openai_model", default="default", help="model name sent to --openai_url")
    p.add_argument("--openai_ban_tokens", type=lambda s: [int(x) for x in s.split(",") if x], default=[0, 2],
                   help="token ids banned with logit_bias on --openai_url (SmolLM2: 0 <|endoftext|>, 2 <|im_end|>)")
    p.add_argument("--openai_ignore_eos", action="store_true",
                   help="send ignore_eos instead of --openai_ban_tokens (a kvcache router's --http_listen, vLLM)")
    p.add_argument("--token", default=None, help="bearer token")
    p.add_argument("--tls_ca", default=None, help="PEM CA file; TLS when set (gRPC)")
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--qps", type=float, default=0.5, help="new users per second (0: all at once)")
    p.add_argument("--think_time", type=float, default=0.0, help="seconds between a user's rounds")
    p.add_argument("--system_tokens", type=int, default=1000, help="shared system prompt length (words ~ tokens)")
    p.add_argument("--user_context_tokens", type=int, default=0,
                   help="each user's private notes, sent with its first question (words ~ tokens)")
    p.add_argument("--question_tokens", type=lambda s: tuple(int(x) for x in s.split(",")), default=(50, 100),
                   help="MIN,MAX words per question")
    p.add_argument("--answer_tokens", type=int, default=32)
    p.add_argument("--duration", type=float, default=600.0, help="stop after this many seconds")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request at most")
    p.add_argument("--seed", type=int, default=10)
    p.add_argument("--label", default=None, help="name of this run in the report")
    p.add_argument("--server_note", default=None, help="what the server is (version, flags), for the report")
    p.add_argument("--run_id", default=None,
                   help="id of the benchmark run this report belongs to (--combine refuses mixed ids)")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--requests_jsonl", default=None,
                   help="write one JSON line per request here (user, round, send time, TTFT, tokens, worker)")
    p.add_argument("--proto_dir", default=DEFAULT_PROTO_DIR)
    p.add_argument("--combine", nargs="+", metavar="MODE=FILE",
                   help="merge per-mode reports of one run (SHAPE/MODE=FILE) into --json and exit")
    args = p.parse_args()

    if args.combine:
        combine(args.combine, args.json)
        return 0
    if args.label is None:
        args.label = "openai" if args.openai_url else args.target
    stubs_dir = None
    if args.openai_url:
        client = OpenAiClient(args)
    else:
        try:
            import grpc  # noqa: F401
            import grpc_tools  # noqa: F401
        except ImportError as e:
            sys.exit(f"multi_round_qa.py needs grpcio and grpcio-tools ({e}): "
                     "pip install grpcio==1.85.1 grpcio-tools==1.85.1")
        stubs_dir = tempfile.mkdtemp(prefix="kvcache_bench_stubs_")
        client = GrpcClient(args, stubs_dir)
    try:
        run = Run(args, client)
        run.go()
    finally:
        if stubs_dir:
            shutil.rmtree(stubs_dir, ignore_errors=True)
    metrics, notes = summarize(run, grpc_target=not args.openai_url)
    notes["workload"] = (f"{args.users} users x {args.rounds} rounds, system ~{args.system_tokens} tokens, "
                         f"user notes ~{args.user_context_tokens} tokens, "
                         f"questions {args.question_tokens[0]}-{args.question_tokens[1]} words, "
                         f"answers {args.answer_tokens} tokens, qps {args.qps}, think {args.think_time}s")
    notes["target"] = args.openai_url or f"{args.target} {args.address}"
    if args.server_note:
        notes["server"] = args.server_note
    print(f"== multi_round_qa [{args.label}] {notes['workload']} ==")
    print_table({args.label: {"metrics": metrics}})
    for k, v in sorted(notes.items()):
        print(f"note {k}: {v}")
    if args.json:
        write_json(args.json, f"multi_round_qa_{args.label}", metrics, {}, {}, notes, run_id=args.run_id)
    if args.requests_jsonl:
        write_requests(args.requests_jsonl, run)
    return 1 if metrics["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
