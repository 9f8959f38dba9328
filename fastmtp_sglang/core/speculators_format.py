"""The speculators format (vLLM's `speculators` library, 0.9.0) <-> draft directories.

`speculators` 0.9.0 has one multi-token-prediction algorithm, ``mtp``: its ``MTPDraftModel``
trains one MTP layer recursively with FastMTP's step weights (arXiv 2509.18362, Eq. 2), and vLLM
detects a directory whose ``config.json`` says ``"speculators_model_type": "mtp"``. What it reads
(``speculators/models/mtp/{config,core,model_definitions}.py`` and ``MTPDraftModel.save_pretrained``
in 0.9.0):

- ``config.json``: ``architectures: ["MTPDraftModel"]``, ``speculators_model_type: "mtp"``,
  ``speculators_version``, ``num_nextn_predict_layers: 1`` (the only value it accepts),
  ``transformer_layer_config`` (the block's HF config, rebuilt with ``AutoConfig.for_model`` of its
  ``model_type``), ``speculators_config`` = {``algorithm: "mtp"``, ``proposal_methods``: one
  ``greedy`` proposal with ``speculative_tokens`` = K, ``default_proposal_method: "greedy"``,
  ``verifier``: {``name_or_path``, ``architectures``}};
- ``model.safetensors``: ``mtp_layers.0.{token_layernorm, hidden_layernorm, input_proj,
  input_layernorm, self_attn.*, post_attention_layernorm, mlp.*, final_layernorm}``. MiMo's names,
  but **not MiMo's order**: ``MTPLayerMixin.forward`` projects ``cat[token_layernorm(e),
  hidden_layernorm(h)]``, embedding first, as our ``deepseek`` layout. The embedding and lm_head
  are the verifier's (``_keys_to_ignore_on_save``), never stored;
- vocabulary maps: ``t2d`` [V] bool and ``d2t`` [V'] offsets exist as buffers (``DraftVocabMixin``),
  but ``MTPDraftModel`` raises ``NotImplementedError`` when the draft vocabulary is smaller than
  the verifier's, so an ``mtp`` directory holds neither; we write neither and refuse a reducing
  pair on import. Our per-language tables (``fastmtp.vocab_tables``) travel as files beside the
  weights, listed under ``fastmtp_head`` in config.json (speculators reads neither), and come back
  on import.

Limits of 0.9.0 that matter here: ``MTPDraftModel`` builds only ``qwen3`` / ``qwen3_next`` /
``qwen3_5*`` blocks; the config classes accept our ``llama`` / ``qwen2`` blocks (vLLM reads the
config), the package's model class does not. A qwen3 block (q/k RMSNorm) is not one FastMTPHead
has, so importing one is refused.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from fastmtp_sglang.core.layouts import BLOCK_NAMES, change_layout
from fastmtp_sglang.core.draft_dir import (
    ARCH_KEYS, CONFIG_NAME, WEIGHTS_NAME, atomic_dir, check_output, check_tensors, copy_tables,
    expected_shapes, load_draft_dir, make_draft_config, save_draft_dir,
)
from fastmtp_sglang.core.errors import DraftFormatError, FastMTPError, MismatchError
from fastmtp_sglang.core.head import LAYOUTS, HeadConfig

SPECULATORS_VERSION = "0.9.0"
ALGORITHM = "mtp"
ARCHITECTURE = "MTPDraftModel"
PREFIX = "mtp_layers.0."
PROVENANCE_KEY = "fastmtp_head"  # extra keys survive speculators' config (extra="allow")
# speculators' name (under PREFIX) -> ours; input_proj sees cat[embed, hidden] = our eh_proj
_OWN = {"token_layernorm.weight": "enorm.weight", "hidden_layernorm.weight": "hnorm.weight",
        "input_proj.weight": "eh_proj.weight", "final_layernorm.weight": "final_norm.weight"}
_NAMES = {PREFIX + k: v for k, v in _OWN.items()} | {PREFIX + k: "layer." + k for k in BLOCK_NAMES}
_TO_SPEC = {v: k for k, v in _NAMES.items()}
# the verifier's tensors, which a saved MTPDraftModel may carry: not part of the head
_VERIFIER = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight")
_BLOCK_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}


def _verifier(head_cfg: dict[str, Any], verifier: str | None
              ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(speculators' VerifierConfig fields, the target's config when it is a local directory).
    A local target must fit the head: speculators checks the hidden size only at load.

    ``name_or_path`` is what vLLM loads the verifier from, so it must resolve: a local model
    directory (written as an absolute path) or a hub id (``org/name``). Without ``verifier`` it
    comes from the head's record (its base model's name, or the verifier of the speculators
    directory it was converted from); a bare name that is neither is refused."""
    meta = head_cfg.get("fastmtp", {})
    base = meta.get("base_model") or {}
    if verifier is not None:
        name = _resolvable(verifier)
        if name is None:
            raise FastMTPError(f"--verifier {verifier}: no model directory (with {CONFIG_NAME}) "
                               "there, and not a hub id (org/name): give the target's checkpoint "
                               "directory or its hub id")
    else:
        recorded = [base.get("name"), ((meta.get("converted_from") or {}).get("verifier")
                                       or {}).get("name_or_path")]
        name = next((r for r in map(_resolvable, filter(None, recorded)) if r), None)
        if name is None:
            raise FastMTPError(
                f"the head records its base model only as {base.get('name')!r}, which is neither "
                "a model directory here nor a hub id (org/name), so vLLM could not load the "
                "verifier from it: pass --verifier with the target's checkpoint directory or "
                "hub id")
    target = None
    if (Path(name) / CONFIG_NAME).is_file():
        target = json.loads((Path(name) / CONFIG_NAME).read_text())
        text = target.get("text_config") or target
        for key in ("hidden_size", "vocab_size"):
            if text.get(key) is not None and text[key] != head_cfg.get(key):
                raise MismatchError(
                    f"the head has {key} {head_cfg.get(key)}, the verifier {name} has "
                    f"{text[key]}: pass --verifier the target this head was made for")
    archs = list((target or {}).get("architectures") or [])
    if not archs:  # the family's causal LM, as transformers names it
        archs = ["Qwen2ForCausalLM" if head_cfg.get("model_type") == "qwen2" else "LlamaForCausalLM"]
    return {"name_or_path": name, "architectures": archs}, target


