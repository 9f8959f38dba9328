"""`fastmtp export --native`: the target's own checkpoint with the trained head as its MTP layer.

Engines serve a family's MTP layer natively (no out-of-tree class, no plugin) when it sits in the
family's checkpoint under the family's names. SGLang 0.5.23 rewrites a draft's architecture from
the target's config (``ModelConfig``: ``MiMoForCausalLM`` -> ``MiMoMTP``, ``DeepseekV3ForCausalLM``
-> ``DeepseekV3ForCausalLMNextN``), so the draft path is the exported checkpoint itself.

- MiMo (``MiMoForCausalLM``): ``model.mtp_layers.0.{token_layernorm, hidden_layernorm,
  input_proj, input_layernorm, self_attn.{q,k,v,o}_proj (+ q/k/v bias), post_attention_layernorm,
  mlp.{gate,up,down}_proj, final_layernorm}``; ``input_proj(cat[hidden, embed])``. SGLang's
  ``MiMoMTP`` (a Qwen2 block) loads it; tests/test_export_native.py runs it on CPU.
- DeepSeek-V3 with a dense block: ``model.layers.{num_hidden_layers}.{enorm, hnorm, eh_proj,
  <block>, shared_head.norm}``; ``eh_proj(cat[embed, hidden])``. No engine class serves it:
  SGLang's ``DeepseekV3ForCausalLMNextN`` always builds MLA attention and an MoE MLP
  (``DeepseekV2DecoderLayer._is_layer_sparse`` is true for ``is_nextn``), and transformers'
  ``DeepseekV3Config`` fills ``kv_lora_rank=512``, ``q_lora_rank=1536``, ``n_routed_experts=256``
  into a config that lacks them. Written for tools that read the naming (``fastmtp convert
  --format deepseek``); a checkpoint whose config declares MLA or MoE is refused.

What is written (docs/scale.md, "Export for native serving"):

- every tensor of the source that is not part of its MTP layer(s), byte for byte: shards without
  MTP tensors are copied as files; a shard that mixed MTP and other tensors is rewritten without
  the old MTP tensors (the same bytes per tensor, the same header metadata);
- the head's tensors under the family's names, in the source's storage dtype (``dtype`` to
  override), moved to the family's concatenation order exactly (``layouts.change_layout``);
- sharded sources (``model.safetensors.index.json``): the same shard files (less any that held
  only the old MTP layer) plus one new shard ``model-mtp.safetensors``, and an updated index;
  one ``model.safetensors``: the same one file with the head's tensors in it;
- ``config.json`` with ``num_nextn_predict_layers: 1`` (SGLang's MiMoMTP maps every
  ``mtp_layers.{i}`` onto its one layer, so older layers must not survive) and a
  ``fastmtp_export`` record; every other file of the source is copied.

The write is atomic (``draft_dir.atomic_dir``): a temporary directory renamed into place, nothing
under OUT on failure.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from fastmtp_sglang.core.checkpoint import INDEX_NAME
from fastmtp_sglang.core.layouts import SHARED_NAMES, change_layout, source_name_map, source_prefix
from fastmtp_sglang.core.draft_dir import CONFIG_NAME, DraftDir, atomic_dir, load_draft_dir, read_json_file
from fastmtp_sglang.core.errors import DraftFormatError, FastMTPError, MismatchError
from fastmtp_sglang.core.head import HeadConfig

MTP_SHARD = "model-mtp.safetensors"
SINGLE_FILE = "model.safetensors"
EXPORT_KEY = "fastmtp_export"  # not "fastmtp": that block marks a draft directory
_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
              "F64": torch.float64}


@dataclass(frozen=True)
class NativeFamily:
    """A target family whose engines load an MTP layer from its own checkpoint."""

    name: str
    layout: str          # convert's naming: "mimo" or "deepseek"
    block: str | None    # the dense block its MTP layer is (None: the head's own block)
    served_by: str       # the engine class that loads it, for messages and docs

    def prefix(self, config: dict[str, Any]) -> str:
        return source_prefix(self.layout, config, 0)

    def is_mtp(self, name: str, config: dict[str, Any]) -> bool:
        """True for a tensor of any of the source's own MTP layers (replaced by the export)."""
        if self.layout == "mimo":
            return name.startswith("model.mtp_layers.")
        m = re.match(r"model\.layers\.(\d+)\.", name)
        return m is not None and int(m.group(1)) >= int(config["num_hidden_layers"])


