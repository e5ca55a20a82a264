"""`docker compose up --build` for real: the project's images built on a real Docker engine from local stand-ins of
the public base images, every service healthy, the seed's pod admitted and its events read back through
`docker compose exec watcher kai-isolator events` (webhook, watcher and node agent: injected, admitted, scheduled,
running, a 4147 MiB grant written), and `docker compose down -v` leaving nothing behind.

The engine is the one DOCKER_HOST names, else the system's, else `hack/dockerd`'s private one (`make test` starts it).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kai_isolator.services.devcluster import images

REPO = Path(__file__).resolve().parents[2]
PROJECT = "kai-isolator-compose-test"
UP_TIMEOUT_S = 1800  # a fresh machine builds the base images, the compose plugin and every image first
EVENTS_TIMEOUT_S = 120
LONG_RUNNING = {"nats", "devcluster", "webhook", "watcher", "verifier", "nodeagent"}
ONE_SHOT = {"certs", "gpu-driver"}
# The devcluster image keeps kubectl in its kube cache entry, whose name carries the version and digest.
KUBECTL = 'exec /opt/kube/kubernetes-*/kubectl --kubeconfig /srv/kai-isolator/kube/kubeconfig.yaml "$@"'
SEED_POD_EVENTS = {"io.kai-isolator.admission.decision.v1", "io.kai-isolator.pod.admitted.v1", "io.kai-isolator.pod.scheduled.v1",
                   "io.kai-isolator.pod.running.v1", "io.kai-isolator.grant.decision.v1"}
SEED_POD = """
apiVersion: v1
kind: Pod
metadata:
  name: gpu-sharing-with-isolation
  annotations:
    gpu-memory: "4096"
spec:
  schedulerName: kai-scheduler
  securityContext:
    seccompProfile: {type: RuntimeDefault}
  containers:
  - name: main
    image: nvidia/cuda:12.9.2-base-ubuntu24.04
    command: ["sleep", "infinity"]
