"""`fastmtp convert`: extract the MTP layer of a base checkpoint into a draft directory, or change
a draft directory's layout. Layout changes are exact: they only move columns of one matrix.

Source naming (``--format``):
  mimo      model.mtp_layers.{i}.{token_layernorm, hidden_layernorm, input_proj, input_layernorm,
            self_attn.*, post_attention_layernorm, mlp.*, final_layernorm}; input_proj sees
            cat[hidden, embed]
  deepseek  model.layers.{num_hidden_layers + i}.{enorm, hnorm, eh_proj, ..., shared_head.norm};
            eh_proj sees cat[embed, hidden]
  split     as deepseek, with e_proj and h_proj (two H x H matrices) in place of eh_proj
  draft     a draft directory (auto-detected)
  speculators  a speculators-format directory of the `mtp` algorithm (auto-detected;
            core/speculators_format.py): mtp_layers.0.*, input_proj sees cat[embed, hidden]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fastmtp_sglang.core.checkpoint import CheckpointReader
from fastmtp_sglang.core.draft_dir import (
    check_output, check_tensors, expected_shapes, is_draft_dir, load_draft_dir,
    make_draft_config, save_draft_dir,
)
from fastmtp_sglang.core.errors import DraftFormatError, FastMTPError
from fastmtp_sglang.core.head import LAYOUTS, HeadConfig
from fastmtp_sglang.core.identity import target_identity
# the layouts' checkpoint names and the exact layout change (shared with the native and
# Speculators exports); change_layout, source_* and split_projection are re-exported for callers
from fastmtp_sglang.core.layouts import (SHARED_NAMES, change_layout, source_name_map,  # noqa: F401
                                         source_prefix, split_projection)

FORMATS = ("mimo", "deepseek", "split", "draft", "speculators")

def _guess_format(keys: list[str], config: dict[str, Any]) -> str | None:
    if any(k.startswith("model.mtp_layers.") for k in keys):
        return "mimo"
    n = config.get("num_hidden_layers")
    if n is not None:
        pre = f"model.layers.{n}."
        if any(k.startswith(pre + "e_proj") for k in keys):
            return "split"
        if any(k.startswith(pre) for k in keys):
            return "deepseek"
    return None


def _tokenizer_or_none(path: Path):
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))
    except Exception:  # a checkpoint without tokenizer files is fine: identity just lacks its hash
        return None


def extract(src: str | Path, fmt: str, mtp_index: int = 0, model_type: str | None = None
            ) -> tuple[dict[str, Any], dict[str, torch.Tensor], str, CheckpointReader]:
    """Read the MTP layer of a base checkpoint -> (target config, head state dict, layout)."""
    reader = CheckpointReader(src)
    config = reader.config()
    keys = reader.keys()
    prefix = source_prefix(fmt, config, mtp_index)
    under = [k for k in keys if k.startswith(prefix)]
    if not under:
        guess = _guess_format(keys, config)
        hint = f" It looks like --format {guess}." if guess and guess != fmt else ""
        raise DraftFormatError(
            f"{src}: no tensors under {prefix!r}, where --format {fmt} keeps its MTP layer.{hint}")
    names = source_name_map(fmt, prefix)
    unknown = sorted(k for k in under if k not in names and k[len(prefix):] not in SHARED_NAMES)
    if unknown:
        guess = _guess_format(keys, config)  # deepseek and split share a prefix
        hint = (f" It looks like --format {guess}." if guess and guess != fmt else
                " (MoE / MLA MTP layers are served by SGLang's in-tree NextN classes, not FastMTP)")
        raise DraftFormatError(
            f"{src}: tensors under {prefix!r} that a dense {fmt} MTP layer does not have: "
            f"{', '.join(unknown[:12])}{' ...' if len(unknown) > 12 else ''}.{hint}")
    sd = {names[k]: reader.get(k) for k in under if k in names}
    layout = fmt
    return config, sd, layout, reader


def convert(src: str | Path, out: str | Path, fmt: str | None = None, layout: str | None = None,
            mtp_index: int = 0, model_type: str | None = None, dtype: str | None = None,
            name: str | None = None, overwrite: bool = False) -> Path:
    src, out = Path(src), Path(out)
    if fmt is not None and fmt not in FORMATS:
        raise FastMTPError(f"unknown --format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if layout is not None and layout not in LAYOUTS:
        raise FastMTPError(f"unknown --layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    check_output(out, overwrite)  # before reading SRC: --overwrite replaces only a draft directory
    is_draft = is_draft_dir(src)  # parsed: an exported checkpoint may say "fastmtp" elsewhere
    if is_draft:
        if fmt not in (None, "draft"):
            raise FastMTPError(f"{src} is a draft directory, not a {fmt} base checkpoint; "
                               "drop --format (or pass --format draft) to change its layout")
        d = load_draft_dir(src)
        src_layout = d.head_config.layout
        dst = layout or src_layout
        sd = change_layout(d.state_dict, src_layout, dst)
        meta = {k: v for k, v in d.meta.items()
                if k not in ("format_version", "layout", "block", "concat_order")}
        target_cfg = {k: v for k, v in d.config.items() if k != "fastmtp"}
        cfg = make_draft_config(target_cfg, dst, block=d.head_config.block,
                                dtype=dtype or d.config.get("torch_dtype"), extra=None)
        cfg["fastmtp"].update(meta)
        cfg["fastmtp"]["converted_from"] = {"path": str(src), "layout": src_layout}
        return save_draft_dir(out, cfg, sd, overwrite=overwrite)
    from fastmtp_sglang.core.speculators_format import import_speculators, is_speculators_dir

    if fmt == "speculators" or (fmt is None and is_speculators_dir(src)):
        return import_speculators(src, out, layout=layout, dtype=dtype, overwrite=overwrite)
    if fmt is None:
        raise FastMTPError(f"{src} is not a draft directory: pass --format mimo, deepseek or split "
                           "to say how its MTP layer is named")
    if fmt == "draft":
        raise FastMTPError(f"{src} is not a draft directory (no config.json with a 'fastmtp' block)")
    target_cfg, sd, src_layout, reader = extract(src, fmt, mtp_index, model_type)
    # fail before writing (and before moving columns) when the checkpoint's tensors do not fit
    # its own config; name them as the checkpoint does
    src_cfg = make_draft_config(target_cfg, src_layout, model_type=model_type)
    to_src = {v: k for k, v in source_name_map(fmt, source_prefix(fmt, target_cfg, mtp_index)).items()}
    check_tensors({to_src.get(k, k): s for k, s in expected_shapes(HeadConfig.from_dict(src_cfg)).items()},
                  {to_src.get(k, k): tuple(v.shape) for k, v in sd.items()}, f"{src} ({fmt} MTP layer)")
    dst = layout or src_layout
    sd = change_layout(sd, src_layout, dst)
    src_dtype = str(next(iter(sd.values())).dtype).replace("torch.", "")
    tok = _tokenizer_or_none(reader.dir)
    ident = target_identity(name or target_cfg.get("_name_or_path") or reader.dir.name, target_cfg, tok)
    cfg = make_draft_config(target_cfg, dst, model_type=model_type, base_model=ident,
                            dtype=dtype or src_dtype,
                            extra={"converted_from": {"path": str(src), "format": fmt,
                                                      "mtp_index": mtp_index}})
    return save_draft_dir(out, cfg, sd, overwrite=overwrite)
