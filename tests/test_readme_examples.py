"""The README's code examples run in a test (the project's rule).

Every ```python block of README.md is covered by exactly one test below (:data:`COVERAGE`); a block
that is added or whose opening changes fails ``test_every_readme_python_block_is_covered`` until
it is given a test here.

* Blocks that run on a CPU in one process are executed as written (``exec``, statement by
  statement: tests/readme_harness.py) in a namespace that supplies what the fragment assumes (a
  small torch model, AdamW, ``state``, ``train_step``, ...), in a tmp_path working directory, and
  the result is checked: the checkpoints committed, the step a restore returned, the values it
  brought back. The only rewrites are for what cannot exist here, each explicit (``rewrite``
  fails if its text is no longer in the block):
  - ``s3://bucket/...``: the bucket name becomes a fresh bucket on the real S3 server the suite
    starts (tests/s3_server.py, moto on 127.0.0.1); the URL is otherwise as written.
  - the memory tier's ``replicas=1`` becomes ``replicas=0`` with a ``root`` under tmp_path: one
    process is one node, which cannot hold a replica of itself (refused by design).
* Blocks for DeepSpeed, Megatron-core and torchtitan, which need a live framework job, run their
  imports for real; then every adapter function they call is replaced by one that binds the
  README's arguments to the real function's signature (placeholders for the engine/model/
  optimizer), and option dataclasses are constructed for real with the README's fields.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import re
import signal
import threading
import types
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import ckptkit
from tests.readme_harness import (
    README,
    BindingModule,
    Block,
    Call,
    binding,
    exec_block,
    python_blocks,
    rewrite,
    split_imports,
    text_before,
)
from tests.s3_server import s3_env, s3_server  # noqa: F401 - fixtures

# The opening of each README python block (a prefix of its source) -> the test that covers it.
COVERAGE = {
    "import ckptkit\nfrom torch.distributed.checkpoint.state_dict import": "test_using_it_save_and_load",
    "mgr = ckptkit.CheckpointManager(\n    \"runs/exp1\",": "test_checkpoint_manager",
    "tier = ckptkit.MemoryTier(": "test_memory_tier",
    "ckpt = ckptkit.open(": "test_open_slices_and_tensors",
    "from ckptkit.adapters.torchtitan import CkptkitCheckpointManager": "test_torchtitan_config",
    "from ckptkit.adapters import deepspeed as ds_ckpt": "test_deepspeed_adapter_calls",
    "from ckptkit.adapters import megatron as mckpt": "test_megatron_adapter_calls",
    "mgr = ckptkit.CheckpointManager(\"s3://bucket/run1\"": "test_resilience_controller_loop",
    "policy = ckptkit.SpikePolicy(": "test_spike_policy_rungs",
}


@dataclass(frozen=True)
class ReadmeBug:
    """A README example that is wrong as written: the verbatim block must still fail this way (so
    this entry is removed once the README is fixed), and the test runs it with ``old`` -> ``new``."""

    old: str
    new: str
    error: type[BaseException]
    match: str


README_BUGS: dict[str, list[ReadmeBug]] = {
    # Each entry: the README as written fails this way, in this order (each fix applied reaches the next).
    # Empty: every example runs as written. (The first entries found here, a `"train": {}` state that
    # cannot receive "train/step" and a missing set_*_state_dict import, were fixed in the README.)
}


def _blocks_by_key() -> dict[str, list[Block]]:
    blocks = python_blocks()
    return {key: [b for b in blocks if b.source.startswith(key)] for key in COVERAGE}


def covered(test_name: str) -> Block:
    (key,) = [k for k, name in COVERAGE.items() if name == test_name]
    matches = _blocks_by_key()[key]
    assert len(matches) == 1, f"README.md: {len(matches)} python blocks start with {key!r} (covered by {test_name})"
    return matches[0]


def test_every_readme_python_block_is_covered():
    blocks = python_blocks()
    assert blocks, "no ```python blocks found in README.md"
    problems = []
    for b in blocks:
        keys = [k for k in COVERAGE if b.source.startswith(k)]
        if not keys:
            problems.append(f"{b.where()} starts with {b.first_line!r} and no test covers it: write a test in "
                            f"tests/test_readme_examples.py that runs it (or, for a framework that cannot run here, "
                            f"binds its calls) and add its opening to COVERAGE, e.g. {b.first_line!r}: 'test_...'")
        elif len(keys) > 1:
            problems.append(f"{b.where()} matches several COVERAGE keys {keys}: make them longer")
    for key, matches in _blocks_by_key().items():
        if len(matches) != 1:
            problems.append(f"COVERAGE key {key!r} ({COVERAGE[key]}) matches {len(matches)} README python blocks "
                            f"(at lines {[m.line for m in matches]}): exactly one expected")
    for name in COVERAGE.values():
        assert callable(globals().get(name)), f"COVERAGE names {name}, which is not a test in this file"
    assert not problems, "\n".join(problems)


def readme_source(test_name: str, block: Block, fresh_ns) -> str:
    """The block's source with the recorded README bugs fixed, after checking that each one still fails
    as recorded (``fresh_ns()``: a new namespace, and working directory, for each try). When the README
    is fixed, this fails: remove the entry from README_BUGS."""
    source = block.source
    for bug in README_BUGS.get(test_name, []):
        try:
            exec_block(block, source, fresh_ns())
        except bug.error as exc:
            assert re.search(bug.match, str(exc)), f"README_BUGS expects {bug.match!r} in: {exc}"
        else:
            pytest.fail(f"{block.where()} no longer fails with {bug.error.__name__} ({bug.match!r}): the README "
                        f"was fixed; remove that entry from README_BUGS in tests/test_readme_examples.py")
        source = rewrite(source, bug.old, bug.new, why=f"known README bug ({bug.error.__name__}: {bug.match})")
    return source


# ------------------------------------------------------------------------------------- a tiny job

class TinyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def batch_of(first: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples [first, first + size): a deterministic function of the absolute sample index."""
    xs, ys = [], []
    for i in range(first, first + size):
        g = torch.Generator().manual_seed(1000 + i)
        x = torch.randn(8, generator=g)
        xs.append(x)
        ys.append(x.flip(0) * 0.5)
    return torch.stack(xs), torch.stack(ys)


