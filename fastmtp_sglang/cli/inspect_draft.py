"""`fastmtp inspect DIR [--target T]`: what a draft directory holds and whether it fits a target."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fastmtp_sglang.core.draft_dir import load_draft_dir
from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.core.target import check_fits, read_target_config


def describe(path: str | Path, target: str | Path | None = None, as_json: bool = False) -> tuple[str, bool]:
    """A printable report, and whether every fit check passed."""
    d = load_draft_dir(path)
    c, meta = d.head_config, d.meta
    n_params = sum(v.numel() for v in d.state_dict.values())
    dtypes = sorted({str(v.dtype).replace("torch.", "") for v in d.state_dict.values()})
    info = {
        "path": str(d.path), "layout": c.layout, "block": c.block,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads, "head_dim": c.head_dim,
        "vocab_size": c.vocab_size, "aux_hidden_states": list(c.aux_hidden_states),
        "parameters": n_params, "dtype": dtypes,
        "tensors": {k: list(v.shape) for k, v in d.state_dict.items()}, "fastmtp": meta,
    }
    ok = True
    if target is not None:
        tcfg = read_target_config(target)
        tok = None
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(target), local_files_only=True)
        except Exception:  # tokenizer files are optional for a shape check
            pass
        rows = check_fits(d.config, tcfg, tok)
        ok = all(r[1] for r in rows)
        info["fits_target"] = {"target": str(target), "ok": ok,
                               "checks": [{"check": n, "ok": o, "detail": m} for n, o, m in rows]}
    if as_json:
        return json.dumps(info, indent=2), ok
    lines = [
        f"draft directory  {d.path}",
        f"layout           {c.layout} ({'input_proj(cat[hnorm(h), enorm(e)])' if c.layout == 'mimo' else 'eh_proj(cat[enorm(e), hnorm(h)])' if c.layout == 'deepseek' else 'e_proj(enorm(e)) + h_proj(hnorm(h))'})",
        f"block            {c.block}: hidden {c.hidden_size}, intermediate {c.intermediate_size}, "
        f"heads {c.num_attention_heads}/{c.num_key_value_heads} (q/kv), head_dim {c.head_dim}",
        f"vocab            {c.vocab_size} (embedding and lm_head come from the target)",
        "input            " + (f"fc(cat[aux layers {list(c.aux_hidden_states)} (each RMS-normed), "
                               "last hidden]) at step 1 (reference engine only)"
                               if c.aux_hidden_states else "the target's last hidden state"),
        f"parameters       {n_params:,} ({', '.join(dtypes)})",
        f"trained steps    K={meta.get('trained_steps', 0)}"
        + (f", step weights {meta['step_weights']}" if meta.get("step_weights") else ""),
        f"base model       {json.dumps(meta.get('base_model', {}))}",
        f"vocab tables     {meta.get('vocab_tables') or 'none (full vocabulary)'}",
    ]
    for key in ("init", "converted_from", "training"):
        if key in meta:
            lines.append(f"{key:<16} {json.dumps(meta[key])}")
    lines.append("tensors:")
    lines += [f"  {k:<42} {list(v.shape)}" for k, v in d.state_dict.items()]
    if target is not None:
        lines.append(f"fits target {target}: {'yes' if ok else 'NO'}")
        for name, good, detail in rows:
            lines.append(f"  [{'ok' if good else 'MISMATCH'}] {name}: {detail}")
    return "\n".join(lines), ok


def _run(args: argparse.Namespace) -> int:
    text, ok = describe(args.dir, args.target, args.json)
    print(text)
    if not ok:
        raise FastMTPError(f"{args.dir} does not fit the target {args.target} (see above)")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="print a draft directory's layout, shapes and metadata")
    p.add_argument("dir", help="draft directory")
    p.add_argument("--target", default=None, help="target model directory to check the fit against")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=_run)
