from __future__ import annotations

import pytest

from tests.worlds import Worlds


SLOW = {"on": False}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="run the long reliability tests at full count")


def pytest_configure(config: pytest.Config) -> None:
    SLOW["on"] = bool(config.getoption("--run-slow"))


def trials(default: int, slow: int) -> int:
    """How many trials a reliability sweep runs: a CI-sized count by default, the full one with --run-slow."""
    return slow if SLOW["on"] else default


@pytest.fixture(scope="session")
def worlds():
    w = Worlds()
    yield w
    w.close()


@pytest.fixture(scope="module")
def retire_megatron_world(worlds):
    """For Megatron modules: the CPU shims (tests/megatron_cpu_shims.py) stay installed in the world's
    processes, including a TorchFunctionMode that slows every torch call, so after the module the
    4-rank world is closed and no later module shares it."""
    yield
    worlds.retire(4)


@pytest.fixture(scope="session")
def dtensor_checkpoints(worlds, tmp_path_factory):
    """DTensor checkpoints saved once per session by 4 gloo ranks: (layout, dtype) -> (path, rank 0's
    record of what it saved); FSDP2 Shard(0) and FSDP2 x TP, fp32 and bf16 (tests/test_dtensor_*.py)."""
    from tests.test_dtensor_reshard import DTYPES, save_run

    out = {}
    for layout in ("fsdp", "fsdp_tp"):
        for dtype in DTYPES:
            path = str(tmp_path_factory.mktemp("ckpt") / f"{layout}-{dtype}")
            out[(layout, dtype)] = (path, worlds.run(4, save_run, layout, dtype, path)[0])
    return out