def _resolvable(name: str) -> str | None:
    """``name`` as vLLM can load it: a local model directory's absolute path, or a hub id
    (``org/name``, when no such path exists here); None for anything else (a bare name)."""
    path = Path(name).expanduser()
    if (path / CONFIG_NAME).is_file():
        return str(path.absolute())
    if not path.exists() and re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", str(name)):
        return str(name)
    return None


def speculators_config(head_cfg: dict[str, Any], steps: int, verifier: dict[str, Any],
                       dtype: str, target: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json of an ``mtp`` speculators directory for a draft directory's config."""
    meta = head_cfg.get("fastmtp", {})
    layer = {k: head_cfg[k] for k in ARCH_KEYS if head_cfg.get(k) is not None}
    # the target's depth (MTPDraftModel reads the last layer's index), where known
    depth = (target or {}).get("num_hidden_layers") or (
        meta.get("converted_from") or {}).get("verifier_num_hidden_layers")
    if depth:
        layer["num_hidden_layers"] = depth
    return {
        "architectures": [ARCHITECTURE],
        "speculators_model_type": ALGORITHM,
        "speculators_version": SPECULATORS_VERSION,
        "num_nextn_predict_layers": 1,
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": ALGORITHM,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": steps,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": verifier,
        },
        "dtype": dtype,
        "tie_word_embeddings": bool(head_cfg.get("tie_word_embeddings", False)),
        PROVENANCE_KEY: {k: meta[k] for k in ("layout", "trained_steps", "step_weights",
                                              "base_model", "vocab_tables", "script_classes")
                         if k in meta},
    }


