#!/usr/bin/env python3
"""Validates deploy/k8s without a cluster:

1. deploy/generate.py --check: the PrometheusRule and the dashboard ConfigMap are up to date.
2. Renders overlays/cpu and overlays/gpu, each with every combination of the optional components
   (tls, autoscaling), with kustomize_lite.py (the same output as `kubectl kustomize`; see
   crosscheck_kustomize.sh).
3. Validates every built-in object against the Kubernetes JSON schemas (kubernetes-validate,
   strict: unknown fields are errors), and the Prometheus Operator objects structurally.
4. Checks the objects agree with each other: Service/PDB/ServiceMonitor selectors select pods,
   named ports exist, every flag is one the binary takes (its ABSL_FLAGs in the sources), every
   $(VAR) is defined, probes use the health service names and the gRPC ports, the router resolves
   the headless worker Service (which publishes not-ready workers), GPU requests, resources, TLS
   mounts. Router and workers pass the same --model (the router hashes prompts with the workers'
   tokenizer), a file their image bakes (its Dockerfile's ENV KVCACHE_MODEL) or on a mounted volume.
5. Secure by default: every worker and router reads --cluster_token_file from the mounted Secret
   kvcache-cluster-token, the router --auth_tokens_file from kvcache-router-tokens, nothing passes
   --allow_unauthenticated, and no Secret (no secret value) is in the manifests.
6. Drain timing: a worker's --shutdown_deadline covers running streams plus migrating its tier 0 +
   tier 1 at the measured migration throughput (with margin), and its grace period covers that;
   the HPA (autoscaling component) removes one worker per grace period; its metric is one the
   prometheus-adapter rule (components/autoscaling/prometheus-adapter-values.yaml) exposes from a
   worker gauge of deploy/metrics.txt, with a query promtool parses.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

try:
    import yaml
except ImportError:
    sys.exit("FAIL: PyYAML missing: apt-get install python3-yaml (or pip install PyYAML)")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
K8S = os.path.join(ROOT, "deploy", "k8s")
sys.path.insert(0, HERE)
import kustomize_lite  # noqa: E402

try:
    import kubernetes_validate
except ImportError:
    sys.exit("FAIL: python module kubernetes_validate missing: pip install kubernetes-validate==1.37.0")

K8S_VERSION = "1.30.0"  # native gRPC probes are GA since 1.27
# The sources whose ABSL_FLAGs each binary links (common/init.cc: --listen, --tls_*,
# --cluster_token_file, --allow_unauthenticated ...; common/logging.cc: --log_level).
FLAG_SOURCES = {
    "worker": ["worker/main.cc", "common/init.cc", "common/logging.cc"],
    "router": ["router/main.cc", "common/init.cc", "common/logging.cc"],
}
TLS_DIR = "/etc/kvcache/tls"
DOCKER = os.path.join(ROOT, "deploy", "docker")
# Secrets the operator creates (deploy/README.md): name, key, the flag that reads the file, roles.
SECRET_FILES = [
    ("kvcache-cluster-token", "token", "cluster_token_file", ("worker", "router")),
    ("kvcache-router-tokens", "tokens", "auth_tokens_file", ("router",)),
]
# Drain timing (deploy/README.md, "Drain timing"). README.md's benchmarks: migrating a 4,000-token
# SmolLM2 session (92.16 MB of KV) took 274 ms, i.e. 336 MB/s per migration.
MIGRATION_BYTES_PER_S = 336e6
STREAMS_S = 60          # running streams may finish within the deadline (--drain_deadline)
MIGRATION_MARGIN = 1.5  # on the time to migrate tier 0 + tier 1
EXIT_S = 30             # grace period beyond --shutdown_deadline: last migrations in flight, exit
ADAPTER_VALUES = os.path.join(K8S, "components", "autoscaling", "prometheus-adapter-values.yaml")
COMPONENT_SETS = [(), ("tls",), ("autoscaling",), ("tls", "autoscaling")]
FLAGS = {}  # role -> flag names, from the sources (source_flags)

errors = []


def err(variant, msg):
    errors.append(f"[{variant}] {msg}")


def selects(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def duration_seconds(text):
    m = re.fullmatch(r"(\d+)(s|m)", text)
    if not m:
        return None
    return int(m.group(1)) * (60 if m.group(2) == "m" else 1)


def source_flags():
    """Flag names each binary takes, from the ABSL_FLAG definitions in its sources."""
    flags = {}
    for role, files in FLAG_SOURCES.items():
        names = set()
        for f in files:
            with open(os.path.join(ROOT, f)) as fh:
                text = re.sub(r"//[^\n]*", "", fh.read())
            names |= set(re.findall(r"\bABSL_FLAG\(\s*[^,()]+?\s*,\s*([A-Za-z_]\w*)\s*,", text))
        flags[role] = names
    # Guard the parser: flags the manifests rely on must be found where they are defined.
    for role, want in (("worker", {"listen", "log_level", "cluster_token_file", "allow_unauthenticated",
                                   "tier0_bytes"}),
                       ("router", {"listen", "log_level", "cluster_token_file", "allow_unauthenticated",
                                   "auth_tokens_file", "worker_dns", "worker_tls_ca"})):
        if want - flags[role]:
            errors.append(f"no ABSL_FLAG for {sorted(want - flags[role])} in {FLAG_SOURCES[role]}")
    return flags


def baked_model(dockerfile):
    """The model path the image bakes by default (MODEL=pypi), from its Dockerfile; None if none."""
    with open(os.path.join(DOCKER, dockerfile)) as fh:
        text = fh.read()
    m = re.search(r"^ENV KVCACHE_MODEL=(\S+)", text, re.M)
    if not m or not re.search(r"^ARG MODEL=pypi$", text, re.M) or \
            not re.search(r"^COPY --from=model /models /models$", text, re.M):
        return None
    return m.group(1)


# The model the images bake (SmolLM2-135M-Instruct Q4_1).
BAKED_MODEL_BYTES = 98_362_432


def worker_process_bytes():
    """kWorkerProcessBytes of common/memory_limit.h: the worker's memory beside its tiers and model."""
    with open(os.path.join(ROOT, "common", "memory_limit.h")) as fh:
        m = re.search(r"kWorkerProcessBytes = int64_t\{(\d+)\} << (\d+);", fh.read())
    if not m:
        sys.exit("FAIL: kWorkerProcessBytes not found in common/memory_limit.h")
    return int(m.group(1)) << int(m.group(2))


