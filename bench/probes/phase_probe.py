"""Where a `fastmtp bench` run spends its engine time, per arm and phase: runs the bench command
given (any `fastmtp bench` arguments) with timers around the reference engine's phases (prefill,
choice of K, draft, verify, draft extend, catch-up, bookkeeping, joins and leaves of the batch)
and the server's join and cycle, and prints the seconds and calls of each per arm at exit.

    python bench/probes/phase_probe.py --engine reference --target T --draft D --steps 0,auto \\
        --concurrency 16 --prompts bench/data/spec_bench.jsonl --limit-per-category 2 \\
        --max-new-tokens 64 --repeats 1 --out /tmp/phases

The timers cost microseconds per call; the totals include the untimed warm-up level. Compare
arms within one run (design 6.4). Behind docs/design.md section 6.8's per-phase account of auto
at 16 clients.
"""
import atexit
import collections
import sys
import time

import fastmtp_sglang.decode.batch as batch_mod
import fastmtp_sglang.decode.engine as engine_mod
import fastmtp_sglang.decode.slot_cache as slot_mod
import fastmtp_sglang.serving.worker as worker_mod

totals: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


def timed(cls, name, arm_of):
    inner = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(self, *args, **kwargs)
        finally:
            d = totals[arm_of(self)]
            d[name] += time.perf_counter() - t
            d[name + " calls"] += 1
    setattr(cls, name, wrapper)


def arm(engine) -> str:
    return "auto" if engine.auto is not None else f"K={engine.steps}"


for phase in ("step", "_start", "_prefill", "_choose", "_draft", "_verify", "_draft_extend",
              "_catch_up", "_advance", "_collect"):
    timed(engine_mod.ReferenceEngine, phase, arm)
for phase in ("merge", "remove"):
    timed(batch_mod.Batch, phase, lambda b: arm(b.engine))
for phase in ("append", "move_rows", "repack"):
    timed(slot_mod.SlotCache, phase, lambda c: "target cache (all arms)")
for phase in ("_join", "_cycle"):
    timed(worker_mod.EngineWorker, phase, lambda w: arm(w.engine))


@atexit.register
def report() -> None:
    for name, d in sorted(totals.items()):
        print(f"\n{name}:", file=sys.stderr)
        for phase in sorted(k for k in d if not k.endswith(" calls")):
            print(f"  {phase:<14} {d[phase]:8.2f} s  {d[phase + ' calls']:6d} calls", file=sys.stderr)


if __name__ == "__main__":
    from fastmtp_sglang.cli import main

    sys.argv = ["fastmtp", "bench"] + sys.argv[1:]
    main()