MIMO = NativeFamily("MiMo", "mimo", "qwen2", "SGLang's MiMoMTP (sglang/srt/models/mimo_mtp.py)")
DEEPSEEK_V3 = NativeFamily(
    "DeepSeek-V3 (dense block)", "deepseek", None,
    "the DeepSeek-V3 NextN naming; SGLang's DeepseekV3ForCausalLMNextN builds MLA + MoE only")
FAMILIES_BY_ARCH = {"MiMoForCausalLM": MIMO, "DeepseekV3ForCausalLM": DEEPSEEK_V3,
                    "DeepseekV32ForCausalLM": DEEPSEEK_V3}
FAMILIES_BY_TYPE = {"mimo": MIMO, "deepseek_v3": DEEPSEEK_V3, "deepseek_v32": DEEPSEEK_V3}


def family_of(config: dict[str, Any], src: Path, head: Path) -> NativeFamily:
    """The target's native MTP family, or a FastMTPError that names the EAGLE-style path."""
    archs = config.get("architectures") or []
    fam = FAMILIES_BY_ARCH.get(archs[0]) if archs else None
    fam = fam or FAMILIES_BY_TYPE.get(str(config.get("model_type")))
    what = archs[0] if archs else f"model_type {config.get('model_type')!r}"
    eagle = f"serve the head EAGLE-style instead: fastmtp serve --target {src} --draft {head}"
    if fam is None:
        raise FastMTPError(f"{src}: {what} has no native MTP layer class in SGLang 0.5.23 "
                           f"(export --native knows MiMo and dense DeepSeek-V3); {eagle}")
    if fam is DEEPSEEK_V3:
        mla_moe = {k: config[k] for k in ("kv_lora_rank", "q_lora_rank", "n_routed_experts")
                   if config.get(k) is not None}
        if mla_moe:
            shown = ", ".join(f"{k}={v}" for k, v in mla_moe.items())
            raise FastMTPError(f"{src}: its NextN layer is an MLA + MoE block ({shown}) that a "
                               f"dense FastMTP head cannot replace; {eagle}")
    return fam


def _rope(cfg: dict[str, Any]) -> tuple[Any, Any]:
    """(theta, scaling without theta) from legacy keys or transformers 5's rope_parameters."""
    rp = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta") or rp.get("rope_theta")
    scaling = cfg.get("rope_scaling") or {k: v for k, v in rp.items() if k != "rope_theta"}
    scaling = {("rope_type" if k == "type" else k): v for k, v in (scaling or {}).items()
               if k != "rope_theta"}
    if scaling.get("rope_type", "default") == "default":
        scaling = None
    return (float(theta) if theta is not None else None), scaling


