#!/usr/bin/env python3
"""The router's OpenAI-compatible HTTP API driven by the official `openai` package.

Starts a kvcache-worker with the bundled model (SmolLM2) and a kvcache-router with
--http_listen=127.0.0.1:0 in front of it (bearer tokens from a tokens file, one
tenant per test so that the per-tenant request quota of the worker, 1, meets
only the test that wants it), plus a second router with no worker. Every
process listens on port 0 and is stopped at the end. Checks: streaming and
non-streaming chat and completions, a three-turn conversation whose later turns
report cached tokens, stop strings, seeded sampling, the status of every
reachable error (400, 401, 404, 429, 503, 504), /health, /ready and
/v1/models, and a client that disconnects mid-stream (the worker's request ends
CANCELLED, not after its 1,500 tokens). Fails with a clear message when `openai`
is missing (scripts/setup.sh installs it) or the model file is absent.
"""

import argparse
import json
import os
import re
import sys
import tempfile
import time
import urllib.error
import urllib.request

from server_process import Server, fail

PIP_LINE = "pip install openai==3.57.0"
MODEL_NAME = "smollm2"
FAILURES = []


def check(condition, message):
    if not condition:
        FAILURES.append(message)
        print(f"  check failed: {message}", file=sys.stderr, flush=True)


