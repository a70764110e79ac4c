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
# EDITABLE_QUIET: setuptools' editable install of this layout (converters/ installed as
# ckptkit_converters, so a meta-path finder rather than a .pth) always emits "Editable installation.
# Please be careful with folders in your working directory with the same name as your package";
# no setuptools option turns it off for a finder (compat mode would break ckptkit_converters), and
# the folder it means is the package itself. Only that message is filtered, for pip only.
# (Lines "WARNING: Location 'file:///opt/pypi-more/...' is ignored" come from the machine's pip
# configuration, /etc/xdg/pip/pip.conf, not from this project.)
EDITABLE_QUIET := PYTHONWARNINGS="ignore:Editable installation.:UserWarning"

.PHONY: setup demo test bench clean

setup: $(VENV)/.ckptkit-installed

$(VENV)/.ckptkit-installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	DS_BUILD_OPS=0 $(EDITABLE_QUIET) $(PY) -m pip install -q -e ".[test]" "$(S3FS_PIN)" "$(TORCH_PIN)"
	touch $@

demo: setup
	$(PY) examples/demo.py

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: setup
	$(PY) benchmarks/run_all.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) runs bench-out .pytest_cache .hypothesis
