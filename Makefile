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

# Two pytest-xdist workers, whole test files at a time (module fixtures and worlds stay in one worker): the
# scheduler in tests/conftest.py makes every module that runs a multi-rank world one unit, run in order by one
# worker, and every other module a unit of its own, the costliest first. On 2 cores the other worker's
# single-process modules and waits (S3 retries, watchdog stalls) fill the core a serial run leaves idle,
# and no two multi-rank worlds compete; that worker runs at a lower priority (os.nice), so a world's ranks never
# wait for a core behind it. TEST_WORKERS=0 runs serially (needed for `PYTEST_ARGS=--module-costs`).
TEST_WORKERS ?= 2

test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

bench: setup
	$(PY) benchmarks/run_all.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) runs bench-out .pytest_cache .hypothesis

# The GPU check (issue 28; docs/testing.md "GPU"). `make gpu-wheels` here (registry access) builds the
# wheels a GPU machine without registry access lacks into $(GPU_WHEELS)/ (git-ignored; must fit the device
# tool's 64 MiB with the tree); `make gpu-check` there (= `python3 benchmarks/gpu_check.py --install
# gpu-wheels`, for a machine without make) installs them with --no-deps into $(GPU_SITE) for the machine's
# own python3 and torch (never the CPU pin: no torch wheel is carried), then runs every tests/test_gpu_*.py
# and the GPU benchmark, one line each, then PASS / FAIL / INCOMPLETE / NO-GPU (exit 0 only for PASS).
# gpu-wheels reads the versions from .venv (the CPU suite's); gpu-check uses no .venv at all.
# (GPU_SITE, not a venv: the machine's python3 is itself a venv, /opt/torch/.venv, so a
# --system-site-packages venv made from it would not see its torch.)
GPU_WHEELS ?= gpu-wheels
GPU_PYTHON ?= python3
GPU_SITE ?= /tmp/ckptkit-gpu-site

.PHONY: gpu-wheels gpu-check

gpu-wheels: setup
	$(PY) benchmarks/gpu_wheels.py --out $(GPU_WHEELS)

gpu-check:
	PYTHONUNBUFFERED=1 $(GPU_PYTHON) benchmarks/gpu_check.py --install $(GPU_WHEELS) --site $(GPU_SITE) $(GPU_CHECK_ARGS)
