# Two commands do all the set-up on a fresh machine:
#   make run    create .venv if needed, then train on the bundled default data
#   make test   create .venv if needed, then lint (ruff) and run the test suite
#   make test-fast  lint and the tests that need no Ray cluster: the edit-test loop
#   make bench  augment-stage img/s against the seed's torchvision pipeline (not a test)
#   make bench-train  end-to-end training img/s: jobs.train vs the seed's plain script vs synthetic batches
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
ARGS   ?=

.PHONY: run test test-fast bench bench-train clean venv

venv: $(STAMP)

# torch and torchvision are installed first, as an exact pair, with plain pip: on the build
# machines pip takes them from local package files. The rest follows from pyproject.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.14.1" "torchvision==0.29.1"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

# bytecode of the project's own modules, which an editable install leaves uncompiled: where
# PYTHONDONTWRITEBYTECODE is set (the build machines set it), every process of a run, Ray's
# workers among them, would compile them again (docs/benchmark-log.md, "Bytecode")
BYTECODE := $(PY) -m compileall -q augment training jobs tests bench > /dev/null

run: $(STAMP)
	$(BYTECODE)
	$(PY) -m jobs.train $(ARGS)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(BYTECODE)
	$(PY) -m pytest -q -p tests.file_times --durations=10 tests $(ARGS)

test-fast: $(STAMP)
	$(VENV)/bin/ruff check .
	$(BYTECODE)
	$(PY) -m pytest -q -p tests.file_times --durations=10 -m "not ray" tests $(ARGS)

bench: $(STAMP)
	$(PY) -m bench.augment $(ARGS)

bench-train: $(STAMP)
	$(PY) -m bench.train $(ARGS)

clean:
	rm -rf $(VENV) runs
