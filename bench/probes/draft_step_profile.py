"""Where a draft step's time goes at batch 1 on CPU: the head's block, the projection over the
compressed table, the argmax, and the draft extend, timed separately (medians over many calls,
after warm-up), plus a torch.profiler table of one step. Nothing else should run meanwhile.
The head runs as the engine runs it (packed weights; on AMX machines decode/lean_head.py, a
draft step in one kernel call); ``--module`` times the module's forward instead. Each part is
timed twice: back to back ("hot": its weights in cache) and right after a target step
("cold", as a cycle's first draft step runs; what the cost curve times).

    python bench/probes/draft_step_profile.py [--head DIR] [--vocab TABLE.pt] [--dtype bfloat16] [--ctx 200] [--module] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def med_ms(fn, n: int = 200, warm: int = 20) -> float:
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", default=str(REPO / "fastmtp_sglang/data/heads/smollm2-135m-fastmtp-k3"))
    ap.add_argument("--target", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--ctx", type=int, default=200, help="positions already in the head's cache")
    ap.add_argument("--steps", type=int, default=3, help="K: the draft extend covers K+1 positions")
    ap.add_argument("--vocab", default=None, help="table(s) to draft over (as `fastmtp bench --vocab`); "
                    "default: the head's own tables")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--module", action="store_true", help="the head's module forward, not the engine's path")
    ap.add_argument("--out")
    args = ap.parse_args()

    from fastmtp_sglang.core.draft_dir import load_head
    from fastmtp_sglang.vocab.draft_vocab import resolve_vocab
    from fastmtp_sglang.core.target import load_target

    if args.target is None:
        from fastmtp_sglang.core.demo_target import materialize_smollm2
        args.target = str(materialize_smollm2())
    t = load_target(args.target, dtype=args.dtype)
    dt = getattr(torch, args.dtype)
    head = load_head(args.head, t.embed, t.lm_head, dtype=dt)
    vocab = resolve_vocab(args.vocab, t.tokenizer, t.lm_head, draft_dir=args.head)
    from fastmtp_sglang.cpu_kernels.packed_linear import pack_for_inference
    from fastmtp_sglang.decode.lean_forward import lean_forward_for
    from fastmtp_sglang.decode.lean_head import LeanHead
    from fastmtp_sglang.decode.slot_cache import SlotCache, use_gqa_sdpa

    use_gqa_sdpa(t.model)
    pack_for_inference(t.model, head)  # (as ReferenceEngine does)
    fwd = lean_forward_for(t.model, "auto")
    if args.module or fwd is None:
        def run_head(h, i, p, c):
            return head(h, i, p, c, return_logits=False)[0]
    else:
        run_head = LeanHead(head).run
    H = head.cfg.hidden_size
    g0 = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (1, args.ctx + 16), generator=g0)
    hid = torch.randn(1, args.ctx, H, generator=g0).to(dt)
    from fastmtp_sglang.decode.costs import cpu_description
    res: dict = {"cpu": cpu_description(), "dtype": args.dtype, "ctx": args.ctx, "threads": torch.get_num_threads(),
                 "table": None if vocab is None else int(vocab.tables.lens.max())}
    with torch.inference_mode():
        cache = head.new_cache(1, args.ctx + 64)
        pos = torch.arange(args.ctx)[None]
        head(hid, ids[:, 1:args.ctx + 1], pos, cache, return_logits=False)
        g = hid[:, -1]
        tok = ids[:, args.ctx:args.ctx + 1]
        p1 = torch.tensor([[args.ctx]])
        tidx = extra = None
        if vocab is not None:
            tidx, extra = vocab.choose(ids[:, :args.ctx], torch.ones(1, args.ctx, dtype=torch.bool))

        def block():
            return run_head(g[:, None], tok, p1, cache)

        def proj():
            if vocab is None:
                return head.project(g).argmax(-1)
            return vocab.greedy(g, tidx, extra)

        full_w = t.lm_head.weight

        def proj_full():
            return torch.nn.functional.linear(g.to(full_w.dtype), full_w).argmax(-1)

        kp = args.steps + 1
        vh = torch.randn(1, kp, H, generator=g0).to(dt)
        vpos = torch.arange(args.ctx, args.ctx + kp)[None]

        def extend():
            return run_head(vh, ids[:, 1:kp + 1], vpos, cache)

        def step():
            block()
            return proj()

        # a target step first (its 270 MB through the caches), as a cycle's first draft step
        tcache = SlotCache()
        L = args.ctx
        tids = torch.randint(0, 1000, (1, L + 1), generator=g0)
        t.model.model(input_ids=tids[:, :L], position_ids=torch.arange(L)[None],
                      attention_mask=torch.ones(1, L, dtype=torch.long), past_key_values=tcache, use_cache=True)

        def target_step():
            m = torch.ones(1, L + 1, dtype=torch.long)
            pos = torch.tensor([[L]])
            h = (fwd(tids[:, L:], pos, m, tcache)[0] if fwd is not None else
                 t.model.model(input_ids=tids[:, L:], position_ids=pos, attention_mask=m,
                               past_key_values=tcache, use_cache=True).last_hidden_state)
            t.lm_head(h).float().argmax(-1)
            tcache.crop(-1)

        def after_target(fn):
            def timed():
                target_step()
                t0 = time.perf_counter()
                fn()
                return time.perf_counter() - t0
            return timed

        def med_cold_ms(fn, n=60, warm=5):
            for _ in range(warm):
                after_target(fn)()
            return statistics.median(after_target(fn)() for _ in range(n)) * 1e3

        res["path"] = "module" if args.module or fwd is None else "engine (LeanHead)"
        res["block_ms_after_target_step"] = med_cold_ms(block)
        res["projection_argmax_ms_after_target_step"] = med_cold_ms(proj)
        res["draft_step_ms_after_target_step"] = med_cold_ms(step)
        res["block_ms"] = med_ms(block)
        res["projection_argmax_ms"] = med_ms(proj)
        res["projection_full_vocab_ms"] = med_ms(proj_full)
        res["draft_step_ms"] = med_ms(step)
        res["draft_extend_ms"] = med_ms(extend)
        res["cycle_draft_ms_K"] = res["projection_argmax_ms"] + (args.steps - 1) * res["draft_step_ms"] \
            + res["draft_extend_ms"]
        print(json.dumps(res, indent=1))
        if args.profile:
            from torch.profiler import profile
            with profile() as prof:
                for _ in range(20):
                    step()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
