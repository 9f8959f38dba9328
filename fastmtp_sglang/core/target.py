"""Loading a target model (a transformers causal LM of the Llama / Qwen2 families) on CPU or GPU."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fastmtp_sglang.core.errors import FastMTPError, MismatchError
from fastmtp_sglang.core.hardware import auto_dtype_name
from fastmtp_sglang.core.identity import config_hash, tokenizer_hash

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str | torch.dtype, device: str = "cpu") -> torch.dtype:
    """A dtype name (or ``auto``: bf16 on CUDA and on CPUs with bf16 units, fp32 elsewhere; see
    fastmtp_sglang.core.hardware) -> the torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        name = auto_dtype_name(device)
    try:
        return DTYPES[name]
    except KeyError:
        raise FastMTPError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}, auto") from None


@dataclass
class Target:
    model: Any  # transformers PreTrainedModel (LlamaForCausalLM, Qwen2ForCausalLM, ...)
    tokenizer: Any | None
    config: dict[str, Any]
    name: str

    @property
    def embed(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()

    @property
    def eos_ids(self) -> list[int]:
        ids = self.config.get("eos_token_id")
        gen = getattr(self.model, "generation_config", None)
        if gen is not None and gen.eos_token_id is not None:
            ids = gen.eos_token_id
        if ids is None and self.tokenizer is not None:
            ids = self.tokenizer.eos_token_id
        return sorted({ids} if isinstance(ids, int) else set(ids or []))


def read_target_config(path: str | Path) -> dict[str, Any]:
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        raise FastMTPError(f"target {path} has no config.json: pass a Hugging Face model directory")
    return json.loads(cfg.read_text())


def load_target(path: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu",
                tokenizer: bool = True) -> Target:
    """Load a transformers causal LM and its tokenizer from a local directory (no downloads)."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not path.is_dir():
        raise FastMTPError(f"target {path} is not a directory; pass a local Hugging Face model "
                           "directory (this tool never downloads)")
    cfg = read_target_config(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=parse_dtype(dtype, device),
                                                     local_files_only=True)
    except (OSError, ValueError) as exc:
        raise FastMTPError(f"cannot load target {path}: {exc}") from None
    model.to(device).eval()
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "norm"):
        raise FastMTPError(f"target {path} ({type(model).__name__}) is not a Llama/Qwen2-family "
                           "decoder (needs model.layers and model.norm)")
    tok = _tokenizer(path) if tokenizer else None
    return Target(model, tok, cfg, cfg.get("_name_or_path") or path.name)


def _tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise FastMTPError(f"cannot load the tokenizer of {path}: {exc}") from None


class _EmbedAndHead(torch.nn.Module):
    """A target reduced to what training from a feature cache reads: the token embedding and the
    output projection (tied when the checkpoint ties them), with the model's accessors."""

    def __init__(self, embed: torch.nn.Embedding, lm_head: torch.nn.Linear):
        super().__init__()
        self.embed_tokens, self.lm_head = embed, lm_head

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed_tokens

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head


EMBED_NAMES = ("model.embed_tokens.weight",)
HEAD_NAMES = ("lm_head.weight",)


def load_embed_and_head(path: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu",
                        tokenizer: bool = True) -> Target | None:
    """The target's embedding and lm_head read straight from its safetensors files (the other
    layers are never read), for training from a complete feature cache: a 70B target's two
    vocabulary matrices instead of the whole model. None where the checkpoint is not in
    safetensors or names them otherwise (then load the whole model with :func:`load_target`)."""
    from safetensors import safe_open

    path = Path(path)
    cfg = read_target_config(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        where = json.loads(index.read_text()).get("weight_map", {})
    else:
        where = {}
        for f in sorted(path.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as fh:
                where.update({k: f.name for k in fh.keys()})
    embed_name = next((n for n in EMBED_NAMES if n in where), None)
    head_name = next((n for n in HEAD_NAMES if n in where), None)
    if embed_name is None or (head_name is None and not cfg.get("tie_word_embeddings", False)):
        return None
    dt = parse_dtype(dtype, device)

    def read(name: str) -> torch.Tensor:
        with safe_open(str(path / where[name]), framework="pt") as fh:
            return fh.get_tensor(name).to(device=device, dtype=dt)

    w_embed = read(embed_name)
    embed = torch.nn.Embedding(w_embed.shape[0], w_embed.shape[1], device="meta")
    embed.weight = torch.nn.Parameter(w_embed, requires_grad=False)
    head = torch.nn.Linear(w_embed.shape[1], w_embed.shape[0], bias=False, device="meta")
    tied = head_name is None or cfg.get("tie_word_embeddings", False)
    head.weight = embed.weight if tied else torch.nn.Parameter(read(head_name), requires_grad=False)
    tok = _tokenizer(path) if tokenizer else None
    return Target(_EmbedAndHead(embed, head).eval(), tok, cfg, cfg.get("_name_or_path") or path.name)


BASE_CHECKS = ("base config hash", "tokenizer hash")


def check_fits(draft_config: dict[str, Any], target_config: dict[str, Any],
               tokenizer: Any | None = None) -> list[tuple[str, bool, str]]:
    """Compare a draft's config with a target's: a list of (check, ok, detail)."""
    if not isinstance(draft_config, dict):
        raise MismatchError(f"a draft's config.json must hold a JSON object, got "
                            f"{type(draft_config).__name__}")
    rows = []
    for key in ("hidden_size", "vocab_size"):
        d, t = draft_config.get(key), target_config.get(key)
        rows.append((key, d == t, f"draft {d}, target {t}"))
    for key in ("num_attention_heads", "num_key_value_heads", "head_dim"):
        d, t = draft_config.get(key), target_config.get(key)
        if t is None:
            continue
        # heads may differ by design (the head's own block), but a change is worth showing
        rows.append((key, True, f"draft {d}, target {t}" + ("" if d == t else " (differs)")))
    meta = draft_config.get("fastmtp")
    base = meta.get("base_model") if isinstance(meta, dict) else None
    base = base if isinstance(base, dict) else {}
    if base.get("config_sha256"):
        mine = config_hash(target_config)
        same = base["config_sha256"] == mine
        rows.append(("base config hash", same, f"draft made for {base.get('name')!r}" + (
            "" if same else f" (config hash {base['config_sha256']}; this target's is {mine}: "
                            "another architecture or size)")))
    if tokenizer is not None and base.get("tokenizer_sha256"):
        mine = tokenizer_hash(tokenizer)
        same = base["tokenizer_sha256"] == mine
        rows.append(("tokenizer hash", same, "same tokenizer" if same else
                     f"the draft was made with another tokenizer (hash {base['tokenizer_sha256']}; "
                     f"this target's is {mine})"))
    return rows


def require_fits(draft_config: dict[str, Any], target_config: dict[str, Any],
                 tokenizer: Any | None = None, where: str = "draft",
                 allow_base_mismatch: bool = False) -> list[str]:
    """Raise MismatchError when the draft cannot run on the target (hidden size or vocabulary
    differ) or was made for another one (its recorded base-model config or tokenizer hash is not
    this target's), unless ``allow_base_mismatch``. Returns the base-model mismatches allowed
    that way (empty when the draft is the target's own), for the caller to warn about."""
    rows = check_fits(draft_config, target_config, tokenizer)
    bad = [f"{name}: {detail}" for name, ok, detail in rows
           if not ok and name in ("hidden_size", "vocab_size")]
    aux = (draft_config.get("fastmtp") or {}).get("aux_hidden_states") or []
    layers = int(target_config.get("num_hidden_layers") or 0)
    if aux and layers and not all(1 <= int(i) < layers for i in aux):
        bad.append(f"aux_hidden_states {list(aux)}: the target has {layers} decoder layers "
                   f"(the draft reads the streams leaving layers 1..{layers - 1})")
    if bad:
        raise MismatchError(f"{where} does not fit the target: " + "; ".join(bad))
    foreign = [f"{name}: {detail}" for name, ok, detail in rows if not ok and name in BASE_CHECKS]
    if foreign and not allow_base_mismatch:
        raise MismatchError(f"{where} was made for another target: " + "; ".join(foreign)
                            + ". Pass --allow-base-mismatch to use it anyway (its drafts will "
                            "be accepted less often, or not at all)")
    return foreign
