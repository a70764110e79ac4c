from __future__ import annotations

import functools
import os
from typing import Any

import pytest

from tests.worlds import Worlds

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest-xdist gives its workers COLUMNS=80 / LINES=24. The CLI reads COLUMNS as the user's wish for a
    # width when stdout is piped, so the tests' CLI output (asserted line by line) would wrap where a user's
    # pipe does not: the workers see the environment a plain pytest run has.
    os.environ.pop("COLUMNS", None)
    os.environ.pop("LINES", None)


SLOW = {"on": False}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="run the long reliability tests at full count")
    parser.addoption("--module-costs", action="store_true",
                     help="print each test module's wall time and the machine's CPU time meanwhile (all processes: "
                          "the ranks of its worlds, its servers, its subprocesses), the most costly first")


def pytest_configure(config: pytest.Config) -> None:
    SLOW["on"] = bool(config.getoption("--run-slow"))
    if config.getoption("--module-costs"):
        if config.getoption("numprocesses", None):
            raise pytest.UsageError("--module-costs measures a serial run: add -n 0 (make test TEST_WORKERS=0)")
        from tests.module_costs import ModuleCosts

        config.pluginmanager.register(ModuleCosts(), "module-costs")


COSTLY_FIRST = (
    "test_megatron_moe.py", "test_megatron.py", "test_megatron_convert.py", "test_overlap_megatron.py",
    "test_torchtitan_moe.py", "test_torchtitan.py", "test_overlap_torchtitan.py", "test_resilience_dist.py",
    "test_scale_layouts.py", "test_dtensor_reshard.py", "test_memory_tier_torchrun.py", "test_crash_consistency.py",
    "test_overlap_adapters.py", "test_s3_restore_faults.py",
    "test_s3_faults.py", "test_store_s3.py", "test_async_waves.py", "test_async_overlap.py",
)
"""The most costly modules (``pytest --module-costs``, 2 cores), the costliest first. They run first, the rest in
file order after them: with two workers (``make test`` runs pytest-xdist, one test file at a time per worker)
the long ones start early and the short ones fill the end, instead of one long module running alone last.
A family's modules stay next to each other, so a worker that runs two of them in a row keeps their worlds
(:data:`FAMILIES`)."""


MULTI_RANK_BY_LAUNCHER = ("test_resilience_dist.py", "test_memory_tier_torchrun.py")
"""Modules whose gloo worlds are started by torchrun rather than by the ``worlds`` fixture."""


