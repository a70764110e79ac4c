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
