"""Where an arm's time goes under load, through the real in-process server: runs
``fastmtp bench --concurrency`` with the engines' ``start``/``join``/``step`` wrapped to log
every call (rows, K of the cycle, ms), then prints per arm the joins (count, seconds, prompts per
join), the cycles by batch-size class and K (count, median ms) and what the cycles emitted.

    python bench/probes/server_load_probe.py --concurrency 16 --steps 0,auto --per-client 5 \
        --limit-per-category 2 --max-new-tokens 64 --repeats 2 --out /tmp/probe

Every flag after the script's name goes to ``fastmtp bench`` as is (``--engine reference``,
``--target`` and ``--draft`` are filled in for the demo target and the shipped head when absent).
Direction only: the wrappers cost a few microseconds a call.
"""
import statistics
import sys
import time
from collections import defaultdict

from fastmtp_sglang.cli import main as fastmtp_main
from fastmtp_sglang.decode.auto import batch_class
from fastmtp_sglang.decode.engine import ReferenceEngine

LOG = defaultdict(list)  # engine id -> [(kind, rows, K, ms, emitted or joiners)]


def _wrap():
    start, join, step = ReferenceEngine._start, ReferenceEngine.join, ReferenceEngine.step

    def _start(self, requests, keys, on_tokens, rows):
        t = time.perf_counter()
        b = start(self, requests, keys, on_tokens, rows)
        LOG[id(self)].append(("prefill", len(requests), 0, 1e3 * (time.perf_counter() - t), len(requests)))
        return b

    def _join(self, b, requests, keys, on_tokens=None):
        n = len(b)
        t = time.perf_counter()
        join(self, b, requests, keys, on_tokens)
        LOG[id(self)].append(("join", n, 0, 1e3 * (time.perf_counter() - t), len(requests)))

    def _step(self, b, on_tokens=None):
        rows = list(b.rows)
        before = [len(r.out) for r in rows]
        cyc = [len(r.metrics.cycles) for r in rows]
        holes = b.valid.shape[1] - int(b.valid.sum(1).max()) if b.valid is not None else 0
        t = time.perf_counter()
        done = step(self, b, on_tokens)
        ms = 1e3 * (time.perf_counter() - t)
        ran = [r for r, c in zip(rows, cyc) if len(r.metrics.cycles) > c]
        if ran:
            k = max(r.metrics.cycles[-1].drafted for r in ran)
            em = sum(len(r.out) - n for r, n in zip(rows, before))
            c = ran[0].metrics.cycles[-1]  # (draft_s, verify_s: the cycle's, split per row)
            parts = (1e3 * c.draft_s * len(ran), 1e3 * c.verify_s * len(ran))
            LOG[id(self)].append(("cycle", len(ran), k, ms, em, parts, holes))
        return done

    ReferenceEngine._start, ReferenceEngine.join, ReferenceEngine.step = _start, _join, _step


def report():
    for eid, log in LOG.items():
        joins = [x for x in log if x[0] in ("join", "prefill")]
        cycles = [x for x in log if x[0] == "cycle"]
        print(f"engine {eid}: {len(joins)} prefill calls ({sum(x[3] for x in joins) / 1e3:.1f} s, "
              f"{statistics.mean(x[4] for x in joins) if joins else 0:.1f} prompts each), "
              f"{len(cycles)} cycles ({sum(x[3] for x in cycles) / 1e3:.1f} s, "
              f"{statistics.mean(x[1] for x in cycles) if cycles else 0:.1f} rows, "
              f"{sum(x[4] for x in cycles)} tokens)")
        by = defaultdict(list)
        for _, rows, k, ms, em, (dr, ve), holes in cycles:
            by[(batch_class(rows), k)].append((ms, em, rows, dr, ve, holes))
        for (cls, k), xs in sorted(by.items()):
            med = lambda i: statistics.median(x[i] for x in xs)  # noqa: E731
            print(f"   class {cls:>2} K={k}: {len(xs):4d} cycles, median {med(0):6.1f} ms "
                  f"(draft+extend {med(3):.1f}, verify {med(4):.1f}, rest {med(0) - med(3) - med(4):.1f}), "
                  f"{sum(x[1] for x in xs) / sum(x[2] for x in xs):.2f} tokens/row, "
                  f"{sum(x[0] for x in xs) / 1e3:.1f} s, hole slots median {med(5)}")


if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--engine" not in argv:
        from fastmtp_sglang.cli.demo import shipped_head
        from fastmtp_sglang.core.demo_target import materialize_smollm2
        argv = ["bench", "--engine", "reference", "--target", str(materialize_smollm2()),
                "--draft", str(shipped_head()), "--prompts", "bench/data/spec_bench.jsonl"] + argv
    _wrap()
    rc = fastmtp_main(argv)
    report()
    sys.exit(rc)