def job(seed: int = 0, warm_steps: int = 2) -> dict:
    """A namespace with what the README's training fragments assume: ``model``, ``optimizer``,
    ``scheduler``, ``state`` (model + optimizer, DCP's state-dict getters), ``train_step()`` (one whole
    step, which also sets ``v``, the val loss the manager example records). Each test adds the rest."""
    torch.manual_seed(seed)
    model = TinyModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5))
    ns: dict = {"__name__": "readme_example", "ckptkit": ckptkit, "model": model, "optimizer": optimizer,
                "scheduler": scheduler, "v": math.nan}

    def train_step() -> None:
        x, y = batch_of(8 * int(ns.get("step", 0)), 8)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        ns["v"] = loss.item()

    for _ in range(warm_steps):  # non-zero optimizer moments, so a restore of them means something
        train_step()
    ns["train_step"] = train_step
    ns["state"] = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    return ns


def snapshot(ns: dict) -> dict:
    """Copies of the model's and the optimizer's tensors (what a restore must bring back), the
    optimizer's per parameter in the model's order."""
    model, optimizer = ns["model"], ns["optimizer"]
    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optim": [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in optimizer.state[p].items()}
                      for p in model.parameters()]}


def scramble(ns: dict) -> None:
    """Overwrite the live model and optimizer state in place, as a fresh job would hold it."""
    with torch.no_grad():
        for p in ns["model"].parameters():
            p.fill_(7.0)
        for s in ns["optimizer"].state.values():
            for v in s.values():
                if torch.is_tensor(v):
                    v.fill_(3.0)


def assert_same(want: dict, ns_or_snapshot: dict) -> None:
    got = ns_or_snapshot if "optimizer" not in ns_or_snapshot else snapshot(ns_or_snapshot)
    assert want["model"].keys() == got["model"].keys()
    for k in want["model"]:
        assert torch.equal(want["model"][k], got["model"][k]), f"model {k} not restored"
    assert len(want["optim"]) == len(got["optim"]) and all(want["optim"]), "no optimizer state to compare"
    for i, (w, g) in enumerate(zip(want["optim"], got["optim"])):
        assert w.keys() == g.keys()
        for k, v in w.items():
            assert torch.equal(v, g[k]) if torch.is_tensor(v) else v == g[k], f"optimizer state {k} of parameter {i}"


def committed(url: str, **kw) -> list[tuple[str, int]]:
    return [(c.name, c.step) for c in ckptkit.list_checkpoints(url, **kw) if c.committed]


# ----------------------------------------------------------------------------- "## Using it"

