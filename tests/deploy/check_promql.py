#!/usr/bin/env python3
"""Checks every PromQL expression of the Grafana dashboard and the alert rules against the metric
contract deploy/metrics.txt, and the dashboard's structure:

- every metric an expression names is in the contract (histograms: X_bucket/X_sum/X_count), or
  Prometheus's own `up`; every label it filters or groups by belongs to one of its metrics (or is
  a target label: job, instance, namespace, pod; `le` for buckets);
- counters and histogram series appear only inside rate()/increase(), gauges never do;
  histogram_quantile() aggregates by le;
- every expression parses: the dashboard's are written into a rule file, with Grafana variables
  substituted, and checked with `promtool check rules`;
- the dashboard uses every contract metric, a datasource variable and a `worker` variable, and
  its panels have unique ids and do not overlap;
- deploy/README.md's metrics table lists exactly the contract (name, type, labels).
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

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
DEPLOY = os.path.join(ROOT, "deploy")
TARGET_LABELS = {"job", "instance", "namespace", "pod", "service", "container", "endpoint"}
KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
            "offset", "bool", "inf", "nan", "atan2"}
errors = []


def load_contract():
    contract = {}
    with open(os.path.join(DEPLOY, "metrics.txt")) as f:
        for n, line in enumerate(f, 1):
            if not line.strip() or line.startswith("#"):
                continue
            parts = line.rstrip("\n").split("\t")
            if len(parts) != 4 or parts[1] not in ("counter", "gauge", "histogram"):
                sys.exit(f"FAIL: deploy/metrics.txt:{n}: want name<TAB>type<TAB>labels<TAB>meaning")
            name, kind, labels, _ = parts
            if (kind == "counter") != name.endswith("_total"):
                errors.append(f"metrics.txt: {name}: counters, and only counters, end in _total")
            contract[name] = (kind, set() if labels == "-" else set(labels.split(",")))
    return contract


def series_names(contract):
    """Series name -> (metric, kind as used: counter, gauge, histogram-series)."""
    out = {"up": ("up", "gauge")}
    for name, (kind, _) in contract.items():
        if kind == "histogram":
            for suffix in ("_bucket", "_sum", "_count"):
                out[name + suffix] = (name, "histogram")
        else:
            out[name] = (name, kind)
    return out


def substitute(expr):
    return (expr.replace("$__rate_interval", "5m").replace("$__interval", "1m")
            .replace("${worker}", ".*").replace("$worker", ".*"))


def check_expr(where, expr, contract, series):
    e = substitute(expr)
    no_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', e)
    labels_used = set()
    for body in re.findall(r"\{([^}]*)\}", no_strings):
        labels_used |= set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", body))
    for clause in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", no_strings):
        labels_used |= {x.strip() for x in clause.split(",") if x.strip()}
    bare = re.sub(r"\{[^}]*\}", " ", no_strings)
    bare = re.sub(r"\[[^\]]*\]", " ", bare)
    bare = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", bare)
    used = []
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", bare):
        word = m.group(0)
        if word in KEYWORDS or re.match(r"\s*\(", bare[m.end():]):
            continue
        if m.start() > 0 and (bare[m.start() - 1].isdigit() or bare[m.start() - 1] == "."):
            continue  # a number like 1e3 or a duration
        if word not in series:
            errors.append(f"{where}: {word!r} is not in the metric contract (deploy/metrics.txt): {expr}")
            continue
        used.append((word, m.start()))
    allowed = set(TARGET_LABELS)
    for word, pos in used:
        metric, kind = series[word]
        if metric in contract:
            allowed |= contract[metric][1]
        if word.endswith("_bucket"):
            allowed.add("le")
        if metric == "kvcache_router_worker_up":
            allowed.add("worker")
        inside_rate = re.search(r"\b(?:rate|increase|irate)\s*\(\s*$", bare[:pos]) is not None
        if kind in ("counter", "histogram") and not inside_rate:
            errors.append(f"{where}: {kind} series {word} used outside rate()/increase(): {expr}")
        if kind == "gauge" and inside_rate:
            errors.append(f"{where}: gauge {word} inside rate(): {expr}")
    for label in labels_used - allowed:
        errors.append(f"{where}: label {label!r} belongs to none of the metrics used: {expr}")
    for m in re.finditer(r"histogram_quantile\s*\(", no_strings):
        rest = no_strings[m.end():]
        if not re.search(r"\bby\s*\([^)]*\ble\b", rest) or "_bucket" not in rest:
            errors.append(f"{where}: histogram_quantile needs rate(X_bucket) summed by (le): {expr}")
    return {series[w][0] for w, _ in used}


def check_readme(contract):
    with open(os.path.join(DEPLOY, "README.md")) as f:
        text = f.read()
    rows = {}
    for m in re.finditer(r"^\|\s*`([a-z_:]+)`\s*\|\s*(\w+)\s*\|\s*([^|]*)\|", text, re.M):
        labels = set(re.findall(r"`?([a-z_]+)`?", m.group(3).split("(")[0])) - {"none"}
        rows[m.group(1)] = (m.group(2), labels)
    for name, (kind, labels) in contract.items():
        if name not in rows:
            errors.append(f"deploy/README.md: metrics table lacks {name}")
        elif rows[name] != (kind, labels):
            errors.append(f"deploy/README.md: {name} is {rows[name]}, contract says {(kind, labels)}")
    for name in set(rows) - set(contract) - {"up"}:
        errors.append(f"deploy/README.md: metrics table lists {name}, which is not in the contract")


def check_dashboard(dash, contract, series):
    if not isinstance(dash.get("schemaVersion"), int) or dash["schemaVersion"] < 36:
        errors.append("dashboard: schemaVersion must be >= 36")
    variables = {v["name"]: v for v in dash.get("templating", {}).get("list", [])}
    ds = variables.get("DS_PROMETHEUS")
    if not ds or ds.get("type") != "datasource" or ds.get("query") != "prometheus":
        errors.append("dashboard: want a datasource variable DS_PROMETHEUS of type prometheus")
    if "worker" not in variables:
        errors.append("dashboard: want a `worker` template variable")
    exprs = []
    for name, v in variables.items():
        q = v.get("query")
        if v.get("type") == "query":
            text = q.get("query") if isinstance(q, dict) else q
            m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", text or "")
            if not m:
                errors.append(f"dashboard variable {name}: want label_values(metric, label), got {text!r}")
            else:
                exprs.append((f"variable {name}", m.group(1)))
    ids, boxes = set(), []
    for p in dash.get("panels", []):
        if p.get("id") in ids:
            errors.append(f"dashboard: duplicate panel id {p.get('id')}")
        ids.add(p.get("id"))
        g = p["gridPos"]
        if g["x"] < 0 or g["x"] + g["w"] > 24:
            errors.append(f"dashboard: panel {p['title']!r} outside the 24-column grid")
        for (t, o) in boxes:
            if g["x"] < o["x"] + o["w"] and o["x"] < g["x"] + g["w"] and g["y"] < o["y"] + o["h"] and o["y"] < g["y"] + g["h"]:
                errors.append(f"dashboard: panels {t!r} and {p['title']!r} overlap")
        boxes.append((p["title"], g))
        if p["type"] == "row":
            continue
        if p.get("datasource", {}).get("uid") != "${DS_PROMETHEUS}":
            errors.append(f"dashboard: panel {p['title']!r} does not use ${{DS_PROMETHEUS}}")
        if not p.get("targets"):
            errors.append(f"dashboard: panel {p['title']!r} has no query")
        for t in p.get("targets", []):
            exprs.append((f"panel {p['title']!r}", t["expr"]))
            for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", t.get("legendFormat", "")):
                if label not in TARGET_LABELS and not any(label in lbls for _, lbls in contract.values()):
                    errors.append(f"panel {p['title']!r}: legend uses unknown label {label}")
    used = set()
    for where, e in exprs:
        used |= check_expr(f"dashboard {where}", e, contract, series)
    for name in sorted(set(contract) - used):
        errors.append(f"dashboard: no panel shows {name}")
    return [e for w, e in exprs if w.startswith("panel")]


def promtool_check(exprs):
    promtool = shutil.which("promtool")
    if not promtool:
        sys.exit("FAIL: promtool not found: apt-get install prometheus")
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:expr_{i}", "expr": substitute(e)} for i, e in enumerate(exprs)]}]}
    with tempfile.NamedTemporaryFile("w", suffix=".yml", delete=False) as f:
        yaml.safe_dump(rules, f)
    try:
        r = subprocess.run([promtool, "check", "rules", f.name], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    if r.returncode != 0:
        errors.append("promtool rejects a dashboard expression:\n" + r.stdout + r.stderr)
    return len(exprs)


def main():
    contract = load_contract()
    series = series_names(contract)
    with open(os.path.join(DEPLOY, "grafana", "kvcache-dashboard.json")) as f:
        try:
            dash = json.load(f)
        except json.JSONDecodeError as e:
            sys.exit(f"FAIL: deploy/grafana/kvcache-dashboard.json does not parse: {e}")
    panel_exprs = check_dashboard(dash, contract, series)
    n = promtool_check(panel_exprs)
    with open(os.path.join(DEPLOY, "prometheus", "alerts.yml")) as f:
        alerts = yaml.safe_load(f)
    n_alerts = 0
    for g in alerts["groups"]:
        for r in g["rules"]:
            n_alerts += 1
            check_expr(f"alert {r.get('alert')}", r["expr"], contract, series)
            if r.get("labels", {}).get("severity") not in ("critical", "warning", "info"):
                errors.append(f"alert {r.get('alert')}: severity label must be critical, warning or info")
            for a in ("summary", "description", "runbook"):
                if not r.get("annotations", {}).get(a):
                    errors.append(f"alert {r.get('alert')}: annotation {a} missing")
    check_readme(contract)
    for e in errors:
        print("FAIL:", e)
    if errors:
        sys.exit(f"check_promql: {len(errors)} problem(s)")
    print(f"check_promql: {n} dashboard and {n_alerts} alert expressions use only the {len(contract)} "
          f"contract metrics (+ up), parse with promtool; README table matches")


if __name__ == "__main__":
    main()
