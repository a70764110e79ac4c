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
  a checkpoint for another parallel layout, of any format a registered converter detects;
* :func:`torchrun_group`: the process group of a ``torchrun`` launch, which :func:`reshard`
  spreads its work over (``process_group=``);
* :class:`Format`, :class:`RunOptions`, :class:`ConvertResult`: the contract every other format
  implements (``ckptkit_converters``), how a conversion runs, and what it returns.

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
    from ckptkit.offline.spread import SpreadError, launched_by_torchrun, torchrun_group
    from ckptkit.offline.verification import Problem, VerifyReport, verify
    from ckptkit.offline.view import CheckpointView, TensorEntry, TensorView, ViewOptions, open
    from ckptkit.offline.formats import (Format, ImportOptions, MissingImportOptions, RunOptions, detect_format,
                                         option_types, options_from, parse_options)
    from ckptkit.engine.offline_writer import ConvertResult
    from ckptkit.plan.reshard_plan import ReshardPlanOptions, plan_summary_lines

# Lazy: listing, describing and verifying import no torch; views, diffs and reshards do.
_WHERE = {
    **dict.fromkeys(("CheckpointDescription", "MeshInfo", "RankInfo", "TensorInfo", "describe"), "description"),
    **dict.fromkeys(("DiffOptions", "DiffReport", "TensorDiff", "ValueDiff", "diff"), "comparison"),
    **dict.fromkeys(("CheckpointInfo", "list_checkpoints"), "listing"),
    **dict.fromkeys(("ReshardOptions", "ReshardResult", "plan_reshard", "reshard"), "resharding"),
    **dict.fromkeys(("Problem", "VerifyReport", "verify"), "verification"),
    **dict.fromkeys(("SpreadError", "launched_by_torchrun", "torchrun_group"), "spread"),
    **dict.fromkeys(("CheckpointView", "TensorEntry", "TensorView", "ViewOptions", "open"), "view"),
    # other formats: the contract converters implement, and what the CLI builds and prints
    **dict.fromkeys(("Format", "RunOptions", "ImportOptions", "MissingImportOptions", "options_from",
                     "option_types", "parse_options", "detect_format"), "formats"),
}
_ELSEWHERE = {  # public names whose home is outside ckptkit.offline
    "ConvertResult": "ckptkit.engine.offline_writer",
    "ReshardPlanOptions": "ckptkit.plan.reshard_plan",
    "plan_summary_lines": "ckptkit.plan.reshard_plan",
}


def __getattr__(name: str) -> Any:
    module = f"ckptkit.offline.{_WHERE[name]}" if name in _WHERE else _ELSEWHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptkit.offline' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "CheckpointDescription", "CheckpointInfo", "CheckpointView", "DiffOptions", "DiffReport", "MeshInfo",
    "Problem", "RankInfo", "ReshardOptions", "ReshardResult", "TensorDiff", "TensorEntry", "TensorInfo",
    "TensorView", "ValueDiff", "VerifyReport", "ViewOptions", "describe", "diff", "list_checkpoints", "open",
    "plan_reshard", "reshard", "verify", "SpreadError", "launched_by_torchrun", "torchrun_group",
    "ConvertResult", "Format", "ImportOptions", "MissingImportOptions", "ReshardPlanOptions", "RunOptions",
    "detect_format", "option_types", "options_from", "parse_options", "plan_summary_lines",
]