def test_using_it_save_and_load(tmp_path, monkeypatch):
    block = covered("test_using_it_save_and_load")

    tries = iter(range(100))

    def fresh_ns() -> dict:
        folder = tmp_path / f"try-{next(tries)}"
        folder.mkdir()
        monkeypatch.chdir(folder)
        return job() | {"step": 1000, "tokens_seen": 4096_000}

    source = readme_source("test_using_it_save_and_load", block, fresh_ns)
    (tmp_path / "run").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    ns = job() | {"step": 1000, "tokens_seen": 4096_000}
    saved: dict = {}

    def after_save(ns: dict) -> None:  # the load below must bring back what was saved, not what is there
        saved.update(snapshot(ns))
        scramble(ns)

    exec_block(block, source, ns, hooks={"ckptkit.save(": after_save})
    assert committed("runs/exp1") == [("step-0001000", 1000)]
    assert ns["state"]["train"] == {"step": 1000, "tokens": 4096_000}
    assert_same(saved, ns)


# ------------------------------------------------------------- "### Asynchronous saves and the checkpoint manager"

def test_checkpoint_manager(tmp_path, monkeypatch):
    block = covered("test_checkpoint_manager")
    monkeypatch.chdir(tmp_path)
    ns = job() | {"total_steps": 201}  # saves at steps 100 and 200 (every_steps=100); the last step is 200
    exec_block(block, ns=ns)
    assert ns["start"] == 0  # nothing to restore yet
    assert committed("runs/exp1") == [("step-0000100", 100), ("step-0000200", 200)]
    infos = {c.step: c for c in ckptkit.list_checkpoints("runs/exp1")}
    assert infos[200].metrics["val_loss"] == pytest.approx(ns["v"])
    at_200 = snapshot(ns)

    # the same code again is a restarted job: it resumes from step 200 with the saved values
    scramble(ns)
    exec_block(block, ns=ns)
    assert ns["start"] == 200
    assert_same(at_200, ns)


# ------------------------------------------------------------- "### A memory tier"

def test_memory_tier(tmp_path, monkeypatch, capsys):
    block = covered("test_memory_tier")
    monkeypatch.chdir(tmp_path)
    # one process is one node: it cannot hold a replica of its own snapshot (refused by design), so
    # replicas=0 (the node's own copy only); the node's memory folder under tmp_path, not /dev/shm
    source = rewrite(block.source, "replicas=1)", f"replicas=0, root={str(tmp_path / 'mem')!r})",
                     why="a single node cannot hold replicas")
    ns = job() | {"total_steps": 11}  # memory snapshots at 5 and 10; no persistent save (every 500)
    exec_block(block, source, ns)
    assert ns["start"] == 0 and ns["mgr"].last_restore is None
    assert capsys.readouterr().out == "None\n"
    at_10 = snapshot(ns)

    scramble(ns)
    exec_block(block, source, ns)  # a restarted worker on the same node
    assert ns["start"] == 10
    info = ns["mgr"].last_restore
    assert (info.step, info.source) == (10, "memory") and info.seconds >= 0
    assert repr(info) in capsys.readouterr().out
    assert not os.path.exists("runs/exp1") or committed("runs/exp1") == []  # it came from memory alone
    assert_same(at_10, ns)


# ------------------------------------------------------------- "### Looking inside a checkpoint"

class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 320)
        self.fc2 = nn.Linear(320, 8)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = Mlp()


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer.mlp.fc2(torch.relu(layer.mlp.fc1(x)))
        return x


def test_open_slices_and_tensors(s3_env):  # noqa: F811
    block = covered("test_open_slices_and_tensors")
    torch.manual_seed(0)
    model = Stack()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).square().sum().backward()
    optimizer.step()
    url = f"s3://{s3_env}/run1/step-0001200"  # the README's checkpoint, in a real (local) bucket
    ckptkit.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}, url)
    # s3://bucket is no bucket of ours: the same URL in a fresh bucket of the local S3 server
    source = rewrite(block.source, "s3://bucket/", f"s3://{s3_env}/", why="the bucket is a local test bucket")
    run = exec_block(block, source, {"ckptkit": ckptkit})
    entries = run.values['ckpt.tensors("optim/*")']
    keys = {e.key for e in entries}
    assert keys and all(k.startswith("optim/") for k in keys)
    exp_avg = [e for e in entries if "layers.3.mlp.fc1.weight" in e.key and e.key.endswith("exp_avg")]
    assert [tuple(e.shape) for e in exp_avg] == [(320, 8)], keys
    assert torch.equal(run.ns["rows"], model.layers[3].mlp.fc1.weight.detach()[128:256, :])


# ------------------------------------------------------------- frameworks: bind, do not run

