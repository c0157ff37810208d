#!/usr/bin/env python3
"""Live check of deploy/'s monitoring against the real binaries and a real Prometheus server.

Starts two kvcache-workers and a kvcache-router on loopback (port 0), a Prometheus server
(Debian package `prometheus`) scraping their /metrics every 1s and loading
deploy/prometheus/alerts.yml, drives traffic through the router with kvcache-demo (a multi-user
chat with forks, tier-0 pressure that forces offload/restore, and one admin migration), then:

- pipes every live /metrics body into `promtool check metrics` (must exit 0);
- checks every metric of deploy/metrics.txt is exported by the right process (router names by the
  router, worker names by every worker) with its declared type and labels, and that the binaries
  export no kvcache_* metric the contract lacks;
- checks the alert rules are loaded into Prometheus with health "ok";
- evaluates every dashboard expression (Grafana variables substituted) and every alert expression
  with /api/v1/query: each must succeed; every metric selector in them must match live series
  (a wrong metric name or label value shows up here); the core panels (CORE_PANELS) must return
  finite data; the dashboard's label_values() variables must return the workers.

Every process it starts is stopped (SIGTERM, then SIGKILL) before it exits.

  check_live_prometheus.py --worker BIN --router BIN --demo BIN [--model GGUF] [-v]
"""
import argparse
import json
import math
import os
import re
import secrets
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

try:
    import yaml
except ImportError:
    sys.exit("FAIL: PyYAML missing: apt-get install python3-yaml (or pip install PyYAML)")

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
DEPLOY = os.path.join(ROOT, "deploy")
DEFAULT_MODEL = os.environ.get("KVCACHE_MODEL") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvcache", "models",
    "SmolLM2-135M-Instruct.Q4_1.gguf")

SCRAPE_INTERVAL_S = 1
# Grafana variables -> values for a direct query: the rate window covers the whole run, the
# worker filter selects every worker (the variable's allValue).
SUBSTITUTIONS = [("${__rate_interval}", "1m"), ("$__rate_interval", "1m"), ("${__interval}", "1s"),
                 ("$__interval", "1s"), ("${__range}", "1m"), ("$__range", "1m"),
                 ("${worker:regex}", ".*"), ("${worker}", ".*"), ("$worker", ".*")]
# The panels an operator looks at first: every query of these must return finite data after the
# traffic. (Offload/restore/migration latencies, retries, preemptions and wasted slots may be
# empty or NaN in a short run; their selectors are still checked below.)
CORE_PANELS = [
    "Request rate",
    "Token throughput",
    "Time to first token (router, client-observed)",
    "Time to first token (workers)",
    "Request duration",
    "KV cache usage by tier",
    "KV pages by tier and state",
    "KV cache capacity by tier",
    "Prefix cache hit ratio",
    "Router: predicted vs actual cached tokens",
    "Sessions by state",
    "Routing decisions by reason",
    "Worker health (router view)",
    "Scrape health and draining",
    "Running and waiting requests",
    "Step time",
    "Batch size",
]
# Contract metrics that a process exports only after an event this run may not cause on that
# process: they must appear on at least one process of their kind, not on each. None today: the
# labelled families appear once their first event happens, and the demo causes each on every
# worker: it migrates one session from its worker to the other (kvcache_migration_bytes_total
# direction="out" on one, "in" on the other) and then continues that session on the destination
# while its twin stays on the source (kvcache_requests_total{code} on both).
EVENT_ONLY_PER_PROCESS = {}
# Contract metrics that need an event the demo does not cause at all: this run's router has a
# static --workers list, so it never looks a name up in DNS (tests/integration/dns_lifecycle_test
# checks that counter).
EVENT_ONLY = {"kvcache_router_dns_resolutions_total"}

procs = []  # (name, Popen)
failures = []
verbose = False


def log(msg):
    print(f"[live] {msg}", flush=True)


def fail(msg):
    failures.append(msg)
    print(f"FAIL: {msg}", flush=True)


def die(msg):
    raise SystemExit(f"FAIL: {msg}")


def find_tool(name):
    """The tool's path: $PROMETHEUS / $PROMTOOL, else PATH, else /usr/bin."""
    env = os.environ.get(name.upper())
    if env:
        if not os.access(env, os.X_OK):
            die(f"{name}: ${name.upper()}={env} is not an executable")
        return env
    path = shutil.which(name) or (f"/usr/bin/{name}" if os.access(f"/usr/bin/{name}", os.X_OK) else None)
    if not path:
        die(f"{name} not found: apt-get install prometheus (the Debian package ships prometheus and promtool)")
    return path


