# The two set-up commands of the README: `make demo` and `make test`.
# Each installs what is missing into .venv first. torch is pinned to the CPU build here only;
# pyproject.toml keeps the loose range users need.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.distckpt-installed

.PHONY: install demo demo-s3 test test-faults bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,s3,data]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) launch/demo.py

demo-s3: $(STAMP)
	$(PY) launch/demo.py --s3

test: $(STAMP)
	$(PY) -m pytest -q

# The whole fault matrix (make test runs a sample of it).
test-faults: $(STAMP)
	$(PY) -m pytest -q -m faults

bench: $(STAMP)
	$(PY) bench/run.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
