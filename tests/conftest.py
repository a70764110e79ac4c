from __future__ import annotations

import pytest

from tests.worlds import Worlds


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="run the long reliability tests at full count")


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
