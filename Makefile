# The README's two commands: `make test` and `make run`. Everything else is set-up they share.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test run hami-core bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check --upgrade pip
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

hami-core:
	$(MAKE) -C hami-core

test: $(STAMP) hami-core
	$(BIN)/python -m pytest $(PYTEST_ARGS)

run: $(STAMP) hami-core
	$(BIN)/kai-isolator dev --demo

bench: $(STAMP) hami-core
	for b in bench/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) hami-core/build .pytest_cache
