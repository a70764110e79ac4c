"""``make gpu-wheels``: the wheels ``make gpu-check`` installs on a GPU machine that reaches no registry.

The GPU machine lent through the device tool has Python 3.12 with its own CUDA torch (2.11),
numpy, fsspec, click, rich, safetensors, tensorstore, transformers, psutil, einops, tqdm,
msgpack, ninja, py-cpuinfo, tensorboard, triton, pytest and hypothesis, but not ckptkit's other
needs nor the three frameworks. This script puts, into one git-ignored folder (``gpu-wheels/``),
a wheel of every package the GPU checks import that the machine lacks, at the version this
checkout's CPU suite runs (read from the running interpreter, i.e. ``.venv``):

* ckptkit itself (with ``ckptkit_converters``), built from the working tree;
* ckptkit's required ``crc32c`` (a cp312 build);
* megatron-core (a cp312 build);
* deepspeed, built here from its sdist as pure Python (``DS_BUILD_OPS=0``), and what it imports
  that the machine lacks: hjson, pydantic, pydantic-core (cp312), annotated-types,
  typing-inspection, typing-extensions;
* torchtitan and what it imports on the checks' path: torchdata, spmd-types, tyro,
  docstring-parser, typeguard, torch-checkpointing, and datasets with dill and multiprocess (a
  model config's ``update_from_config`` imports ``torchtitan.trainer``, which imports them).

Not carried, because nothing on the checks' path imports them (each is named in a check's skip
reason if that ever changes): torch (the machine's own is used, never the CPU pin), torchao
(a torch-version-specific binary; torchtitan imports it only for float8/MX training), wandb
(torchtitan's optional logger), zarr (a test-only extra of ckptkit: the zarr
converter), s3fs and moto (S3 tests).

The folder must fit, with the working tree, into the device tool's 64 MiB per call; the script
prints the wheels' total, the tree's, and fails if the sum is over. Wheels already present at the
right version are kept (ckptkit's is rebuilt every time), other versions of the same package are
removed (two versions of one package stop pip). Run: ``make gpu-wheels`` (= ``.venv/bin/python
benchmarks/gpu_wheels.py --out gpu-wheels``); ``--check`` only checks an existing folder.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT = 64 << 20
"""What one call of the device tool carries: the working tree and the carried paths together."""

PYTHON_TAG = "cp312"
"""The GPU machine's interpreter (Python 3.12)."""
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64"]

DOWNLOADED = [
    # ckptkit's own required dependency the machine lacks
    "crc32c",
    # megatron-core (needs torch, numpy, packaging: on the machine)
    "megatron-core",
    # what deepspeed imports that the machine lacks
    "hjson", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions",
    # torchtitan and what it imports on the checks' path (its model configs import torchtitan.trainer, which
    # imports its HF data loading: datasets, with dill and multiprocess; pandas, pyarrow, xxhash are there)
    "torchtitan", "torchdata", "spmd-types", "tyro", "docstring-parser", "typeguard", "torch-checkpointing",
    "datasets", "dill", "multiprocess",
]
BUILT = ["deepspeed", "ckptkit"]
"""Built here: deepspeed from its sdist (pure Python with DS_BUILD_OPS=0), ckptkit from the working tree."""

ON_GPU_MACHINE = {
    # the device tool's KINDS.md, "Python packages already there" (the names a carried wheel may need)
    "torch", "numpy", "fsspec", "click", "rich", "safetensors", "tensorstore", "transformers", "psutil", "einops",
    "tqdm", "msgpack", "ninja", "py-cpuinfo", "tensorboard", "triton", "pytest", "hypothesis", "packaging",
    "pyyaml", "requests", "urllib3", "tokenizers", "pillow", "filelock", "jinja2", "sympy", "networkx",
    "setuptools", "wheel", "pytest-timeout", "huggingface-hub", "xxhash", "protobuf", "absl-py", "pyarrow",
    "pandas", "typer", "regex", "sentencepiece", "tiktoken", "ml-dtypes", "httpx", "aiohttp", "huggingface-hub",
}
NOT_CARRIED = {
    "torch": "the machine's own CUDA build is used",
    "torchao": "torch-version-specific binary; torchtitan imports it only for float8/MX training",
    "wandb": "torchtitan's optional logger, not on the checks' path",
    "tensorboard": "on the machine",
    "zarr": "a test-only extra of ckptkit (the zarr converter)",
}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wanted() -> dict[str, str]:
    """Package -> version: what this interpreter (the CPU suite's .venv) has installed."""
    out = {}
    for name in DOWNLOADED + BUILT:
        try:
            out[norm(name)] = md.version(name)
        except md.PackageNotFoundError:
            raise SystemExit(f"gpu-wheels: {name} is not installed in {sys.prefix}; run `make setup` first")
    return out


