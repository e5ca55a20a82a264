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

.PHONY: test run hami-core bench clean contract contract-tools control-plane images real-node kai docs

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check --upgrade pip
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

$(abspath $(CUDA_WHEEL_DIR))/nvidia/cu13/include/cuda.h: | $(STAMP)
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps --target $(CUDA_WHEEL_DIR) 'nvidia-cuda-runtime==13.0.*'
	test -s $@

hami-core: $(CUDA_HEADERS)
	$(MAKE) -C hami-core CUDA_HOME=$(CUDA_HOME)

# tests/kai and tests/realnode run these of KAI-Scheduler's programs (a target-specific value: `kai` below builds only them for `test`).
test: KAI_PROGRAMS = admission scheduler binder podgrouper resourcereservation
# The suite mostly waits on real servers, so it runs in PYTEST_WORKERS pytest-xdist workers, more than the cores; tests
# that share a costly session or module fixture stay together in one worker (tests/conftest.py). PYTEST_WORKERS=0: one process.
PYTEST_WORKERS ?= 4
test: $(STAMP) hami-core contract-tools control-plane real-node kai
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# The event contract (docs/events): regenerate it from the code; build its validator and example subscribers.
contract: $(STAMP)
	$(BIN)/python -m kai_isolator.shared.event_contract docs/events

contract-tools:
	$(MAKE) -C docs/events tools

# docs/configuration.md: every setting and flag, generated from the settings models and the CLI's parsers
# (tests/docs fails while the committed page differs).
docs: $(STAMP)
	$(BIN)/python -m kai_isolator.services.config_docs docs/configuration.md

# The real etcd, kube-apiserver and kubectl the tests run against, and the promtool that checks the alert rules,
# built from services/devcluster/go once per version into ~/.cache/kai-isolator/kube (KAI_ISOLATOR_KUBE_CACHE
# moves it); needs Go and its module proxy.
control-plane: $(STAMP)
	$(BIN)/python -m kai_isolator.services.devcluster.build

# Every image of the project (kai-isolator:dev, kai-isolator-nodeagent:dev, kai-isolator-devcluster:dev) on the
# Docker engine DOCKER_HOST names (`.ci/dockerd` starts a private one), with local stand-ins for the public base images
# made from Debian packages (mmdebstrap) and the compose CLI plugin; prints each image's size and build time.
images: $(STAMP) hami-core control-plane
	$(BIN)/python -m kai_isolator.services.devcluster.images

# The real node's kubelet, kube-controller-manager, kube-scheduler (the control plane's Kubernetes release), containerd
# with its runc shim and ctr, and the CNI loopback plugin, cached the same way; runc is Debian's (`apt-get install runc`).
real-node: control-plane
	$(BIN)/python -m kai_isolator.services.devcluster.build --real-node

# The real KAI-Scheduler's programs (scheduler, binder, admission, resourcereservation, podgrouper, queuecontroller,
# podgroupcontroller), built from its source archive beside the checkout (../shared/third_party/kai-scheduler/, or
# KAI_ISOLATOR_KAI_SOURCE) into the same cache, keyed by the archive's sha256 and the Go version; KAI_PROGRAMS picks some.
kai: $(STAMP)
	$(BIN)/python -m kai_isolator.services.devcluster.build --kai $(KAI_PROGRAMS)

run: $(STAMP) hami-core control-plane
	$(BIN)/kai-isolator dev --demo

bench: $(STAMP) hami-core
	for b in bench/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) $(CUDA_WHEEL_DIR) hami-core/build .pytest_cache
