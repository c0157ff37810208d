#!/usr/bin/env bash
# Runs deploy/local/monitor.sh for real: a stand-in /metrics endpoint on loopback (python's
# http.server serving a file in the exposition format), the real Prometheus server, then asks
# Prometheus's HTTP API that both targets are scraped with the right job labels, that the metric
# arrived, and that the alert rules are loaded; then stops it with SIGINT (Ctrl-C) and checks
# that Prometheus and its temporary directory are gone. Loopback only, bounded in time.
set -euo pipefail
cd "$(dirname "$0")/../.."

for tool in curl python3; do
  command -v "$tool" >/dev/null || { echo "FAIL: $tool not found" >&2; exit 1; }
done
[ -x /usr/bin/prometheus ] || command -v prometheus >/dev/null ||
  { echo "FAIL: prometheus not found: apt-get install prometheus" >&2; exit 1; }

work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
fail() { echo "FAIL: $*" >&2; echo "--- monitor.sh output:" >&2; cat "$work/monitor.out" >&2 || true; exit 1; }

mkdir "$work/www"
cat >"$work/www/metrics" <<'METRICS'
# HELP kvcache_kv_usage_ratio Used / capacity pages of a tier
# TYPE kvcache_kv_usage_ratio gauge
kvcache_kv_usage_ratio{tier="device"} 0.25
kvcache_kv_usage_ratio{tier="host"} 0
METRICS
mport=$(free_port)
pport=$(free_port)
(cd "$work/www" && exec timeout 60 python3 -m http.server "$mport" --bind 127.0.0.1) >/dev/null 2>&1 &
pids+=($!)

# The same endpoint as router and as worker; a second worker address that nothing serves.
dead=$(free_port)
TMPDIR=$work timeout 60 deploy/local/monitor.sh --port "$pport" "127.0.0.1:$mport" \
  "127.0.0.1:$mport" "127.0.0.1:$dead" >"$work/monitor.out" 2>&1 &
mon=$!
pids+=("$mon")

api="http://127.0.0.1:$pport/api/v1"
ok=""
for _ in $(seq 60); do
  if curl -fsS "$api/query?query=count(kvcache_kv_usage_ratio)" 2>/dev/null | grep -q '"value":\[[0-9.]*,"4"\]'; then
    ok=1; break
  fi
  sleep 0.5
done
[ -n "$ok" ] || fail "kvcache_kv_usage_ratio not scraped from the router and worker targets within 30s"
grep -q "http://127.0.0.1:$pport/graph" "$work/monitor.out" || fail "monitor.sh did not print the UI address"

# Every target scraped at least once: two up, the unserved one down.
check_targets() {
  python3 - "$(curl -fsS "$api/targets")" "$mport" "$dead" <<'PY'
import json, sys
t = json.loads(sys.argv[1])["data"]["activeTargets"]
got = sorted((x["labels"]["job"], x["labels"]["instance"], x["health"]) for x in t)
m, d = sys.argv[2], sys.argv[3]
want = sorted([("kvcache-router", f"127.0.0.1:{m}", "up"), ("kvcache-worker", f"127.0.0.1:{m}", "up"),
               ("kvcache-worker", f"127.0.0.1:{d}", "down")])
if got != want:
    sys.exit(f"targets {got}, want {want}")
print("targets:", got)
PY
}
ok=""
for _ in $(seq 20); do
  if check_targets 2>"$work/targets.err"; then ok=1; break; fi
  sleep 0.5
done
[ -n "$ok" ] || fail "targets wrong: $(cat "$work/targets.err")"
rules=$(curl -fsS "$api/rules")
python3 - "$rules" <<'PY' || fail "alert rules not loaded"
import json, sys, yaml
names = sorted(r["name"] for g in json.loads(sys.argv[1])["data"]["groups"] for r in g["rules"])
with open("deploy/prometheus/alerts.yml") as f:
    want = sorted(r["alert"] for g in yaml.safe_load(f)["groups"] for r in g["rules"])
if names != want:
    sys.exit(f"rules {names}, want {want}")
print("alert rules loaded:", ", ".join(names))
PY
prom_dir=$(sed -n 's/^  config and data: \([^ ]*\) .*/\1/p' "$work/monitor.out")
if [ -z "$prom_dir" ] || [ ! -d "$prom_dir" ]; then fail "monitor.sh did not report its directory"; fi

kill -INT "$mon"
rc=0
wait "$mon" || rc=$?
[ "$rc" -eq 130 ] || fail "monitor.sh exited $rc after SIGINT, want 130"
for _ in $(seq 20); do curl -fsS "http://127.0.0.1:$pport/-/ready" >/dev/null 2>&1 || break; sleep 0.25; done
if curl -fsS "http://127.0.0.1:$pport/-/ready" >/dev/null 2>&1; then fail "prometheus still running after Ctrl-C"; fi
[ ! -e "$prom_dir" ] || fail "temporary directory $prom_dir left behind"
echo "check_monitor: ok (prometheus scraped router+worker, loaded the alerts, stopped cleanly)"