def wheel_name_version(filename: str) -> tuple[str, str]:
    parts = filename[:-len(".whl")].split("-")
    return norm(parts[0]), parts[1]


def wheel_tags(filename: str) -> list[tuple[str, str, str]]:
    """The (python, abi, platform) tags a wheel's file name declares (compressed tag sets expanded)."""
    parts = filename[:-len(".whl")].split("-")
    py, abi, plat = parts[-3], parts[-2], parts[-1]
    return [(p, a, q) for p in py.split(".") for a in abi.split(".") for q in plat.split(".")]


def runs_on_gpu_machine(filename: str) -> bool:
    """Whether CPython 3.12 on manylinux x86-64 (glibc 2.39) installs this wheel."""
    for py, abi, plat in wheel_tags(filename):
        py_ok = py in ("py3", "py312", PYTHON_TAG) or (abi == "abi3" and re.fullmatch(r"cp3(\d+)", py)
                                                        and int(py[3:]) <= 12)
        abi_ok = abi in ("none", "abi3", PYTHON_TAG)
        m = re.fullmatch(r"manylinux_2_(\d+)_x86_64", plat)
        plat_ok = plat == "any" or plat in ("manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64") or (
            m is not None and int(m.group(1)) <= 39)
        if py_ok and abi_ok and plat_ok:
            return True
    return False


def requires(path: str) -> list[str]:
    """A wheel's unconditional requirements on Linux / CPython 3.12 (extras skipped), as normalised names."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode("utf-8", "replace")
    out = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        spec, _, marker = req.partition(";")
        if "extra" in marker:
            continue
        if re.search(r"python_version\s*<\s*['\"]3\.(\d|1[01])['\"]", marker) or "sys_platform == \"win32\"" in marker \
                or "platform_system == \"Windows\"" in marker:
            continue
        out.append(norm(re.split(r"[\s<>=!~\[(;]", spec.strip(), maxsplit=1)[0]))
    return out


SKIPPED_DIRS = {".git", ".venv", "gpu-wheels", "gpu-out", "runs", "bench-out", "__pycache__", ".pytest_cache",
                ".hypothesis", "build", "dist"}
"""Where git is not there (the device machine's copy of the tree): the folders .gitignore leaves out."""


def tree_bytes(root: str = ROOT) -> int:
    """Bytes of what the device tool sends besides the carried paths: tracked and untracked-not-ignored files
    (without git: every file outside :data:`SKIPPED_DIRS`)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                             capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        total = 0
        for dirpath, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and not d.endswith(".egg-info")]
            total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files
                         if not os.path.islink(os.path.join(dirpath, f)))
        return total
    total = 0
    for rel in out.decode().split("\0"):
        path = os.path.join(root, rel)
        if rel and os.path.isfile(path) and not os.path.islink(path):
            total += os.path.getsize(path)
    return total


def folder_bytes(folder: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(dirpath, f)
            if not os.path.islink(p):
                total += os.path.getsize(p)
    return total


def check_size(folder: str, tree: int, limit: int = LIMIT) -> tuple[bool, str]:
    """Whether ``folder`` and ``tree`` bytes of working tree fit the device tool's per-call limit; a line saying so."""
    wheels = folder_bytes(folder)
    total = wheels + tree
    ok = total <= limit
    line = (f"gpu-wheels: {folder}: {wheels / 2**20:.1f} MiB of wheels + {tree / 2**20:.1f} MiB of working tree = "
            f"{total / 2**20:.1f} MiB, {'within' if ok else 'OVER'} the device tool's {limit / 2**20:.0f} MiB per call")
    return ok, line


def check_folder(folder: str, want: dict[str, str] | None = None) -> list[str]:
    """Problems with the wheels in ``folder``: not installable on the GPU machine, two versions of one package,
    a version other than the CPU suite's, a package missing."""
    problems = []
    seen: dict[str, str] = {}
    for f in sorted(os.listdir(folder)):
        if not f.endswith(".whl"):
            continue
        name, version = wheel_name_version(f)
        if name in seen:
            problems.append(f"two versions of {name}: {seen[name]} and {version}")
        seen[name] = version
        if not runs_on_gpu_machine(f):
            problems.append(f"{f}: not installable on CPython 3.12 / manylinux x86-64")
        if want is not None and name in want and want[name] != version:
            problems.append(f"{f}: version {version}, the CPU suite runs {want[name]}")
    for name in (want or {}):
        if name not in seen:
            problems.append(f"{name}: no wheel")
    return problems


def unmet(folder: str) -> dict[str, list[str]]:
    """Requirements of the carried wheels that neither the folder nor the GPU machine provides."""
    carried = {wheel_name_version(f)[0] for f in os.listdir(folder) if f.endswith(".whl")}
    out: dict[str, list[str]] = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".whl"):
            for req in requires(os.path.join(folder, f)):
                if req not in carried and req not in ON_GPU_MACHINE:
                    out.setdefault(req, []).append(wheel_name_version(f)[0])
    return out