def _bind_adapter_block(test_name: str, placeholders: dict) -> tuple[dict, list[Call]]:
    """Run the block's imports for real, then the rest with every adapter module it imported replaced by
    a :class:`BindingModule`, and every adapter function it imported by :func:`binding` of it (calls bind
    to the real signatures and are recorded, in order; classes and option dataclasses are the real ones)."""
    block = covered(test_name)
    imports, rest = split_imports(block.source)
    ns: dict = {"__name__": "readme_example", "ckptkit": ckptkit}
    exec_block(block, imports, ns)
    calls: list[Call] = []
    for name, value in list(ns.items()):
        if isinstance(value, types.ModuleType) and value.__name__.startswith("ckptkit.adapters"):
            ns[name] = BindingModule(value, calls)
        elif inspect.isfunction(value) and value.__module__.startswith("ckptkit.adapters"):
            ns[name] = binding(value, calls)
    ns.update(placeholders)
    exec_block(block, rest, ns)
    return ns, calls


class Placeholder:
    def __init__(self, what: str) -> None:
        self.what = what

    def __repr__(self) -> str:
        return f"<{self.what}>"


def test_torchtitan_config():
    from torchtitan.components.checkpointer.base import BaseCheckpointManager

    config = types.SimpleNamespace(checkpoint=None)  # torchtitan's job config; only .checkpoint is set
    ns, calls = _bind_adapter_block("test_torchtitan_config", {"config": config})
    assert calls == []  # the block constructs the real Config; nothing to bind
    cls = ns["CkptkitCheckpointManager"]
    assert issubclass(cls, BaseCheckpointManager) and issubclass(cls.Config, BaseCheckpointManager.Config)
    cfg = config.checkpoint
    assert isinstance(cfg, cls.Config) and dataclasses.is_dataclass(cfg)
    assert (cfg.enable, cfg.folder, cfg.interval, cfg.keep_latest_k, cfg.async_mode) == (
        True, "checkpoint", 500, 3, "async")


def test_deepspeed_adapter_calls():
    engine = Placeholder("deepspeed engine")
    ns, calls = _bind_adapter_block("test_deepspeed_adapter_calls", {"engine": engine})
    assert [c.name for c in calls] == ["save", "load"]
    save, load = calls
    assert save.arguments == {"engine": engine, "path": "runs/exp1/step-0001000", "client_state": {"epoch": 3},
                              "asynchronous": True}
    assert load.arguments == {"engine": engine, "path": "runs/exp1/step-0001000"}
    assert ns["client_state"] is load


def test_megatron_adapter_calls():
    from ckptkit.adapters import megatron

    model, optimizer, scheduler = Placeholder("model"), Placeholder("optimizer"), Placeholder("scheduler")
    ns, calls = _bind_adapter_block("test_megatron_adapter_calls", {
        "model": model, "optimizer": optimizer, "scheduler": scheduler, "consumed": 123})
    opts = ns["opts"]
    assert isinstance(opts, megatron.MegatronOptions)
    assert (opts.vocab_size, opts.make_vocab_size_divisible_by) == (50257, 128)
    assert [c.name for c in calls] == ["save", "load"]
    save, load = calls
    assert save.arguments == {"model": model, "path": "runs/gpt/iter-0001000", "optimizer": optimizer,
                              "scheduler": scheduler, "iteration": 1000, "extra": {"consumed_samples": 123},
                              "options": opts, "asynchronous": True}
    assert load.arguments == {"model": model, "path": "runs/gpt/iter-0001000", "optimizer": optimizer,
                              "scheduler": scheduler}


# ------------------------------------------------------------- "### Resilience"