"""

pytestmark = [
    pytest.mark.skipif(not images.engine_answers(), reason="no Docker engine answers (hack/dockerd starts a private one)"),
    # The first test's budget includes the stack's setup: on a fresh machine, every build (each step has its own bound).
    pytest.mark.timeout(UP_TIMEOUT_S + 900),
]


def phase(name: str, started: float) -> None:
    print(f"phase {name}: {time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)


def compose(*args: str, env: dict[str, str], timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["docker", "compose", "-p", PROJECT, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"docker compose {' '.join(args)} exited {done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}")
    return done


def leftovers(env: dict[str, str]) -> list[str]:
    label = f"label=com.docker.compose.project={PROJECT}"
    found = []
    for kind in (["ps", "-a"], ["volume", "ls"], ["network", "ls"]):
        out = subprocess.run(["docker", *kind, "-q", "--filter", label], env=env, capture_output=True, text=True, timeout=60,
                             check=True).stdout.split()
        found += [f"{kind[0]} {item}" for item in out]
    return found


def clear_interrupted_run(env: dict[str, str]) -> None:
    """A run killed mid-test (a timeout, a lost machine) leaves its project in the engine, whose state is cached."""
    left = leftovers(env)
    if not left:
        return
    print(f"clearing what an interrupted run left: {left}", file=sys.stderr, flush=True)
    down = compose("down", "-v", "--remove-orphans", env=env, timeout=300, check=False)
    assert down.returncode == 0, f"docker compose down -v of an interrupted run exited {down.returncode}: {down.stderr}"
    assert not leftovers(env), f"docker compose down -v did not clear an interrupted run: {leftovers(env)}"


@pytest.fixture(scope="module")
def stack() -> Iterator[dict[str, str]]:
    env = images.compose_env()
    assert images.engine_answers(env), f"no Docker engine answers at {env.get('DOCKER_HOST', 'the default socket')}"
    started = time.monotonic()
    env["GO_IMAGE"] = images.ensure_prerequisites()
    phase("base images, builder image and compose plugin", started)
    clear_interrupted_run(env)
    try:
        with images.build_ca():
            started = time.monotonic()
            compose("build", env=env, timeout=UP_TIMEOUT_S)
            phase("compose build", started)
            started = time.monotonic()
            compose("up", "--build", "-d", "--wait", "--wait-timeout", "600", env=env, timeout=900)
            phase("compose up --build (every service healthy)", started)
        yield env
    finally:
        down = compose("down", "-v", "--remove-orphans", env=env, timeout=300, check=False)
        assert down.returncode == 0, down.stderr
        assert not leftovers(env), f"docker compose down -v left {leftovers(env)}"


def test_every_service_is_healthy_and_the_one_shots_succeeded(stack: dict[str, str]) -> None:
    listed = compose("ps", "-a", "--format", "json", env=stack).stdout
    services = {s["Service"]: s for s in (json.loads(line) for line in listed.splitlines() if line.strip())}
    assert set(services) == LONG_RUNNING | ONE_SHOT
    for name in LONG_RUNNING:
        assert services[name]["State"] == "running" and services[name]["Health"] == "healthy", services[name]
    for name in ONE_SHOT:
        assert services[name]["State"] == "exited" and services[name]["ExitCode"] == 0, services[name]


def test_the_seed_pod_is_admitted_granted_and_its_events_reach_kai_isolator_events(stack: dict[str, str]) -> None:
    applied = subprocess.run(["docker", "compose", "-p", PROJECT, "exec", "-T", "devcluster", "sh", "-c", KUBECTL, "kubectl",
                              "apply", "-n", "default", "-f", "-"], cwd=REPO, env=stack, input=SEED_POD, capture_output=True,
                             text=True, timeout=120)
    assert applied.returncode == 0, applied.stderr
    deadline = time.monotonic() + EVENTS_TIMEOUT_S
    about_pod: dict[str, dict[str, Any]] = {}
    decisions: list[str] = []
    while time.monotonic() < deadline and not SEED_POD_EVENTS <= set(about_pod):
        # `events` follows the stream; `timeout` ends each read, and a later read replays from the start again.
        out = compose("exec", "-T", "watcher", "timeout", "10", "kai-isolator", "events", "--nats-url", "nats://nats:4222",
                      "--since", "1h", "--json", env=stack, check=False).stdout
        events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        seed = [e for e in events if e.get("subject") == "default/gpu-sharing-with-isolation"]
        about_pod = {e["type"]: e["data"] for e in seed}
        decisions = [e["data"]["decision"] for e in seed if e["type"] == "io.kai-isolator.admission.decision.v1"]
    assert SEED_POD_EVENTS <= set(about_pod), f"events about the seed's pod: {sorted(about_pod)}"
    # Ours is called before KAI's admission and again after it (reinvocation): the second call finds nothing to do.
    assert sorted(decisions) == ["injected", "skipped"], decisions
    assert about_pod["io.kai-isolator.pod.scheduled.v1"]["expected_limit"] == "4147m"
    grant = about_pod["io.kai-isolator.grant.decision.v1"]
    assert (grant["outcome"], grant["node_name"], grant["limit_bytes"]) == ("written", "gpu-node-1", 4147 << 20)


def test_no_image_carries_the_build_ca_bundle(stack: dict[str, str]) -> None:
    """The bundle pip used in the build stages (this machine's) is in no final image, under any name."""
    source = images.build_ca_source()
    assert source is not None, "this machine has no CA bundle, so the builds could not have reached PyPI"
    bundle = source.read_bytes()
    assert not images.BUILD_CA.exists(), "the build CA bundle was left in the build context"
    finder = ("import hashlib, os, sys\n"
              "size, digest = int(sys.argv[1]), sys.argv[2]\n"
              "for root, dirs, files in os.walk('/'):\n"
              "    dirs[:] = [d for d in dirs if os.path.join(root, d) not in ('/proc', '/sys', '/dev')]\n"
              "    for f in files:\n"
              "        p = os.path.join(root, f)\n"
              "        if os.path.isfile(p) and not os.path.islink(p) and os.path.getsize(p) == size:\n"
              "            if hashlib.sha256(open(p, 'rb').read()).hexdigest() == digest: print(p)\n")
    for image in images.PROJECT_IMAGES:
        history = subprocess.run(["docker", "history", "--no-trunc", "--format", "{{.CreatedBy}}", image.tag], env=stack,
                                 capture_output=True, text=True, timeout=60, check=True).stdout
        assert "build-ca" not in history, f"{image.tag}'s final stage touches the build CA:\n{history}"
        found = subprocess.run(["docker", "run", "--rm", "--network", "none", "--user", "0:0", "--entrypoint", "python",
                                image.tag, "-c", finder, str(len(bundle)), hashlib.sha256(bundle).hexdigest()],
                               env=stack, capture_output=True, text=True, timeout=300)
        assert found.returncode == 0, found.stderr
        assert found.stdout == "", f"{image.tag} carries the build CA bundle at {found.stdout.split()}"