def pip(*args: str, env: dict[str, str] | None = None) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"gpu-wheels: failed: {' '.join(cmd)}")


def build(folder: str) -> None:
    want = wanted()
    os.makedirs(folder, exist_ok=True)
    have = {}
    for f in os.listdir(folder):
        if f.endswith(".whl"):
            name, version = wheel_name_version(f)
            if name == "ckptkit" or want.get(name) != version:
                os.remove(os.path.join(folder, f))  # ckptkit is rebuilt; other versions would stop pip
            else:
                have[name] = f
    missing = [f"{n}=={want[n]}" for n in map(norm, DOWNLOADED) if n not in have]
    if missing:
        print(f"gpu-wheels: downloading {len(missing)} wheel(s) for CPython 3.12: {' '.join(missing)}", flush=True)
        plats = [a for p in PLATFORMS for a in ("--platform", p)]
        pip("download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
            "--abi", PYTHON_TAG, "--abi", "abi3", "--abi", "none", *plats, "-d", folder, *missing)
    if "deepspeed" not in have:
        print(f"gpu-wheels: building deepspeed=={want['deepspeed']} as pure Python (DS_BUILD_OPS=0)", flush=True)
        env = {**os.environ, "DS_BUILD_OPS": "0"}
        pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", folder, f"deepspeed=={want['deepspeed']}",
            env=env)
    print("gpu-wheels: building ckptkit from the working tree", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        # a copy of what git would send: the build's own scratch (build/, *.egg-info) stays out of the checkout
        files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                               capture_output=True, check=True).stdout.decode().split("\0")
        src = os.path.join(tmp, "src")
        for rel in files:
            if rel and os.path.isfile(os.path.join(ROOT, rel)):
                os.makedirs(os.path.dirname(os.path.join(src, rel)), exist_ok=True)
                shutil.copy2(os.path.join(ROOT, rel), os.path.join(src, rel))
        pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", folder, src)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "gpu-wheels"))
    ap.add_argument("--check", action="store_true", help="only check an existing folder")
    args = ap.parse_args(argv)
    folder = os.path.abspath(args.out)
    if not args.check:
        build(folder)
    elif not os.path.isdir(folder):
        print(f"gpu-wheels: {folder} does not exist; run `make gpu-wheels`")
        return 1
    want = wanted()
    problems = check_folder(folder, want)
    for f in sorted(os.listdir(folder)):
        if f.endswith(".whl"):
            print(f"  {os.path.getsize(os.path.join(folder, f)) / 2**20:6.2f} MiB  {f}")
    gaps = unmet(folder)
    if gaps:
        print("gpu-wheels: declared needs neither carried nor on the GPU machine (not imported on the checks' path):")
        for req, by in sorted(gaps.items()):
            print(f"  {req} (required by {', '.join(by)}){': ' + NOT_CARRIED[req] if req in NOT_CARRIED else ''}")
    ok, line = check_size(folder, tree_bytes())
    print(line)
    for p in problems:
        print(f"gpu-wheels: PROBLEM: {p}")
    return 0 if ok and not problems else 1


if __name__ == "__main__":
    sys.exit(main())
