"""The real KAI-Scheduler's admission, built from its source archive (services/devcluster/build.py), run as a process
against a local control plane with the flags KAI's operator gives it, and registered as the operator registers it.

The operator (pkg/operator/operands/admission) is not run: it needs a cluster that runs its Deployment. What it would
create is spelt here from its source: the arguments (`buildArgsList`), the MutatingWebhookConfiguration
`mutating-kai-admission` and the ValidatingWebhookConfiguration `validating-kai-admission` (webhook
`admission.kai-scheduler.svc`, namespaces but kube-system and kai-scheduler, pods naming `kai-scheduler`, failure
policy Fail, the mutating one reinvoked IfNeeded), pointed at this machine instead of the Service.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kai_isolator.services.devcluster.build import ensure_kai
from kai_isolator.services.devcluster.kai import (
    ADMISSION_NAME, ADMISSION_WEBHOOK, GPU_MEMORY_LABEL, KAI_NAMESPACE, SCHEDULER_NAME, fake_gpu_uuid,
)
from kai_isolator.services.devcluster.kubelet import node_object
from kai_isolator.services.devcluster.plane import ApiCallError, ControlPlane, ControlPlaneError
from kai_isolator.shared.ports import free_port
from kai_isolator.shared.contract import RESERVATION_NAMESPACE, RESERVED_GPU_ANNOTATION
from kai_isolator.shared.pki import CertificateAuthority

Obj = dict[str, Any]
VALIDATING_NAME = "validating-kai-admission"
TENANT = "tenant"  # where the tests' pods go (KAI's webhooks leave its own namespace alone)
_REGISTRATION = "/apis/admissionregistration.k8s.io/v1"


def operator_args(*, hamicore: bool = True, gpu_sharing: bool = True) -> list[str]:
    """What buildArgsList gives the admission Deployment for the seed's install, ports aside."""
    args = ["--scheduler-name", SCHEDULER_NAME]
    if gpu_sharing:
        args.append("--gpu-sharing-enabled=true")
    if hamicore:
        args.append("--hami-core-enabled=true")
    return args


class RealKaiAdmission:
    """`admission` from the KAI build cache, serving on loopback with a certificate of its own, registered on `plane`."""

    def __init__(self, plane: ControlPlane, workdir: Path, *, hamicore: bool = True, gpu_sharing: bool = True) -> None:
        self.plane = plane
        self.workdir = workdir
        self.args = operator_args(hamicore=hamicore, gpu_sharing=gpu_sharing)
        self.port = free_port()
        self.probe_port = free_port()
        self.ca = CertificateAuthority("kai-isolator test KAI admission")
        self.process: subprocess.Popen[bytes] | None = None
        self.started_s = 0.0

    def start(self) -> RealKaiAdmission:
        binary = ensure_kai(("admission",)) / "admission"
        # controller-runtime's webhook server reads tls.crt/tls.key from $TMPDIR/k8s-webhook-server/serving-certs.
        certs = self.workdir / "tmp" / "k8s-webhook-server" / "serving-certs"
        certs.mkdir(parents=True, exist_ok=True)
        self.ca.issue_server(["127.0.0.1"]).write(certs / "tls.crt", certs / "tls.key")
        command = [str(binary), *self.args, "--webhook-addr", str(self.port), "--health-probe-bind-address", f"127.0.0.1:{self.probe_port}",
                   "--metrics-bind-address", "0", f"--kubeconfig={self.plane.admin_kubeconfig}"]
        self.log_path = self.workdir / "kai-admission.log"
        started = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TMPDIR": str(self.workdir / "tmp")})
        self._until_ready()
        self.started_s = time.monotonic() - started
        return self

    def _until_ready(self, timeout_s: float = 30) -> None:
        import urllib.request
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise ControlPlaneError(f"KAI's admission exited {self.process.returncode}:\n{self.log()}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://127.0.0.1:{self.probe_port}/readyz", timeout=1) as answer:
                    if answer.status == 200:
                        return
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"KAI's admission not ready after {timeout_s:.0f}s:\n{self.log()}")
            time.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)

    def _hook(self, path: str) -> Obj:
        return {
            "name": ADMISSION_WEBHOOK, "admissionReviewVersions": ["v1"], "sideEffects": "None", "failurePolicy": "Fail",
            "clientConfig": {"url": f"https://127.0.0.1:{self.port}{path}", "caBundle": base64.b64encode(self.ca.cert_pem).decode()},
            "namespaceSelector": {"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "NotIn",
                                                        "values": ["kube-system", KAI_NAMESPACE]}]},
            "matchConditions": [{"name": "scheduler-name-match", "expression": f"object.spec.schedulerName == '{SCHEDULER_NAME}'"}],
        }

    def configurations(self) -> list[tuple[str, Obj]]:
        mutating = {**self._hook("/mutate--v1-pod"), "reinvocationPolicy": "IfNeeded",
                    "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"], "scope": "Namespaced"}]}
        validating = {**self._hook("/validate--v1-pod"),
                      "rules": [{"operations": ["CREATE", "UPDATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"],
                                 "scope": "Namespaced"}]}
        return [("mutatingwebhookconfigurations", {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
                                                   "metadata": {"name": ADMISSION_NAME}, "webhooks": [mutating]}),
                ("validatingwebhookconfigurations", {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
                                                     "metadata": {"name": VALIDATING_NAME}, "webhooks": [validating]})]

    def register(self) -> None:
        """Put KAI's configurations in place (replacing any earlier ones) and wait until they are in force."""
        for plural, body in self.configurations():
            with contextlib.suppress(ApiCallError):
                self.plane.request("DELETE", f"{_REGISTRATION}/{plural}/{body['metadata']['name']}")
            self.plane.request("POST", f"{_REGISTRATION}/{plural}", body)

    def unregister(self) -> None:
        for plural, body in self.configurations():
            with contextlib.suppress(ApiCallError):
                self.plane.request("DELETE", f"{_REGISTRATION}/{plural}/{body['metadata']['name']}")


