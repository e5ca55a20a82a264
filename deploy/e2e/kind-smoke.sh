#!/usr/bin/env bash
# Smoke test on a GPU-less kind cluster: builds both images, installs kai-resource-isolator
# (kustomize dev overlay, or the Helm chart with INSTALL=helm) and checks what upstream's
# hack/e2e/kind-smoke.sh checks, plus our fail-closed and opt-out rules.
# Needs docker, kind and kubectl (and helm for INSTALL=helm). NOT run by `make test`: its private Docker engine
# (no bridge, no iptables rules) cannot network a kind node; it runs this script against recording stand-ins and
# installs our manifests on its own real node instead.
#
#   deploy/e2e/kind-smoke.sh              # create cluster kri-smoke, install, check, keep cluster
#   KEEP=0 deploy/e2e/kind-smoke.sh       # delete the cluster afterwards (only if this script created it)
#   INSTALL=helm deploy/e2e/kind-smoke.sh
set -euo pipefail

KIND_CLUSTER=${KIND_CLUSTER:-kri-smoke}
NAMESPACE=kai-resource-isolator
INSTALL=${INSTALL:-kustomize}
TIMEOUT=${TIMEOUT:-180s}
KEEP=${KEEP:-1}
TEST_IMAGE=${TEST_IMAGE:-ubuntu:24.04}
# 0: the non-root write into the per-container state dir is expected to fail (reported as XFAIL).
EXPECT_NONROOT_WRITE=${EXPECT_NONROOT_WRITE:-1}
TEST_NS="kri-smoke-$(date +%s)-$$-${RANDOM}"
REPO=$(cd "$(dirname "$0")/../.." && pwd)
CREATED_CLUSTER=0
FAILURES=0

say() { printf '\n== %s\n' "$*"; }
pass() { printf 'PASS %s\n' "$*"; }
fail() { printf 'FAIL %s\n' "$*"; FAILURES=$((FAILURES + 1)); }
check() { local name=$1; shift; if "$@"; then pass "$name"; else fail "$name"; fi; }
need() { command -v "$1" >/dev/null || { echo "kind-smoke: $1 is required" >&2; exit 2; }; }

cleanup() {
  kubectl delete namespace "$TEST_NS" "${TEST_NS}-ignored" --ignore-not-found --wait=false >/dev/null 2>&1 || true
  if [[ $KEEP == 0 && $CREATED_CLUSTER == 1 ]]; then kind delete cluster --name "$KIND_CLUSTER"; fi
}
trap cleanup EXIT

need docker; need kind; need kubectl
[[ $INSTALL == helm ]] && need helm

say "images"
docker build -q -f "$REPO/deploy/docker/Dockerfile" -t kai-isolator:dev "$REPO"
docker build -q -f "$REPO/deploy/docker/Dockerfile.nodeagent" -t kai-isolator-nodeagent:dev "$REPO"

say "cluster $KIND_CLUSTER"
if ! kind get clusters | grep -qx "$KIND_CLUSTER"; then
  kind create cluster --name "$KIND_CLUSTER" --wait 120s
  CREATED_CLUSTER=1
fi
kubectl config use-context "kind-$KIND_CLUSTER" >/dev/null
if kubectl get namespace "$NAMESPACE" >/dev/null 2>&1; then
  echo "kind-smoke: namespace $NAMESPACE already exists in kind-$KIND_CLUSTER; refusing to touch an existing install" >&2
  exit 2
fi
kind load docker-image --name "$KIND_CLUSTER" kai-isolator:dev kai-isolator-nodeagent:dev
NODE=$(kubectl get nodes -o jsonpath='{.items[0].metadata.name}')
# kind has no GPU: pretend, so the node agent (GPU nodes only) lands.
kubectl label node "$NODE" nvidia.com/gpu.present=true --overwrite >/dev/null

say "install ($INSTALL)"
if [[ $INSTALL == helm ]]; then
  helm install kai-resource-isolator "$REPO/deploy/helm/kai-resource-isolator" --namespace "$NAMESPACE" --create-namespace \
    --set image.registry= --set image.repository=kai-isolator --set image.tag=dev --set image.pullPolicy=Never \
    --set nodeAgent.image.registry= --set nodeAgent.image.repository=kai-isolator-nodeagent --set nodeAgent.image.tag=dev \
    --set nodeAgent.image.pullPolicy=Never --set webhook.replicaCount=1 --set nats.enabled=true --wait --timeout 5m
else
  kubectl apply -k "$REPO/deploy/kustomize/overlays/dev"
  kubectl -n "$NAMESPACE" wait --for=condition=complete job/kai-resource-isolator-certs --timeout="$TIMEOUT"
fi
kubectl -n "$NAMESPACE" rollout status statefulset/nats --timeout="$TIMEOUT"
kubectl -n "$NAMESPACE" rollout status deployment/kai-resource-isolator-webhook --timeout="$TIMEOUT"
kubectl -n "$NAMESPACE" rollout status daemonset/kai-resource-isolator-nodeagent --timeout="$TIMEOUT"