def memory_bytes(quantity):
    """A Kubernetes memory quantity (\"6Gi\", \"512Mi\", \"4G\", bytes) in bytes; None if unreadable."""
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|k|M|G|T)?", str(quantity or ""))
    if not m:
        return None
    scale = {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9,
             "T": 10**12}[m.group(2)]
    return int(m.group(1)) * scale


def router_default_seconds(flag):
    """The default of a router duration flag given as absl::Seconds(N)."""
    with open(os.path.join(ROOT, "router", "main.cc")) as fh:
        m = re.search(rf"ABSL_FLAG\(\s*absl::Duration,\s*{flag},\s*absl::Seconds\((\d+)\)", fh.read())
    if not m:
        errors.append(f"router/main.cc: no absl::Seconds default for --{flag}")
        return 0
    return int(m.group(1))


def worker_gauges():
    """Gauges deploy/metrics.txt lists for kvcache-worker."""
    gauges, section = set(), None
    with open(os.path.join(ROOT, "deploy", "metrics.txt")) as fh:
        for line in fh:
            if line.startswith("# kvcache-"):
                section = line[2:].strip()
            elif not line.startswith("#") and line.strip():
                name, kind = line.split("\t")[:2]
                if section == "kvcache-worker" and kind == "gauge":
                    gauges.add(name)
    return gauges