def http_get(url):
    """(status, body) of a GET."""
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def http_post(url, body, headers=None):
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def wait_until(predicate, timeout, what):
    """Polls `predicate` (an external process's state: there is no event to wait on)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    fail(f"timed out after {timeout:.0f}s waiting for {what}")


def metric(text, name):
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def run_tests(base, no_worker_base, worker_metrics):
    import openai

    def client(token):
        return openai.OpenAI(base_url=f"{base}/v1", api_key=token, max_retries=0, timeout=120)

    def status_of(call):
        try:
            call()
        except openai.APIStatusError as e:
            return e.status_code, e.body
        return 200, None

    chat_messages = [{"role": "system", "content": "You are a helpful assistant."},
                     {"role": "user", "content": "Name three colours."}]

    print("non-streaming chat", flush=True)
    c = client("tok-chat")
    r = c.chat.completions.create(model=MODEL_NAME, messages=chat_messages, max_tokens=12, temperature=0)
    check(r.id.startswith("chatcmpl-"), f"id {r.id}")
    check(r.object == "chat.completion", r.object)
    check(r.model == MODEL_NAME, r.model)
    check(r.created > 1_600_000_000, f"created {r.created}")
    check(r.choices[0].message.role == "assistant", "role")
    check(len(r.choices[0].message.content) > 0, "empty reply")
    check(r.choices[0].finish_reason in ("stop", "length"), r.choices[0].finish_reason)
    check(r.usage.completion_tokens <= 12 and r.usage.completion_tokens > 0, f"usage {r.usage}")
    check(r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens, f"usage {r.usage}")
    check(r.usage.prompt_tokens_details is not None, "no prompt_tokens_details")
    greedy = r.choices[0].message.content

    print("streaming chat (same greedy request: same text)", flush=True)
    chunks = list(c.chat.completions.create(model=MODEL_NAME, messages=chat_messages, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    check(chunks[0].choices[0].delta.role == "assistant", "first chunk carries the role")
    content = [ch for ch in chunks if ch.choices and ch.choices[0].delta.content]
    check(len(content) >= 2, f"{len(content)} content chunks: one per token expected")
    text = "".join(ch.choices[0].delta.content for ch in content)
    check(text == greedy, f"stream {text!r} vs non-stream {greedy!r}")
    finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    check(len(finals) == 1 and finals[0].choices[0].finish_reason == r.choices[0].finish_reason, "finish chunk")
    check(chunks[-1].choices == [] and chunks[-1].usage is not None, "include_usage: last chunk has usage")
    check(chunks[-1].usage.completion_tokens == r.usage.completion_tokens, "usage of the stream")
    check(len({ch.id for ch in chunks}) == 1, "one id per stream")

    print("completions, streaming and not", flush=True)
    cr = c.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=8, temperature=0)
    check(cr.id.startswith("cmpl-") and cr.object == "text_completion", f"{cr.id} {cr.object}")
    check(len(cr.choices[0].text) > 0, "completion text")
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL_NAME, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True))
    check(streamed == cr.choices[0].text, f"{streamed!r} vs {cr.choices[0].text!r}")

    print("three turns of one conversation: later turns hit the cache", flush=True)
    for how in ("user", "x-session-id", "prompt_cache_key"):
        conv = [{"role": "user", "content": "Tell me about the moon in one sentence."}]
        cached = []
        for turn in range(3):
            kwargs = {}
            if how == "user":
                kwargs["user"] = "alice@example.com"
            elif how == "x-session-id":
                kwargs["extra_headers"] = {"x-session-id": "conv-hdr-1"}
            else:
                kwargs["extra_body"] = {"prompt_cache_key": "conv-key-1"}
            t = c.chat.completions.create(model=MODEL_NAME, messages=conv, max_tokens=16, temperature=0, **kwargs)
            cached.append(t.usage.prompt_tokens_details.cached_tokens)
            conv += [{"role": "assistant", "content": t.choices[0].message.content},
                     {"role": "user", "content": ["And the sun?", "And the stars?"][turn % 2]}]
        print(f"  {how}: cached tokens per turn {cached}", flush=True)
        check(cached[1] > 0 and cached[2] > cached[1], f"{how}: cached tokens {cached}")

    print("stop strings end the reply before them", flush=True)
    base_text = c.completions.create(model=MODEL_NAME, prompt="Count: 1, 2, 3,", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base_text[6:9]
    want = base_text[:base_text.find(stop)]
    for stream in (False, True):
        kwargs = dict(model=MODEL_NAME, prompt="Count: 1, 2, 3,", max_tokens=24, temperature=0, stop=[stop, "@@@"],
                      extra_body={"ignore_eos": True})
        if stream:
            got_chunks = list(c.completions.create(stream=True, **kwargs))
            got = "".join(ch.choices[0].text for ch in got_chunks)
            reason = [ch.choices[0].finish_reason for ch in got_chunks if ch.choices[0].finish_reason]
            reason = reason[0] if reason else None
        else:
            s = c.completions.create(**kwargs)
            got, reason = s.choices[0].text, s.choices[0].finish_reason
        check(got == want and reason == "stop", f"stop {stop!r} (stream={stream}): {got!r}, want {want!r}, {reason}")

    print("seed: the same seed and temperature > 0 give the same text", flush=True)
    def sample(seed, session=None):
        kwargs = {"extra_headers": {"x-session-id": session}} if session else {}
        return c.chat.completions.create(model=MODEL_NAME, messages=chat_messages, max_tokens=24, temperature=1.0,
                                         seed=seed, **kwargs).choices[0].message.content
    a, b, d = sample(1234), sample(1234, "seeded-a"), sample(1234, "seeded-b")
    check(a == b == d, f"seed 1234 gave {a!r}, {b!r}, {d!r}")
    others = {sample(s) for s in (1, 2, 3)}
    check(len(others | {a}) >= 2, "four seeds, one text: sampling ignores the seed?")
    # Without a seed, each request samples anew (as OpenAI's does), with or without a session.
    unseeded = {sample(None) for _ in range(4)} | {sample(None, "unseeded") for _ in range(2)}
    check(len(unseeded) >= 2, f"six unseeded requests at temperature 1 gave one text: {unseeded}")

    print("/v1/models, /health, /ready", flush=True)
    models = [m.id for m in c.models.list()]
    check(models == [MODEL_NAME], f"models {models}")
    check(c.models.retrieve(MODEL_NAME).id == MODEL_NAME, "models.retrieve")
    check(http_get(f"{base}/health")[0] == 200, "/health")
    check(http_get(f"{base}/ready") == (200, '{"status":"SERVING"}'), f"/ready {http_get(base + '/ready')}")
    check(http_get(f"{no_worker_base}/health")[0] == 200, "/health without workers")
    check(http_get(f"{no_worker_base}/ready")[0] == 503, "/ready without workers")

    print("errors: OpenAI's error object with the status of the gRPC code", flush=True)
    create = lambda cl, **kw: cl.chat.completions.create(**{"model": MODEL_NAME, "messages": chat_messages,
                                                            "max_tokens": 4, **kw})
    code, body = status_of(lambda: create(openai.OpenAI(base_url=f"{base}/v1", api_key="not-a-token",
                                                        max_retries=0)))
    check(code == 401 and body["type"] == "authentication_error", f"unknown token: {code} {body}")
    code, body = http_post(f"{base}/v1/chat/completions", json.dumps(
        {"model": MODEL_NAME, "messages": chat_messages}).encode())
    check(code == 401 and "authorization" in json.loads(body)["error"]["message"], f"no token: {code} {body}")
    code, body = status_of(lambda: create(c, model="gpt-4o"))
    check(code == 404 and body["code"] == "model_not_found", f"unknown model: {code} {body}")
    code, body = status_of(lambda: create(c, extra_body={"temperature": "hot"}))
    check(code == 400 and body["param"] == "temperature", f"wrong type: {code} {body}")
    code, body = status_of(lambda: create(c, temperature=5))
    check(code == 400, f"temperature 5: {code} {body}")
    code, body = status_of(lambda: create(c, extra_headers={"x-session-id": "bad id!"}))
    check(code == 400 and "session" in body["message"], f"bad session id: {code} {body}")
    code, body = http_post(f"{base}/v1/chat/completions", b'{"model": "smollm2", "messages": [',
                           {"Authorization": "Bearer tok-chat"})
    check(code == 400 and json.loads(body)["error"]["type"] == "invalid_request_error", f"bad JSON: {code} {body}")
    code, body = status_of(lambda: create(c, max_tokens=1500, extra_headers={"x-request-timeout-ms": "1"}))
    check(code == 504 and body["type"] == "timeout_error", f"deadline: {code} {body}")
    code, body = status_of(lambda: create(openai.OpenAI(base_url=f"{no_worker_base}/v1", api_key="tok-chat",
                                                        max_retries=0)))
    check(code == 503, f"no worker: {code} {body}")
    # The worker takes one request per tenant (--tenant_max_requests=1): while
    # one stream of tenant "quota" runs, the next one of that tenant is refused.
    cancelled = 'kvcache_requests_total{code="CANCELLED"}'
    ok = 'kvcache_requests_total{code="OK"}'
    before_quota = metric(http_get(worker_metrics)[1], cancelled)
    q = client("tok-quota")
    running = q.chat.completions.create(model=MODEL_NAME, messages=chat_messages, max_tokens=1500, stream=True,
                                        extra_body={"ignore_eos": True})
    next(iter(running))  # the status line came: the request is admitted
    code, body = status_of(lambda: create(q))
    check(code == 429 and body["type"] == "rate_limit_error", f"over quota: {code} {body}")
    running.close()
    wait_until(lambda: metric(http_get(worker_metrics)[1], cancelled) >= before_quota + 1, 30,
               "the worker to count the closed over-quota stream as CANCELLED")

    print("a client that disconnects mid-stream cancels the worker's request", flush=True)
    before = http_get(worker_metrics)[1]
    gone = client("tok-gone").chat.completions.create(
        model=MODEL_NAME, messages=chat_messages, max_tokens=1500, stream=True, extra_body={"ignore_eos": True})
    it = iter(gone)
    for _ in range(4):
        next(it)
    gone.close()
    base_cancelled = metric(before, cancelled)
    wait_until(lambda: metric(http_get(worker_metrics)[1], cancelled) >= base_cancelled + 1, 30,
               "the worker to count the disconnected stream as CANCELLED")
    after = http_get(worker_metrics)[1]
    check(metric(after, ok) == metric(before, ok), "the disconnected stream finished OK on the worker")
    check(metric(after, "kvcache_generated_tokens_total") - metric(before, "kvcache_generated_tokens_total") < 1500,
          "the worker generated all 1,500 tokens for a client that left")
    # The quota slot came back: the tenant may run again.
    r = q.chat.completions.create(model=MODEL_NAME, messages=chat_messages, max_tokens=2)
    check(r.usage.completion_tokens > 0, "tenant quota after a cancelled stream")


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--build_dir", required=True)
    parser.add_argument("--model", default=os.environ.get(
        "KVCACHE_MODEL", os.path.expanduser("~/.cache/kvcache/models/SmolLM2-135M-Instruct.Q4_1.gguf")))
    args = parser.parse_args()
    try:
        import openai  # noqa: F401
    except ImportError as e:
        fail(f"the openai package is not installed ({e}); run scripts/setup.sh or: {PIP_LINE}")
    if not os.path.isfile(args.model):
        fail(f"model {args.model} not found; run scripts/setup.sh")

    servers = []
    with tempfile.TemporaryDirectory(prefix="kvcache_openai_test_") as tmp:
        try:
            worker = Server([os.path.join(args.build_dir, "worker", "kvcache-worker"), "--listen=127.0.0.1:0",
                             "--metrics_listen=127.0.0.1:0", "--worker_id=oai-w0", f"--model={args.model}",
                             "--threads=1", "--allow_unauthenticated", "--tenant_max_requests=1"])
            servers.append(worker)
            tokens = os.path.join(tmp, "tokens")
            with open(tokens, "w") as f:
                for t in ("chat", "quota", "gone"):
                    f.write(f"tok-{t} tenant-{t}\n")
            router_bin = os.path.join(args.build_dir, "router", "kvcache-router")
            common = ["--listen=127.0.0.1:0", "--metrics_listen=", f"--model={args.model}",
                      f"--served_model_name={MODEL_NAME}", "--http_listen=127.0.0.1:0", "--rebalance_interval=0s"]
            router = Server([router_bin, f"--workers={worker.fields['grpc']}", f"--auth_tokens_file={tokens}"] + common)
            servers.append(router)
            lonely = Server([router_bin, f"--auth_tokens_file={tokens}"] + common)
            servers.append(lonely)
            base = f"http://{router.fields['http']}"
            wait_until(lambda: http_get(f"{base}/ready")[0] == 200, 60, "the router to be ready")
            run_tests(base, f"http://{lonely.fields['http']}", f"http://{worker.fields['metrics']}/metrics")
        finally:
            for s in reversed(servers):
                s.stop()
    if FAILURES:
        fail(f"{len(FAILURES)} checks failed:\n  " + "\n  ".join(FAILURES))
    print("PASS")


if __name__ == "__main__":
    main()
