# Each target creates .venv on first use and reinstalls when pyproject.toml changes.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test clean

$(VENV)/.installed: pyproject.toml tools/install.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) tools/install.py --extra test
	touch $@

demo: $(VENV)/.installed
	$(PY) -m gpipe.demo

# worksteal: each worker starts on a contiguous half of the tests (module
# fixtures built once) and takes over the other's tail when it runs dry.
# A test that crashes its worker (a segfault in TensorFlow's runtime) runs
# once more in a new one (tests/conftest.py); a failure is final.
test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 --dist worksteal --durations=10 tests

clean:
	rm -rf $(VENV)