def check_fits(head: DraftDir, target: dict[str, Any], fam: NativeFamily, src: Path) -> None:
    """The engine builds the MTP layer from the TARGET's config: every number that shapes or
    computes the layer must be the head's, or the exported layer would be read wrongly."""
    hc = head.head_config
    if hc.aux_hidden_states:
        raise FastMTPError(
            f"{head.path} fuses target layers {list(hc.aux_hidden_states)}; a native MTP layer "
            f"reads only the last hidden state: serve this head EAGLE-style (fastmtp serve "
            f"--target {src} --draft {head.path})")
    block = fam.block or hc.block
    if hc.block != block:
        raise MismatchError(f"{head.path} has a {hc.block} block; {fam.name}'s MTP layer is a "
                            f"{block} block: convert a head made for this target")
    try:
        tc = HeadConfig.from_dict({**target, "fastmtp": {"layout": fam.layout, "block": block}})
    except (DraftFormatError, TypeError, ValueError) as exc:
        raise DraftFormatError(f"{src}/config.json does not describe a dense block: {exc}") from None
    if tc.hidden_size != hc.hidden_size:
        raise MismatchError(
            f"{head.path} has hidden_size {hc.hidden_size}, the target {src} has {tc.hidden_size}: "
            "the head was made for another model; export a head trained for this target")
    pairs = {k: (getattr(hc, k), getattr(tc, k)) for k in (
        "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "vocab_size", "qkv_bias", "o_bias", "mlp_bias", "hidden_act", "rms_norm_eps")}
    pairs["rope (theta, scaling)"] = (_rope(hc.hf_config), _rope(target))
    wrong = [f"{k}: head {a!r}, target {b!r}" for k, (a, b) in pairs.items() if a != b]
    if wrong:
        raise MismatchError(f"{head.path} does not fit {src} ({'; '.join(wrong)}): the engine "
                            "builds the MTP layer from the target's config; export a head made "
                            "for this target")


def native_tensors(head: DraftDir, fam: NativeFamily, target: dict[str, Any],
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The head's tensors under the family's checkpoint names, in the family's layout."""
    sd = change_layout(head.state_dict, head.head_config.layout, fam.layout)
    to_native = {ours: theirs for theirs, ours in
                 source_name_map(fam.layout, fam.prefix(target)).items()}
    unknown = sorted(set(sd) - set(to_native))
    if unknown:  # a tensor the family's names cannot carry: never drop one silently
        raise DraftFormatError(f"{head.path}: no {fam.name} name for {', '.join(unknown)}")
    return {to_native[k]: v.detach().to("cpu", dtype).contiguous() for k, v in sd.items()}


# ------------------------------------------------------------------------------------------------
# the source checkpoint's files
# ------------------------------------------------------------------------------------------------

def read_header(path: Path) -> dict[str, Any]:
    """A safetensors file's JSON header: name -> {dtype, shape, data_offsets}, + __metadata__."""
    try:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            return json.loads(f.read(n))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DraftFormatError(f"{path} is not a readable safetensors file: {exc}") from None


@dataclass
class SourceCheckpoint:
    dir: Path
    config: dict[str, Any]
    shards: dict[str, list[str]]       # file name -> tensor names, in the source's order
    index: dict[str, Any] | None       # the parsed index, None without one

    @classmethod
    def open(cls, src: Path) -> "SourceCheckpoint":
        if not src.is_dir():
            raise FastMTPError(f"{src} is not a directory: pass the target's checkpoint directory "
                               "(config.json and its safetensors files)")
        config = read_json_file(src / CONFIG_NAME, f"{src} has no {CONFIG_NAME}")
        index = None
        if (src / INDEX_NAME).is_file():
            try:
                index = json.loads((src / INDEX_NAME).read_text())
                weight_map: dict[str, str] = index["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise DraftFormatError(f"{src / INDEX_NAME} is not a valid index: {exc}") from None
            names = sorted(set(weight_map.values()))
        else:
            names = sorted(p.name for p in src.glob("*.safetensors"))
            if not names:
                raise DraftFormatError(f"{src} holds no .safetensors file")
        shards = {}
        for name in names:
            if not (src / name).is_file():
                raise DraftFormatError(f"{src}: shard {name} listed in the index is missing")
            shards[name] = [k for k in read_header(src / name) if k != "__metadata__"]
        if index is not None:
            listed = {k for k, f in index["weight_map"].items()}
            found = {k for ks in shards.values() for k in ks}
            if listed != found:
                raise DraftFormatError(f"{src / INDEX_NAME} does not list the tensors its shards "
                                       f"hold: {sorted(listed ^ found)[:8]}")
        return cls(src, config, shards, index)

    def storage_dtype(self, fam: NativeFamily) -> torch.dtype:
        """The dtype the source stores its floating-point weights in (its first such tensor)."""
        for f, names in self.shards.items():
            header = read_header(self.dir / f)
            for k in names:
                dt = _ST_DTYPES.get(header[k]["dtype"])
                if dt is not None and not fam.is_mtp(k, self.config):
                    return dt
        return torch.bfloat16


# ------------------------------------------------------------------------------------------------
# export
# ------------------------------------------------------------------------------------------------

def _copy_tree_except(src: Path, dst: Path, skip: set[str]) -> None:
    """Every file and folder of the source checkpoint but the weights we write (and dot-entries)."""
    for p in src.iterdir():
        if p.name in skip or p.name.startswith("."):
            continue
        if p.is_dir():
            shutil.copytree(p, dst / p.name, symlinks=False)
        else:
            shutil.copyfile(p, dst / p.name)


def _rewrite_without(path: Path, drop: set[str], out: Path,
                     extra: dict[str, torch.Tensor] | None = None) -> None:
    """``path``'s tensors less ``drop`` (plus ``extra``) into ``out``, with its header metadata."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        kept = {k: f.get_tensor(k) for k in f.keys() if k not in drop}
    kept.update(extra or {})
    save_file(kept, str(out), metadata=meta)


def _tensor_bytes(path: Path) -> int:
    header = read_header(path)
    return sum(v["data_offsets"][1] - v["data_offsets"][0]
               for k, v in header.items() if k != "__metadata__")


def export_native(src: str | Path, head: str | Path, out: str | Path,
                  dtype: str | None = None) -> Path:
    """Write SRC's checkpoint to OUT with HEAD as its native MTP layer; returns OUT."""
    src, head, out = Path(src), Path(head), Path(out)
    if out.exists():
        raise FastMTPError(f"{out} already exists; export writes a new directory: choose another "
                           "output path")
    source = SourceCheckpoint.open(src)
    draft = load_draft_dir(head)
    fam = family_of(source.config, src, head)
    check_fits(draft, source.config, fam, src)
    store = getattr(torch, dtype) if dtype else source.storage_dtype(fam)
    new = native_tensors(draft, fam, source.config, store)

    prefix = fam.prefix(source.config)
    keep_shared = {prefix + s for s in SHARED_NAMES}  # the target's own tensors repeated at the prefix
    old_mtp = {k for ks in source.shards.values() for k in ks
               if fam.is_mtp(k, source.config) and k not in keep_shared}
    clash = sorted(set(new) & ({k for ks in source.shards.values() for k in ks} - old_mtp))
    if clash:  # cannot happen with the families above; a guard, not a user error
        raise AssertionError(f"export would overwrite target tensors {clash}")

    config = dict(source.config)
    config["num_nextn_predict_layers"] = 1
    meta = draft.meta
    config[EXPORT_KEY] = {
        "head": str(head.resolve()), "family": fam.name, "layout": fam.layout,
        "mtp_prefix": prefix, "head_layout": draft.head_config.layout,
        "trained_steps": meta.get("trained_steps"), "step_weights": meta.get("step_weights"),
        "base_model": meta.get("base_model"), "dtype": str(store).replace("torch.", ""),
    }
    single = source.index is None and len(source.shards) == 1
    if not single and MTP_SHARD in source.shards:
        raise FastMTPError(f"{src} already has a shard named {MTP_SHARD}; rename it first")
    try:
        with atomic_dir(out) as tmp:
            _copy_tree_except(src, tmp, {CONFIG_NAME, INDEX_NAME, *source.shards})
            weight_map: dict[str, str] = {}
            for name, keys in source.shards.items():
                drop = old_mtp.intersection(keys)
                if single:
                    _rewrite_without(src / name, drop, tmp / name, extra=new)
                    continue
                if not drop:
                    shutil.copyfile(src / name, tmp / name)
                elif len(drop) < len(keys):
                    _rewrite_without(src / name, drop, tmp / name)
                else:
                    continue  # held only the old MTP layer: nothing of it survives
                weight_map.update({k: name for k in keys if k not in drop})
            if not single:
                save_file(new, str(tmp / MTP_SHARD), metadata={"format": "pt"})
                weight_map.update({k: MTP_SHARD for k in new})
                if source.index is not None:
                    index = dict(source.index)
                    files = sorted(set(weight_map.values()))
                    index["metadata"] = {**(source.index.get("metadata") or {}),
                                         "total_size": sum(_tensor_bytes(tmp / f) for f in files)}
                    index["weight_map"] = dict(sorted(weight_map.items()))
                    (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
            (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    except (OSError, SafetensorError) as exc:  # disk full, ...: atomic_dir removed its temp dir
        why = getattr(exc, "strerror", None) or exc
        raise FastMTPError(f"cannot write {out}: {why}; nothing was written") from None
    return out


def serve_hint(out: Path, steps: int | None) -> str:
    """The SGLang command that serves an export natively (the checkpoint is its own draft)."""
    k = steps or 3
    return (f"python -m sglang.launch_server --model-path {out} --speculative-algorithm EAGLE "
            f"--speculative-draft-model-path {out} --speculative-num-steps {k} "
            f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}")