def ensure_namespace(plane: ControlPlane, name: str) -> None:
    for path, body in ((("/api/v1/namespaces"), {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}),
                       (f"/api/v1/namespaces/{name}/serviceaccounts", {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}})):
        try:
            plane.request("POST", path, body)
        except ApiCallError as error:
            if error.code != 409:
                raise


def ensure_runtime_class(plane: ControlPlane, name: str = "nvidia") -> None:
    try:
        plane.request("POST", "/apis/node.k8s.io/v1/runtimeclasses", {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
                                                                      "metadata": {"name": name}, "handler": name})
    except ApiCallError as error:
        if error.code != 409:
            raise


def dry_run_create(plane: ControlPlane, namespace: str, pod: Obj) -> Obj:
    """The pod as the API server would store it, every admission step run, nothing stored; or ApiCallError."""
    return plane.request("POST", f"/api/v1/namespaces/{namespace}/pods?dryRun=All", pod)  # type: ignore[no-any-return]


def until_in_force(plane: ControlPlane, namespace: str, admitted: Any, what: str, timeout_s: float = 20) -> None:
    """The API server takes up webhook configurations from a watch, not at once: probe with dry runs until it does."""
    probe = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "kai-probe", "annotations": {"gpu-memory": "1024"}},
             "spec": {"schedulerName": SCHEDULER_NAME, "containers": [{"name": "main", "image": "busybox"}],
                      "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}}}}  # what our policy asks, under enforce
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(ApiCallError):
            if admitted(dry_run_create(plane, namespace, probe)):
                return
        if time.monotonic() > deadline:
            raise ControlPlaneError(f"{what} not in force {timeout_s:.0f}s after its registration")
        time.sleep(0.1)


def answered_by(hamicore: bool) -> Any:
    """A probe predicate: KAI's admission with (or without) hamicore answered, not one registered before it."""
    def check(probe: Obj) -> bool:
        env = [e["name"] for e in probe["spec"]["containers"][0].get("env") or []]
        return "GPU_PORTION" in env and ("CUDA_DEVICE_MEMORY_LIMIT" in env) == hamicore
    return check


def real_admission(plane: ControlPlane, workdir: Path, hamicore: bool) -> Iterator[RealKaiAdmission]:
    """KAI's admission started, registered and in force on `plane`; unregistered and stopped afterwards."""
    kai = RealKaiAdmission(plane, workdir, hamicore=hamicore).start()
    try:
        kai.register()
        until_in_force(plane, TENANT, answered_by(hamicore), "KAI's admission")
        yield kai
    finally:
        kai.unregister()
        kai.stop()


# --- KAI's scheduler, binder and podgrouper ----------------------------------------------------------------------

CRDS = Path("deployments") / "kai-scheduler" / "crds"
GPU_INDEX_ANNOTATION = RESERVED_GPU_ANNOTATION  # what the reservation pod's resourcereservation binary writes
GPU_COUNT_LABEL = "nvidia.com/gpu.count"


# The image the seed's chart names for the reservation pod: global.registry / binder.resourceReservationImage.name :
# the chart's appVersion (0.0.0 in the source tree), as the operator's Image.Url() spells it.
RESERVATION_IMAGE = "registry/local/kai-scheduler/resourcereservation:0.0.0"


def operator_binder_args(*, hamicore: bool = True, cdi: bool = False) -> list[str]:
    """The binder's arguments from KAI's operator (operands/binder buildArgsList) for the seed's install, ports aside;
    `cdi` as the operator sets it when the GPU Operator's ClusterPolicy turns CDI on (`binder.cdiEnabled`)."""
    gpusharing: Obj = {"enabled": True, **({"arguments": {"cdiEnabled": "true"}} if cdi else {})}
    plugins = {"gpusharing": gpusharing, "hamicore": {"enabled": hamicore}}
    return ["--scheduler-name", SCHEDULER_NAME, "--resource-reservation-namespace", RESERVATION_NAMESPACE,
            "--resource-reservation-service-account", RESERVATION_NAMESPACE, "--resource-reservation-app-label", RESERVATION_NAMESPACE,
            "--resource-reservation-pod-image", RESERVATION_IMAGE, "--plugins", json.dumps(plugins)]


class RealKaiScheduling:
    """KAI's podgrouper, scheduler (its built-in default configuration) and binder as processes on `plane`, with what
    KAI's chart installs first (its CRDs, the default queues) and what a cluster's controllers would do that this
    plane lacks: each namespace's `kube-root-ca.crt`, a new node's not-ready taint lifted. On a real node the reservation
    pod runs KAI's `resourcereservation` program, which asks NVML for its GPU and writes the UUID on its pod; a
    reservation pod bound to a simulated node has nothing to run it, and `simulate_reservations` does what its container
    would, writing its GPU's UUID on it."""

    def __init__(self, plane: ControlPlane, workdir: Path, source_tree: Path) -> None:
        self.plane, self.workdir, self.source_tree = plane, workdir, source_tree
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self._stop = threading.Event()
        self._reserver: threading.Thread | None = None
        self.started_s = 0.0
        self.hamicore = True

    def install(self, namespaces: list[str]) -> None:
        self.plane.kubectl("apply", "--server-side", "-f", str(self.source_tree / CRDS))
        deadline = time.monotonic() + 30
        while True:  # established, and served: a create right after can still meet a 404 otherwise
            with contextlib.suppress(ApiCallError):
                self.plane.request("GET", "/apis/scheduling.run.ai/v2/queues")
                self.plane.request("GET", "/apis/scheduling.run.ai/v1alpha2/bindrequests")
                break
            if time.monotonic() > deadline:
                raise ControlPlaneError("KAI's CRDs are not served 30 s after they were applied")
            time.sleep(0.2)
        unlimited = {r: {"quota": -1, "limit": -1, "overQuotaWeight": 1} for r in ("cpu", "gpu", "memory")}
        for name, parent in (("default-parent-queue", None), ("default-queue", "default-parent-queue")):
            spec: Obj = {"resources": unlimited, **({"parentQueue": parent} if parent else {})}
            with contextlib.suppress(ApiCallError):
                self.plane.request("POST", "/apis/scheduling.run.ai/v2/queues",
                                   {"apiVersion": "scheduling.run.ai/v2", "kind": "Queue", "metadata": {"name": name}, "spec": spec})
        ca = self.plane.workdir.joinpath("ca.crt").read_text()
        for namespace in [*namespaces, RESERVATION_NAMESPACE]:
            ensure_namespace(self.plane, namespace)
            with contextlib.suppress(ApiCallError):
                self.plane.request("POST", f"/api/v1/namespaces/{namespace}/configmaps",
                                   {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "kube-root-ca.crt"}, "data": {"ca.crt": ca}})
        with contextlib.suppress(ApiCallError):
            self.plane.request("POST", f"/api/v1/namespaces/{RESERVATION_NAMESPACE}/serviceaccounts",
                               {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": RESERVATION_NAMESPACE}})

    def add_node(self, name: str, labels: dict[str, str]) -> None:
        node = node_object(name, 15360, int(labels.get(GPU_COUNT_LABEL, "1")))
        status = node.pop("status")
        node["metadata"]["labels"] = {**{k: v for k, v in node["metadata"]["labels"].items() if k != GPU_MEMORY_LABEL}, **labels}
        self.plane.request("POST", "/api/v1/nodes", node)
        self.plane.request("PATCH", f"/api/v1/nodes/{name}/status", {"status": status}, content_type="application/merge-patch+json")
        self.plane.request("PATCH", f"/api/v1/nodes/{name}", {"spec": {"taints": None}}, content_type="application/merge-patch+json")

    def start(self, *, hamicore: bool = True, simulate_reservations: bool = True) -> RealKaiScheduling:
        binaries = ensure_kai(("podgrouper", "scheduler", "binder"))
        kubeconfig = str(self.plane.admin_kubeconfig)
        started = time.monotonic()
        self._spawn("podgrouper", [str(binaries / "podgrouper"), f"-health-probe-bind-address=127.0.0.1:{free_port()}",
                                   "-metrics-bind-address=0", f"-kubeconfig={kubeconfig}"])
        self._spawn("scheduler", [str(binaries / "scheduler"), f"--scheduler-name={SCHEDULER_NAME}", f"--namespace={KAI_NAMESPACE}",
                                  f"--listen-address=127.0.0.1:{free_port()}", f"--plugin-server-port={free_port()}",
                                  f"--profiler-port={free_port()}"])
        self.hamicore = hamicore
        self._start_binder(hamicore=hamicore)
        self.started_s = time.monotonic() - started
        if simulate_reservations:
            self._reserver = threading.Thread(target=self._serve_reservations, daemon=True)
            self._reserver.start()
        return self

    def _start_binder(self, *, hamicore: bool = True, cdi: bool = False) -> None:
        binary = ensure_kai(("binder",)) / "binder"
        self._spawn("binder", [str(binary), *operator_binder_args(hamicore=hamicore, cdi=cdi),
                               "--health-probe-bind-address", f"127.0.0.1:{free_port()}", "--metrics-bind-address", "0",
                               f"--kubeconfig={self.plane.admin_kubeconfig}"])

    def restart_binder(self, *, cdi: bool) -> None:
        """The binder again, as KAI's operator redeploys it when the cluster's CDI setting changes (seed flags otherwise)."""
        process = self.processes["binder"]
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        self._start_binder(hamicore=self.hamicore, cdi=cdi)

    def _spawn(self, name: str, command: list[str]) -> None:
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - the process keeps it (a restarted one appends)
        # The scheduler takes its kubeconfig from KUBECONFIG only (it has no --kubeconfig flag).
        self.processes[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                                env={**os.environ, "KUBECONFIG": str(self.plane.admin_kubeconfig)})

    def _serve_reservations(self) -> None:
        """Each reservation pod learns a GPU of its node that no other GPU group there holds, as the device plugin would
        hand it one."""
        while not self._stop.wait(0.1):
            with contextlib.suppress(ApiCallError, OSError):
                pods = self.plane.request("GET", f"/api/v1/namespaces/{RESERVATION_NAMESPACE}/pods")["items"]
                for pod in pods:
                    if pod["spec"].get("nodeName") and GPU_INDEX_ANNOTATION not in (pod["metadata"].get("annotations") or {}):
                        held = {(p["metadata"].get("annotations") or {}).get(GPU_INDEX_ANNOTATION) for p in pods
                                if p["spec"].get("nodeName") == pod["spec"]["nodeName"]}
                        free = next(i for i in range(64) if fake_gpu_uuid(i) not in held)
                        self.plane.request("PATCH", f"/api/v1/namespaces/{RESERVATION_NAMESPACE}/pods/{pod['metadata']['name']}",
                                           {"metadata": {"annotations": {GPU_INDEX_ANNOTATION: fake_gpu_uuid(free)}}},
                                           content_type="application/merge-patch+json")
                        pod.setdefault("metadata", {}).setdefault("annotations", {})[GPU_INDEX_ANNOTATION] = fake_gpu_uuid(free)

    def check_alive(self) -> None:
        for name, process in self.processes.items():
            if process.poll() is not None:
                raise ControlPlaneError(f"KAI's {name} exited {process.returncode}: see {self.workdir / (name + '.log')}")

    def stop(self) -> None:
        self._stop.set()
        if self._reserver is not None:
            self._reserver.join(timeout=5)
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
