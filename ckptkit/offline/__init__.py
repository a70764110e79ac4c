"""The offline API: checkpoints examined, compared and rewritten without a training job.

Beside ``save``/``load`` (collective, inside a job), these work on a login node, a laptop or in
a notebook, on local paths and ``s3://`` URLs, and return typed, frozen results with a
``to_json()`` (what the CLI prints with ``--json``):

* :func:`open` -> :class:`CheckpointView`: lazy model-space access, ``view[key][rows]`` reads
  only those rows' bytes;
* :func:`list_checkpoints` -> [:class:`CheckpointInfo`]: a run's checkpoints, committed or not
  and why, with what retention keeps;
* :func:`describe` -> :class:`CheckpointDescription`: tensors, layouts, pieces per rank;
* :func:`verify` -> :class:`VerifyReport`: every digest, coverage and block checksum;
* :func:`diff` -> :class:`DiffReport`: two checkpoints of any layouts, tensor by tensor;
* :func:`reshard` / :func:`plan_reshard` -> :class:`ReshardResult`: rewrite (or plan rewriting)
  a checkpoint for another parallel layout, of any format a registered converter detects.

All of them read through one engine (:class:`~ckptkit.engine.read_session.ReadSession`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckptkit.offline.description import CheckpointDescription, MeshInfo, RankInfo, TensorInfo, describe
    from ckptkit.offline.comparison import DiffOptions, DiffReport, TensorDiff, ValueDiff, diff
    from ckptkit.offline.listing import CheckpointInfo, list_checkpoints
    from ckptkit.offline.resharding import ReshardOptions, ReshardResult, plan_reshard, reshard
    from ckptkit.offline.verification import Problem, VerifyReport, verify
    from ckptkit.offline.view import CheckpointView, TensorEntry, TensorView, ViewOptions, open

# Lazy: listing, describing and verifying import no torch; views, diffs and reshards do.
_WHERE = {
    **dict.fromkeys(("CheckpointDescription", "MeshInfo", "RankInfo", "TensorInfo", "describe"), "description"),
    **dict.fromkeys(("DiffOptions", "DiffReport", "TensorDiff", "ValueDiff", "diff"), "comparison"),
    **dict.fromkeys(("CheckpointInfo", "list_checkpoints"), "listing"),
    **dict.fromkeys(("ReshardOptions", "ReshardResult", "plan_reshard", "reshard"), "resharding"),
    **dict.fromkeys(("Problem", "VerifyReport", "verify"), "verification"),
    **dict.fromkeys(("CheckpointView", "TensorEntry", "TensorView", "ViewOptions", "open"), "view"),
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptkit.offline' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"ckptkit.offline.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "CheckpointDescription", "CheckpointInfo", "CheckpointView", "DiffOptions", "DiffReport", "MeshInfo",
    "Problem", "RankInfo", "ReshardOptions", "ReshardResult", "TensorDiff", "TensorEntry", "TensorInfo",
    "TensorView", "ValueDiff", "VerifyReport", "ViewOptions", "describe", "diff", "list_checkpoints", "open",
    "plan_reshard", "reshard", "verify",
]
