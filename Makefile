# Two entry points (README): `make demo` and `make test`. Both set up .venv first.
# torch is pinned here (a local CPU build on the dev machines); the package itself
# declares a range so GPU users keep their own build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
# s3fs and fsspec release in lockstep; pinning s3fs keeps pip's resolver from backtracking
# for many minutes against packages that cap fsspec (shared/ENVIRONMENT.md).
S3FS_PIN ?= s3fs==2026.2.0
# DS_BUILD_OPS=0: deepspeed (an sdist) builds as pure Python, no CUDA extensions compiled.

.PHONY: setup demo test bench clean

setup: $(VENV)/.ckptkit-installed

$(VENV)/.ckptkit-installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	DS_BUILD_OPS=0 $(PY) -m pip install -q -e ".[test]" "$(S3FS_PIN)" "$(TORCH_PIN)"
	touch $@

demo: setup
	$(PY) examples/demo.py

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: setup
	$(PY) benchmarks/run_all.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) runs bench-out .pytest_cache .hypothesis
