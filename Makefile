# Every target creates or refreshes .venv first, so a fresh machine needs only `make demo` / `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# Re-install when the project's metadata changes; otherwise the targets start at once.
STAMP  := $(VENV)/.graphopt-installed
# The CPU build of torch for development and CI; the library itself declares torch>=2.6.
TORCH  := torch==2.13.0

.PHONY: venv test fuzz demo bench-compare clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest

# The property-based test with 500 random models per preset (make test runs a bounded number).
fuzz: $(STAMP)
	GRAPHOPT_FUZZ_EXAMPLES=500 $(PY) -m pytest tests/test_fuzz.py -p no:cacheprovider

demo: $(STAMP)
	$(VENV)/bin/graphopt demo

# Eager fp32, channels_last and bf16 autocast vs graphopt on the reference models (run on a quiet machine).
bench-compare: $(STAMP)
	$(PY) -m graphopt.bench.compare

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
