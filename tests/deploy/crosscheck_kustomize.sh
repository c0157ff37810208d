#!/usr/bin/env bash
# Manual check (not run by ctest: kubectl is not part of the set-up): renders each overlay, with
# each combination of the optional components (tls, autoscaling), with both `kubectl kustomize`
# and kustomize_lite.py and compares the objects. Run it after changing the kustomizations or
# kustomize_lite.py on a machine with kubectl.
set -euo pipefail
cd "$(dirname "$0")/../.."
command -v kubectl >/dev/null || { echo "FAIL: kubectl not found" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp -r deploy/k8s "$tmp/"
for overlay in cpu gpu; do
  for comps in "" tls autoscaling "tls autoscaling"; do
    dir=deploy/k8s/overlays/$overlay
    lite=(python3 tests/deploy/kustomize_lite.py "$dir")
    if [ -n "$comps" ]; then
      # kustomize takes only relative paths: an overlay on the overlay, in a copy of the tree.
      name="$overlay-${comps// /-}"
      mkdir -p "$tmp/k8s/overlays/$name"
      {
        printf 'apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - ../%s\ncomponents:\n' \
          "$overlay"
        for c in $comps; do
          printf '  - ../../components/%s\n' "$c"
          lite+=(--component "deploy/k8s/components/$c")
        done
      } >"$tmp/k8s/overlays/$name/kustomization.yaml"
      kubectl kustomize "$tmp/k8s/overlays/$name" >"$tmp/real.yaml"
    else
      kubectl kustomize "$dir" >"$tmp/real.yaml"
    fi
    "${lite[@]}" >"$tmp/lite.yaml"
    python3 - "$tmp/real.yaml" "$tmp/lite.yaml" "$overlay components=[${comps}]" <<'PY'
import sys, yaml
real, lite = ({(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(open(p)) if o}
              for p in sys.argv[1:3])
bad = sorted(set(real) ^ set(lite)) + [k for k in sorted(set(real) & set(lite)) if real[k] != lite[k]]
print(f"{sys.argv[3]}: {len(real)} objects, {'identical' if not bad else 'DIFFERENT: ' + str(bad)}")
sys.exit(1 if bad else 0)
PY
  done
done
