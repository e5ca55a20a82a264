# The README's two commands: `make test` and `make run`. Everything else is set-up they share.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# hami-core compiles against the driver API's cuda.h. Without a toolkit in CUDA_HOME the
# header comes from PyPI (the nvidia-cuda-runtime wheel ships it), so no machine needs CUDA.
CUDA_HOME ?= /usr/local/cuda
CUDA_WHEEL_DIR := .cuda-headers
ifeq ($(wildcard $(CUDA_HOME)/include/cuda.h),)
override CUDA_HOME := $(abspath $(CUDA_WHEEL_DIR))/nvidia/cu13
CUDA_HEADERS := $(CUDA_HOME)/include/cuda.h
endif
export CUDA_HOME

.PHONY: test run host hami-core bench clean contract contract-tools control-plane promtool images real-node kai docs

# pip's own output (setuptools' editable-install banner among it) goes to a log, shown only when the install fails.
PIP_INSTALL = $(BIN)/pip install --quiet --disable-pip-version-check
$(STAMP): pyproject.toml
	@echo "setting up $(VENV): pip install -e '.[test]' (log: $(VENV)/pip.log)"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@{ $(PIP_INSTALL) --upgrade pip && $(PIP_INSTALL) -e '.[test]'; } >$(VENV)/pip.log 2>&1 \
		|| { tail -n 40 $(VENV)/pip.log; exit 1; }
	@touch $(STAMP)

$(abspath $(CUDA_WHEEL_DIR))/nvidia/cu13/include/cuda.h: | $(STAMP)
	@echo "fetching CUDA's headers (the nvidia-cuda-runtime wheel) into $(CUDA_WHEEL_DIR)"
	@$(PIP_INSTALL) --no-deps --target $(CUDA_WHEEL_DIR) 'nvidia-cuda-runtime==13.0.*' >$(VENV)/pip-cuda.log 2>&1 \
		|| { tail -n 40 $(VENV)/pip-cuda.log; exit 1; }
	@test -s $@

hami-core: $(CUDA_HEADERS)
	@$(MAKE) --no-print-directory -s -C hami-core CUDA_HOME=$(CUDA_HOME)

# tests/kai and tests/realnode run these of KAI-Scheduler's programs (a target-specific value: `kai` below builds only them for `test`).
test: KAI_PROGRAMS = admission scheduler binder podgrouper resourcereservation
# The suite mostly waits on real servers, so it runs in PYTEST_WORKERS pytest-xdist workers, more than the cores; tests
# that share a costly session or module fixture stay together in one worker (tests/conftest.py). PYTEST_WORKERS=0: one process.
# A skip fails under make test (--fail-on-skip): make installs everything its tests need, so a skip would hide a
# missing install step.
PYTEST_WORKERS ?= 4
test: host $(STAMP) hami-core contract-tools control-plane promtool real-node release-tools kai
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadgroup --fail-on-skip $(PYTEST_ARGS)

# What the tests need from the machine and cannot build: Debian's runc, docker.io, mmdebstrap, ... (installed as root
# with apt-get when missing) and a Docker engine (a private one when none answers). Else one line says what is missing.
host:
	@hack/host-setup

# The event contract (docs/events): regenerate it from the code; build its validator and example subscribers.
contract: $(STAMP)
	$(BIN)/python -m kai_isolator.shared.event_contract docs/events

contract-tools:
	@$(MAKE) --no-print-directory -s -C docs/events tools

# docs/configuration.md: every setting and flag, generated from the settings models and the CLI's parsers
# (tests/docs fails while the committed page differs).
docs: $(STAMP)
	$(BIN)/python -m kai_isolator.services.config_docs docs/configuration.md

# The real etcd, kube-apiserver and kubectl the tests and `make run` run against, built from services/devcluster/go
# once per version into ~/.cache/kai-isolator/kube (KAI_ISOLATOR_KUBE_CACHE moves it); needs Go and its module proxy.
control-plane: $(STAMP)
	@$(BIN)/python -m kai_isolator.services.devcluster.build

# The promtool that checks the alert rules (only the tests use it), built and cached the same way.
promtool: control-plane
	@$(BIN)/python -m kai_isolator.services.devcluster.build --promtool

# Every image of the project (kai-isolator:dev, kai-isolator-nodeagent:dev, kai-isolator-devcluster:dev) on the
# Docker engine DOCKER_HOST names (`hack/dockerd` starts a private one; `make test` does), with local stand-ins for the public base images
# made from Debian packages (mmdebstrap) and the compose CLI plugin; prints each image's size and build time.
images: $(STAMP) hami-core control-plane
	$(BIN)/python -m kai_isolator.services.devcluster.images

# The real node's kubelet, kube-controller-manager, kube-scheduler (the control plane's Kubernetes release), containerd
# with its runc shim and ctr, and the CNI loopback plugin, cached the same way; runc is Debian's (`apt-get install runc`).
real-node: control-plane
	@$(BIN)/python -m kai_isolator.services.devcluster.build --real-node

# The real KAI-Scheduler's programs (scheduler, binder, admission, resourcereservation, podgrouper, queuecontroller,
# podgroupcontroller), built from its source archive beside the checkout (../shared/third_party/kai-scheduler/, or
# KAI_ISOLATOR_KAI_SOURCE) into the same cache, keyed by the archive's sha256 and the Go version; KAI_PROGRAMS picks some.
kai: $(STAMP)
	@$(BIN)/python -m kai_isolator.services.devcluster.build --kai $(KAI_PROGRAMS)

run: $(STAMP) hami-core control-plane
	@$(BIN)/kai-isolator dev --demo

bench: $(STAMP) hami-core
	for b in bench/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) $(CUDA_WHEEL_DIR) hami-core/build .pytest_cache

.PHONY: release-tools release
# helm and the OCI registry (CNCF Distribution) that the chart checks, the real node and `make release` run, built from
# their pinned Go modules in services/devcluster/go and cached like the control plane.
release-tools: $(STAMP)
	@$(BIN)/python -m kai_isolator.services.devcluster.build --release-tools

# The release as users receive it: the images built (as `make images` builds them) and pushed to a real OCI registry on
# a loopback address of its own (storage kept in ~/.cache/kai-isolator/registry), the chart packaged as <version>-chart
# with those images pinned by digest, `helm lint --strict`ed and `helm push`ed beside them; prints each image's digest
# and size.
release: $(STAMP) hami-core control-plane release-tools
	$(BIN)/python -m kai_isolator.services.devcluster.release
