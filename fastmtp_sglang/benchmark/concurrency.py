"""Throughput across K under load: ``fastmtp bench --concurrency 1,4,16``.

At each concurrency level C, C closed-loop clients share one prompt list: each streams a
request, and sends its next one when the answer is complete, until the level's requests are
done. Per level and arm the report gives the server's output tokens/s (all completion tokens
over the wall time from the first request to the last answer), each request's tokens/s, TTFT
(time to the first streamed chunk) and TPOT ((end-to-end - TTFT) / (tokens - 1)) at p50 and p90,
the accept length (tokens after the prefill's first one per verify cycle, from each answer's
meta_info: 1.0 at K=0), and the
speedup over K=0 at the same level.

Arms run against one server each: in-process (the reference engine; one ReferenceServer per
arm, every one driven by this process's main thread, where PyTorch is fastest), or given
servers (``--url``, ours or SGLang's, each keyed by the K it reports; a vLLM server behind the
metrics adapter is loaded directly through its OpenAI API, since the adapter serialises requests,
and its accept length comes from vLLM's /metrics counters over each run). Timing discipline as in fastmtp_sglang.benchmark.sweep: an untimed warm-up level per
arm, the order of the arms rotated from level to level and repeat to repeat, the median over
repeats, and speedups paired within a repeat (each arm over the K=0 run next to it). With
``--schedule sandwich`` a level is instead short blocks, each arm's between two K=0 blocks, in
rounds until the ratios are settled (benchmark/sandwich.py: drift on the VM cancels).
"""

from __future__ import annotations

import math
import queue
import random
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from fastmtp_sglang.core.errors import FastMTPError


@dataclass
class RequestRecord:
    tokens: int
    ttft_s: float
    e2e_s: float
    verify_ct: int

    @property
    def tpot_s(self) -> float:
        return (self.e2e_s - self.ttft_s) / (self.tokens - 1) if self.tokens > 1 else 0.0


@dataclass
class LevelRun:
    """One arm at one concurrency level, one repeat. ``spec``: server-wide speculation counters
    over the run ({"drafts", "accepted"}: vLLM reports no per-request counts), or None."""
    arm: str
    level: int
    repeat: int
    wall_s: float
    records: list[RequestRecord] = field(default_factory=list)
    spec: dict[str, int] | None = None

    @property
    def output_tokens(self) -> int:
        return sum(r.tokens for r in self.records)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0


def closed_loop(url: str, bodies: list[dict[str, Any]], concurrency: int,
                timeout: float = 600) -> tuple[float, list[RequestRecord]]:
    """Send ``bodies`` (each {"input_ids": [...], "sampling_params": {...}}) to SGLang's
    ``/generate`` (ours or SGLang's) from ``concurrency`` streaming clients, each sending its
    next body when its answer is complete. Returns (wall seconds from the first send to the last
    answer, one record per request)."""
    from fastmtp_sglang.serving.client import stream_generate

    def one(body: dict[str, Any]) -> RequestRecord:
        t0 = time.perf_counter()
        ttft, last = None, None
        for chunk in stream_generate(url, input_ids=body["input_ids"],
                                     sampling_params=body["sampling_params"], timeout=timeout):
            if ttft is None and chunk.get("output_ids"):
                ttft = time.perf_counter() - t0
            last = chunk
        e2e = time.perf_counter() - t0
        meta = (last or {}).get("meta_info", {})
        n = int(meta.get("completion_tokens", len((last or {}).get("output_ids", []))))
        return RequestRecord(n, ttft if ttft is not None else e2e, e2e,
                             int(meta.get("spec_verify_ct") or 0))

    return _run_clients(one, bodies, concurrency, url)