def load_contract():
    contract = {}
    with open(os.path.join(DEPLOY, "metrics.txt")) as f:
        section = None
        for line in f:
            if line.startswith("# kvcache-worker"):
                section = "worker"
            elif line.startswith("# kvcache-router"):
                section = "router"
            if not line.strip() or line.startswith("#"):
                continue
            name, kind, labels, _ = line.rstrip("\n").split("\t")
            if section is None:
                die("deploy/metrics.txt: a metric before the '# kvcache-worker' / '# kvcache-router' headers")
            contract[name] = (section, kind, set() if labels == "-" else set(labels.split(",")))
    return contract


# ---- processes --------------------------------------------------------------------------------

def start_server(name, argv, tmp, timeout=60):
    """Starts a kvcache binary and returns (grpc, metrics) from its 'listening' stdout line."""
    err = open(os.path.join(tmp, f"{name}.log"), "w")
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, text=True)
    procs.append((name, p))
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    line = ""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            die(f"{name} printed no 'listening' line within {timeout}s; log: {tail(tmp, name)}")
        if not sel.select(left):
            continue
        line = p.stdout.readline()
        if not line:
            p.wait()
            die(f"{name} exited ({p.returncode}) before serving; log: {tail(tmp, name)}")
        m = re.search(r" listening grpc=(\S+) metrics=(\S+)", line)
        if m:
            break
    sel.close()
    # Keep draining stdout so that the process never blocks on a full pipe.
    out = open(os.path.join(tmp, f"{name}.out"), "w")
    threading.Thread(target=lambda: [out.write(l) for l in p.stdout], daemon=True).start()
    return m.group(1), m.group(2)


def tail(tmp, name, n=15):
    try:
        with open(os.path.join(tmp, f"{name}.log")) as f:
            return "\n" + "".join(f.readlines()[-n:])
    except OSError:
        return "(none)"


def stop_all():
    for _, p in procs:
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 10
    for name, p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log(f"{name} ignored SIGTERM for 10s: SIGKILL")
            p.kill()
            p.wait()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- HTTP -------------------------------------------------------------------------------------

def http_get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def api(base, path, **params):
    url = f"{base}/api/v1/{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params, doseq=True)
    try:
        body = http_get(url)
    except urllib.error.HTTPError as e:  # 400/422: a bad expression; the body says why
        body = e.read().decode()
    return json.loads(body)


def query(base, expr):
    return api(base, "query", query=expr)


