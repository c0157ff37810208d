#!/usr/bin/env bash
# Static checks of deploy/ with the real tools: yamllint on every YAML file, promtool on the
# alert rules (syntax and unit tests) and the local Prometheus configuration, shellcheck on the
# scripts. A missing tool is a failure, not a skip.
set -euo pipefail
cd "$(dirname "$0")/../.."

need() {
  command -v "$1" >/dev/null || { echo "FAIL: $1 not found: apt-get install $2" >&2; exit 1; }
}
need yamllint yamllint
need promtool prometheus
need shellcheck shellcheck

echo "== yamllint"
yamllint --strict -c deploy/.yamllint deploy tests/deploy
echo "ok: $(find deploy tests/deploy -name '*.yaml' -o -name '*.yml' | wc -l) YAML files"

echo "== promtool check rules"
promtool check rules deploy/prometheus/alerts.yml
echo "== promtool test rules"
promtool test rules tests/deploy/alerts_test.yml
echo "== promtool check config"
# file_sd target files are written by monitor.sh at run time; check with them present.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp deploy/prometheus/prometheus.yml deploy/prometheus/alerts.yml "$tmp/"
mkdir "$tmp/targets"
echo '[{"targets": ["127.0.0.1:9101"]}]' >"$tmp/targets/router.json"
echo '[{"targets": ["127.0.0.1:9102"]}]' >"$tmp/targets/worker.json"
promtool check config "$tmp/prometheus.yml"

echo "== shellcheck"
shellcheck deploy/local/monitor.sh tests/deploy/*.sh
echo "check_static: ok"
