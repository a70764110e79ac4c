"""What vetting Transformer Engine ``_extra_state`` payloads costs a load, against unpickling them.

A Megatron load through ckptkit hands each TE module its FP8 payload only after
``ckptkit.adapters.megatron.te_payload.check`` has walked it (opcodes, nested storage streams,
``torch.load(weights_only=True)`` of each). The baseline is what TE's ``set_extra_state`` does with
the payload anyway: ``pickle.loads``. Payloads are of exactly TE 2.x's serialised shape
(tests/te_payloads.py) with TE's default amax history of 1024 steps; the totals are for the
payloads a whole job holds:

  dense 70B   80 layers x 4 linear modules (qkv, proj, fc1, fc2) =   320 payloads
  MoE         48 layers x (2 attention + 64 experts x 2)         = 6,240 payloads

Figures: per payload (median of ``--reps`` passes over 64 distinct payloads), the ratio vetting /
unpickling, and the totals (one rank vets only the payloads of the layers it holds, so these are
upper bounds for any rank).

Run: .venv/bin/python benchmarks/bench_te_payload.py [--quick] [--reps 5] [--out DIR]
"""

from __future__ import annotations

import os
import pickle
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import median, quick_reps_out_args, run_main, table, write_results  # noqa: E402

JOBS = {"dense 70B": 80 * 4, "MoE 48x64": 48 * (2 + 64 * 2)}


def _payloads(n: int, history: int) -> list[bytes]:
    from tests import te_payloads as te

    te.HISTORY = history
    return [te.payload(f"module {i}").numpy().tobytes() for i in range(n)]


def _per_payload(fn, payloads: list[bytes], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for p in payloads:
            fn(p)
        times.append((time.perf_counter() - t0) / len(payloads))
    return median(times)


def run(args) -> int:
    from ckptkit.adapters.megatron import te_payload
    from tests import te_payloads as te

    history = 16 if args.quick else 1024
    payloads = _payloads(8 if args.quick else 64, history)
    reps = max(1, args.reps)

    def unpickle(p: bytes) -> None:
        with te.te_recipe_module():
            pickle.loads(p)

    vet = _per_payload(lambda p: te_payload.check(p, "bench"), payloads, reps)
    base = _per_payload(unpickle, payloads, reps)
    size = len(payloads[0])
    rows = [["pickle.loads (baseline)", f"{base * 1e6:.0f} us", "1.00x"],
            ["te_payload.check", f"{vet * 1e6:.0f} us", f"{vet / base:.2f}x"]]
    print(f"\n== vetting TE FP8 payloads ({size / 1024:.1f} KiB each, amax history {history}) ==")
    print(table(["per payload", "time", "vs unpickling"], rows))
    totals = {name: n * vet for name, n in JOBS.items()}
    for name, n in JOBS.items():
        print(f"  {name}: {n} payloads, {totals[name]:.3f} s to vet (upper bound for one rank)")
    write_results(args.out, "bench_te_payload", {
        "payload_bytes": size, "amax_history": history, "vet_s": vet, "unpickle_s": base, "ratio": vet / base,
        "job_totals_s": totals})
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(lambda a: quick_reps_out_args(__doc__, "8 payloads of a 16-step history", a), run, argv)


if __name__ == "__main__":
    sys.exit(main())
