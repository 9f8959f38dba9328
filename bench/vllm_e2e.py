"""vLLM's speculative decoding with a FastMTP head, end to end on CPU, against the reference engine.

    /work/vllm-venv/bin/python bench/vllm_e2e.py --out bench/results/vllm_cpu
    # fewer prompts / tokens for a quick check:
    /work/vllm-venv/bin/python bench/vllm_e2e.py --limit-per-category 1 --categories coding,math \
        --max-new-tokens 32 --dtypes float32 --out /tmp/vllm_check

For each dtype, vLLM (``vllm.LLM``, the same engine ``vllm serve`` runs) serves the target at
K=0 and at K (default 3) with the draft as ``speculative_config={"method": "eagle", ...}``, each
in its own process, one prompt at a time, greedy; then the reference engine
(``fastmtp_sglang.decode.engine``) runs the same prompt token ids with the same head at the same K and
dtype. Written to ``--out``: ``results.json`` (every prompt's tokens, per-prompt acceptance from
vLLM's own counters, timings) and ``results.md``.

What is compared:
- greedy identity: vLLM at K vs vLLM at K=0, per prompt (all tokens equal);
- tau: vLLM's ``1 + accepted / drafts`` (its ``spec_decode_num_drafts`` and
  ``..._num_accepted_tokens`` counters, per prompt as deltas) vs the reference engine's
  emitted / cycles, over all prompts and over the prompts whose K-step outputs are identical in
  both engines (where the drafting contexts are the same token for token);
- tok/s: completion tokens / wall time of ``generate`` at batch 1 (prefill included), after an
  untimed warm-up request, K=0 and K in two processes run back to back.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DRAFT = REPO / "fastmtp_sglang" / "data" / "heads" / "smollm2-135m-fastmtp-k3"
DEFAULT_PROMPTS = REPO / "bench" / "data" / "spec_bench.jsonl"
KV_CACHE_BYTES = 1 << 30  # see fastmtp_sglang.serving.vllm_launch: the CPU worker's default refuses shared RAM


# -- vLLM worker (its own process: one engine per process) -------------------------------------

def _spec_counters(llm) -> tuple[int, list[int]]:
    """(drafts, accepted per position) from vLLM's own metrics, cumulative."""
    drafts, per_pos = 0, []
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            drafts = int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            per_pos = [int(v) for v in m.values]
    return drafts, per_pos


def vllm_worker(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    os.environ.update(job.get("env") or {})  # (before vLLM spawns its engine core)
    k = job["steps"]
    spec = ({"method": "eagle", "model": job["draft"], "num_speculative_tokens": k} if k else None)
    if spec and job.get("k_per_batch_size"):  # vLLM's K per number of running requests
        spec["num_speculative_tokens_per_batch_size"] = job["k_per_batch_size"]
    t = time.perf_counter()
    llm = LLM(model=job["target"], dtype=job["dtype"], speculative_config=spec,
              max_model_len=job["max_model_len"], enforce_eager=True, seed=0,
              kv_cache_memory_bytes=KV_CACHE_BYTES, disable_log_stats=False)
    startup_s = time.perf_counter() - t
    sp = SamplingParams(temperature=0, max_tokens=job["max_new_tokens"])
    prompts = job["prompts"]
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0]["ids"])], sp, use_tqdm=False)  # warm-up
    if job.get("together"):  # one generate call: the prompts run as one batch, each to its own length
        return _together(llm, job, prompts, startup_s)
    rows = []
    for p in prompts:
        d0, a0 = _spec_counters(llm)
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=p["ids"])], sp, use_tqdm=False)[0]
        dt = time.perf_counter() - t
        d1, a1 = _spec_counters(llm)
        ids = list(out.outputs[0].token_ids)
        a0 = a0 + [0] * (len(a1) - len(a0))
        rows.append({"id": p["id"], "category": p["category"], "output_ids": ids,
                     "completion_tokens": len(ids), "wall_s": dt, "drafts": d1 - d0,
                     "accepted_per_pos": [x - y for x, y in zip(a1, a0)]})
    return {"steps": k, "dtype": job["dtype"], "startup_s": startup_s, "rows": rows}


