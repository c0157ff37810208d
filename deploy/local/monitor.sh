#!/usr/bin/env bash
# Scrape a local kvcache (router + workers on loopback) with a real Prometheus server.
#
#   deploy/local/monitor.sh [--port N] [--router ADDR]... [--worker ADDR]... [ADDR...]
#
# ADDR is a /metrics address host:port (the --metrics_listen of a binary). Bare ADDRs: the
# first is the router, the rest are workers. Without arguments the addresses come from
# KVCACHE_ROUTER_METRICS and KVCACHE_WORKER_METRICS (comma-separated). Prometheus listens on
# 127.0.0.1:PORT (--port, else KVCACHE_PROMETHEUS_PORT, else 9099), scrapes every 2s with
# deploy/prometheus/prometheus.yml and evaluates deploy/prometheus/alerts.yml; its config and
# data live in a temporary directory that is removed when it stops (Ctrl-C, SIGTERM, exit).
# Everything stays on loopback: non-loopback addresses are refused.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
promdir="$here/../prometheus"
port=${KVCACHE_PROMETHEUS_PORT:-9099}
routers=()
workers=()
bare=()

die() { printf 'monitor.sh: %s\n' "$*" >&2; exit 2; }

while [ $# -gt 0 ]; do
  case "$1" in
    --port) [ $# -ge 2 ] || die "--port needs a value"; port=$2; shift 2 ;;
    --port=*) port=${1#--port=}; shift ;;
    --router) [ $# -ge 2 ] || die "--router needs a value"; routers+=("$2"); shift 2 ;;
    --router=*) routers+=("${1#--router=}"); shift ;;
    --worker) [ $# -ge 2 ] || die "--worker needs a value"; workers+=("$2"); shift 2 ;;
    --worker=*) workers+=("${1#--worker=}"); shift ;;
    -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) bare+=("$1"); shift ;;
  esac
done
if [ ${#bare[@]} -gt 0 ]; then
  routers+=("${bare[0]}")
  workers+=("${bare[@]:1}")
fi
if [ ${#routers[@]} -eq 0 ] && [ ${#workers[@]} -eq 0 ]; then
  IFS=, read -r -a routers <<<"${KVCACHE_ROUTER_METRICS:-}"
  IFS=, read -r -a workers <<<"${KVCACHE_WORKER_METRICS:-}"
fi
[ $((${#routers[@]} + ${#workers[@]})) -gt 0 ] ||
  die "no targets: pass ROUTER_ADDR [WORKER_ADDR...] or set KVCACHE_ROUTER_METRICS/KVCACHE_WORKER_METRICS"
if ! [[ "$port" =~ ^[0-9]+$ ]] || [ "$port" -lt 1 ] || [ "$port" -gt 65535 ]; then die "bad port: $port"; fi

# host:port with a loopback host only.
check_addr() {
  [[ "$1" =~ ^(127\.[0-9]+\.[0-9]+\.[0-9]+|localhost|\[::1\]):[0-9]+$ ]] ||
    die "not a loopback host:port address: '$1'"
}
# A file_sd target file: [{"targets": ["a", "b"]}].
targets_json() {
  local out="" a
  for a in "$@"; do check_addr "$a"; out+="${out:+, }\"$a\""; done
  printf '[{"targets": [%s]}]\n' "$out"
}

prometheus=${PROMETHEUS:-$(command -v prometheus || echo /usr/bin/prometheus)}
[ -x "$prometheus" ] || die "prometheus not found (apt-get install prometheus, or set PROMETHEUS=/path)"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvcache-prometheus.XXXXXX")
prom_pid=""
exiting=""
# A second Ctrl-C (a terminal, or `timeout`, sends it to the whole process group
# as well) must not cut the clean-up short: one arriving before cleanup's first
# line ran `exit` again from inside it, and the directory stayed behind.
# shellcheck disable=SC2317  # called through trap
on_signal() {
  [ -z "$exiting" ] || return 0
  exiting=1
  exit "$1"
}
# shellcheck disable=SC2317  # called through trap
cleanup() {
  trap '' INT TERM
  trap - EXIT
  if [ -n "$prom_pid" ]; then
    kill -TERM "$prom_pid" 2>/dev/null || true
    # A signal taken before the line above ends a wait early: wait until it is gone.
    while kill -0 "$prom_pid" 2>/dev/null; do wait "$prom_pid" 2>/dev/null || true; done
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'on_signal 130' INT
trap 'on_signal 143' TERM

mkdir -p "$tmp/targets" "$tmp/data"
cp "$promdir/prometheus.yml" "$promdir/alerts.yml" "$tmp/"
targets_json "${routers[@]}" >"$tmp/targets/router.json"
targets_json "${workers[@]}" >"$tmp/targets/worker.json"

url="http://127.0.0.1:$port"
"$prometheus" --config.file="$tmp/prometheus.yml" --storage.tsdb.path="$tmp/data" \
  --web.listen-address="127.0.0.1:$port" --storage.tsdb.retention.time=1d \
  >"$tmp/prometheus.log" 2>&1 &
prom_pid=$!

for _ in $(seq 100); do
  if ! kill -0 "$prom_pid" 2>/dev/null; then
    cat "$tmp/prometheus.log" >&2
    die "prometheus exited during start-up (is port $port free?)"
  fi
  curl -fsS "$url/-/ready" >/dev/null 2>&1 && break
  sleep 0.2
done
curl -fsS "$url/-/ready" >/dev/null 2>&1 || die "prometheus not ready after 20s (log: $tmp/prometheus.log)"

cat <<MSG
Prometheus is scraping kvcache every 2s
  router  /metrics: ${routers[*]:-(none)}
  workers /metrics: ${workers[*]:-(none)}
  UI:      $url/graph
  targets: $url/targets        alerts: $url/alerts
  config and data: $tmp (removed on exit); log: $tmp/prometheus.log
Example queries:
  up{job=~"kvcache-.*"}
  kvcache_kv_usage_ratio
  sum(rate(kvcache_prefix_hit_tokens_total[1m])) / sum(rate(kvcache_prefix_query_tokens_total[1m]))
  histogram_quantile(0.99, sum by (le) (rate(kvcache_time_to_first_token_seconds_bucket[1m])))
  sum by (reason) (rate(kvcache_router_decisions_total[1m]))
Press Ctrl-C to stop.
MSG

# Wait for Prometheus to exit (or for a signal, which runs cleanup).
set +e
wait "$prom_pid"
rc=$?
prom_pid=""
echo "prometheus exited ($rc); log:" >&2
tail -n 20 "$tmp/prometheus.log" >&2
exit "$rc"