def wait_for(what, check, timeout, interval=0.5):
    """Polls check() (Prometheus has no push notification) until it returns a truthy value."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            got = check()
            if got:
                return got
        except (OSError, ValueError, KeyError) as e:
            last = e
        time.sleep(interval)
    die(f"timed out after {timeout}s waiting for {what}" + (f" (last error: {last})" if last else ""))


def start_prometheus(prometheus, tmp, router_metrics, worker_metrics):
    config = {
        "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "evaluation_interval": f"{SCRAPE_INTERVAL_S}s",
                   "scrape_timeout": f"{SCRAPE_INTERVAL_S}s"},
        "rule_files": [os.path.join(DEPLOY, "prometheus", "alerts.yml")],
        # Job names as in deploy/prometheus/prometheus.yml and the ServiceMonitor.
        "scrape_configs": [
            {"job_name": "kvcache-router", "static_configs": [{"targets": [router_metrics]}]},
            {"job_name": "kvcache-worker", "static_configs": [{"targets": worker_metrics}]},
        ],
    }
    cfg = os.path.join(tmp, "prometheus.yml")
    with open(cfg, "w") as f:
        yaml.safe_dump(config, f)
    for attempt in range(5):
        port = free_port()
        data = os.path.join(tmp, f"tsdb{attempt}")
        logpath = os.path.join(tmp, "prometheus.log")
        with open(logpath, "w") as lf:
            p = subprocess.Popen([prometheus, f"--config.file={cfg}", f"--storage.tsdb.path={data}",
                                  f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h",
                                  "--log.level=warn"],
                                 stdout=lf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        procs.append(("prometheus", p))
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and p.poll() is None:
            try:
                http_get(f"{base}/-/ready", timeout=1)
                return base
            except OSError:
                time.sleep(0.2)
        if p.poll() is None:
            die(f"prometheus not ready within 30s on {base}; log:\n{open(logpath).read()[-2000:]}")
        text = open(logpath).read()
        if "address already in use" not in text:
            die(f"prometheus exited ({p.returncode}) during start-up; log:\n{text[-2000:]}")
        log(f"port {port} was taken before prometheus bound it; retrying")
    die("prometheus could not bind a free loopback port in 5 attempts")


# ---- /metrics ---------------------------------------------------------------------------------

def parse_exposition(text):
    """name -> (type, set of label names of its samples, sample count)."""
    types, labels, samples = {}, {}, {}
    for line in text.splitlines():
        m = re.match(r"# TYPE (\S+) (\S+)", line)
        if m:
            types[m.group(1)] = m.group(2)
            continue
        if not line or line.startswith("#"):
            continue
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s", line)
        if not m:
            continue
        series = m.group(1)
        family = series
        for suffix in ("_bucket", "_sum", "_count"):
            if series.endswith(suffix) and series[:-len(suffix)] in types:
                family = series[:-len(suffix)]
        names = set(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', m.group(3) or "")) - {"le", "quantile"}
        labels.setdefault(family, set()).update(names)
        samples[family] = samples.get(family, 0) + 1
    return {n: (t, labels.get(n, set()), samples.get(n, 0)) for n, t in types.items()}


def check_metrics(promtool, contract, bodies):
    """bodies: list of (process name, kind, text)."""
    exported = {}
    for name, kind, text in bodies:
        r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
        if r.returncode != 0:
            fail(f"promtool check metrics rejects {name}'s /metrics (exit {r.returncode}):\n"
                 f"{(r.stdout + r.stderr).strip()}")
        live = parse_exposition(text)
        exported[name] = live
        for metric, (ctype, ckind, clabels) in contract.items():
            if ctype != kind or metric not in live:
                continue
            ltype, llabels, n = live[metric]
            if ltype != ckind:
                fail(f"{name} exports {metric} as {ltype}, deploy/metrics.txt says {ckind}")
            if n == 0:
                fail(f"{name}: {metric} has a # TYPE line but no samples")
            if llabels != clabels:
                fail(f"{name}: {metric} has labels {sorted(llabels)}, deploy/metrics.txt says {sorted(clabels)}")
        for metric in live:
            if metric.startswith("kvcache_") and metric not in contract:
                fail(f"{name} exports {metric}, which deploy/metrics.txt does not list")
            elif metric in contract and contract[metric][0] != kind:
                fail(f"{name} ({kind}) exports {metric}, which deploy/metrics.txt lists under the "
                     f"{contract[metric][0]}")
    for metric, (ctype, _, _) in contract.items():
        holders = [n for n, k, _ in bodies if k == ctype and metric in exported[n]]
        expected = [n for n, k, _ in bodies if k == ctype]
        if metric in EVENT_ONLY:
            continue
        if not holders:
            fail(f"no {ctype} exports {metric} (deploy/metrics.txt lists it): the binary must export it, "
                 f"or the contract is wrong")
        elif len(holders) < len(expected) and metric not in EVENT_ONLY_PER_PROCESS:
            fail(f"{metric} is exported by {holders} but not by {sorted(set(expected) - set(holders))}")


# ---- PromQL -----------------------------------------------------------------------------------

KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
            "offset", "bool", "inf", "nan", "atan2"}


def substitute(expr):
    for var, value in SUBSTITUTIONS:
        expr = expr.replace(var, value)
    m = re.search(r"\$\{?\w+", expr)
    if m:
        die(f"unknown Grafana variable {m.group(0)} in {expr!r}: add it to SUBSTITUTIONS in {__file__}")
    return expr


def selectors_of(expr):
    """The instant-vector selectors of an expression, e.g. 'up{job="x"}' (range suffixes dropped)."""
    out = []
    no_clauses = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    for m in re.finditer(r'([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{(?:[^}"]|"(?:[^"\\]|\\.)*")*\})?', no_clauses):
        word = m.group(1)
        if word in KEYWORDS or re.match(r"\s*\(", no_clauses[m.end():]):
            continue
        before = no_clauses[:m.start()]
        if before and (before[-1].isdigit() or before[-1] == "." or before.count('"') % 2 == 1):
            continue  # part of a number, a duration or a string
        if re.search(r"\[[^\]]*$", before):
            continue  # inside a range [1m]
        out.append(word + (m.group(2) or ""))
    return out


def result_values(res):
    data = res["data"]
    if data["resultType"] in ("vector", "matrix"):
        return [float(s["value"][1]) for s in data["result"] if "value" in s]
    if data["resultType"] == "scalar":
        return [float(data["result"][1])]
    return []


def check_queries(base, dash, alerts, contract):
    exprs = []  # (where, expr, core)
    titles = set()
    for p in dash["panels"]:
        for t in p.get("targets", []):
            if "expr" in t:
                exprs.append((f"panel {p['title']!r} query {t.get('refId')}", substitute(t["expr"]),
                              p["title"] in CORE_PANELS))
        titles.add(p.get("title"))
    for title in CORE_PANELS:
        if title not in titles:
            fail(f"core panel {title!r} is not in the dashboard: update CORE_PANELS in {__file__}")
    for g in alerts["groups"]:
        for r in g["rules"]:
            exprs.append((f"alert {r.get('alert') or r.get('record')}", r["expr"], False))
    checked_selectors = {}
    n_core = 0
    for where, expr, core in exprs:
        res = query(base, expr)
        if res.get("status") != "success":
            fail(f"{where}: Prometheus rejects {expr!r}: {res.get('errorType')}: {res.get('error')}")
            continue
        if verbose:
            log(f"{where}: {len(res['data']['result'])} series")
        if core:
            n_core += 1
            values = result_values(res)
            if not values:
                fail(f"{where} (core panel) returns no data: {expr}")
            elif not any(math.isfinite(v) for v in values):
                fail(f"{where} (core panel) returns only NaN/Inf: {expr} -> {values}")
        for sel in selectors_of(expr):
            if sel in checked_selectors:
                continue
            name = sel.split("{")[0]
            metric = re.sub(r"_(bucket|sum|count)$", "", name) if name not in contract else name
            r2 = query(base, sel)
            ok = r2.get("status") == "success" and r2["data"]["result"]
            checked_selectors[sel] = ok
            if not ok and metric not in EVENT_ONLY:
                fail(f"{where}: selector {sel} matches no live series (wrong metric name or label?): {expr}")
    # Template variables: label_values(metric, label) as Grafana runs it.
    for v in dash.get("templating", {}).get("list", []):
        q = v.get("query")
        text = q.get("query") if isinstance(q, dict) else q
        m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", text or "") if v.get("type") == "query" else None
        if m:
            res = api(base, f"label/{m.group(2)}/values", **{"match[]": m.group(1)})
            if res.get("status") != "success" or not res["data"]:
                fail(f"dashboard variable {v['name']}: {text} returns no values: {res}")
    return len(exprs), n_core, len(checked_selectors)


def check_rules(base, alerts):
    want = sorted(r.get("alert") or r.get("record") for g in alerts["groups"] for r in g["rules"])

    def loaded():
        rules = [r for g in api(base, "rules")["data"]["groups"] for r in g["rules"]]
        bad = [r for r in rules if r.get("health") == "err"]
        if bad:
            return bad
        if sorted(r["name"] for r in rules) == want and all(r.get("health") == "ok" for r in rules):
            return rules
        return None

    rules = wait_for("the alert rules to be loaded and evaluated", loaded, 30)
    for r in rules:
        if r.get("health") != "ok":
            fail(f"alert rule {r['name']}: health {r.get('health')}: {r.get('lastError')}")
    return len(rules)


def scraped(base, jobs, since=None, count=2):
    """True once every target is up and has at least `count` samples (after `since`)."""
    targets = api(base, "targets", state="active")["data"]["activeTargets"]
    if len(targets) != jobs or any(t["health"] != "up" for t in targets):
        return False
    res = query(base, f'count_over_time(up{{job=~"kvcache-.*"}}[5m])')["data"]["result"]
    if len(res) != jobs or any(float(s["value"][1]) < count for s in res):
        return False
    if since is not None:
        res = query(base, 'timestamp(up{job=~"kvcache-.*"})')["data"]["result"]
        return len(res) == jobs and all(float(s["value"][1]) > since for s in res)
    return True


def main():
    global verbose
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", required=True, help="kvcache-worker binary")
    ap.add_argument("--router", required=True, help="kvcache-router binary")
    ap.add_argument("--demo", required=True, help="kvcache-demo binary")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="GGUF model (default: $KVCACHE_MODEL or the setup one)")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    verbose = args.verbose
    prometheus, promtool = find_tool("prometheus"), find_tool("promtool")
    for b in (args.worker, args.router, args.demo):
        if not os.access(b, os.X_OK):
            die(f"{b} is not an executable: build kvcache-worker, kvcache-router and kvcache-demo first")
    if not os.path.isfile(args.model):
        die(f"model {args.model} not found: run scripts/setup.sh or pass --model / set KVCACHE_MODEL")
    contract = load_contract()
    with open(os.path.join(DEPLOY, "grafana", "kvcache-dashboard.json")) as f:
        dash = json.load(f)
    with open(os.path.join(DEPLOY, "prometheus", "alerts.yml")) as f:
        alerts = yaml.safe_load(f)

    # ctest (on a timeout) and users stop the test with SIGTERM: still stop what it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("FAIL: terminated (SIGTERM)"))
    t0 = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="kvcache-live-prom.")
    try:
        # Authenticated as deployed: a cluster token between router and workers, and an
        # admin client token for the demo (it forks and migrates).
        with open(os.path.join(tmp, "cluster-token"), "w") as f:
            f.write(secrets.token_hex(32))
        demo_token = secrets.token_hex(16)
        with open(os.path.join(tmp, "client-tokens"), "w") as f:
            f.write(f"{demo_token} default admin\n")
        common = ["--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0", "--shutdown_deadline=2s",
                  f"--cluster_token_file={os.path.join(tmp, 'cluster-token')}"]
        # A small tier 0 (34 pages of 16 tokens) as in scripts/run.sh, so that the demo's
        # conversations do not all fit and pages are offloaded and restored.
        workers = {}
        for w in ("w0", "w1"):
            workers[w] = start_server(w, [args.worker, *common, f"--worker_id={w}", f"--model={args.model}",
                                          "--threads=1", f"--tier0_bytes={12 << 20}", "--drain_deadline=2s"], tmp)
        router = start_server("router", [args.router, *common, f"--workers={workers['w0'][0]},{workers['w1'][0]}",
                                         "--min_ready_workers=2", "--rebalance_interval=0s",
                                         f"--model={args.model}",
                                         f"--auth_tokens_file={os.path.join(tmp, 'client-tokens')}"], tmp)
        log(f"workers {workers}, router {router} ({time.monotonic() - t0:.1f}s)")

        base = start_prometheus(prometheus, tmp, router[1], [workers[w][1] for w in sorted(workers)])
        log(f"prometheus ready on {base} ({time.monotonic() - t0:.1f}s)")
        wait_for("3 targets up with 2 scrapes each", lambda: scraped(base, 3), 60)
        log(f"targets up and scraped ({time.monotonic() - t0:.1f}s)")

        try:
            demo = subprocess.run([args.demo, f"--router={router[0]}", "--users=2", "--max_tokens=8",
                                   f"--token={demo_token}"],
                                  capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired as e:
            die(f"kvcache-demo did not finish within 120s:\n{(e.stdout or b'')[-3000:]!r}")
        if demo.returncode != 0:
            die(f"kvcache-demo exited {demo.returncode}:\n{demo.stdout[-3000:]}\n{demo.stderr[-2000:]}")
        if verbose:
            print(demo.stdout)
        traffic_end = time.time()
        log(f"kvcache-demo done ({time.monotonic() - t0:.1f}s)")
        bodies = [(name, kind, http_get(f"http://{addr}/metrics"))
                  for name, kind, addr in [("router", "router", router[1]), ("w0", "worker", workers["w0"][1]),
                                           ("w1", "worker", workers["w1"][1])]]
        check_metrics(promtool, contract, bodies)
        # Two scrapes after the traffic, so that rate() windows hold the final counter values.
        wait_for("a scrape of every target after the traffic",
                 lambda: scraped(base, 3, since=traffic_end + SCRAPE_INTERVAL_S), 30)
        n_rules = check_rules(base, alerts)
        n_exprs, n_core, n_sel = check_queries(base, dash, alerts, contract)
        elapsed = time.monotonic() - t0
    finally:
        stop_all()
        shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        sys.exit(f"check_live_prometheus: {len(failures)} problem(s)")
    print(f"check_live_prometheus: promtool accepts the 3 live /metrics; the {len(contract)} contract metrics are "
          f"exported with their types and labels; {n_rules} alert rules loaded (health ok); {n_exprs} dashboard "
          f"and alert expressions evaluate ({n_core} core panel queries return data, {n_sel} selectors match "
          f"live series) in {elapsed:.1f}s")


if __name__ == "__main__":
    main()