def export_speculators(head: str | Path, out: str | Path, algorithm: str = ALGORITHM,
                       verifier: str | None = None, steps: int | None = None,
                       dtype: str | None = None) -> Path:
    """Write draft directory HEAD as an ``mtp`` speculators directory OUT."""
    head, out = Path(head), Path(out)
    if algorithm != ALGORITHM:
        raise FastMTPError(f"speculators {SPECULATORS_VERSION} has one MTP algorithm, "
                           f"{ALGORITHM!r}; got {algorithm!r}")
    if out.exists():
        raise FastMTPError(f"{out} already exists; export writes a new directory: choose another "
                           "output path")
    d = load_draft_dir(head)
    if d.head_config.aux_hidden_states:
        raise FastMTPError(f"{head} fuses target layers {list(d.head_config.aux_hidden_states)}; "
                           "speculators' mtp layer reads only the last hidden state")
    k = steps or int(d.meta.get("trained_steps") or 0) or 3
    store = dtype or str(d.config.get("torch_dtype") or "bfloat16")
    sd = change_layout(d.state_dict, d.head_config.layout, "deepseek")  # embed columns first
    tensors = {_TO_SPEC[n]: t.detach().to("cpu", getattr(torch, store)).contiguous()
               for n, t in sd.items()}
    fields, target = _verifier(d.config, verifier)
    cfg = speculators_config(d.config, k, fields, store, target)
    try:
        with atomic_dir(out) as tmp:
            (tmp / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n")
            save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
            copy_tables(d.meta.get("vocab_tables"), head, tmp)
    except (OSError, SafetensorError) as exc:
        why = getattr(exc, "strerror", None) or exc
        raise FastMTPError(f"cannot write {out}: {why}; nothing was written") from None
    return out


def is_speculators_dir(path: Path) -> bool:
    try:
        return "speculators_model_type" in json.loads((Path(path) / CONFIG_NAME).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return False


def import_speculators(src: str | Path, out: str | Path, layout: str | None = None,
                       dtype: str | None = None, overwrite: bool = False) -> Path:
    """Read an ``mtp`` speculators directory SRC into draft directory OUT (exact tensors)."""
    src, out = Path(src), Path(out)
    check_output(out, overwrite)
    try:
        cfg = json.loads((src / CONFIG_NAME).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DraftFormatError(f"{src}/{CONFIG_NAME} is not readable JSON: {exc}") from None
    kind = cfg.get("speculators_model_type")
    if kind != ALGORITHM:
        raise DraftFormatError(f"{src} is a speculators {kind!r} directory; fastmtp reads the "
                               f"{ALGORITHM!r} algorithm (one MTP layer)")
    if cfg.get("num_nextn_predict_layers", 1) != 1:
        raise DraftFormatError(f"{src} has {cfg['num_nextn_predict_layers']} MTP layers; "
                               "speculators' mtp (and fastmtp) use one")
    layer = dict(cfg.get("transformer_layer_config") or {})
    block = _BLOCK_TYPES.get(str(layer.get("model_type")))
    if block is None:
        raise DraftFormatError(
            f"{src}: its MTP block is model_type {layer.get('model_type')!r}; FastMTPHead has "
            "llama and qwen2 blocks (a qwen3 block's q/k norms are not one of them)")
    prov = cfg.get(PROVENANCE_KEY) or {}
    spec = cfg.get("speculators_config") or {}
    proposals = spec.get("proposal_methods") or [{}]
    steps = int(prov.get("trained_steps") or proposals[0].get("speculative_tokens") or 0)
    try:
        with safe_open(str(src / WEIGHTS_NAME), framework="pt") as f:
            raw = {k: f.get_tensor(k) for k in f.keys()}
    except (OSError, SafetensorError) as exc:
        raise DraftFormatError(f"{src / WEIGHTS_NAME} is not a readable safetensors file: "
                               f"{exc}") from None
    vocab_maps = [k for k in ("t2d", "d2t") if k in raw]
    if vocab_maps and int(raw.get("t2d", torch.ones(1)).sum()) != int(layer.get("vocab_size", -1)):
        raise DraftFormatError(f"{src} reduces the draft vocabulary ({', '.join(vocab_maps)}); "
                               "speculators' mtp does not, and fastmtp keeps its vocabulary "
                               "tables in the draft directory: drop the maps")
    raw = {k: v for k, v in raw.items() if k not in _VERIFIER and k not in ("t2d", "d2t")}
    target = {**layer, "torch_dtype": cfg.get("dtype") or cfg.get("torch_dtype")}
    src_layout_cfg = make_draft_config(target, "deepseek", block=block)
    check_tensors({_TO_SPEC.get(k, k): s for k, s in
                   expected_shapes(HeadConfig.from_dict(src_layout_cfg)).items()},
                  {k: tuple(v.shape) for k, v in raw.items()}, f"{src} (speculators mtp layer)")
    dst = layout or prov.get("layout") or "deepseek"  # the head's own, when we wrote SRC
    if dst not in LAYOUTS:
        raise FastMTPError(f"unknown --layout {dst!r}; choose one of {', '.join(LAYOUTS)}")
    sd = change_layout({_NAMES[k]: v for k, v in raw.items()}, "deepseek", dst)
    src_dtype = str(next(iter(sd.values())).dtype).replace("torch.", "")
    verifier = spec.get("verifier") or {}
    base = prov.get("base_model") or {"name": verifier.get("name_or_path")}
    draft_cfg = make_draft_config(
        target, dst, block=block, base_model=base, trained_steps=steps,
        step_weights=prov.get("step_weights"), vocab_tables=prov.get("vocab_tables"),
        dtype=dtype or src_dtype,
        extra={"converted_from": {"path": str(src), "format": "speculators",
                                  "algorithm": ALGORITHM, "verifier": verifier,
                                  "verifier_num_hidden_layers": layer.get("num_hidden_layers")}})
    if "script_classes" in prov:
        draft_cfg["fastmtp"]["script_classes"] = prov["script_classes"]
    return save_draft_dir(out, draft_cfg, sd, overwrite=overwrite,
                          write_extra=lambda tmp: copy_tables(prov.get("vocab_tables"), src, tmp))