@functools.lru_cache(maxsize=None)
def runs_worlds(test_file: str) -> bool:
    """Whether a test module runs multi-rank gloo worlds: it names the ``worlds`` fixture, or torchrun starts
    its worlds (:data:`MULTI_RANK_BY_LAUNCHER`). Read from the source, because xdist's controller schedules
    from node ids alone; a module that only mentions worlds lands in the worlds lane, which costs nothing."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), test_file)
    if os.path.basename(path) in MULTI_RANK_BY_LAUNCHER:
        return True
    try:
        with open(path, encoding="utf-8") as f:
            return "worlds" in f.read()
    except OSError:
        return False


WORLDS_TAIL = (
    "test_deepspeed.py", "test_deepspeed_convert.py", "test_deepspeed_moe.py", "test_convert_dcp.py",
    "test_convert_hf_megatron.py", "test_memory_tier.py", "test_catalog.py", "test_bitflips.py",
    "test_modelspace_diff.py", "test_modelspace_view.py", "test_modelspace_zarr.py", "test_heterogeneous_states.py",
    "test_megatron_extra_state.py", "test_deepspeed_frozen.py", "test_megatron_legacy_optimizer.py",
    "test_adapter_refused_loads.py",
)
"""Modules with worlds that run as a second worlds unit, queued after every other module: the worker whose
single-process modules end first (measured: 476 s against the worlds lane's 641 s) takes them, while the
worlds lane still runs. Only modules whose assertions do not depend on time (no stall thresholds, no
timeouts, no timed waits): on the single-process worker their ranks run at its lower priority, beside the
worlds lane's ranks for a while. Each has its own worlds (no session fixture of the worlds lane), so the
lane it lands in computes nothing twice."""


def work_unit(test_file: str) -> str:
    """The scheduling unit of a test module: "worlds", "worlds-tail" (:data:`WORLDS_TAIL`) or the file."""
    if not runs_worlds(test_file):
        return test_file
    return "worlds-tail" if os.path.basename(test_file) in WORLDS_TAIL else "worlds"


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``make test``'s two workers: every module that runs multi-rank worlds is one work unit, "worlds", which
    one worker runs in order; every other module is a unit of its own, the costliest first (collection
    order). Two 4-rank worlds at once on 2 cores put 8 ranks in every collective's way: measured with one
    unit per file, tests that take 4 s alone took 40-70 s. So the worlds run one at a time, beside the
    single-process modules and the waits (S3 retries, watchdog stalls) of the other worker. (xdist's own
    ``loadgroup`` cannot do this here: it renames node ids in a way pytest 9.2 no longer sees.)"""
    if config.getvalue("dist") not in ("load", "loadfile", "loadscope", "loadgroup"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class WorldsLane(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid.split("::", 1)[0])

    return WorldsLane(config, log)


SINGLE_PROCESS_LANE_NICENESS = 10
"""How much lower the priority of the worker that runs no worlds is (``os.nice``). A 4-rank world on 2 cores is
as fast as its slowest rank at every collective: a rank that waits for a core stalls the other three. The
single-process modules need less than the CPU the worlds leave idle (measured serially: the worlds modules
keep 1.5 of the 2 cores busy; the others need 190 CPU seconds in all), so they take that CPU at a lower
priority instead of taking turns with the ranks. Measured from one clone on a quiet machine: 804 s of tests
with both workers at one priority, 453 s with this, 760 s serially."""

_LANE: dict[str, bool] = {}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """On an xdist worker's first test: a worker that starts with a module of no worlds is the single-process
    lane (the scheduler sends the one worlds unit first to the first worker) and lowers its priority for good."""
    if _LANE or not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    _LANE["worlds"] = runs_worlds(item.nodeid.split("::", 1)[0])
    if not _LANE["worlds"]:
        try:
            os.nice(SINGLE_PROCESS_LANE_NICENESS)
        except OSError:  # a sandbox that refuses it: the lanes then share the cores as equals
            pass


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The costliest modules first (:data:`COSTLY_FIRST`), file order within and after them, and the
    worlds tail (:data:`WORLDS_TAIL`) last."""
    order = {name: i for i, name in enumerate(COSTLY_FIRST)}
    last = len(order) + 1
    items.sort(key=lambda item: last if item.path.name in WORLDS_TAIL else order.get(item.path.name, len(order)))


def trials(default: int, slow: int) -> int:
    """How many trials a reliability sweep runs: a CI-sized count by default, the full one with --run-slow."""
    return slow if SLOW["on"] else default


_SESSION: dict[str, Any] = {}

FAMILIES = {"retire_megatron_world": "megatron", "torchtitan_worlds": "torchtitan"}
"""Fixtures a module requests (``pytestmark = pytest.mark.usefixtures(...)``) to say which framework its
worlds' ranks carry, shims included: consecutive modules of one family share those worlds."""


def world_family(item: pytest.Item | None) -> str | None:
    """The family of ``item``'s module (:data:`FAMILIES`), None for a module of none (or no item)."""
    if item is None:
        return None
    return next((family for name, family in FAMILIES.items() if name in item.fixturenames), None)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Note, before the module's fixtures are finalized, whether the next test runs in the same family."""
    _SESSION["same_family_next"] = world_family(item) is not None and world_family(item) == world_family(nextitem)


@pytest.fixture(scope="session")
def worlds():
    w = Worlds()
    _SESSION["worlds"] = w
    yield w
    _SESSION.pop("worlds", None)
    w.close()


@pytest.fixture(scope="module", autouse=True)
def retire_heavy_worlds():
    """After every module, worlds whose ranks imported a framework are closed (tests/worlds.py
    ``retire_heavy``): no module leaves idle Megatron/DeepSpeed/torchtitan ranks behind, and the
    Megatron CPU shims (a TorchFunctionMode that slows every torch call) never reach a later module. The
    one exception: the next module is of the same family (:data:`FAMILIES`), which needs those very ranks,
    shims and all; it then skips importing the framework into fresh ranks again."""
    yield
    if "worlds" in _SESSION and not _SESSION.pop("same_family_next", False):
        _SESSION["worlds"].retire_heavy()


@pytest.fixture(scope="module")
def retire_megatron_world(worlds):
    """Marks a Megatron module (its ranks install tests/megatron_cpu_shims.py): see :data:`FAMILIES`."""
    yield


@pytest.fixture(scope="module")
def torchtitan_worlds(worlds):
    """Marks a torchtitan module (its ranks carry tests/torchtitan_job.py's shims): see :data:`FAMILIES`."""
    yield


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


@pytest.fixture
def held_writes(monkeypatch):
    """Background writes (the thread executor's) wait until the test sets the event this yields: the test
    acts while its save persists."""
    import threading

    import ckptkit.engine.async_save as async_save

    gate = threading.Event()
    write = async_save.write_staged

    def held(*args, **kwargs):
        gate.wait(30)
        return write(*args, **kwargs)

    monkeypatch.setattr(async_save, "write_staged", held)
    yield gate
    gate.set()