kubectl create namespace "$TEST_NS" >/dev/null
pod() {  # name, annotations (JSON object), [namespace]
  cat <<YAML
apiVersion: v1
kind: Pod
metadata: {name: $1, namespace: ${3:-$TEST_NS}, annotations: $2}
spec:
  securityContext: {runAsUser: 1000, runAsGroup: 1000}
  containers:
    - name: main
      image: $TEST_IMAGE
      command: [sleep, infinity]
      resources: {requests: {cpu: 10m, memory: 16Mi}, limits: {memory: 64Mi}}
YAML
}

say "webhook reachable (server-side dry-run)"
for _ in $(seq 1 60); do
  if pod probe '{"gpu-fraction": "0.5"}' | kubectl create --dry-run=server -o json -f - 2>/dev/null | grep -q kai-resource-isolator-vgpu; then break; fi
  sleep 2
done

say "a: node agent"
ready=$(kubectl -n "$NAMESPACE" get ds kai-resource-isolator-nodeagent -o jsonpath='{.status.desiredNumberScheduled}/{.status.numberReady}')
check "a1 DaemonSet ready ($ready)" test "${ready%/*}" = "${ready#*/}" -a "${ready%/*}" != 0
check "a2 node has libvgpu.so" docker exec "$NODE" test -s /usr/local/vgpu/libvgpu.so
check "a3 node ld.so.preload names libvgpu.so" docker exec "$NODE" grep -q libvgpu.so /usr/local/vgpu/ld.so.preload

say "b: a gpu-fraction pod is mutated"
pod shared '{"gpu-fraction": "0.5"}' | kubectl create -f - >/dev/null
spec=$(kubectl -n "$TEST_NS" get pod shared -o json)
check "b1 volumes" grep -q '"kai-resource-isolator-vgpu"' <<<"$spec"
check "b2 preload mount" grep -q '"/etc/ld.so.preload"' <<<"$spec"
for env in POD_UID CONTAINER_NAME CONTAINER_VGPU_MOUNT; do check "b3 env $env" grep -q "\"$env\"" <<<"$spec"; done

say "c: the pod runs with libvgpu loaded"
check "c1 Ready" kubectl -n "$TEST_NS" wait --for=condition=Ready pod/shared --timeout="$TIMEOUT"
check "c1 no restarts" test "$(kubectl -n "$TEST_NS" get pod shared -o jsonpath='{.status.containerStatuses[0].restartCount}')" = 0
check "c2 /etc/ld.so.preload names libvgpu.so" kubectl -n "$TEST_NS" exec shared -- grep -q libvgpu.so /etc/ld.so.preload
check "c3 libvgpu.so mapped in PID 1" kubectl -n "$TEST_NS" exec shared -- grep -q libvgpu.so /proc/1/maps
check "c4 library dir is read-only" bash -c "! kubectl -n '$TEST_NS' exec shared -- touch /usr/local/vgpu/x 2>/dev/null"
if kubectl -n "$TEST_NS" exec shared -- sh -c 'touch /run/kai-isolator/probe' 2>/dev/null; then
  pass "c5 non-root writes its own state dir"
elif [[ $EXPECT_NONROOT_WRITE == 0 ]]; then
  echo "XFAIL c5 non-root writes its own state dir"
else
  fail "c5 non-root writes its own state dir"
fi

say "d: opt-outs"
pod plain '{}' | kubectl create -f - >/dev/null
pod optout '{"gpu-fraction": "0.5", "kai-resource-isolator.io/inject": "false"}' | kubectl create -f - >/dev/null
kubectl create namespace "${TEST_NS}-ignored" >/dev/null
kubectl label namespace "${TEST_NS}-ignored" kai-resource-isolator.io/webhook=ignore >/dev/null
pod ignored '{"gpu-fraction": "0.5"}' "${TEST_NS}-ignored" | kubectl create -f - >/dev/null
untouched() { ! kubectl -n "$2" get pod "$1" -o json | grep -Eq 'kai-resource-isolator-vgpu|ld.so.preload|CONTAINER_VGPU_MOUNT'; }
check "d1 plain pod untouched" untouched plain "$TEST_NS"
check "d1 inject=false pod untouched" untouched optout "$TEST_NS"
check "d1 pod in an ignored namespace untouched" untouched ignored "${TEST_NS}-ignored"

say "e: fails closed"
check "e1 failurePolicy Fail" test "$(kubectl get mutatingwebhookconfiguration kai-resource-isolator-mutating -o jsonpath='{.webhooks[0].failurePolicy}')" = Fail
kubectl -n "$NAMESPACE" scale deployment/kai-resource-isolator-webhook --replicas=0 >/dev/null
kubectl -n "$NAMESPACE" wait --for=delete pod -l app.kubernetes.io/component=webhook --timeout="$TIMEOUT" >/dev/null || true
if pod down '{"gpu-fraction": "0.5"}' | kubectl create -f - 2>/dev/null; then
  fail "e2 gpu pod refused while the webhook is down"
else
  pass "e2 gpu pod refused while the webhook is down"
fi
check "e3 plain pod still admitted" kubectl create -f - <<<"$(pod up '{}')"
kubectl -n "$NAMESPACE" scale deployment/kai-resource-isolator-webhook --replicas=1 >/dev/null

say "result"
if [[ $FAILURES -ne 0 ]]; then echo "kind-smoke: $FAILURES check(s) failed"; exit 1; fi
echo "kind-smoke: all checks passed"