@pytest.fixture
def own_signal_handlers():
    """The controller installs SIGTERM/SIGUSR1 handlers in this (pytest's) process: put pytest's back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


NAN_SAMPLES = (24, 32)  # the batch of step 4 (8 samples a step) has a NaN: a non-finite loss


def resilience_job(seed: int, preempt_at: int, applied: list) -> dict:
    """What the resilience fragment assumes: ``state`` (model + optimizer), ``apply(state)`` (into the
    model and optimizer), ``get_batch(first_sample)``, ``train_step(batch) -> (loss, grad_norm)``,
    ``global_batch``, ``scheduler``. At step ``preempt_at`` the job gets a real SIGTERM."""
    ns = job(seed, warm_steps=0)
    model, optimizer = ns["model"], ns["optimizer"]
    ns["global_batch"] = 8

    def get_batch(first: int):
        x, y = batch_of(first, 8)
        if first < NAN_SAMPLES[1] and NAN_SAMPLES[0] < first + 8:
            x[0, 0] = math.nan
        return x, y

    def train_step(batch):
        x, y = batch
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        if ns["step"] == preempt_at:
            ctl = ns["ctl"]
            if signal.getsignal(signal.SIGTERM) == ctl._on_signal:
                ns["preempted_by"] = "SIGTERM"
                os.kill(os.getpid(), signal.SIGTERM)  # the preemption notice, as a scheduler sends it
            else:  # the handler could not be installed (not the main thread): what SIGTERM would do
                ns["preempted_by"] = "preempt()"
                ctl.preempt()
        return loss.item(), grad_norm.item()

    def apply(state: dict) -> None:
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"])
        applied.append(snapshot(ns))

    ns.update(get_batch=get_batch, train_step=train_step, apply=apply)
    return ns


def test_resilience_controller_loop(s3_env, own_signal_handlers):  # noqa: F811
    from ckptkit.resilience.incidents import IncidentLog
    from ckptkit.storage import open_store

    block = covered("test_resilience_controller_loop")
    # s3://bucket is no bucket of ours: the same URL in a fresh bucket of the local S3 server
    source = rewrite(block.source, "s3://bucket/", f"s3://{s3_env}/", why="the bucket is a local test bucket")
    run = f"s3://{s3_env}/run1"

    applied: list = []
    ns = resilience_job(seed=0, preempt_at=7, applied=applied)
    exec_block(block, source, ns)
    assert ns["start"] == 1  # a fresh run
    in_main = threading.current_thread() is threading.main_thread()
    assert ns["preempted_by"] == ("SIGTERM" if in_main else "preempt()")  # the controller's handler got it
    assert ns["step"] == 7 and ns["ctl"].should_stop  # SIGTERM at step 7: an emergency save, then stop
    assert committed(run) == [("step-0000007", 7)]  # every_steps=100 never came: only the emergency save
    assert all(torch.isfinite(p).all() for p in ns["model"].parameters()), "step 4's NaN reached the weights"
    kinds = [(i.kind, i.step) for i in IncidentLog(open_store(run), writer=False).read()]
    assert ("skip_step", 4) in kinds and ("preempt", 7) in kinds and ("emergency_save", 7) in kinds, kinds
    at_7 = snapshot(ns)

    # the restarted job (another seed: its own fresh weights) resumes from the emergency save
    applied.clear()
    ns = resilience_job(seed=1, preempt_at=9, applied=applied)
    exec_block(block, source, ns)
    assert ns["start"] == 8
    assert len(applied) == 1
    assert_same(at_7, applied[0])  # apply(state) right after resume got what the emergency save wrote
    assert committed(run) == [("step-0000007", 7), ("step-0000009", 9)]


def test_spike_policy_rungs(tmp_path):
    block = covered("test_spike_policy_rungs")
    # the names come from the import the README gives just above the block
    intro = text_before(block)
    found = re.findall(r"`(from ckptkit\.resilience import [^`]+)`", intro)
    assert len(found) == 1, f"expected the README's `from ckptkit.resilience import ...` before {block.where()}"
    ns: dict = {"ckptkit": ckptkit}
    exec(found[0], ns)  # noqa: S102
    exec_block(block, ns=ns)
    from ckptkit.resilience import LowerLR, Rewarm, Rollback

    policy = ns["policy"]
    assert isinstance(policy, ckptkit.SpikePolicy)
    assert policy.rollback == Rollback(after_spikes=3, steps_before=50, skip_before=10, skip_after=50)
    assert policy.rewarm == Rewarm(factor=0.1, steps=100)
    assert policy.lower_lr == LowerLR(max_rollbacks=3, factor=0.5, max_drops=2)
    # and a controller takes it
    ctl = ckptkit.ResilienceController(ckptkit.CheckpointManager(str(tmp_path / "run")), policy, batch_size=8,
                                       signals=())
    assert ctl.policy is policy
    ctl.close()

    # the sentence after the block (inline code, not a block): change a preset's rung with dataclasses.replace
    for change in re.findall(r"`(dataclasses\.replace\(p, rollback=replace\(p\.rollback, [^`]+\))`",
                             README.read_text(encoding="utf-8")):
        p = ckptkit.SpikePolicy.palm()  # a preset with a rollback rung (olmo's is None)
        changed = eval(change, {"dataclasses": dataclasses, "replace": dataclasses.replace, "p": p})  # noqa: S307
        assert changed.rollback != p.rollback and changed.rewarm == p.rewarm and changed.loss == p.loss