def check_adapter_rules():
    """The prometheus-adapter rules: returns {exposed metric name: series}."""
    where = os.path.relpath(ADAPTER_VALUES, ROOT)
    with open(ADAPTER_VALUES) as fh:
        values = yaml.safe_load(fh)
    rules = (values or {}).get("rules", {}).get("custom")
    if not isinstance(rules, list) or not rules:
        errors.append(f"{where}: want a non-empty rules.custom list")
        return {}
    gauges, exposed, queries = worker_gauges(), {}, []
    for r in rules:
        m = re.fullmatch(r"([a-zA-Z_:][\w:]*)\{([^}]*)\}", r.get("seriesQuery", ""))
        if not m or m.group(1) not in gauges:
            errors.append(f"{where}: seriesQuery {r.get('seriesQuery')!r} must select a worker gauge of "
                          f"deploy/metrics.txt")
            continue
        if 'namespace!=""' not in m.group(2) or 'pod!=""' not in m.group(2):
            errors.append(f"{where}: seriesQuery must require the namespace and pod target labels")
        overrides = r.get("resources", {}).get("overrides", {})
        if overrides.get("namespace") != {"resource": "namespace"} or overrides.get("pod") != {"resource": "pod"}:
            errors.append(f"{where}: resources.overrides must map namespace and pod, got {overrides}")
        name = r.get("name", {})
        if not re.fullmatch(r"[a-z_:][a-z0-9_:]*", str(name.get("as", ""))) or \
                not re.search(name.get("matches", "^$"), m.group(1)):
            errors.append(f"{where}: name must match {m.group(1)} and expose it `as` a metric name")
            continue
        q = r.get("metricsQuery", "")
        if any(t not in q for t in ("<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>")):
            errors.append(f"{where}: metricsQuery must use <<.Series>>, <<.LabelMatchers>> and <<.GroupBy>>")
        queries.append(q.replace("<<.Series>>", m.group(1))
                       .replace("<<.LabelMatchers>>", 'namespace="kvcache",pod=~"kvcache-worker-0|kvcache-worker-1"')
                       .replace("<<.GroupBy>>", "pod"))
        exposed[name["as"]] = m.group(1)
    promtool = shutil.which("promtool")
    if not promtool:
        sys.exit("FAIL: promtool not found: apt-get install prometheus")
    with tempfile.NamedTemporaryFile("w", suffix=".yml", delete=False) as f:
        yaml.safe_dump({"groups": [{"name": "adapter", "rules": [
            {"record": f"adapter:query_{i}", "expr": q} for i, q in enumerate(queries)]}]}, f)
    try:
        r = subprocess.run([promtool, "check", "rules", f.name], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    if r.returncode != 0:
        errors.append(f"{where}: promtool rejects a metricsQuery:\n{r.stdout}{r.stderr}")
    return exposed


def secret_file(pod, c, path):
    """(Secret name, key, read-only) of the Secret volume file `path` in container c, or None."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for m in c.get("volumeMounts", []):
        secret = volumes.get(m["name"], {}).get("secret")
        if not secret:
            continue
        if m.get("subPath"):
            if m["mountPath"] != path:
                continue
            name = m["subPath"]
        elif os.path.dirname(path) == m["mountPath"].rstrip("/"):
            name = os.path.basename(path)
        else:
            continue
        items = secret.get("items")
        key = name if items is None else next((i["key"] for i in items if i["path"] == name), None)
        if key is not None:
            return secret.get("secretName"), key, bool(m.get("readOnly"))
    return None


def check_crd(variant, o):
    name = f"{o['kind']}/{o['metadata'].get('name')}"
    spec = o.get("spec")
    if o["apiVersion"] != "monitoring.coreos.com/v1" or not isinstance(spec, dict):
        return err(variant, f"{name}: want apiVersion monitoring.coreos.com/v1 and a spec")
    if o["kind"] == "ServiceMonitor":
        if not isinstance(spec.get("selector", {}).get("matchLabels"), dict):
            err(variant, f"{name}: spec.selector.matchLabels missing")
        eps = spec.get("endpoints")
        if not isinstance(eps, list) or not eps:
            err(variant, f"{name}: spec.endpoints must be a non-empty list")
        for ep in eps or []:
            unknown = set(ep) - {"port", "targetPort", "path", "interval", "scrapeTimeout", "scheme",
                                 "tlsConfig", "relabelings", "metricRelabelings", "honorLabels"}
            if unknown or "port" not in ep:
                err(variant, f"{name}: endpoint {ep}: needs port, unknown fields {sorted(unknown)}")
            for key in ("interval", "scrapeTimeout"):
                if key in ep and not re.fullmatch(r"\d+(ms|s|m|h)", ep[key]):
                    err(variant, f"{name}: bad {key} {ep[key]!r}")
    elif o["kind"] == "PrometheusRule":
        groups = spec.get("groups")
        if not isinstance(groups, list) or not groups:
            return err(variant, f"{name}: spec.groups must be a non-empty list")
        for g in groups:
            if not isinstance(g.get("name"), str) or not isinstance(g.get("rules"), list):
                err(variant, f"{name}: group needs name and rules")
            for r in g.get("rules", []):
                if ("alert" in r) == ("record" in r) or not isinstance(r.get("expr"), str):
                    err(variant, f"{name}: rule needs expr and exactly one of alert/record: {r}")
                if "for" in r and not re.fullmatch(r"\d+[smh]", r["for"]):
                    err(variant, f"{name}: bad for {r['for']!r}")
                for key in ("labels", "annotations"):
                    if not all(isinstance(v, str) for v in r.get(key, {}).values()):
                        err(variant, f"{name}: {key} values must be strings")
    else:
        err(variant, f"{name}: unexpected monitoring.coreos.com kind")


def check_container(variant, role, pod, c, configmaps, tls):
    where = f"{role} container {c['name']}"
    env_names = {e["name"] for e in c.get("env", [])}
    for ef in c.get("envFrom", []):
        cm = configmaps.get(ef.get("configMapRef", {}).get("name"))
        if cm is None:
            err(variant, f"{where}: envFrom names a missing ConfigMap {ef}")
        else:
            env_names |= set(cm.get("data", {}))
    env_values = {}
    for ef in c.get("envFrom", []):
        env_values.update(configmaps.get(ef.get("configMapRef", {}).get("name"), {}).get("data", {}))
    flags = {}
    for a in c.get("args", []):
        m = re.fullmatch(r"--([a-z0-9_]+)=(.*)", a)
        if not m:
            err(variant, f"{where}: argument {a!r} is not --flag=value")
            continue
        if m.group(1) not in FLAGS[role]:
            err(variant, f"{where}: kvcache-{role} takes no flag --{m.group(1)}")
        flags[m.group(1)] = m.group(2)
        for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", a):
            if var not in env_names:
                err(variant, f"{where}: {a} uses $({var}), which no env or ConfigMap key defines")
    ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
    if set(ports) != {"grpc", "metrics"}:
        err(variant, f"{where}: want ports named grpc and metrics, got {sorted(map(str, ports))}")
    if flags.get("listen") != f"0.0.0.0:{ports.get('grpc')}":
        err(variant, f"{where}: --listen={flags.get('listen')} does not match port grpc {ports.get('grpc')}")
    if flags.get("metrics_listen") != f"0.0.0.0:{ports.get('metrics')}" or ports.get("metrics") != 9090:
        err(variant, f"{where}: --metrics_listen={flags.get('metrics_listen')} / port metrics must be 9090")
    want_grpc = {"worker": 7070, "router": 7000}[role]
    if ports.get("grpc") != want_grpc:
        err(variant, f"{where}: grpc port {ports.get('grpc')}, want {want_grpc}")
    required = ["model", "tls_cert", "tls_key", "tls_client_ca", "shutdown_deadline", "log_level",
                "cluster_token_file"]
    if role == "worker":
        required += ["drain_deadline"]
    if role == "router":
        required += ["auth_tokens_file", "worker_tls_ca", "worker_tls_cert", "worker_tls_key"]
    for f in required:
        if f not in flags:
            err(variant, f"{where}: --{f} missing")

    def expand(v):
        return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: str(env_values.get(m.group(1), "")), v)

    # The model (the binary exits at start without it): a file the image bakes, or on a volume.
    model = expand(flags.get("model", ""))
    image = c.get("image", "")
    dockerfile = {"router": "Dockerfile.router"}.get(role) or \
        ("Dockerfile.worker-cuda" if image.endswith(":cuda") else "Dockerfile.worker")
    mounted = [m["mountPath"] for m in c.get("volumeMounts", [])
               if model.startswith(m["mountPath"].rstrip("/") + "/")]
    baked = baked_model(dockerfile)
    if not model.startswith("/") or (not mounted and model != baked):
        err(variant, f"{where}: --model={model!r} is neither the file deploy/docker/{dockerfile} bakes "
                     f"({baked or 'it bakes none'}) nor on a mounted volume")

    # Probes: liveness/startup on "liveness", readiness on "readiness", against the gRPC port.
    for probe, service in (("startupProbe", "liveness"), ("livenessProbe", "liveness"),
                           ("readinessProbe", "readiness")):
        p = c.get(probe)
        if not p:
            err(variant, f"{where}: {probe} missing")
            continue
        if not tls:
            if p.get("grpc") != {"port": want_grpc, "service": service}:
                err(variant, f"{where}: {probe} must be grpc {{port: {want_grpc}, service: {service}}}, "
                             f"got {p.get('grpc')}")
        else:
            cmd = p.get("exec", {}).get("command", [])
            want = [f"--addr=127.0.0.1:{want_grpc}", f"--service={service}", f"--tls_ca={TLS_DIR}/ca.crt",
                    f"--tls_cert={TLS_DIR}/tls.crt", f"--tls_key={TLS_DIR}/tls.key"]
            if "grpc" in p or not cmd or cmd[0] != "/usr/local/bin/kvcache-health" or \
                    any(w not in cmd for w in want):
                err(variant, f"{where}: TLS {probe} must exec kvcache-health with {want}, got {p}")
    if c.get("startupProbe"):
        sp = c["startupProbe"]
        budget = sp.get("periodSeconds", 10) * sp.get("failureThreshold", 3)
        if role == "worker" and budget < 120:
            err(variant, f"{where}: startupProbe allows only {budget}s for the model to load")
    # preStop pause (the router's, so that the Service endpoints drop it first; a worker needs
    # none: it announces its drain on its Watch streams), then SIGTERM drain within the grace period.
    pause = 0
    cmd = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    if cmd or role == "router":
        if len(cmd) != 2 or not cmd[0].endswith("sleep") or not cmd[1].isdigit():
            err(variant, f"{where}: preStop must be exec sleep N, got {cmd}")
        else:
            pause = int(cmd[1])
    deadline = duration_seconds(expand(flags.get("shutdown_deadline", "")))
    grace = pod.get("terminationGracePeriodSeconds", 30)
    if deadline is None:
        err(variant, f"{where}: --shutdown_deadline={expand(flags.get('shutdown_deadline', ''))} not Ns/Nm")
    elif role == "router" and grace < pause + deadline + 10:
        err(variant, f"{where}: terminationGracePeriodSeconds {grace} < preStop {pause}s + deadline "
                     f"{deadline}s + 10s")
    elif role == "worker":
        # The worker drains within --shutdown_deadline: running streams, then every session
        # migrated away. Worst case it holds tier 0 + tier 1 full of sessions.
        kv_bytes = sum(int(expand(flags.get(k, "")) or 0) for k in ("tier0_bytes", "tier1_bytes")
                       if expand(flags.get(k, "")).isdigit())
        migrate_s = kv_bytes / MIGRATION_BYTES_PER_S
        need = STREAMS_S + MIGRATION_MARGIN * migrate_s
        # Streams get --drain_deadline (capped at two thirds of the deadline), then are cut.
        streams = duration_seconds(expand(flags.get("drain_deadline", "")))
        if streams is None or streams > STREAMS_S:
            err(variant, f"{where}: --drain_deadline={expand(flags.get('drain_deadline', ''))} must be at "
                         f"most the {STREAMS_S}s the deadline budgets for streams")
        if deadline < need:
            err(variant, f"{where}: --shutdown_deadline {deadline}s < {STREAMS_S}s for streams + "
                         f"{MIGRATION_MARGIN} x {migrate_s:.0f}s to migrate {kv_bytes / 2**30:.1f} GiB "
                         f"of KV at {MIGRATION_BYTES_PER_S / 1e6:.0f} MB/s = {need:.0f}s")
        if grace < pause + deadline + EXIT_S:
            err(variant, f"{where}: terminationGracePeriodSeconds {grace} < preStop {pause}s + deadline "
                         f"{deadline}s + {EXIT_S}s")
    if role == "worker" and grace < 120:
        err(variant, f"{where}: worker grace period {grace}s leaves no time to migrate sessions")
    # Resources.
    res = c.get("resources", {})
    for kind in ("requests", "limits"):
        for r in ("cpu", "memory"):
            if r not in res.get(kind, {}):
                err(variant, f"{where}: resources.{kind}.{r} missing")
    # Secure by default: the token files come from the Secrets the operator creates.
    for secret, key, flag, roles in SECRET_FILES:
        if role not in roles:
            continue
        path = expand(flags.get(flag, ""))
        found = secret_file(pod, c, path) if path.startswith("/") else None
        if found is None or found[:2] != (secret, key):
            err(variant, f"{where}: --{flag}={path!r} must name key {key!r} of the Secret {secret}, mounted; "
                         f"got {found}")
        elif not found[2]:
            err(variant, f"{where}: mount the Secret {secret} readOnly")
    if "allow_unauthenticated" in json.dumps([c, {k: v for k, v in env_values.items()}]):
        err(variant, f"{where}: passes --allow_unauthenticated: the manifests must be secure by default")
    # TLS: the flags point into the mounted Secret, or are all empty.
    tls_flags = ["tls_cert", "tls_key", "tls_client_ca"]
    tls_want = [f"{TLS_DIR}/tls.crt", f"{TLS_DIR}/tls.key", f"{TLS_DIR}/ca.crt"]
    if role == "router":  # the router's client side towards the workers
        tls_flags += ["worker_tls_ca", "worker_tls_cert", "worker_tls_key"]
        tls_want += [f"{TLS_DIR}/ca.crt", f"{TLS_DIR}/tls.crt", f"{TLS_DIR}/tls.key"]
    tls_values = [expand(flags.get(f, "")) for f in tls_flags]
    mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    if tls:
        if tls_values != tls_want:
            err(variant, f"{where}: TLS flags {tls_flags} expand to {tls_values}, want {tls_want}")
        secret = volumes.get(mounts.get(TLS_DIR), {}).get("secret", {}).get("secretName")
        if secret != "kvcache-tls":
            err(variant, f"{where}: Secret kvcache-tls not mounted at {TLS_DIR}")
        if not pod.get("securityContext", {}).get("fsGroup"):
            err(variant, f"{where}: fsGroup needed for the non-root user to read the Secret")
    elif any(tls_values):
        err(variant, f"{where}: TLS flags set without the tls component: {tls_values}")
    if "/tmp" not in mounts:
        err(variant, f"{where}: read-only root filesystem needs an emptyDir at /tmp")
    sc = c.get("securityContext", {})
    if sc.get("allowPrivilegeEscalation") is not False or not sc.get("readOnlyRootFilesystem"):
        err(variant, f"{where}: securityContext must forbid privilege escalation, read-only root fs")
    if not pod.get("securityContext", {}).get("runAsNonRoot"):
        err(variant, f"{where}: pod must runAsNonRoot")
    return flags, expand, res


def check_variant(variant, objs, gpu, tls, autoscaling, exposed):
    by_kind = {}
    for o in objs:
        by_kind.setdefault(o["kind"], {})[o["metadata"]["name"]] = o

    # 3. Schemas.
    for o in objs:
        name = f"{o['kind']}/{o['metadata']['name']}"
        if o["apiVersion"].startswith("monitoring.coreos.com/"):
            check_crd(variant, o)
            continue
        try:
            kubernetes_validate.validate(o, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            err(variant, f"{name}: schema: {path}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError:
            err(variant, f"{name}: no Kubernetes {K8S_VERSION} schema for {o['apiVersion']} {o['kind']}")

    # 4. Consistency.
    namespaces = list(by_kind.get("Namespace", {}))
    if len(namespaces) != 1:
        return err(variant, f"want one Namespace, got {namespaces}")
    ns = namespaces[0]
    for o in objs:
        if o["kind"] != "Namespace" and o["metadata"].get("namespace") != ns:
            err(variant, f"{o['kind']}/{o['metadata']['name']}: not in namespace {ns}")
    if by_kind.get("Secret"):
        err(variant, f"Secrets {sorted(by_kind['Secret'])} in the manifests: the operator creates them")
    sts = by_kind.get("StatefulSet", {}).get("kvcache-worker")
    dep = by_kind.get("Deployment", {}).get("kvcache-router")
    if not sts or not dep:
        return err(variant, "StatefulSet kvcache-worker and Deployment kvcache-router are required")
    if dep["spec"].get("replicas") != 2:
        err(variant, "router Deployment: want 2 replicas")
    configmaps = by_kind.get("ConfigMap", {})
    workloads = {"worker": sts, "router": dep}
    pod_labels = {r: w["spec"]["template"]["metadata"]["labels"] for r, w in workloads.items()}
    container_ports = {}
    flags = {}
    for role, w in workloads.items():
        if not selects(w["spec"]["selector"]["matchLabels"], pod_labels[role]):
            err(variant, f"{role}: selector does not match its pod template")
        pod = w["spec"]["template"]["spec"]
        cs = pod["containers"]
        if len(cs) != 1:
            err(variant, f"{role}: want one container")
        c = cs[0]
        container_ports[role] = {p.get("name") for p in c.get("ports", [])}
        f, expand, res = check_container(variant, role, pod, c, configmaps, tls)
        flags[role] = (f, expand)
        image = c.get("image", "")
        if role == "worker":
            want_tag = "cuda" if gpu else "cpu"
            if not image.endswith(":" + want_tag):
                err(variant, f"worker image {image!r}: want tag {want_tag}")
            device = expand(f.get("device", ""))
            gpus = [res.get(k, {}).get("nvidia.com/gpu") for k in ("requests", "limits")]
            if gpu:
                if device != "cuda:0" or gpus != [1, 1]:
                    err(variant, f"gpu worker: --device={device}, nvidia.com/gpu requests/limits {gpus}")
                if not pod.get("tolerations") or not pod.get("nodeSelector"):
                    err(variant, "gpu worker: nodeSelector and tolerations example missing")
            elif device != "cpu" or gpus != [None, None]:
                err(variant, f"cpu worker: --device={device}, nvidia.com/gpu {gpus}")
            if f.get("worker_id") != "$(POD_NAME)" or not any(
                    e["name"] == "POD_NAME" and e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
                    == "metadata.name" for e in c.get("env", [])):
                err(variant, "worker: --worker_id must be the pod name from the downward API")
            for k in ("tier0_bytes", "tier1_bytes", "page_tokens", "threads", "max_batch_tokens", "max_context"):
                if not expand(f.get(k, "")).isdigit():
                    err(variant, f"worker: --{k}={expand(f.get(k, ''))} is not a number")
            # The budgets fit the memory limit as the worker checks at start (else it refuses them):
            # tier 1, tier 0 on the CPU, the model and the process (common/memory_limit.h).
            tiers = [int(v) if (v := expand(f.get(k, ""))).isdigit() else 0 for k in ("tier0_bytes", "tier1_bytes")]
            need = (0 if gpu else tiers[0]) + tiers[1] + BAKED_MODEL_BYTES + worker_process_bytes()
            limit = memory_bytes(res.get("limits", {}).get("memory"))
            if limit is None or need > limit:
                err(variant, f"worker: memory limit {res.get('limits', {}).get('memory')} below the "
                             f"{need / 2**30:.2f} GiB its KV budgets, model and process need")

    # One model: the router hashes prompts with the workers' tokenizer.
    models = {role: flags[role][1](flags[role][0].get("model", "")) for role in workloads}
    if models["router"] != models["worker"]:
        err(variant, f"router --model={models['router']!r} is not the workers' {models['worker']!r}: the "
                     f"router hashes prompts with the workers' tokenizer")

    # Worker updates: one pod at a time, each Ready long enough for the routers to resolve it.
    worker_grace = sts["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
    upd = sts["spec"].get("updateStrategy", {})
    if upd.get("type") != "RollingUpdate" or upd.get("rollingUpdate", {}).get("maxUnavailable", 1) != 1:
        err(variant, f"worker StatefulSet: want RollingUpdate one pod at a time, got {upd}")
    dns_refresh = duration_seconds(flags["router"][1](flags["router"][0].get("dns_refresh", ""))) or \
        router_default_seconds("dns_refresh")
    if sts["spec"].get("minReadySeconds", 0) < dns_refresh:
        err(variant, f"worker StatefulSet: minReadySeconds {sts['spec'].get('minReadySeconds', 0)} < the "
                     f"routers' --dns_refresh {dns_refresh}s")

    # The headless Service the StatefulSet and the router's --worker_dns use. It publishes
    # not-ready pods: a draining worker must stay in DNS until its sessions are migrated.
    services = by_kind.get("Service", {})
    headless = services.get(sts["spec"].get("serviceName"))
    if not headless or headless["spec"].get("clusterIP") != "None":
        err(variant, f"StatefulSet serviceName {sts['spec'].get('serviceName')} is not a headless Service")
    elif headless["spec"].get("publishNotReadyAddresses") is not True:
        err(variant, f"Service {headless['metadata']['name']}: want publishNotReadyAddresses: true (draining "
                     f"workers stay in DNS)")
    else:
        grpc_port = next((p["port"] for p in headless["spec"]["ports"] if p["name"] == "grpc"), None)
        want = f"{headless['metadata']['name']}.$(POD_NAMESPACE).svc.cluster.local:{grpc_port}"
        if flags["router"][0].get("worker_dns") != want:
            err(variant, f"router --worker_dns={flags['router'][0].get('worker_dns')}, want {want}")
        rc = dep["spec"]["template"]["spec"]["containers"][0]
        if not any(e["name"] == "POD_NAMESPACE" and e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
                   == "metadata.namespace" for e in rc.get("env", [])):
            err(variant, "router: POD_NAMESPACE must come from the downward API")
    if services.get("kvcache-router", {}).get("spec", {}).get("type") != "ClusterIP":
        err(variant, "Service kvcache-router must be ClusterIP")
    for name, s in services.items():
        roles = [r for r in workloads if selects(s["spec"].get("selector"), pod_labels[r])]
        if len(roles) != 1:
            err(variant, f"Service {name} selects {roles}, want exactly one workload")
            continue
        for p in s["spec"]["ports"]:
            if p.get("targetPort") not in container_ports[roles[0]]:
                err(variant, f"Service {name} port {p['name']}: targetPort {p.get('targetPort')} not a named port")
        if {p["name"] for p in s["spec"]["ports"]} != {"grpc", "metrics"}:
            err(variant, f"Service {name}: want ports grpc and metrics")
    pdbs = by_kind.get("PodDisruptionBudget", {})
    want_pdb = {"worker": ("maxUnavailable", 1), "router": ("minAvailable", 1)}
    for role, (field, value) in want_pdb.items():
        found = [p for p in pdbs.values() if selects(p["spec"]["selector"]["matchLabels"], pod_labels[role])]
        if len(found) != 1 or found[0]["spec"].get(field) != value:
            err(variant, f"{role}: want one PodDisruptionBudget with {field}: {value}")

    # Autoscaling: the HPA owns the worker count and removes one worker per drain.
    hpas = by_kind.get("HorizontalPodAutoscaler", {})
    if not autoscaling:
        if hpas:
            err(variant, f"HorizontalPodAutoscaler {sorted(hpas)} without the autoscaling component")
        if sts["spec"].get("replicas", 1) < 2:
            err(variant, "worker StatefulSet: want at least 2 replicas (migration needs a target)")
    elif len(hpas) != 1:
        err(variant, f"autoscaling: want one HorizontalPodAutoscaler, got {sorted(hpas)}")
    else:
        hpa = next(iter(hpas.values()))
        spec = hpa["spec"]
        where = f"HorizontalPodAutoscaler/{hpa['metadata']['name']}"
        if hpa["apiVersion"] != "autoscaling/v2":
            err(variant, f"{where}: want autoscaling/v2")
        if spec["scaleTargetRef"] != {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "kvcache-worker"}:
            err(variant, f"{where}: scaleTargetRef {spec['scaleTargetRef']} is not the worker StatefulSet")
        if "replicas" in sts["spec"]:
            err(variant, "worker StatefulSet: spec.replicas must be unset when the HPA owns it")
        if not 2 <= spec.get("minReplicas", 1) <= spec["maxReplicas"]:
            err(variant, f"{where}: want 2 <= minReplicas <= maxReplicas")
        for m in spec.get("metrics", []):
            name = m.get("pods", {}).get("metric", {}).get("name")
            if m.get("type") != "Pods" or name not in exposed:
                err(variant, f"{where}: metric {m} must be a Pods metric the prometheus-adapter rule exposes "
                             f"({sorted(exposed)})")
            elif m["pods"]["target"].get("type") != "AverageValue":
                err(variant, f"{where}: a Pods metric targets an AverageValue")
        if not spec.get("metrics"):
            err(variant, f"{where}: no metrics")
        down = spec.get("behavior", {}).get("scaleDown", {})
        policies = down.get("policies", [])
        if not policies or any(p["type"] != "Pods" or p["value"] != 1 or p["periodSeconds"] < worker_grace
                               for p in policies):
            err(variant, f"{where}: scaleDown must remove 1 pod per period >= the worker grace period "
                         f"{worker_grace}s (one drain at a time), got {policies}")
        if down.get("stabilizationWindowSeconds", 300) < 300:
            err(variant, f"{where}: scaleDown.stabilizationWindowSeconds under 300s")

    # Monitoring.
    sms = by_kind.get("ServiceMonitor", {})
    scraped = set()
    for sm in sms.values():
        for name, s in services.items():
            if selects(sm["spec"]["selector"]["matchLabels"], s["metadata"].get("labels", {})):
                scraped.add(name)
                for ep in sm["spec"]["endpoints"]:
                    if ep["port"] not in {p["name"] for p in s["spec"]["ports"]} or ep.get("path") != "/metrics":
                        err(variant, f"ServiceMonitor: Service {name} has no port {ep['port']} (or path not /metrics)")
    if scraped != set(services):
        err(variant, f"ServiceMonitor scrapes {sorted(scraped)}, want {sorted(services)}")
    with open(os.path.join(ROOT, "deploy", "prometheus", "alerts.yml")) as f:
        alerts = yaml.safe_load(f)
    rules = by_kind.get("PrometheusRule", {})
    if len(rules) != 1 or next(iter(rules.values()))["spec"]["groups"] != alerts["groups"]:
        err(variant, "PrometheusRule groups differ from deploy/prometheus/alerts.yml")
    dash = [cm for cm in configmaps.values() if cm["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
    with open(os.path.join(ROOT, "deploy", "grafana", "kvcache-dashboard.json")) as f:
        dash_text = f.read()
    if len(dash) != 1 or dash[0].get("data", {}).get("kvcache-dashboard.json") != dash_text:
        err(variant, "want one ConfigMap labelled grafana_dashboard=\"1\" holding deploy/grafana/kvcache-dashboard.json")
    else:
        json.loads(dash[0]["data"]["kvcache-dashboard.json"])


def main():
    global FLAGS
    gen = subprocess.run([sys.executable, os.path.join(ROOT, "deploy", "generate.py"), "--check"],
                         capture_output=True, text=True)
    if gen.returncode != 0:
        errors.append("deploy/generate.py --check: " + (gen.stderr or gen.stdout).strip())
    FLAGS = source_flags()
    exposed = check_adapter_rules()
    variants = 0
    want = 2 * len(COMPONENT_SETS)
    for overlay in ("cpu", "gpu"):
        for comps in COMPONENT_SETS:
            variant = "+".join((overlay,) + comps)
            try:
                objs = kustomize_lite.render(os.path.join(K8S, "overlays", overlay),
                                             [f"../../components/{c}" for c in comps])
            except (kustomize_lite.RenderError, OSError, yaml.YAMLError, KeyError) as e:
                err(variant, f"render: {e}")
                continue
            before = len(errors)
            check_variant(variant, objs, gpu=(overlay == "gpu"), tls="tls" in comps,
                          autoscaling="autoscaling" in comps, exposed=exposed)
            variants += 1
            print(f"{variant}: {len(objs)} objects ({', '.join(sorted({o['kind'] for o in objs}))}): "
                  f"{'ok' if len(errors) == before else 'FAILED'}")
    for e in errors:
        print("FAIL:", e)
    if errors or variants != want:
        sys.exit(f"check_k8s: {len(errors)} problem(s)")
    print(f"check_k8s: {want} renderings valid against Kubernetes {K8S_VERSION} schemas and consistent; "
          f"secure by default; drain timing covers tier 0 + tier 1 at {MIGRATION_BYTES_PER_S / 1e6:.0f} MB/s")


if __name__ == "__main__":
    main()