def closed_loop_openai(vllm_url: str, bodies: list[dict[str, Any]], concurrency: int,
                       timeout: float = 600) -> tuple[float, list[RequestRecord], dict[str, int]]:
    """``closed_loop`` against a vLLM OpenAI-compatible server directly (streamed
    /v1/completions with token-id prompts; the SGLang-API adapter serialises requests, so under
    load the clients talk to vLLM itself). Returns (wall s, records, {"drafts", "accepted"}: the
    deltas of vLLM's /metrics counters over the run)."""
    import http.client
    import json
    from urllib.parse import urlparse

    from fastmtp_sglang.serving.vllm_proxy import VLLMAdapter

    adapter = VLLMAdapter(vllm_url, 0)
    model = adapter.model_name()
    u = urlparse(vllm_url)

    def one(body: dict[str, Any]) -> RequestRecord:
        sp = dict(body["sampling_params"])
        req = {"model": model, "prompt": body["input_ids"], "stream": True,
               "stream_options": {"include_usage": True},
               "max_tokens": int(sp.pop("max_new_tokens", 128)),
               "temperature": float(sp.pop("temperature", 1.0))}
        for key in ("top_p", "top_k", "seed", "ignore_eos", "stop", "stop_token_ids"):
            if key in sp:
                req[key] = sp[key]
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
        t0 = time.perf_counter()
        ttft, tokens = None, None
        try:
            conn.request("POST", "/v1/completions", json.dumps(req), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise FastMTPError(f"vLLM at {vllm_url}: HTTP {resp.status}: {resp.read()[:300]!r}")
            for raw in resp:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if ttft is None and any(c.get("text") for c in chunk.get("choices") or []):
                    ttft = time.perf_counter() - t0
                if chunk.get("usage"):
                    tokens = int(chunk["usage"]["completion_tokens"])
        finally:
            conn.close()
        e2e = time.perf_counter() - t0
        return RequestRecord(tokens or 0, ttft if ttft is not None else e2e, e2e, 0)

    before = adapter.metrics()
    wall, records = _run_clients(one, bodies, concurrency, vllm_url)
    after = adapter.metrics()
    return wall, records, {"drafts": after["drafts"] - before["drafts"],
                           "accepted": after["accepted"] - before["accepted"]}


def _run_clients(one: Callable[[dict[str, Any]], RequestRecord], bodies: list[dict[str, Any]],
                 concurrency: int, where: str) -> tuple[float, list[RequestRecord]]:
    """``concurrency`` threads, each running ``one(body)`` for the next body until none is left."""
    todo: queue.Queue = queue.Queue()
    for b in bodies:
        todo.put(b)
    records: list[RequestRecord] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def client() -> None:
        while not errors:
            try:
                body = todo.get_nowait()
            except queue.Empty:
                return
            try:
                rec = one(body)
            except BaseException as exc:  # noqa: BLE001 - reported below
                with lock:
                    errors.append(exc)
                return
            with lock:
                records.append(rec)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise FastMTPError(f"a request failed at concurrency {concurrency} against {where}: "
                           f"{type(errors[0]).__name__}: {errors[0]}")
    return wall, records


def budget_range(mean: int, spread: float) -> tuple[int, int]:
    """The smallest and largest budget :func:`request_budgets` draws."""
    if not 0.0 <= spread < 1.0:
        raise FastMTPError(f"--length-spread must be in [0, 1), got {spread}")
    return max(1, round(mean * (1.0 - spread))), max(1, round(mean * (1.0 + spread)))


def request_budgets(n: int, mean: int, spread: float, seed: int = 0) -> list[int]:
    """``n`` requests' token budgets: each drawn uniformly from the integers within ``spread``
    of ``mean`` (``spread`` 0.5 and ``mean`` 64: 32..96), the same draws for the same
    arguments, so every arm of a level gets the same requests. ``spread`` 0: all ``mean``."""
    lo, hi = budget_range(mean, spread)
    rng = random.Random(f"{seed}:{n}:{mean}:{spread}")
    return [rng.randint(lo, hi) for _ in range(n)]


def level_bodies(prompts: list[list[int]], level: int, per_level: int,
                 sampling: dict[str, Any], per_client: int = 2,
                 length_spread: float = 0.0) -> list[dict[str, Any]]:
    """The requests of one level: the prompt list cycled to ``max(per_level, per_client *
    level)`` requests, so every client sends at least ``per_client`` (with 2, a level of 16
    clients is half ramp-up and drain: every client's second request is its last).
    ``length_spread`` > 0 gives each request its own budget around ``max_new_tokens``
    (:func:`request_budgets`): with one budget for all, plain decoding keeps a batch in step
    (its rows finish in the same cycle and the next prompts join in one prefill), which
    traffic whose answers differ in length does not."""
    n = max(per_level, per_client * level)
    bodies = [{"input_ids": list(prompts[i % len(prompts)]), "sampling_params": dict(sampling)}
              for i in range(n)]
    if length_spread:
        budgets = request_budgets(n, int(sampling.get("max_new_tokens", 128)), length_spread,
                                  int(sampling.get("seed") or 0))
        for body, budget in zip(bodies, budgets):
            body["sampling_params"]["max_new_tokens"] = budget
    return bodies


def run_levels(runners: dict[str, Callable[[list[dict], int], tuple[float, list[RequestRecord]]]],
               prompts: list[list[int]], levels: list[int], sampling: dict[str, Any],
               per_level: int, repeats: int, warmup: bool = True,
               progress: bool = True, per_client: int = 2,
               length_spread: float = 0.0) -> list[LevelRun]:
    """Every arm at every level, ``repeats`` times, arms rotated. ``runners[arm](bodies, C)``
    runs one closed loop and returns (wall s, records); each level sends at least
    ``per_client`` requests per client (:func:`level_bodies`)."""
    import sys

    from tqdm import tqdm

    arms = list(runners)
    runs: list[LevelRun] = []
    total = len(arms) * len(levels) * repeats + (len(arms) if warmup else 0)
    with tqdm(total=total, desc="concurrency", unit="level", disable=not progress,
              file=sys.stderr) as bar:
        if warmup:  # untimed: the first forwards of each batch shape are many times slower
            for arm in arms:
                bar.set_postfix_str(f"warm-up {arm}")
                runners[arm](level_bodies(prompts, max(levels), max(levels), sampling), max(levels))
                bar.update(1)
        i = 0
        for rep in range(repeats):
            for level in levels:
                bodies = level_bodies(prompts, level, per_level, sampling, per_client, length_spread)
                for arm in arms[i % len(arms):] + arms[:i % len(arms)]:
                    bar.set_postfix_str(f"C={level} {arm}")
                    wall, records, *spec = runners[arm](bodies, level)
                    runs.append(LevelRun(arm, level, rep, wall, records, spec[0] if spec else None))
                    bar.update(1)
                i += 1
    return runs


def run_levels_sandwiched(runners: dict[str, Callable[..., tuple]], prompts: list[list[int]],
                          levels: list[int], sampling: dict[str, Any], block_requests: int, *,
                          per_client: int = 2, bound: float = 0.02, min_rounds: int = 3,
                          max_rounds: int = 12, budget_s: float | None = None, warmup: bool = True,
                          progress: bool = True, baseline: str = "0", length_spread: float = 0.0,
                          clock: Callable[[], float] = time.perf_counter) -> tuple[list[LevelRun], dict]:
    """Every level as sandwiched blocks (benchmark/sandwich.py): ``block_requests`` requests a
    block (at least ``per_client`` per client), each arm's block between two baseline blocks,
    rounds until each arm's ratio over the baseline is settled to ``bound`` or the level's
    ``budget_s`` / ``max_rounds`` is spent. Returns (one LevelRun per block, its ``repeat`` the
    round; {level: SandwichRun})."""
    import sys

    from tqdm import tqdm

    from fastmtp_sglang.benchmark import sandwich

    if baseline not in runners:
        raise FastMTPError(f"the sandwiched schedule needs a K={baseline} arm to compare against")
    arms = list(runners)
    runs: list[LevelRun] = []
    verdicts: dict[int, Any] = {}
    with tqdm(desc="concurrency (sandwiched)", unit="block", disable=not progress, file=sys.stderr) as bar:
        if warmup:  # untimed: the first forwards of each batch shape are many times slower
            for arm in arms:
                runners[arm](level_bodies(prompts, max(levels), max(levels), sampling), max(levels))
        for level in levels:
            bodies = level_bodies(prompts, level, block_requests, sampling, per_client, length_spread)

            def run_block(arm: str, rnd: int, level=level, bodies=bodies) -> tuple[int, float]:
                bar.set_postfix_str(f"C={level} round {rnd} {arm}")
                wall, records, *spec = runners[arm](bodies, level)
                runs.append(LevelRun(arm, level, rnd, wall, records, spec[0] if spec else None))
                bar.update(1)
                return runs[-1].output_tokens, wall

            verdicts[level] = sandwich.run(run_block, arms, baseline, bound=bound,
                                           min_rounds=min_rounds, max_rounds=max_rounds,
                                           budget_s=budget_s, clock=clock)
    return runs, verdicts


def apply_sandwich(table: dict[str, dict[str, Any]], verdicts: dict, bound: float) -> dict[str, dict]:
    """Replace each level's paired speedups by the sandwiched ratios (mean of the kept rounds),
    with their half-width and flagged blocks; returns {level: {"rounds", "stopped", "bound"}}
    (for ``meta["sandwich"]``, which :func:`markdown` reads)."""
    notes = {}
    for level, res in verdicts.items():
        lv = table.get(str(level), {})
        for arm, v in res.verdicts.items():
            if arm not in lv:
                continue
            lv[arm]["speedup"] = v.mean
            lv[arm]["speedup_halfwidth"] = v.halfwidth if math.isfinite(v.halfwidth) else None
            lv[arm]["speedup_rounds"] = [round(x, 4) for x in v.kept]
            lv[arm]["flagged_blocks"] = [{"round": r.round, "ratio": round(r.value, 4), "why": r.flagged}
                                         for r in v.flagged]
            lv[arm]["speedup_spread"] = 2 * v.halfwidth if math.isfinite(v.halfwidth) else 1.0
        notes[str(level)] = {"rounds": res.rounds, "stopped": res.stopped, "bound": bound}
    return notes


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def summarize_levels(runs: list[LevelRun], baseline: str = "0") -> dict[str, dict[str, Any]]:
    """{level: {arm: stats}} (JSON keys are strings): output_tokens_per_s (median over repeats),
    per-request tokens/s, TTFT and TPOT p50/p90, accept length, and the paired speedup over
    ``baseline`` at the same level (median over repeats of the ratio within a repeat)."""
    out: dict[str, dict[str, Any]] = {}
    for level in sorted({r.level for r in runs}):
        at = [r for r in runs if r.level == level]
        base = {r.repeat: r.output_tokens_per_s for r in at if r.arm == baseline}
        out[str(level)] = {}
        for arm in dict.fromkeys(r.arm for r in at):
            mine = [r for r in at if r.arm == arm]
            recs = [x for r in mine for x in r.records]
            cycles = sum(x.verify_ct for x in recs)
            spec = [r.spec for r in mine if r.spec is not None]
            ratios = [r.output_tokens_per_s / base[r.repeat] for r in mine
                      if base.get(r.repeat)]
            out[str(level)][arm] = {
                "output_tokens_per_s": statistics.median(r.output_tokens_per_s for r in mine),
                "output_tokens_per_s_repeats": [r.output_tokens_per_s for r in mine],
                "per_request_tokens_per_s_p50": _pct([x.tokens / x.e2e_s for x in recs if x.e2e_s], 0.5),
                "ttft_s_p50": _pct([x.ttft_s for x in recs], 0.5),
                "ttft_s_p90": _pct([x.ttft_s for x in recs], 0.9),
                "tpot_s_p50": _pct([x.tpot_s for x in recs if x.tokens > 1], 0.5),
                "tpot_s_p90": _pct([x.tpot_s for x in recs if x.tokens > 1], 0.9),
                # tokens per verify cycle after the prefill's first token (1.0 at K=0)
                "accept_length": (sum(x.tokens - 1 for x in recs) / cycles if cycles else
                                  _spec_accept_length(spec)),
                "requests": len(recs) // max(len(mine), 1),
                "speedup": statistics.median(ratios) if ratios else None,
                "speedup_spread": ((max(ratios) - min(ratios)) / statistics.median(ratios)
                                   if len(ratios) > 1 else 0.0),
            }
    return out


def _spec_accept_length(spec: list[dict[str, int]]) -> float | None:
    """vLLM's counters: 1 + accepted / drafts over the runs (its tau, our cycle definition)."""
    drafts = sum(x["drafts"] for x in spec)
    return 1 + sum(x["accepted"] for x in spec) / drafts if drafts else None


def stops_paying(table: dict[str, dict[str, Any]], baseline: str = "0") -> dict[str, int | None]:
    """For each arm, the lowest level at which it is no faster than the baseline (None: it
    pays at every level measured)."""
    arms = {a for lv in table.values() for a in lv if a != baseline}
    out: dict[str, int | None] = {}
    for arm in sorted(arms):
        out[arm] = next((int(lv) for lv in sorted(table, key=int)
                         if (table[lv].get(arm, {}).get("speedup") or 0) <= 1.0), None)
    return out


def against_best_static(table: dict[str, dict[str, Any]], arm: str = "auto",
                        baseline: str = "0") -> dict[str, dict[str, Any]]:
    """Per level, ``arm`` (an adaptive one) against the best static arm: {level: {"best": its
    key, "best_speedup", "speedup" (``arm``'s), "vs_best" (arm / best - 1), "vs_baseline"
    (arm's speedup - 1)}}, from the paired speedups over ``baseline`` (1.0 for the baseline
    itself); levels where ``arm`` or every static arm lacks a speedup are left out."""
    out: dict[str, dict[str, Any]] = {}
    for lv in sorted(table, key=int):
        mine = (table[lv].get(arm) or {}).get("speedup")
        static = {a: (1.0 if a == baseline else s.get("speedup")) for a, s in table[lv].items() if a != arm}
        static = {a: v for a, v in static.items() if v is not None}
        if mine is None or not static:
            continue
        best = max(static, key=lambda a: static[a])
        out[lv] = {"best": best, "best_speedup": static[best], "speedup": mine,
                   "vs_best": mine / static[best] - 1.0, "vs_baseline": mine - 1.0}
    return out


# paired speedups whose repeats differ by more than this leave small differences between arms
# unread (the committed AMX runs: 6-11%; a run on a VM with a noisy neighbour: 13-38%)
SPREAD_WARN = 0.10


def repeat_spread(table: dict[str, dict[str, Any]], baseline: str = "0") -> dict[str, dict[str, float]]:
    """Per level: the baseline's output tokens/s across repeats ((max - min) / median) and the
    widest spread of any arm's paired speedup."""
    out: dict[str, dict[str, float]] = {}
    for lv in sorted(table, key=int):
        reps = (table[lv].get(baseline) or {}).get("output_tokens_per_s_repeats") or []
        base = ((max(reps) - min(reps)) / statistics.median(reps)) if len(reps) > 1 and statistics.median(reps) else 0.0
        sp = max((s.get("speedup_spread") or 0.0 for s in table[lv].values()), default=0.0)
        out[lv] = {"baseline": base, "speedup": sp}
    return out


def _requests(table: dict[str, dict[str, Any]], meta: dict[str, Any]) -> str:
    """The requests each level sent per arm: "26" or "26-80" (levels past ``per_level`` clients
    x ``per_client`` send more)."""
    counts = sorted({s["requests"] for lv in table.values() for s in lv.values() if "requests" in s})
    if not counts:
        return str(meta.get("per_level", "?"))
    return str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"


def sandwich_markdown(table: dict[str, dict[str, Any]], notes: dict[str, dict]) -> list[str]:
    """The sandwiched schedule's lines (``notes``: apply_sandwich's): per level, the rounds, why
    it stopped, each arm's ratio with its 95% half-width, and the flagged blocks."""
    if not notes:
        return []
    lines = ["", "Sandwiched timing (each arm block between two K=0 blocks; ratio against K=0 "
             "interpolated at the block's midpoint; mean over rounds, 95% half-width):", ""]
    for lv in sorted(notes, key=int):
        n = notes[lv]
        parts = []
        for a, s in table.get(lv, {}).items():
            if a == "0" or s.get("speedup") is None:
                continue
            hw = s.get("speedup_halfwidth")
            parts.append(f"{a} {s['speedup']:.3f}x" + (f" ± {100 * hw:.1f}%" if hw is not None else ""))
            for f in s.get("flagged_blocks") or []:
                parts.append(f"({a} round {f['round']} left out: {f['why']})")
        state = ("settled" if n["stopped"] == "settled" else f"**not settled** ({n['stopped']})")
        lines.append(f"- concurrency {lv}: {n['rounds']} rounds, {state} at ±{100 * n['bound']:.1f}%: "
                     + "; ".join(parts))
    return lines


def _lengths(meta: dict[str, Any]) -> str:
    """"64 new tokens", or with --length-spread "32-96 new tokens a request (uniform, mean 64)"."""
    mean, spread = meta.get("max_new_tokens", "?"), meta.get("length_spread") or 0.0
    if not spread or not isinstance(mean, int):
        return f"{mean} new tokens"
    lo, hi = budget_range(mean, spread)
    return f"{lo}-{hi} new tokens a request (uniform, mean {mean})"


def markdown(table: dict[str, dict[str, Any]], meta: dict[str, Any]) -> str:
    sandwiched = sandwich_markdown(table, meta.get("sandwich") or {})
    arms = list(dict.fromkeys(a for lv in table.values() for a in lv))
    if sandwiched:  # (--repeats is not used: a level runs rounds of blocks)
        unit, how = ("rounds of sandwiched blocks (below)",
                     "median over its blocks; speedup over K=0: the sandwiched ratio, mean of the kept rounds")
    else:
        unit, how = (f"{meta.get('repeats', '?')} repeats",
                     "speedup over K=0 at the same concurrency, paired within a repeat")
    lines = [f"# Throughput across concurrency: {meta.get('label', '')}", "",
             f"- command: `{meta.get('command', '')}`",
             f"- CPU: {meta.get('cpu', '')}",
             f"- engine: {meta.get('engine', '')}",
             f"- {meta.get('prompts', '?')} prompts, {_requests(table, meta)} requests per "
             f"{'block' if sandwiched else 'level and arm'} (at least {meta.get('per_client', 2)} "
             f"per client), {unit}, {_lengths(meta)}",
             "", f"Server output tokens/s ({how}):", "",
             "| concurrency | " + " | ".join(arms) + " |",
             "|---:|" + "---:|" * len(arms)]
    for lv in sorted(table, key=int):
        cells = []
        for a in arms:
            s = table[lv].get(a)
            if s is None:
                cells.append("")
                continue
            sp = f" ({s['speedup']:.2f}x)" if s.get("speedup") is not None and a != "0" else ""
            cells.append(f"{s['output_tokens_per_s']:.1f}{sp}")
        lines.append(f"| {lv} | " + " | ".join(cells) + " |")
    lines += ["", "Latency per request (p50 / p90) and accept length:", "",
              "| concurrency | arm | TTFT s | TPOT ms | tokens/s per request | accept length |",
              "|---:|---|---:|---:|---:|---:|"]
    for lv in sorted(table, key=int):
        for a in arms:
            s = table[lv].get(a)
            if s is None:
                continue
            al = f"{s['accept_length']:.2f}" if s.get("accept_length") else "-"
            lines.append(f"| {lv} | {a} | {s['ttft_s_p50']:.2f} / {s['ttft_s_p90']:.2f} | "
                         f"{1e3 * s['tpot_s_p50']:.0f} / {1e3 * s['tpot_s_p90']:.0f} | "
                         f"{s['per_request_tokens_per_s_p50']:.1f} | {al} |")
    stop = stops_paying(table)
    if stop:
        lines += ["", "Where speculation stops paying (lowest concurrency with speedup <= 1.00x):",
                  ""] + [f"- {a}: " + (f"concurrency {lv}" if lv is not None else
                                       "pays at every level measured") for a, lv in stop.items()]
    best = against_best_static(table)
    if best:
        lines += ["", "auto against the best static arm at each level (paired speedups over K=0):", "",
                  "| concurrency | best static arm | its speedup | auto | auto vs best | auto vs K=0 |",
                  "|---:|---|---:|---:|---:|---:|"]
        lines += [f"| {lv} | {b['best']} | {b['best_speedup']:.2f}x | {b['speedup']:.2f}x | "
                  f"{100 * b['vs_best']:+.1f}% | {100 * b['vs_baseline']:+.1f}% |" for lv, b in best.items()]
    lines += sandwiched
    spread = repeat_spread(table)
    if not sandwiched and any(s["baseline"] or s["speedup"] for s in spread.values()):
        lines += ["", "How far the repeats were apart ((max - min) / median): K=0's output tokens/s, and the "
                  "widest of the arms' paired speedups:", ""]
        lines += [f"- concurrency {lv}: K=0 {100 * s['baseline']:.0f}%, speedups {100 * s['speedup']:.0f}%"
                  for lv, s in spread.items()]
        noisy = [lv for lv, s in spread.items() if s["speedup"] > SPREAD_WARN]
        if noisy:
            lines += ["", f"**Noisy run**: an arm's paired speedup differs by more than "
                      f"{100 * SPREAD_WARN:.0f}% between repeats at concurrency {', '.join(noisy)}; "
                      "differences between arms smaller than the spread are not resolved there (rerun "
                      "on an idle machine, or with more --repeats)."]
    return "\n".join(lines) + "\n"


def plot(table: dict[str, dict[str, Any]], path, title: str = "") -> None:
    """Throughput against concurrency, one line per arm (skipped, with a note, where matplotlib
    is not installed: the vLLM venv)."""
    try:
        import matplotlib
    except ImportError:
        import sys

        print(f"no matplotlib here: {path} not drawn (the JSON and Markdown are written)",
              file=sys.stderr)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(dict.fromkeys(a for lv in table.values() for a in lv))
    levels = sorted(table, key=int)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for a in arms:
        xs = [int(lv) for lv in levels if a in table[lv]]
        ys = [table[lv][a]["output_tokens_per_s"] for lv in levels if a in table[lv]]
        ax.plot(xs, ys, marker="o", label=f"K={a}" if a.isdigit() else a)
    ax.set_xscale("log", base=2)
    ax.set_xticks([int(lv) for lv in levels], [lv for lv in levels])
    ax.set_xlabel("concurrent clients (closed loop)")
    ax.set_ylabel("server output tokens/s")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