def _together(llm, job: dict, prompts: list[dict], startup_s: float) -> dict:
    """The prompts in one ``generate`` call (one batch that shrinks as the shorter answers end;
    ``max_new_tokens`` per prompt where it has one); the spec counters over the whole call."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sps = [SamplingParams(temperature=0, max_tokens=p.get("max_new_tokens", job["max_new_tokens"]))
           for p in prompts]
    d0, a0 = _spec_counters(llm)
    t = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p["ids"]) for p in prompts], sps, use_tqdm=False)
    dt = time.perf_counter() - t
    d1, a1 = _spec_counters(llm)
    a0 = a0 + [0] * (len(a1) - len(a0))
    rows = [{"id": p["id"], "output_ids": list(o.outputs[0].token_ids)} for p, o in zip(prompts, outs)]
    res = {"steps": job["steps"], "dtype": job["dtype"], "startup_s": startup_s, "rows": rows,
           "wall_s": dt, "drafts": d1 - d0, "accepted_per_pos": [x - y for x, y in zip(a1, a0)]}
    if job.get("draft_kv_digest"):  # the draft's KV cache, slot for slot (needs the env below)
        from fastmtp_sglang.vllm_models.k0 import draft_kv_digest

        res["draft_kv_digest"] = llm.collective_rpc(draft_kv_digest)
    return res


def run_vllm(job: dict, workdir: Path) -> dict:
    """One engine in a fresh process (vLLM spawns its engine core; one LLM per process)."""
    tag = f"{job['dtype']}-{job['steps']}{job.get('tag', '')}"
    jpath, rpath = workdir / f"job-{tag}.json", workdir / "result.json"
    jpath.write_text(json.dumps(job))
    rpath.unlink(missing_ok=True)
    log = workdir / f"vllm-{tag}.log"
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, __file__, "--out", str(workdir), "--worker",
                             str(jpath), str(rpath)],
                            stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0 or not rpath.exists():
        raise SystemExit(f"vLLM run {job['dtype']} K={job['steps']} failed (exit {rc}); see {log}")
    return json.loads(rpath.read_text())


# -- the reference engine ------------------------------------------------------------------------

def run_reference(target_dir: str, draft: str, steps: int, dtype: str, prompts: list[dict],
                  max_new_tokens: int) -> list[dict]:
    from fastmtp_sglang.core.draft_dir import load_head
    from fastmtp_sglang.decode.engine import ReferenceEngine, Request
    from fastmtp_sglang.decode.sampling import SamplingParams
    from fastmtp_sglang.core.target import load_target, parse_dtype

    dt = parse_dtype(dtype)
    target = load_target(target_dir, dt, "cpu")
    head = load_head(draft, target.embed, target.lm_head, dtype=dt, device="cpu")
    eng = ReferenceEngine(target, head, steps)
    rows = []
    for p in prompts:
        r = eng.generate([Request(list(p["ids"]), SamplingParams(temperature=0.0,
                                                                 max_new_tokens=max_new_tokens),
                                  p["id"])])[0]
        acc = [c.accepted for c in r.metrics.cycles]
        rows.append({"id": p["id"], "output_ids": list(r.output_ids), "cycles": len(acc),
                     "accepted": sum(acc), "hist": [acc.count(a) for a in range(steps + 1)]})
    return rows


# -- summary -------------------------------------------------------------------------------------

def _tau(drafts: int, accepted: int) -> float | None:
    return 1 + accepted / drafts if drafts else None


def summarize(dtype: str, k0: dict, kk: dict, ref: list[dict], steps: int) -> dict:
    by_id0 = {r["id"]: r for r in k0["rows"]}
    ref_by = {r["id"]: r for r in ref}
    same_k0 = [r["id"] for r in kk["rows"] if r["output_ids"] == by_id0[r["id"]]["output_ids"]]
    same_ref = [r["id"] for r in kk["rows"] if r["output_ids"] == ref_by[r["id"]]["output_ids"]]

    def vtau(ids):
        rows = [r for r in kk["rows"] if r["id"] in ids]
        return _tau(sum(r["drafts"] for r in rows), sum(sum(r["accepted_per_pos"]) for r in rows))

    def rtau(ids):
        rows = [r for r in ref if r["id"] in ids]
        return _tau(sum(r["cycles"] for r in rows), sum(r["accepted"] for r in rows))

    all_ids = [r["id"] for r in kk["rows"]]
    drafts = sum(r["drafts"] for r in kk["rows"])
    per_pos = [sum(r["accepted_per_pos"][i] for r in kk["rows"] if len(r["accepted_per_pos"]) > i)
               for i in range(steps)]

    def tps(run):
        return sum(r["completion_tokens"] for r in run["rows"]) / sum(r["wall_s"] for r in run["rows"])

    def vpos(ids):  # accepted drafts per position over these prompts, from vLLM's counters
        rows = [r for r in kk["rows"] if r["id"] in ids]
        return [sum(r["accepted_per_pos"][i] for r in rows if len(r["accepted_per_pos"]) > i)
                for i in range(steps)]

    def rpos(ids):  # the same from the reference engine's cycles (a chain accepts a prefix)
        rows = [r for r in ref if r["id"] in ids]
        return [sum(sum(r["hist"][i + 1:]) for r in rows) for i in range(steps)]

    ref_cycles = sum(r["cycles"] for r in ref)
    ref_A = [sum(sum(r["hist"][a:]) for r in ref) / ref_cycles if ref_cycles else None
             for a in range(1, steps + 1)]
    return {
        "dtype": dtype, "steps": steps, "prompts": len(all_ids),
        "identical_to_k0": len(same_k0), "identical_to_k0_ids": same_k0,
        "identical_to_reference": len(same_ref),
        "tau_vllm": vtau(all_ids), "tau_reference": rtau(all_ids),
        "tau_vllm_same_output": vtau(same_ref), "tau_reference_same_output": rtau(same_ref),
        "A_k_vllm": [c / drafts if drafts else None for c in per_pos], "A_k_reference": ref_A,
        # on prompts with the same output the two engines verify the same drafts: in fp32 these
        # counts are equal, cycle for cycle
        "drafts_vllm_same_output": sum(r["drafts"] for r in kk["rows"] if r["id"] in same_ref),
        "cycles_reference_same_output": sum(r["cycles"] for r in ref if r["id"] in same_ref),
        "accepted_per_pos_vllm_same_output": vpos(same_ref),
        "accepted_per_pos_reference_same_output": rpos(same_ref),
        "drafts_vllm": drafts, "cycles_reference": ref_cycles,
        "tok_s_k0": tps(k0), "tok_s_k": tps(kk), "speedup": tps(kk) / tps(k0),
        "startup_s_k0": k0["startup_s"], "startup_s_k": kk["startup_s"],
    }


def _f(x, fmt="{:.3f}"):
    return "-" if x is None else fmt.format(x)


def markdown(res: dict) -> str:
    m = res["meta"]
    lines = [
        "# vLLM (CPU) serving the demo target with the shipped FastMTP head", "",
        f"Command: `{m['command']}`", "",
        f"vllm-cpu {m['vllm']} (torch {m['torch']}), target `{m['target']}`, draft `{m['draft']}`, "
        f"{m['prompts']} prompts ({m['prompt_source']}), chat template, {m['max_new_tokens']} new "
        f"tokens, greedy, batch 1, `enforce_eager`. Speculation: `speculative_config="
        f"{{\"method\": \"eagle\", \"model\": DRAFT, \"num_speculative_tokens\": {m['steps']}}}`.", "",
        f"**Machine shared** with other jobs (2 cores): tok/s are one pass each, K=0 and "
        f"K={m['steps']} in two processes run back to back; read the ratio, not the absolute "
        "numbers, and treat it as indicative.", "",
        "| dtype | same as K=0 (vLLM) | same as reference | tau vLLM | tau reference | "
        "tau on same-output prompts (vLLM / ref) | A_k vLLM (%) | A_k reference (%) | "
        "tok/s K=0 | tok/s K | speedup |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in res["summary"]:
        pct = lambda xs: "/".join("-" if x is None else f"{100 * x:.0f}" for x in xs)  # noqa: E731
        lines.append(
            f"| {s['dtype']} | {s['identical_to_k0']}/{s['prompts']} | "
            f"{s['identical_to_reference']}/{s['prompts']} | {_f(s['tau_vllm'])} | "
            f"{_f(s['tau_reference'])} | {_f(s['tau_vllm_same_output'])} / "
            f"{_f(s['tau_reference_same_output'])} | {pct(s['A_k_vllm'])} | "
            f"{pct(s['A_k_reference'])} | {_f(s['tok_s_k0'], '{:.1f}')} | "
            f"{_f(s['tok_s_k'], '{:.1f}')} | {_f(s['speedup'], '{:.2f}x')} |")
    lines += ["", "tau vLLM = 1 + accepted / drafts from vLLM's `spec_decode_num_drafts` and "
              "`spec_decode_num_accepted_tokens` counters (deltas per request); tau reference = "
              "emitted / verify cycles of `fastmtp_sglang.decode.engine`. \"Same as reference\": the "
              "vLLM K-step output equals the reference engine's K-step output token for token.",
              ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None,
                    help="target directory (default: the demo target, materialised if needed)")
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT), help="FastMTP draft directory")
    ap.add_argument("--steps", type=int, default=3, help="K, drafts per cycle (default 3)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated dtypes")
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="prompt file (JSONL)")
    ap.add_argument("--limit-per-category", type=int, default=1,
                    help="first N prompts of each category (default 1: 13 Spec-Bench prompts)")
    ap.add_argument("--categories", default=None, help="comma-separated categories (default all)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens per answer (default 64)")
    ap.add_argument("--max-model-len", type=int, default=2048, help="vLLM context (tokens)")
    ap.add_argument("--out", required=True, help="output directory (results.json, results.md)")
    ap.add_argument("--worker", nargs=2, metavar=("JOB", "RESULT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.worker:
        job = json.loads(Path(args.worker[0]).read_text())
        Path(args.worker[1]).write_text(json.dumps(vllm_worker(job)))
        return 0

    import torch
    import vllm
    from transformers import AutoTokenizer

    from fastmtp_sglang.core.prompts import load_prompts, render_chat

    target = args.target
    if target is None:
        from fastmtp_sglang.core.demo_target import materialize_smollm2

        target = str(materialize_smollm2())
    tok = AutoTokenizer.from_pretrained(target)
    cats = args.categories.split(",") if args.categories else None
    prompts = []
    for p in load_prompts(args.prompts, limit_per_category=args.limit_per_category, categories=cats):
        text = render_chat(tok, p.text)
        prompts.append({"id": p.id, "category": p.category,
                        "ids": tok(text, add_special_tokens=False).input_ids})
    out = Path(args.out)
    work = out / "_work"
    work.mkdir(parents=True, exist_ok=True)
    runs, refs, summary = {}, {}, []
    for dtype in args.dtypes.split(","):
        base = {"target": target, "draft": str(Path(args.draft).resolve()), "dtype": dtype,
                "prompts": prompts, "max_new_tokens": args.max_new_tokens,
                "max_model_len": args.max_model_len}
        for k in (0, args.steps):
            print(f"vLLM {dtype} K={k} ...", flush=True)
            runs[f"{dtype}/k{k}"] = run_vllm({**base, "steps": k}, work)
        print(f"reference {dtype} K={args.steps} ...", flush=True)
        refs[dtype] = run_reference(target, args.draft, args.steps, dtype, prompts,
                                    args.max_new_tokens)
        summary.append(summarize(dtype, runs[f"{dtype}/k0"], runs[f"{dtype}/k{args.steps}"],
                                 refs[dtype], args.steps))
        print(json.dumps(summary[-1], indent=1), flush=True)
    meta = {"command": "python bench/vllm_e2e.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
            "vllm": vllm.__version__, "torch": torch.__version__, "target": target,
            "draft": args.draft, "steps": args.steps, "prompts": len(prompts),
            "prompt_source": f"{Path(args.prompts).name}, first {args.limit_per_category} per category",
            "max_new_tokens": args.max_new_tokens, "machine": "2 CPU cores, shared with other jobs"}
    res = {"meta": meta, "summary": summary, "vllm_runs": runs, "reference_runs": refs}
    (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "results.md").write_text(markdown(res))
    shutil.rmtree(work)  # job files and vLLM logs: kept only when a run fails
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
