"""Benchmark across K: tau, A_k, a_k, decode tokens/s and speedup over K=0, per category.

Two back ends with one output format:

- in-process (``--engine reference``): one target and one head loaded once; every prompt is run
  for every K back to back (batch 1), so the K=0 baseline and each K see the same machine state.
  Tokens/s counts decode only (prefill excluded).
- ``--url`` (repeatable): one server per K, ours or SGLang's (same ``/generate`` shape); each
  server's K comes from ``/server_info``. Tokens/s is completion tokens over end-to-end latency.

Speedup = tokens/s at K / tokens/s at K=0 over the same prompts in the same run. Greedy runs also
report how many outputs at K > 0 equal the K=0 output (exact in fp32; bf16 is not batch-shape
invariant, docs/design.md section 6).

Timing discipline (docs/design.md section 6: the first forwards of a process and of each new shape
are many times slower, and a concurrent job on 2 cores swings ratios wildly):

- an untimed **warm-up** runs one whole prompt at every K before anything is timed, so every
  engine has seen the shapes the timed runs will see;
- the **order of K rotates** from prompt to prompt (and repeat to repeat), so drift hits every K
  alike;
- ``repeats`` runs of the prompt set (default 3), tokens/s is the **median** over repeats;
- speedups are **paired**: each arm over the K=0 run of the same prompt and repeat, which ran
  next to it (``paired_speedups``: per repeat the geometric mean over prompts, then the median
  over repeats), so a machine whose speed drifts slowly over the run does not bias them;
- a **sanity guard** (``timing_guard``) marks the run *contaminated* when the numbers break their
  own physics: a speedup above ``tau * t0 / (t0 + draft ms per cycle)`` (a cycle verifies K+1
  tokens, which costs at least one plain step t0, and drafts K), a verification of K+1 tokens
  measured cheaper than a plain step, or one arm's paired speedup varying across repeats by more
  than ``max_spread`` (raw tokens/s may drift with the machine: that is reported as
  ``plain_drift``, not counted against the run). A contaminated report shows no speedups, only
  the reasons.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.decode.auto_setup import AutoSpec
from fastmtp_sglang.decode.metrics import summarize_cycles




@dataclass
class BenchConfig:
    steps: list[int]
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    repeats: int = 3
    seed: int = 0
    warmup: bool = True
    # Guard bounds. Spread: (max - min) / median of one arm's paired speedup over repeats; idle runs of
    # the demo measured 1-6%, runs beside a concurrent job 20-60%. Slack: how far a speedup may
    # sit above its physical bound before the run is called contaminated (per-cycle costs are
    # themselves measured, so a few percent of noise is expected).
    max_spread: float = 0.15
    slack: float = 0.10
    ngram_steps: list[int] = field(default_factory=list)  # prompt-lookup arms (in-process), by K
    auto: AutoSpec | None = None  # the `auto` arm (in-process: K chosen per cycle); None = no such arm
    # the auto arm's K range: auto.max_steps, or its ceiling until build_engines settles it from
    # this machine's costs (decode/auto_setup.py); 0 = no auto arm
    auto_steps: int = 0
    auto_width: int = 1  # the width the auto engine drafts at (settled with auto_steps)
    # the head with leaves (decode/leaves.py): arms at these K, each drafted position with
    # leaf_width candidates (the chain's and leaf_width - 1 leaves); in-process
    leaf_steps: list[int] = field(default_factory=list)
    leaf_width: int = 3

    def __post_init__(self) -> None:
        if not self.steps or any(k < 0 for k in self.steps):
            raise ValueError(f"steps must be a non-empty list of K >= 0, got {self.steps}")
        if 0 not in self.steps:  # every speedup is relative to K=0 measured in the same run
            self.steps = [0] + list(self.steps)
        self.steps = sorted(set(self.steps))
        if self.repeats < 1:
            raise ValueError("repeats must be >= 1")
        if not (self.max_spread > 0 and self.slack >= 0):
            raise ValueError("max_spread must be > 0 and slack >= 0")
        if any(k < 1 for k in self.ngram_steps):
            raise ValueError(f"ngram steps must be >= 1, got {self.ngram_steps}")
        self.ngram_steps = sorted(set(self.ngram_steps))
        if any(k < 1 for k in self.leaf_steps):
            raise ValueError(f"leaf steps must be >= 1, got {self.leaf_steps}")
        if self.leaf_steps and self.leaf_width < 2:
            raise ValueError(f"--draft-width must be >= 2 for leaf arms, got {self.leaf_width}")
        self.leaf_steps = sorted(set(self.leaf_steps))
        if self.auto is not None and not self.auto_steps:
            self.auto_steps = self.auto.ceiling
        if self.auto is None:
            self.auto_steps = 0

    @property
    def arms(self) -> list[tuple[str, int]]:
        """(drafter, K) of every timed configuration: the head at each K (K=0 = plain decoding)
        and prompt lookup at each ngram K, and the auto arm (K chosen per cycle up to auto_steps)."""
        return ([("head", k) for k in self.steps] + [("ngram", k) for k in self.ngram_steps]
                + [("leaves", k) for k in self.leaf_steps]
                + ([("auto", self.auto_steps)] if self.auto_steps else []))

    def sampling_params(self) -> dict[str, Any]:
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "top_k": self.top_k, "ignore_eos": False}


@dataclass
class Sample:
    """One prompt at one K (one repeat)."""
    prompt_id: str
    category: str
    steps: int
    completion_tokens: int
    seconds: float              # decode seconds (in-process) or e2e latency (URL)
    verify_ct: int
    accepted: list[int] | None  # per-cycle accepted counts when the back end reports them
    output_ids: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0
    repeat: int = 0
    drafter: str = "head"       # "head" (K=0: plain decoding), "ngram" (prompt lookup), "leaves" or "auto"
    drafted: list[int] | None = None  # per-cycle drafts verified (auto: the K each cycle chose)
    lookup_cycles: int = 0            # hybrid: cycles that took prompt lookup's proposal
    splice_cycles: int = 0            # hybrid: cycles whose proposal the head continued


def _group(samples: list[Sample], k: int, category: str | None, drafter: str = "head") -> list[Sample]:
    return [s for s in samples if s.steps == k and s.drafter == drafter
            and (category is None or s.category == category)]


def _stats(group: list[Sample], k: int, repeats: int) -> dict[str, Any]:
    """Acceptance over all cycles of the group; tokens/s = median over repeats of the ratio."""
    out: dict[str, Any] = {"steps": k, "prompts": len(group) // max(repeats, 1)}
    if all(s.accepted is not None for s in group):
        # (auto: a_k among the cycles that drafted a k-th token, not all of them)
        drafted = ([d for s in group for d in s.drafted] if all(s.drafted is not None for s in group)
                   else None)
        out.update(summarize_cycles([a for s in group for a in s.accepted], k, drafted))
    else:  # SGLang: only totals per request
        cyc = sum(s.verify_ct for s in group)
        out.update(cycles=cyc, tau=sum(s.completion_tokens for s in group) / cyc if cyc else 0.0,
                   A_k=None, a_k=None, accept_hist=None)
    per_rep = []
    for r in range(repeats):
        part = [s for s in group if s.repeat == r]
        toks = sum(s.completion_tokens - (1 if s.verify_ct else 0) for s in part)
        secs = sum(s.seconds for s in part)
        per_rep.append(toks / secs if secs > 0 else 0.0)
    drafted = [d for s in group for d in (s.drafted or [])]
    if drafted:
        out["mean_k"] = sum(drafted) / len(drafted)
        out["lookup_share"] = sum(s.lookup_cycles for s in group) / len(drafted)
        out["splice_share"] = sum(s.splice_cycles for s in group) / len(drafted)
    out["tokens_per_s"] = statistics.median(per_rep)
    out["tokens_per_s_repeats"] = per_rep
    out["completion_tokens"] = sum(s.completion_tokens for s in group) // repeats
    tot = sum(s.draft_s + s.verify_s for s in group)
    if tot > 0:
        cycles = max(sum(s.verify_ct for s in group), 1)
        out["draft_ms_per_cycle"] = 1000 * sum(s.draft_s for s in group) / cycles
        out["verify_ms_per_cycle"] = 1000 * sum(s.verify_s for s in group) / cycles
        out["draft_share"] = sum(s.draft_s for s in group) / tot
    return out


def summarize(samples: list[Sample], cfg: BenchConfig) -> dict[str, Any]:
    cats = sorted({s.category for s in samples})
    res: dict[str, Any] = {"overall": {}, "categories": {c: {} for c in cats}}
    for k in cfg.steps:
        res["overall"][k] = _stats(_group(samples, k, None), k, cfg.repeats)
        for c in cats:
            res["categories"][c][k] = _stats(_group(samples, k, c), k, cfg.repeats)
    # prompt lookup and the head with leaves, on the same prompts, against the same K=0 runs
    for extra, ks in (("ngram", cfg.ngram_steps), ("leaves", cfg.leaf_steps)):
        if ks:
            res[extra] = {"overall": {k: _stats(_group(samples, k, None, extra), k, cfg.repeats) for k in ks},
                          "categories": {c: {k: _stats(_group(samples, k, c, extra), k, cfg.repeats)
                                             for k in ks} for c in cats}}
    if cfg.leaf_steps:
        res["leaves"]["width"] = cfg.leaf_width
    if cfg.auto_steps:  # K per cycle from the measured costs, against the same K=0 runs
        ka = cfg.auto_steps
        res["auto"] = {"overall": {ka: _stats(_group(samples, ka, None, "auto"), ka, cfg.repeats)},
                       "categories": {c: {ka: _stats(_group(samples, ka, c, "auto"), ka, cfg.repeats)}
                                      for c in cats}}
        if cfg.auto_width > 1:  # (the engine's: the default is a chain where leaves cannot run)
            res["auto"]["width"] = cfg.auto_width
    blocks = [("head", None, res["overall"]), *[("head", c, res["categories"][c]) for c in cats]]
    for extra in ("ngram", "leaves", "auto"):
        if extra in res:
            blocks += [(extra, None, res[extra]["overall"]),
                       *[(extra, c, res[extra]["categories"][c]) for c in cats]]
    for drafter, cat, block in blocks:
        for k, r in block.items():
            reps = paired_speedups(samples, k, drafter, cat, cfg.repeats)
            r["speedup_repeats"] = reps
            r["speedup"] = statistics.median(reps) if reps else 0.0
    if cfg.temperature == 0:
        base = {s.prompt_id: s.output_ids for s in samples if s.steps == 0}
        for drafter, k in cfg.arms:
            grp = [s for s in samples if s.steps == k and s.drafter == drafter and s.output_ids]
            if grp:
                same = sum(1 for s in grp if s.output_ids == base.get(s.prompt_id))
                blk = res["overall"] if drafter == "head" else res[drafter]["overall"]
                blk[k]["same_output_as_k0"] = f"{same}/{len(grp)}"
    res["timing_check"] = timing_guard(res, cfg)
    return res


def _decode_tps(s: Sample) -> float:
    toks = s.completion_tokens - (1 if s.verify_ct else 0)
    return toks / s.seconds if s.seconds > 0 else 0.0


def paired_speedups(samples: list[Sample], k: int, drafter: str, category: str | None,
                    repeats: int) -> list[float]:
    """Speedup of one arm over plain decoding, per repeat, from paired runs.

    Each (prompt, repeat) runs every arm back to back, so the arm and its K=0 run see the same
    machine: their ratio of decode tokens/s cancels a machine whose speed drifts slowly (a VM whose
    plain step went from 87 to 43 ms over one session). Per repeat, the geometric mean of the
    per-prompt ratios; K=0 against itself is 1.0."""
    base = {(s.prompt_id, s.repeat): _decode_tps(s) for s in _group(samples, 0, category)}
    out = []
    for rep in range(repeats):
        logs = []
        for s in _group(samples, k, category, drafter):
            b = base.get((s.prompt_id, s.repeat))
            if s.repeat == rep and b and _decode_tps(s) > 0:
                logs.append(math.log(_decode_tps(s) / b))
        if logs:
            out.append(math.exp(sum(logs) / len(logs)))
    return out


def rotated(steps: list, i: int) -> list:
    """The order for the i-th (prompt, repeat): a rotation, so every arm runs first as often."""
    j = i % len(steps)
    return steps[j:] + steps[:j]


def _block_problems(block: dict[int, dict[str, Any]], cfg: BenchConfig, where: str) -> list[str]:
    """Physics checks of one block (overall or one category): speedup bound, verify >= plain step."""
    problems = []
    base = block.get(0)
    if not base or base["tokens_per_s"] <= 0:
        return [f"{where}: no K=0 timing to compare against"]
    t0 = 1000.0 / base["tokens_per_s"]  # ms per token of plain decoding (one 1-token step)
    for k, r in block.items():
        if k == 0 or not r.get("tau"):
            continue
        draft_ms = r.get("draft_ms_per_cycle")
        bound = r["tau"] * t0 / (t0 + draft_ms) if draft_ms is not None else r["tau"]
        if r["speedup"] > bound * (1 + cfg.slack):
            what = f"tau {r['tau']:.2f}" + (f", draft {draft_ms:.1f} ms/cycle, plain step "
                                            f"{t0:.1f} ms" if draft_ms is not None else "")
            problems.append(f"{where} K={k}: speedup {r['speedup']:.2f}x exceeds the most "
                            f"{what} allow ({bound:.2f}x)")
        v, v0 = r.get("verify_ms_per_cycle"), base.get("verify_ms_per_cycle")
        if v is not None and v0 and v < v0 * (1 - cfg.slack):
            problems.append(f"{where} K={k}: verifying {k + 1} tokens took {v:.1f} ms, less than "
                            f"the plain step's {v0:.1f} ms (the K=0 runs were slowed down)")
    return problems


def timing_guard(res: dict[str, Any], cfg: BenchConfig) -> dict[str, Any]:
    """Decide whether the run's timings can be reported (docs/design.md section 6).

    Returns ``{"contaminated": bool, "problems": [str], "max_spread": float}``. Acceptance (tau,
    A_k) never depends on timing and is reported either way.
    """
    problems = _block_problems(res["overall"], cfg, "all prompts")
    for cat, block in res["categories"].items():
        problems += _block_problems(block, cfg, f"category {cat}")
    if "ngram" in res:
        problems += _block_problems({0: res["overall"][0], **res["ngram"]["overall"]}, cfg,
                                    "prompt lookup")
    if "leaves" in res:
        problems += _block_problems({0: res["overall"][0], **res["leaves"]["overall"]}, cfg, "leaves")
    if "auto" in res:
        problems += _block_problems({0: res["overall"][0], **res["auto"]["overall"]}, cfg, "auto")
    # run-to-run: the paired speedup (arm / K=0 on the same prompt and repeat) must agree across
    # repeats; raw tokens/s may drift with the machine without contaminating anything
    spreads = {}
    arms = ([(f"K={k}", r) for k, r in res["overall"].items() if k]
            + [(f"prompt lookup K={k}", r) for k, r in res.get("ngram", {}).get("overall", {}).items()]
            + [(f"leaves K={k}", r) for k, r in res.get("leaves", {}).get("overall", {}).items()]
            + [(f"auto (K<={k})", r) for k, r in res.get("auto", {}).get("overall", {}).items()])
    for label, r in arms:
        reps = [x for x in r.get("speedup_repeats", []) if x > 0]
        if len(reps) >= 2:
            spread = (max(reps) - min(reps)) / statistics.median(reps)
            spreads[label] = spread
            if spread > cfg.max_spread:
                problems.append(f"{label}: its speedup over K=0 on the same prompts varied by "
                                f"{100 * spread:.0f}% across {len(reps)} repeats (bound "
                                f"{100 * cfg.max_spread:.0f}%): something else was using the CPU")
    raw = [x for x in res["overall"][0].get("tokens_per_s_repeats", []) if x > 0] if 0 in res["overall"] else []
    drift = (max(raw) - min(raw)) / statistics.median(raw) if len(raw) >= 2 else None
    if cfg.repeats < 2:
        note = "one repeat: run-to-run variation not checked (use --repeats 3)"
    else:
        note = None
    return {"contaminated": bool(problems), "problems": problems, "note": note,
            "max_spread_measured": max(spreads.values()) if spreads else None,
            "plain_drift": drift}


def run_in_process(target, head, prompts: list[tuple[str, str, list[int]]], cfg: BenchConfig,
                   progress: bool = True, max_context: int | None = None,
                   draft_vocab=None, cost_curve=None) -> list[Sample]:
    """prompts: (id, category, input_ids). Each prompt runs at every K back to back. The auto
    arm uses ``cost_curve`` (measured here when None: :func:`auto_costs`)."""
    from tqdm import tqdm

    from fastmtp_sglang.decode.engine import Request
    from fastmtp_sglang.decode.sampling import SamplingParams

    engines = build_engines(target, head, cfg, max_context, draft_vocab, cost_curve, progress)
    samples: list[Sample] = []
    arms = cfg.arms
    warm = len(arms) if cfg.warmup else 0
    total = len(prompts) * len(arms) * cfg.repeats + warm
    with tqdm(total=total, desc="bench", unit="run", disable=not progress, file=sys.stderr) as bar:
        if cfg.warmup:  # untimed: the first forwards of each shape are many times slower
            bar.set_postfix_str("warm-up")
            for arm in arms:
                engines[arm].generate([Request(list(prompts[0][2]), SamplingParams(
                    **{**cfg.sampling_params(), "seed": cfg.seed}), "warmup")])
                bar.update(1)
            bar.set_postfix_str("")
        i = 0
        for rep in range(cfg.repeats):
            for pid, cat, ids in prompts:
                for drafter, k in rotated(arms, i):
                    params = SamplingParams(**{**cfg.sampling_params(), "seed": cfg.seed + rep})
                    r = engines[(drafter, k)].generate([Request(list(ids), params, pid)])[0]
                    m = r.metrics
                    samples.append(Sample(pid, cat, k, m.completion_tokens, m.decode_s, m.verify_ct,
                                          [c.accepted for c in m.cycles], r.output_ids,
                                          sum(c.draft_s for c in m.cycles),
                                          sum(c.verify_s for c in m.cycles), m.prefill_s, rep,
                                          drafter, [c.drafted for c in m.cycles]
                                          if drafter == "auto" else None,
                                          sum(c.source == "lookup" for c in m.cycles),
                                          sum(c.source == "splice" for c in m.cycles)))
                    bar.update(1)
                i += 1
    samples.sort(key=lambda s: (s.drafter, s.steps, s.category, s.prompt_id, s.repeat))
    return samples


def cost_line(curve) -> str:
    """One line a user reads the speedups by: what verifying and drafting cost on this CPU."""
    n = max(curve.verify_ms)
    at = f" at batch {curve.batch}" if getattr(curve, "batch", 1) > 1 else ""
    return (f"on this CPU ({curve.cpu['model']}, {curve.dtype}{at}): verifying {n} tokens costs "
            f"{curve.verify_ratio(n):.2f}x one token ({curve.verify_ms[n]:.1f} vs {curve.plain_ms:.1f} ms, "
            f"memory floor {curve.verify_floor_ms:.1f} ms); a draft step {curve.draft_step_ms:.1f} ms")


def build_engines(target, head, cfg: BenchConfig, max_context: int | None = None, draft_vocab=None,
                  cost_curve=None, progress: bool = True,
                  cost_batches: tuple[int, ...] = ()) -> dict[tuple[str, int], Any]:
    """One reference engine per arm of ``cfg`` (``cfg.arms``), all sharing ``target`` and
    ``head``. The auto arm uses ``cost_curve`` (measured here when None: :func:`auto_costs`),
    and the same costs measured at ``cost_batches`` rows (K per batch size); its K range, when
    ``cfg.auto`` leaves it to this machine's costs, is settled here into ``cfg.auto_steps``
    (the arm's key and the K its report shows)."""
    from fastmtp_sglang.decode.auto_setup import build_auto_engine, describe
    from fastmtp_sglang.decode.engine import ReferenceEngine
    from fastmtp_sglang.decode.ngram import NgramDrafter

    engines = {("head", k): ReferenceEngine(target, head if k else None, k, max_context,
                                            draft_vocab=draft_vocab if k else None) for k in cfg.steps}
    engines.update({("ngram", k): ReferenceEngine(target, None, k, max_context, drafter=NgramDrafter())
                    for k in cfg.ngram_steps})
    engines.update({("leaves", k): ReferenceEngine(target, head, k, max_context, draft_vocab=draft_vocab,
                                                   width=cfg.leaf_width) for k in cfg.leaf_steps})
    if cfg.auto is not None:
        curve = cost_curve or auto_costs(target, head, cfg.auto, draft_vocab, progress)
        batched = [auto_costs(target, head, cfg.auto, draft_vocab, progress, batch=b)
                   for b in cost_batches if b > 1]
        engine = build_auto_engine(cfg.auto, target, head, curve, max_context, draft_vocab, batched)
        cfg.auto_steps, cfg.auto_width = engine.steps, engine.width
        if progress:
            print("auto: " + describe(cfg.auto, engine.steps), file=sys.stderr)
        engines[("auto", cfg.auto_steps)] = engine
    return engines


def arm_key(drafter: str, k: int) -> str:
    """An arm's key in results.json: "0", "3" (the head at K), "lookup3", "auto"."""
    return {"head": str(k), "ngram": f"lookup{k}", "leaves": f"leaves{k}", "auto": "auto"}[drafter]


def auto_costs(target, head, spec: AutoSpec, draft_vocab=None, progress: bool = True, batch: int = 1):
    """This machine's cost curve for the ``auto`` arm (verify up to ceiling + 1 tokens, draft step,
    draft extend; at ``batch`` rows, a few seconds; fastmtp_sglang.decode.auto_setup)."""
    from fastmtp_sglang.decode.auto_setup import measure_costs

    if head is None:
        raise FastMTPError("the auto arm drafts with the head: give --draft")
    if progress:
        print(f"auto: measuring this machine's cost curve (verify {spec.cost_points()} tokens, "
              f"draft step, draft extend) at batch {batch}", file=sys.stderr)
    curve = measure_costs(spec, target, head, draft_vocab, batch)
    if progress:
        print("auto: " + cost_line(curve), file=sys.stderr)
    return curve


def servers_by_k(server_urls: list[str]) -> tuple[dict[int | str, str], dict[int | str, str]]:
    """Ask each server which K it runs (``/server_info``): ({K: url}, {K: draft path or "none"}).
    A server that picks K itself (``speculative_adaptive``: SGLang's --speculative-adaptive, the
    reference engine's --steps auto, vLLM with a K-per-batch-size table behind our adapter) is
    keyed ``"auto"``. Two servers that report the same K are an error."""
    from fastmtp_sglang.serving.client import server_info

    urls: dict[int | str, str] = {}
    drafts: dict[int | str, str] = {}
    for u in server_urls:
        info = server_info(u)
        steps = info.get("steps", info.get("speculative_num_steps") or 0)
        # the reference server reports --steps auto as "auto" (speculative_num_steps: its top K)
        k: int | str = "auto" if steps == "auto" else int(steps or 0)
        if info.get("speculative_algorithm") in (None, "None") and "steps" not in info:
            k = 0
        if k and info.get("speculative_adaptive"):
            k = "auto"
        if k in urls:
            raise FastMTPError(f"two servers report K={k}: {urls[k]} and {u}")
        urls[k] = u
        drafts[k] = str(info.get("speculative_draft_model_path") or info.get("draft_model_path")
                        or "none")
    return urls, drafts


def run_urls(urls: dict[int, str], prompts: list[tuple[str, str, str]], cfg: BenchConfig,
             progress: bool = True) -> list[Sample]:
    """prompts: (id, category, chat-templated text). urls: K -> server URL."""
    from tqdm import tqdm

    from fastmtp_sglang.serving.client import generate

    samples: list[Sample] = []
    warm = len(cfg.steps) if cfg.warmup else 0
    total = len(prompts) * len(cfg.steps) * cfg.repeats + warm
    with tqdm(total=total, desc="bench", unit="req", disable=not progress, file=sys.stderr) as bar:
        if cfg.warmup:  # untimed, one whole prompt per server
            for k in cfg.steps:
                generate(urls[k], text=prompts[0][2], sampling_params=cfg.sampling_params())
                bar.update(1)
        i = 0
        for rep in range(cfg.repeats):
            for pid, cat, text in prompts:
                i += 1
                for k in rotated(cfg.steps, i - 1):
                    t = time.perf_counter()
                    out = generate(urls[k], text=text, sampling_params=cfg.sampling_params())
                    dt = time.perf_counter() - t
                    meta = out.get("meta_info", {})
                    hist = meta.get("accept_hist")
                    accepted = None
                    if hist is not None:  # ours: rebuild per-cycle counts from the histogram
                        accepted = [a for a, n in enumerate(hist) for _ in range(n)]
                    elif k == 0:
                        accepted = [0] * int(meta.get("completion_tokens", 0))
                    ct = int(meta.get("completion_tokens", 0))
                    samples.append(Sample(pid, cat, k, ct, float(meta.get("e2e_latency", dt)),
                                          int(meta.get("spec_verify_ct", ct if k == 0 else 0)),
                                          accepted, list(out.get("output_ids") or []), repeat=rep))
                    bar.update(1)
    samples.sort(key=lambda s: (s.steps, s.category, s.prompt_id, s.repeat))
    return samples


# -- reports ---------------------------------------------------------------------------------

def _fmt_pct(xs: list[float] | None) -> str:
    return "/".join(f"{100 * x:.0f}" for x in xs) if xs else "-"


def _ms(r: dict[str, Any], key: str) -> str:
    return f"{r[key]:.1f}" if r.get(key) is not None else "-"


def contamination_text(check: dict[str, Any] | None) -> str | None:
    """The words a user reads when a run's timings cannot be trusted (None when they can)."""
    if not check or not check.get("contaminated"):
        return None
    return ("Timing is CONTAMINATED, so no speedup is reported: " + "; ".join(check["problems"])
            + ". Acceptance (tau, A_k) does not depend on timing and stands. Rerun on an idle "
            "machine (nothing else running), with --repeats 3 or more.")


def markdown(results: dict[str, Any], meta: dict[str, Any]) -> str:
    check = results.get("timing_check")
    bad = contamination_text(check)
    lines = [f"# {meta.get('label', 'fastmtp bench')}", "",
             f"Command: `{meta.get('command', '')}`", "",
             f"Target: `{meta.get('target')}`; draft: `{meta.get('draft') or 'none'}`; "
             f"{meta.get('prompts')} prompts; max_new_tokens {meta['config']['max_new_tokens']}; "
             f"temperature {meta['config']['temperature']}; repeats {meta['config']['repeats']} "
             f"(median); {meta.get('engine')}.", ""]
    if meta.get("cpu"):
        c = meta["cpu"]
        lines += [f"CPU: {c['model']}; flags {' '.join(c['flags']) or 'no avx2'}; {c['threads']} threads.", ""]
    if bad:
        lines += [f"**{bad}**", ""]
    elif check:
        spread = check.get("max_spread_measured")
        drift = check.get("plain_drift")
        lines += ["Timing check passed: every speedup is within what tau and the measured "
                  "per-cycle costs allow" + (f"; each speedup (paired: arm / K=0 on the same "
                                             f"prompt and repeat) varied by at most {100 * spread:.1f}% "
                                             "across repeats" if spread is not None else "")
                  + (f", while plain decoding's own tokens/s drifted {100 * drift:.0f}%"
                     if drift is not None and drift > 0.05 else "")
                  + (f" ({check['note']})" if check.get("note") else "") + ".", ""]
    if meta.get("dtype") == "bfloat16" and results["overall"].get(0, {}).get("same_output_as_k0"):
        lines += [BF16_NOTE, ""]
    lines += ["| K | tau | A_k (%) | a_k (%) | tok/s | speedup | draft ms/cycle | verify ms/cycle | same as K=0 |",
              "|---|---|---|---|---|---|---|---|---|"]
    for k, r in results["overall"].items():
        sp = "-" if bad else f"{r['speedup']:.2f}x"
        lines.append(
            f"| {k} | {r['tau']:.3f} | {_fmt_pct(r.get('A_k'))} | {_fmt_pct(r.get('a_k'))} | "
            f"{r['tokens_per_s']:.2f} | {sp} | {_ms(r, 'draft_ms_per_cycle')} | "
            f"{_ms(r, 'verify_ms_per_cycle')} | {r.get('same_output_as_k0', '-')} |")
    lw = results.get("leaves", {}).get("width")
    extra_rows = ([(f"prompt lookup {k}", r) for k, r in results.get("ngram", {}).get("overall", {}).items()]
                  + [(f"{k} + leaves (width {lw})", r) for k, r in results.get("leaves", {}).get("overall", {}).items()]
                  + [(f"auto (K<={k}, mean {r.get('mean_k', 0):.2f}"
                      + (f", width {results['auto']['width']}" if results["auto"].get("width") else "")
                      + (f", lookup {100 * r['lookup_share']:.0f}% of cycles" if r.get("lookup_share") else "")
                      + (f", spliced {100 * r['splice_share']:.0f}%" if r.get("splice_share") else "")
                      + ")", r)
                     for k, r in results.get("auto", {}).get("overall", {}).items()])
    for name, r in extra_rows:
        sp = "-" if bad else f"{r['speedup']:.2f}x"
        lines.append(
            f"| {name} | {r['tau']:.3f} | {_fmt_pct(r.get('A_k'))} | {_fmt_pct(r.get('a_k'))} | "
            f"{r['tokens_per_s']:.2f} | {sp} | {_ms(r, 'draft_ms_per_cycle')} | "
            f"{_ms(r, 'verify_ms_per_cycle')} | {r.get('same_output_as_k0', '-')} |")
    lines += ["", "Per category (tau / speedup):" if not bad else "Per category (tau):", "",
              "| category | " + " | ".join(f"K={k}" for k in results["overall"]) + " |",
              "|---|" + "---|" * len(results["overall"])]
    ng = results.get("ngram", {}).get("categories", {})
    lv = results.get("leaves", {}).get("categories", {})
    au = results.get("auto", {}).get("categories", {})
    if ng:
        lines[-2] += "".join(f" lookup {k} |" for k in results["ngram"]["overall"])
        lines[-1] += "---|" * len(results["ngram"]["overall"])
    if lv:
        lines[-2] += "".join(f" {k} + leaves |" for k in results["leaves"]["overall"])
        lines[-1] += "---|" * len(results["leaves"]["overall"])
    if au:
        lines[-2] += " auto |"
        lines[-1] += "---|"
    for c, block in results["categories"].items():
        cells = (list(block.values()) + list(ng.get(c, {}).values()) + list(lv.get(c, {}).values())
                 + list(au.get(c, {}).values()))
        lines.append(f"| {c} | " + " | ".join(
            f"{r['tau']:.2f}" + ("" if bad else f" / {r['speedup']:.2f}x") for r in cells) + " |")
    return "\n".join(lines) + "\n"


BF16_NOTE = ("\"same as K=0\" counts greedy outputs identical to plain decoding. In bfloat16 they "
             "can differ without any loss: verifying K+1 tokens in one forward rounds differently "
             "from one token at a time, so near-ties flip (docs/design.md section 6). The "
             "verification itself is exact: rerun with --dtype float32 and every output is identical.")


def plot(results: dict[str, Any], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return False
    ks = list(results["overall"])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6))
    a1.plot(ks, [results["overall"][k]["tau"] for k in ks], "o-", label="all")
    a1.plot(ks, [k + 1 for k in ks], ":", color="grey", label="K+1 (limit)")
    for c, block in results["categories"].items():
        a1.plot(ks, [block[k]["tau"] for k in ks], "-", alpha=0.35, lw=1)
    ng = results.get("ngram", {}).get("overall", {})
    if ng:  # tau does not depend on timing: drawn even when the timing is contaminated
        a1.plot(list(ng), [r["tau"] for r in ng.values()], "s--", color="C2", label="prompt lookup")
    lv = results.get("leaves", {}).get("overall", {})
    if lv:
        a1.plot(list(lv), [r["tau"] for r in lv.values()], "D-.", color="C4", label="head + leaves")
    au = results.get("auto", {}).get("overall", {})
    for k, r in au.items():  # drawn at its mean K
        a1.plot([r.get("mean_k", k)], [r["tau"]], "*", ms=11, color="C3", label=f"auto (K<={k})")
    a1.set_xlabel("K (draft steps)"); a1.set_ylabel("tau (tokens / verification)")
    a1.legend(fontsize=8); a1.grid(alpha=0.3)
    if contamination_text(results.get("timing_check")):
        a2.text(0.5, 0.5, "timing contaminated:\nno speedup reported", ha="center", va="center",
                transform=a2.transAxes, color="C3")
    else:
        a2.plot(ks, [results["overall"][k]["speedup"] for k in ks], "o-", color="C1", label="draft head")
        if ng:
            a2.plot(list(ng), [r["speedup"] for r in ng.values()], "s--", color="C2",
                    label="prompt lookup")
        if lv:
            a2.plot(list(lv), [r["speedup"] for r in lv.values()], "D-.", color="C4", label="head + leaves")
        for k, r in au.items():
            a2.plot([r.get("mean_k", k)], [r["speedup"]], "*", ms=11, color="C3", label=f"auto (K<={k})")
        if ng or lv or au:
            a2.legend(fontsize=8)
    a2.axhline(1.0, color="grey", ls=":")
    a2.set_xlabel("K (draft steps)"); a2.set_ylabel("speedup over K=0")
    a2.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_results(out: Path, results: dict[str, Any], meta: dict[str, Any],
                  samples: list[Sample]) -> None:
    from fastmtp_sglang.decode.costs import cpu_description

    out.mkdir(parents=True, exist_ok=True)
    meta.setdefault("cpu", cpu_description())  # every result names the machine it ran on
    payload = {"meta": meta, "results": results,
               "samples": [{k: v for k, v in asdict(s).items() if k != "output_ids"} for s in samples]}
    tmp = out / ".results.json.tmp"
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(out / "results.json")
    (out / "results.md").write_text(markdown(results, meta))
    plot(results, out / "results.png", meta.get("label", ""))
