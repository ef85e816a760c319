#!/usr/bin/env bash
# The Kubernetes manifests, rendered and validated offline: every overlay of
# deploy/k8s (and base, the example Job, prod with the optional monitoring
# and dashboards components) is rendered with `kubectl kustomize`, and every
# object is checked against the Kubernetes schemas by validate.mjs (types,
# enums, required fields and unknown field names) and against paramsync's
# rules (non-root, read-only root, no capabilities, resources, probes).
# Then the checker must reject broken objects, and a broken overlay.
#
# Exit 0 passed, 1 failed, 77 skipped (kubectl or Node.js missing: neither
# is a Debian package on these machines). npm ci installs the validator's
# packages from package-lock.json on first use.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
k8s=$(cd "$here/../../deploy/k8s" && pwd)

skip() { echo "SKIPPED: $*"; exit 77; }
fail() { echo "FAILED: $*" >&2; exit 1; }

command -v kubectl >/dev/null || skip "kubectl is not installed (kubectl kustomize renders the manifests)"
command -v node >/dev/null && command -v npm >/dev/null || skip "node and npm are not installed"
major=$(node -p 'process.versions.node.split(".")[0]')
[ "$major" -ge 18 ] || skip "node $major is too old (18 or later)"

if [ ! -f "$here/node_modules/.package-lock.json" ] ||
    [ "$here/package-lock.json" -nt "$here/node_modules/.package-lock.json" ]; then
    echo "npm ci in tests/deploy"
    (cd "$here" && npm ci --no-audit --no-fund --loglevel=error)
fi

tmp=$(mktemp -d /tmp/paramsync-manifests-test.XXXXXX)
trap 'rm -rf "$tmp"' EXIT

render() { # NAME DIR [kubectl kustomize flags]
    local name=$1 dir=$2
    shift 2
    kubectl kustomize "$@" "$dir" >"$tmp/$name.yaml" || fail "kubectl kustomize $dir"
    files+=("$tmp/$name.yaml")
}
files=()
render base "$k8s/base"
n=0
for d in "$k8s"/overlays/*/; do
    render "overlay-$(basename "$d")" "$d"
    n=$((n + 1))
done
[ $n -ge 2 ] || fail "expected the dev and prod overlays, found $n overlays"
render examples "$k8s/examples"

# prod with the optional components (their files live outside deploy/k8s).
mkdir "$tmp/full"
rel=$(realpath --relative-to="$tmp/full" "$k8s")
cat >"$tmp/full/kustomization.yaml" <<YAML
resources:
  - $rel/overlays/prod
components:
  - $rel/components/monitoring
  - $rel/components/dashboards
YAML
render prod-monitoring "$tmp/full" --load-restrictor LoadRestrictionsNone
grep -q '^kind: PodMonitor' "$tmp/prod-monitoring.yaml" || fail "no PodMonitor in prod + monitoring"

# prod with the shared-memory component: the agent mounts the node's /dev/shm.
mkdir "$tmp/shm"
rel=$(realpath --relative-to="$tmp/shm" "$k8s")
cat >"$tmp/shm/kustomization.yaml" <<YAML
resources:
  - $rel/overlays/prod
components:
  - $rel/components/shared-memory
YAML
render prod-shm "$tmp/shm" --load-restrictor LoadRestrictionsNone
grep -q 'path: /dev/shm' "$tmp/prod-shm.yaml" || fail "no /dev/shm hostPath in prod + shared-memory"
grep -q 'mountPath: /dev/shm' "$tmp/prod-shm.yaml" || fail "the agent does not mount /dev/shm"
grep -q 'pod-security.kubernetes.io/enforce: privileged' "$tmp/prod-shm.yaml" ||
    fail "the shared-memory component leaves a Pod Security level that forbids hostPath"
grep -q 'grafana_dashboard: "1"' "$tmp/prod-monitoring.yaml" || fail "no dashboard ConfigMap"

echo "== schemas and rules: ${#files[@]} renders"
node "$here/validate.mjs" "${files[@]}"

echo "== the checker rejects broken objects"
node "$here/validate.mjs" --self-test "$tmp/prod-monitoring.yaml"

echo "== and a broken overlay (a misspelt field, a string where a number belongs)"
mkdir "$tmp/broken"
rel=$(realpath --relative-to="$tmp/broken" "$k8s")
cat >"$tmp/broken/kustomization.yaml" <<YAML
resources:
  - $rel/overlays/dev
patches:
  - patch: |-
      apiVersion: apps/v1
      kind: DaemonSet
      metadata:
        name: paramsync-agent
      spec:
        template:
          spec:
            terminationGracePeriodSeconds: thirty
            containers:
              - name: paramsyncd
                readinessProbe:
                  grpc:
                    port: 29500
                    servise: paramsync.v1.Worker
YAML
kubectl kustomize "$tmp/broken" >"$tmp/broken.yaml" || fail "kubectl kustomize (broken overlay)"
if node "$here/validate.mjs" "$tmp/broken.yaml" >"$tmp/broken.out"; then
    cat "$tmp/broken.out"
    fail "the broken overlay was accepted"
fi
grep -q 'unknown field "servise"' "$tmp/broken.out" || { cat "$tmp/broken.out"; fail "misspelt field not reported"; }
grep -q 'terminationGracePeriodSeconds: type' "$tmp/broken.out" ||
    { cat "$tmp/broken.out"; fail "a string terminationGracePeriodSeconds not reported"; }
echo "broken overlay rejected:"
sed 's/^/  /' "$tmp/broken.out"
echo "manifests test: passed"
