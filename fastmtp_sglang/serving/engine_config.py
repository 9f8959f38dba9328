"""A measured "best K per batch size" table as each engine's own K-per-batch-size setting.

``fastmtp bench --concurrency`` (``fastmtp_sglang.benchmark.concurrency.summarize_levels``)
writes ``{level: {arm: stats}}``: per concurrency level (closed-loop clients, so about the decode
batch size), per arm, ``output_tokens_per_s``. :func:`best_k_by_batch` reads the head arms of
that table (keys ``"0"``, ``"1"``, ``"3"``: K draft tokens per cycle) and picks the fastest K at
every level. The two builders below turn that ``{batch size: K}`` into what each engine takes.
In both, a measured level's K holds from that level up to the next measured level (batch sizes
below the smallest measured one get its K), which is how SGLang routes.

SGLang 0.5.23 (read in ``sglang/srt``)
--------------------------------------
* Flags (``arg_groups/fields/spec.py``, fields ``speculative_adaptive`` and
  ``speculative_adaptive_config``): ``--speculative-adaptive`` (store_true, default off) and
  ``--speculative-adaptive-config PATH`` (a string: the path of a JSON file, not inline JSON;
  default None = the built-in tiers).
* The file (``speculative/adaptive_spec_params.py:_load_adaptive_config``): a JSON object
  whose digit-string keys are batch-size tiers, each ``{"candidate_steps": [non-negative
  ints], ...}``; other keys are ignored as tiers and act as defaults merged under every tier's
  own keys (``AdaptiveSpeculativeParams.__init__``). At least one tier is required. Per-tier
  knobs read by ``AdaptiveStepSlot.__init__``: ``ema_alpha`` (0.2), ``update_interval`` (5),
  ``warmup_batches`` (10), ``up_hysteresis`` (0.0), ``down_hysteresis`` (-0.25),
  ``ceiling_coeff`` (0).
* Built-in tiers (``DEFAULT_ADAPTIVE_CONFIG``): bs 1 -> ``[1, 3, 5, 7]``, bs 8 -> ``[0, 1, 3]``,
  bs 32 -> ``[0, 1]``, bs 64 -> ``[0]`` (bs 1 with down_hysteresis -0.25, the others 0.0).
* What it does: one slot per tier (``AdaptiveStepSlot``) keeps an EMA of accepted drafts and
  moves among its own candidate steps (``_recompute_params``); a tier with one candidate is a
  fixed K. A batch goes to the tier with the largest key <= its size (sizes below the smallest
  key go to the smallest tier; ``_route`` / ``_find_closest_bs``), after padding the size up to
  the next CUDA-graph batch size when graphs are on (``_pad_to_cuda_graph_bs``). K = 0 skips drafting but still runs the
  draft-extend pass (``eagle_worker_v2.py:EAGLEWorkerV2``, unless the environment variable
  ``SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND`` is set), so it is not the same as a server started
  without speculation. One runtime state per candidate step in the union of all tiers is built
  at startup, its CUDA graphs limited to the graph batch sizes whose tier lists that step
  (``adaptive_runtime_state.py:AdaptiveController.init_states``,
  ``AdaptiveSpeculativeParams.cuda_graph_bs_for_step``).
* Checks at argument resolution (``arg_groups/speculative_hook.py``):
  ``_init_adaptive_speculative_params`` raises ``ValueError("--speculative-num-steps=N is not in
  the adaptive config candidate_steps [...]. Pass one of those values.")`` when the start K is
  outside the *union* of all tiers (not per tier), fills ``--speculative-eagle-topk 1`` and
  num_steps (the middle of the union) when unset, and sets ``speculative_num_draft_tokens`` to
  num_steps + 1. ``_maybe_disable_adaptive`` (reasons from
  ``adaptive_spec_params.py:adaptive_unsupported_reason``) turns adaptive off with a warning,
  keeping static params, unless: algorithm EAGLE or EAGLE3 (NEXTN resolves to EAGLE) on the
  built-in worker (no platform worker class), topk 1 (or unset), no attention DP, no
  multi-layer EAGLE, no two-batch overlap, no pdmux. HiSparse (``hisparse_hook.py``), LoRA
  (``lora_hook.py``) and ``SGLANG_ENABLE_PP_SPEC`` (``validation_hook.py``) refuse it outright.
  The worker is ``eagle_worker_v2.py:EAGLEWorkerV2`` (``AdaptiveController`` over
  ``AdaptiveSpeculativeParams``).
* Running requests: with EAGLE-family speculation and ``--max-running-requests`` unset,
  ``_handle_eagle_family`` caps it at 48 (warning "Max running requests is reset to 48 ...");
  setting ``--max-running-requests`` explicitly lifts it. Tiers above 48 are unreachable
  otherwise, so :func:`sglang_adaptive_args` sets it when the table goes past 48.

vLLM 0.32 (read in ``vllm``)
----------------------------
* Field ``SpeculativeConfig.num_speculative_tokens_per_batch_size`` (``config/speculative.py``):
  ``list[tuple[int, int, int]] | None``, entries ``(range_start, range_end, K)`` with inclusive
  ranges, passed as that key of the ``--speculative-config`` JSON object (``speculative_config``
  dict of ``EngineArgs``). The config class checks only the type.
* Validation (``v1/spec_decode/dynamic/utils.py:validate_and_normalize_dynamic_sd_schedule``),
  run when the scheduler builds its lookup (``v1/core/sched/scheduler.py:Scheduler.__init__`` via
  ``build_dynamic_sd_schedule_lookup``): a non-empty list of 3-item entries, positive bounds,
  start <= end, K >= 0, sorted and non-overlapping, first range starting at 1. Gaps are allowed
  (the previous K carries through them), the last K carries up to ``max_num_seqs``, ranges past
  ``max_num_seqs`` are cut, and every K is clamped to ``num_speculative_tokens`` (min), not
  refused. The per-step K is ``lookup[number of scheduled requests]``.
* Data parallelism > 1 drops the schedule with a warning
  (``config/vllm.py:VllmConfig._maybe_disable_dynamic_sd_for_data_parallel``); a full-CUDA-graph
  mode is lowered to PIECEWISE unless the V2 model runner is in use
  (``_maybe_override_dynamic_sd_cudagraph_mode``).
* Default ``max_num_seqs`` (``engine/arg_utils.py``): 128 in ``SchedulerConfig``, 256 for most
  GPUs, 1024 on H100/H200-class and larger; hence this module's ``max_batch`` default of 1024
  (the tail past the real ``max_num_seqs`` is ignored by vLLM).
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "SGLANG_SPEC_RUNNING_REQUESTS_CAP",
    "VLLM_DEFAULT_MAX_BATCH",
    "VLLM_TABLE_KEY",
    "best_k_by_batch",
    "read_vllm_table",
    "sglang_adaptive_args",
    "sglang_adaptive_config",
    "vllm_k_per_batch_size",
    "write_vllm_table",
]

# SGLang 0.5.23 sets --max-running-requests to this under EAGLE speculation when it is unset
SGLANG_SPEC_RUNNING_REQUESTS_CAP = 48
# the largest default max_num_seqs of vLLM 0.32 (H100/H200-class GPUs)
VLLM_DEFAULT_MAX_BATCH = 1024

# a head arm of the bench table: K as a canonical decimal string ("0", "3"; not "03", "-1")
_K_ARM = re.compile(r"0|[1-9][0-9]*")
# the per-tier knobs SGLang's AdaptiveStepSlot reads
_SGLANG_KNOBS = ("ema_alpha", "update_interval", "warmup_batches", "up_hysteresis",
                 "down_hysteresis", "ceiling_coeff")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _level(key: Any) -> int:
    """A table level key (a decimal string or an int) as a batch size >= 1."""
    if _is_int(key):
        level = key
    elif isinstance(key, str) and _K_ARM.fullmatch(key):
        level = int(key)
    else:
        raise ValueError(f"table level {key!r} is not a batch size (a decimal string such as "
                         "'1' or '16')")
    if level < 1:
        raise ValueError(f"table level {key!r}: batch sizes start at 1")
    return level


def best_k_by_batch(table: dict[str, dict[str, dict]],
                    arms: list[str] | None = None) -> dict[int, int]:
    """{batch size: the K with the highest ``output_tokens_per_s`` at that level}.

    ``table`` is ``fastmtp bench --concurrency``'s ``{level: {arm: stats}}``. The head arms are
    the keys that are K in decimal ("0", "1", "3"); other arms ("auto", "lookup3", ...) are
    ignored. ``arms`` restricts the choice to those K arms (each must be a decimal K); arms
    absent at a level are skipped there. On a tie the smaller K wins (less drafting work).
    Returns the levels in increasing order.

    Raises ValueError: an empty table, a level that is not a positive integer (or appears twice,
    as "8" and 8), a level with no K arm to choose from, a chosen arm without a finite,
    non-negative ``output_tokens_per_s``, or a bad ``arms`` list.
    """
    if not isinstance(table, Mapping) or not table:
        raise ValueError("the table is empty: expected {level: {arm: {'output_tokens_per_s': "
                         "...}}} as written by `fastmtp bench --concurrency`")
    wanted: set[str] | None = None
    if arms is not None:
        if isinstance(arms, str) or not arms:
            raise ValueError(f"arms must be a non-empty list of K arm keys such as ['0', '3'], "
                             f"got {arms!r}")
        bad = [a for a in arms if not (isinstance(a, str) and _K_ARM.fullmatch(a))]
        if bad:
            raise ValueError(f"arms {bad!r} are not K arms: a K arm key is K in decimal "
                             "('0', '1', '3')")
        wanted = set(arms)

    best: dict[int, int] = {}
    for key, row in table.items():
        level = _level(key)
        if level in best:
            raise ValueError(f"table level {level} appears twice")
        if not isinstance(row, Mapping):
            raise ValueError(f"level {key!r}: expected {{arm: stats}}, got {type(row).__name__}")
        candidates = [a for a in row if isinstance(a, str) and _K_ARM.fullmatch(a)
                      and (wanted is None or a in wanted)]
        if not candidates:
            which = f"of {sorted(wanted, key=int)}" if wanted is not None else "(keys '0', '1', ...)"
            raise ValueError(f"level {key!r} has no K arm {which}; its arms: {list(row)}")
        scored = []
        for arm in candidates:
            stats = row[arm]
            tps = stats.get("output_tokens_per_s") if isinstance(stats, Mapping) else None
            if (not isinstance(tps, (int, float)) or isinstance(tps, bool)
                    or not math.isfinite(tps) or tps < 0):
                raise ValueError(f"level {key!r}, arm {arm!r}: output_tokens_per_s must be a "
                                 f"finite number >= 0, got {tps!r}")
            scored.append((tps, -int(arm)))
        best[level] = -max(scored)[1]
    return dict(sorted(best.items()))


def _check_best(best: Mapping[int, int]) -> list[tuple[int, int]]:
    """``best`` as sorted (batch size, K) pairs; ValueError unless sizes >= 1 and K >= 0."""
    if not isinstance(best, Mapping) or not best:
        raise ValueError("best is empty: expected {batch size: K}, e.g. from best_k_by_batch()")
    for level, k in best.items():
        if not _is_int(level) or level < 1:
            raise ValueError(f"best: batch size {level!r} must be an int >= 1")
        if not _is_int(k) or k < 0:
            raise ValueError(f"best: K {k!r} at batch size {level} must be an int >= 0")
    return sorted(best.items())


def sglang_adaptive_config(best: dict[int, int], num_steps: int, *, spread: int = 0,
                           knobs: Mapping[str, float] | None = None) -> dict[str, dict[str, Any]]:
    """SGLang 0.5.23's adaptive config (the JSON object behind ``--speculative-adaptive-config``).

    One tier per measured batch size, keyed by the size as a string. Its ``candidate_steps``
    are the measured best K and, with ``spread`` > 0, that many neighbours on each side on the
    ladder of K values (the distinct best Ks plus ``num_steps``): ``spread=0`` pins the K per
    tier (no runtime adaptation), ``spread=1`` lets SGLang's acceptance EMA move one rung.

    ``num_steps`` is ``--speculative-num-steps`` (the start K, >= 1 here). SGLang requires it
    in the union of all tiers' candidates; when no tier has it, it is added to the tier whose
    best K is nearest (the smaller batch size on a tie), which makes that tier adaptive between
    the two. SGLang has one start K for every tier: a tier listing ``num_steps`` starts there,
    any other at its middle candidate. ``knobs`` (SGLang's per-tier ``ema_alpha``, ``update_interval``, ``warmup_batches``,
    ``up_hysteresis``, ``down_hysteresis``, ``ceiling_coeff``) are copied into every tier.

    Raises ValueError: an empty or malformed ``best``, ``num_steps`` < 1, ``spread`` < 0, an
    unknown knob or a non-numeric knob value.
    """
    pairs = _check_best(best)
    if not _is_int(num_steps) or num_steps < 1:
        raise ValueError(f"num_steps (--speculative-num-steps, the start K) must be an int >= 1, "
                         f"got {num_steps!r}")
    if not _is_int(spread) or spread < 0:
        raise ValueError(f"spread must be an int >= 0, got {spread!r}")
    extra: dict[str, Any] = {}
    for name, value in (knobs or {}).items():
        if name not in _SGLANG_KNOBS:
            raise ValueError(f"unknown SGLang adaptive knob {name!r}; known: {', '.join(_SGLANG_KNOBS)}")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ValueError(f"knob {name!r} must be a finite number, got {value!r}")
        floor = {"update_interval": 1, "warmup_batches": 0}.get(name)
        if floor is not None and (not _is_int(value) or value < floor):
            raise ValueError(f"knob {name!r} must be an int >= {floor}, got {value!r}")
        extra[name] = value

    ladder = sorted({k for _, k in pairs} | {num_steps})
    tiers: dict[int, list[int]] = {}
    for level, k in pairs:
        i = ladder.index(k)
        tiers[level] = ladder[max(0, i - spread): i + spread + 1]
    if not any(num_steps in steps for steps in tiers.values()):
        nearest = min(tiers, key=lambda lv: (abs(best[lv] - num_steps), lv))
        tiers[nearest] = sorted({*tiers[nearest], num_steps})
    return {str(level): {"candidate_steps": steps, **extra} for level, steps in tiers.items()}


def sglang_adaptive_args(best: dict[int, int], num_steps: int,
                         path: str | os.PathLike | None = None, *, spread: int = 0,
                         knobs: Mapping[str, float] | None = None,
                         max_running_requests: int | None = None) -> list[str]:
    """SGLang flags for :func:`sglang_adaptive_config`; writes the config file it names.

    SGLang takes the config as a file path, read at argument resolution and again in every
    scheduler process, so the file must outlive the server's start. ``path`` None writes a new
    temporary file (``fastmtp-sglang-adaptive-*.json``, left for the caller to delete). The
    flags are ``--speculative-adaptive --speculative-adaptive-config ABSPATH`` and, when the
    largest batch size is above SGLang's speculative default of 48 running requests (or when
    ``max_running_requests`` is given), ``--max-running-requests N``.

    The EAGLE flags themselves are not included: pass these as ``extra_args`` to
    ``fastmtp_sglang.serving.sglang_launch.build_launch_command`` with ``steps=num_steps``
    (it sets ``--speculative-num-steps``, topk 1 and num-draft-tokens K+1, and refuses them
    in ``extra_args``).

    Raises ValueError: as :func:`sglang_adaptive_config`, or ``max_running_requests`` below the
    largest measured batch size (those tiers could never be reached).
    """
    config = sglang_adaptive_config(best, num_steps, spread=spread, knobs=knobs)
    top = max(best)
    if max_running_requests is not None:
        if not _is_int(max_running_requests) or max_running_requests < top:
            raise ValueError(f"max_running_requests={max_running_requests!r} is below the largest "
                             f"measured batch size {top}: that tier could never be reached")
        running = max_running_requests
    else:
        running = top if top > SGLANG_SPEC_RUNNING_REQUESTS_CAP else None
    if path is None:
        fd, name = tempfile.mkstemp(prefix="fastmtp-sglang-adaptive-", suffix=".json")
        os.close(fd)
        target = Path(name)
    else:
        target = Path(path)
    target = target.expanduser().resolve()
    target.write_text(json.dumps(config, indent=2) + "\n")
    args = ["--speculative-adaptive", "--speculative-adaptive-config", str(target)]
    if running is not None:
        args += ["--max-running-requests", str(running)]
    return args


def vllm_k_per_batch_size(best: dict[int, int], num_speculative_tokens: int,
                          max_batch: int = VLLM_DEFAULT_MAX_BATCH) -> list[tuple[int, int, int]]:
    """vLLM 0.32's ``num_speculative_tokens_per_batch_size``: ``[(start, end, K), ...]``.

    Inclusive ranges from 1 to ``max_batch``, contiguous and sorted: a measured batch size's K
    holds up to the next measured size minus one (batch sizes below the smallest measured one
    get its K), the last up to ``max_batch``. Neighbouring ranges with the same K are merged.
    Each K is capped at ``num_speculative_tokens`` (vLLM would clamp it there anyway; here the
    list says what runs). Put it under that key of the ``--speculative-config`` JSON, next to
    ``num_speculative_tokens``.

    Raises ValueError: an empty or malformed ``best``, ``num_speculative_tokens`` < 1 (vLLM
    needs K > 0 to build the lookup), or ``max_batch`` below the largest measured batch size.
    """
    pairs = _check_best(best)
    if not _is_int(num_speculative_tokens) or num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be an int >= 1, got {num_speculative_tokens!r}")
    top = pairs[-1][0]
    if not _is_int(max_batch) or max_batch < top:
        raise ValueError(f"max_batch={max_batch!r} is below the largest measured batch size {top}; "
                         "pass vLLM's --max-num-seqs or more")
    ranges: list[tuple[int, int, int]] = []
    for i, (_, k) in enumerate(pairs):
        start = 1 if i == 0 else pairs[i][0]
        end = pairs[i + 1][0] - 1 if i + 1 < len(pairs) else max_batch
        k = min(k, num_speculative_tokens)
        if ranges and ranges[-1][2] == k:
            ranges[-1] = (ranges[-1][0], end, k)
        else:
            ranges.append((start, end, k))
    return ranges


VLLM_TABLE_KEY = "num_speculative_tokens_per_batch_size"


def _table_k(ranges) -> int:
    """num_speculative_tokens for a table: its largest K, at least 1 (vLLM builds the lookup
    only with a draft)."""
    return max(1, max(k for _, _, k in ranges))


def write_vllm_table(ranges: list[tuple[int, int, int]], path: str | os.PathLike) -> Path:
    """Write ``{"num_speculative_tokens": K, VLLM_TABLE_KEY: ranges}`` (K = the table's largest,
    at least 1: vLLM builds the lookup only with a draft) for ``fastmtp serve --engine vllm
    --steps auto --adaptive-config PATH``; written beside and renamed."""
    target = Path(path).expanduser().resolve()
    body = {"num_speculative_tokens": _table_k(ranges),
            VLLM_TABLE_KEY: [list(r) for r in ranges]}
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(json.dumps(body, indent=1) + "\n")
    tmp.replace(target)
    return target


def read_vllm_table(path: str | os.PathLike) -> tuple[list[tuple[int, int, int]], int]:
    """(ranges, K) from a file :func:`write_vllm_table` wrote (or a bare list of ranges), checked
    the way vLLM 0.32's scheduler checks them (``validate_and_normalize_dynamic_sd_schedule``):
    3-int entries, positive bounds, start <= end, K >= 0, sorted, non-overlapping, the first
    starting at 1. K is ``num_speculative_tokens`` (default: the largest K, at least 1).

    Raises ValueError naming the file and what is wrong."""
    p = Path(path)
    try:
        body = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{p}: cannot read a K-per-batch-size table ({exc}); write one with "
                         "fastmtp bench --concurrency ... --emit-engine-config") from None
    ranges = body.get(VLLM_TABLE_KEY) if isinstance(body, dict) else body
    if not isinstance(ranges, list) or not ranges:
        raise ValueError(f"{p}: expected a non-empty list under {VLLM_TABLE_KEY!r} "
                         "([[start, end, K], ...], the first starting at 1)")
    out: list[tuple[int, int, int]] = []
    for e in ranges:
        if not (isinstance(e, list) and len(e) == 3 and all(_is_int(x) for x in e)):
            raise ValueError(f"{p}: entry {e!r} is not [start, end, K] (three ints)")
        s, t, k = e
        if s < 1 or t < s or k < 0:
            raise ValueError(f"{p}: entry {e!r}: needs 1 <= start <= end and K >= 0")
        if out and s <= out[-1][1]:
            raise ValueError(f"{p}: entry {e!r} overlaps or precedes {list(out[-1])}: sort the ranges")
        out.append((s, t, k))
    if out[0][0] != 1:
        raise ValueError(f"{p}: the first range starts at {out[0][0]}; vLLM needs it to start at 1")
    kmax = body.get("num_speculative_tokens") if isinstance(body, dict) else None
    if kmax is None:
        kmax = _table_k(out)
    if not _is_int(kmax) or kmax < 1:
        raise ValueError(f"{p}: num_speculative_tokens must be an int >= 1, got {kmax!r}")
    return out, kmax
