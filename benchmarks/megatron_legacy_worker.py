"""One rank of bench_megatron_legacy_import.py's setup: a real megatron-core GPT trains a step and is saved in
Megatron-LM's legacy layout with its optimizer (launched by ``torch.distributed.run``, gloo, CPU only).

The model, its optimizer and the save are the test suite's (tests/megatron_model.py, tests/megatron_convert_job.py ``legacy_save``:
megatron-core's own ``optimizer.state_dict()`` and ``save_parameter_state``), at benchmark sizes.

Usage: megatron_legacy_worker.py FOLDER FORM HIDDEN FFN   (FORM: mixed | distributed)
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def main() -> int:
    import torch.distributed as dist

    from tests import megatron_convert_job as cjob
    from tests import megatron_model as mm

    folder, form, hidden, ffn = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    dist.init_process_group("gloo")
    layout = mm.Layout(tp=2, pp=2, dist_opt=form == "distributed", bf16=True, hidden=hidden, ffn=ffn)
    trainer = mm.setup(layout)
    try:
        mm.train_step(trainer)
        cjob.legacy_save(trainer, layout, folder)
    finally:
        mm.teardown()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
