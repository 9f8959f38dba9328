"""Shared fixtures: tiny random checkpoints and targets built on the spot (no downloads), and an
independent, hand-written forward of the MTP maths that the tests compare FastMTPHead against.

Dimensions are deliberately awkward: GQA (4 query heads, 2 KV heads), head_dim 24 with hidden 64
(so heads * head_dim != hidden), non-default rope scaling, random norm weights and biases.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import save_file

VOCAB = 320  # the tokenizer has 300 entries; the models' embedding rows are padded to 320
H, I, NH, NKV, HD = 64, 96, 4, 2, 24


# --------------------------------------------------------------------------------------------
# the independent reference forward
# --------------------------------------------------------------------------------------------

def ref_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32, cast back, then scaled (Llama / Qwen2 order)."""
    xf = x.float()
    y = xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + eps)
    return w * y.to(x.dtype)


def rope_by_hand(positions: torch.Tensor, head_dim: int, theta: float,
                 linear_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, S, D] of the default / linear-scaled rotary embedding, written out."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = (positions.double() / linear_factor)[..., None] * inv  # [B, S, D/2]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().float(), ang.sin().float()


def rope_from_hf(rope_parameters: dict[str, Any], max_pos: int = 512) -> Callable:
    """cos/sin from transformers' own LlamaRotaryEmbedding (for llama3 scaling)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rot = LlamaRotaryEmbedding(LlamaConfig(hidden_size=H, num_attention_heads=NH, head_dim=HD,
                                           max_position_embeddings=max_pos,
                                           rope_parameters=dict(rope_parameters)))

    def fn(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rot(torch.zeros(1, dtype=torch.float32), positions)

    return fn


def rope_for_config(cfg: dict[str, Any]) -> Callable:
    """The rotary a checkpoint's config.json asks for (default, linear or llama3)."""
    rp = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {k: v for k, v in rp.items() if k != "rope_theta"}
    theta = float(cfg.get("rope_theta") or rp.get("rope_theta") or 10000.0)
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return lambda p: rope_by_hand(p, hd, theta)
    if kind == "linear":
        return lambda p: rope_by_hand(p, hd, theta, float(scaling["factor"]))
    if kind == "llama3":
        return rope_from_hf({"rope_theta": theta, **scaling}, cfg.get("max_position_embeddings", 512))
    raise NotImplementedError(kind)


def _rot_half(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return torch.cat([-x[..., d:], x[..., :d]], dim=-1)


def _lin(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    y = x @ w.T
    return y if b is None else y + b


def ref_attention(w: dict, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  positions: torch.Tensor, n_heads: int, n_kv: int, head_dim: int) -> torch.Tensor:
    """GQA attention with an explicit softmax, causal over positions. x [B, S, H]."""
    b, s, _ = x.shape
    q = _lin(x, w["q"], w.get("qb")).view(b, s, n_heads, head_dim)
    k = _lin(x, w["k"], w.get("kb")).view(b, s, n_kv, head_dim)
    v = _lin(x, w["v"], w.get("vb")).view(b, s, n_kv, head_dim)
    c, sn = cos[:, :, None, :].to(x.dtype), sin[:, :, None, :].to(x.dtype)
    q = q * c + _rot_half(q) * sn
    k = k * c + _rot_half(k) * sn
    outs = []
    group = n_heads // n_kv
    causal = positions[:, None, :] <= positions[:, :, None]  # [B, S(query), S(key)]
    for hh in range(n_heads):
        qh, kh, vh = q[:, :, hh], k[:, :, hh // group], v[:, :, hh // group]  # query head -> kv head
        scores = (qh.float() @ kh.float().transpose(1, 2)) / math.sqrt(head_dim)
        scores = scores.masked_fill(~causal, float("-inf"))
        p = torch.exp(scores - scores.amax(-1, keepdim=True))
        p = p / p.sum(-1, keepdim=True)
        outs.append((p @ vh.float()).to(x.dtype))
    return _lin(torch.cat(outs, dim=-1), w["o"], w.get("ob"))


def ref_block(w: dict, x: torch.Tensor, cos, sin, positions, dims: dict, eps: float) -> torch.Tensor:
    """One dense Llama / Qwen2 decoder layer with SiLU MLP."""
    a = ref_attention(w, ref_rms(x, w["ln1"], eps), cos, sin, positions,
                      dims["n_heads"], dims["n_kv"], dims["head_dim"])
    x = x + a
    y = ref_rms(x, w["ln2"], eps)
    g = _lin(y, w["gate"], w.get("gate_b"))
    m = _lin(torch.nn.functional.silu(g) * _lin(y, w["up"], w.get("up_b")), w["down"], w.get("down_b"))
    return x + m


def ref_mtp(w: dict, hidden: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
            embed_w: torch.Tensor, lm_w: torch.Tensor, rope: Callable, dims: dict, eps: float,
            order: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP step written out. ``w["layout"]`` picks the input projection:
    mimo: W [H, 2H] @ cat[hnorm(h), enorm(e)]; deepseek: W @ cat[enorm(e), hnorm(h)];
    split: We @ enorm(e) + Wh @ hnorm(h). ``order`` overrides the concatenation order
    ("hidden_first" / "embed_first") to show a swapped order gives different numbers."""
    e = embed_w[ids].to(hidden.dtype)
    hn, en = ref_rms(hidden, w["hnorm"], eps), ref_rms(e, w["enorm"], eps)
    layout = w["layout"]
    if layout == "split":
        x = _lin(en, w["e_proj"]) + _lin(hn, w["h_proj"])
    else:
        first = order or ("hidden_first" if layout == "mimo" else "embed_first")
        cat = torch.cat([hn, en] if first == "hidden_first" else [en, hn], dim=-1)
        x = _lin(cat, w["proj"])
    cos, sin = rope(positions)
    x = ref_block(w, x, cos, sin, positions, dims, eps)
    out = ref_rms(x, w["fnorm"], eps)
    return out, _lin(out, lm_w.to(out.dtype))


_BLOCK_NAMES = {
    "ln1": "input_layernorm.weight", "ln2": "post_attention_layernorm.weight",
    "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight", "qb": "self_attn.q_proj.bias", "kb": "self_attn.k_proj.bias",
    "vb": "self_attn.v_proj.bias", "ob": "self_attn.o_proj.bias",
    "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight",
    "gate_b": "mlp.gate_proj.bias", "up_b": "mlp.up_proj.bias", "down_b": "mlp.down_proj.bias",
}


def _block_weights(t: dict[str, torch.Tensor], prefix: str) -> dict:
    return {k: t[prefix + n] for k, n in _BLOCK_NAMES.items() if prefix + n in t}


def ref_weights_mimo(t: dict[str, torch.Tensor], prefix: str = "model.mtp_layers.0.") -> dict:
    """Reference weights straight from a MiMo checkpoint's own tensor names."""
    w = _block_weights(t, prefix)
    w.update(layout="mimo", enorm=t[prefix + "token_layernorm.weight"],
             hnorm=t[prefix + "hidden_layernorm.weight"], proj=t[prefix + "input_proj.weight"],
             fnorm=t[prefix + "final_layernorm.weight"])
    return w


def ref_weights_deepseek(t: dict[str, torch.Tensor], prefix: str) -> dict:
    w = _block_weights(t, prefix)
    w.update(enorm=t[prefix + "enorm.weight"], hnorm=t[prefix + "hnorm.weight"],
             fnorm=t[prefix + "shared_head.norm.weight"])
    if prefix + "eh_proj.weight" in t:
        w.update(layout="deepseek", proj=t[prefix + "eh_proj.weight"])
    else:
        w.update(layout="split", e_proj=t[prefix + "e_proj.weight"], h_proj=t[prefix + "h_proj.weight"])
    return w


def ref_weights_head(sd: dict[str, torch.Tensor], layout: str) -> dict:
    """Reference weights from a FastMTPHead state dict / draft directory's tensor names."""
    w = _block_weights(sd, "layer.")
    w.update(layout=layout, enorm=sd["enorm.weight"], hnorm=sd["hnorm.weight"],
             fnorm=sd["final_norm.weight"])
    if layout == "mimo":
        w["proj"] = sd["input_proj.weight"]
    elif layout == "deepseek":
        w["proj"] = sd["eh_proj.weight"]
    else:
        w.update(e_proj=sd["e_proj.weight"], h_proj=sd["h_proj.weight"])
    return w


@pytest.fixture(scope="session")
def ref():
    """The reference maths, as a namespace (conftest helpers are not importable as a module)."""
    return SimpleNamespace(
        rms=ref_rms, mtp=ref_mtp, rope_by_hand=rope_by_hand, rope_from_hf=rope_from_hf,
        rope_for_config=rope_for_config, weights_mimo=ref_weights_mimo,
        weights_deepseek=ref_weights_deepseek, weights_head=ref_weights_head,
    )


_VECTOR_BUILD: dict = {}


@pytest.fixture(params=["default", "vector"])
def amx_build(request, monkeypatch):
    """Run a kernel test under each build of cpu_kernels/amx.c this CPU loads: its default
    (AMX tiles where it has them) and, on an AMX CPU, the AVX-512 vector build too (what a CPU
    with avx512_bf16 but no AMX runs; FASTMTP_VECTOR). Skipped where the default already is
    the vector build (the "default" run tests it) or no build loads."""
    if request.param == "vector":
        from fastmtp_sglang.cpu_kernels import amx

        if not amx.available() or not amx.tiles():
            pytest.skip("no AMX build here: the default run is the only build")
        if "lib" not in _VECTOR_BUILD:
            _VECTOR_BUILD["lib"], _VECTOR_BUILD["why"] = amx._load("vector")
        if _VECTOR_BUILD["lib"] is None:
            pytest.skip(f"the vector build: {_VECTOR_BUILD['why']}")
        monkeypatch.setitem(amx._state, "lib", _VECTOR_BUILD["lib"])
    return request.param


# --------------------------------------------------------------------------------------------
# tiny checkpoints
# --------------------------------------------------------------------------------------------

def _rand(g: torch.Generator, *shape: int, scale: float | None = None) -> torch.Tensor:
    scale = scale if scale is not None else 1.0 / math.sqrt(shape[-1])
    return torch.randn(*shape, generator=g) * scale


def _norm(g: torch.Generator, n: int) -> torch.Tensor:
    return 1.0 + 0.2 * torch.randn(n, generator=g)


def block_tensors(g: torch.Generator, prefix: str, hidden: int, inter: int, heads: int, kv: int,
                  head_dim: int, qkv_bias: bool) -> dict[str, torch.Tensor]:
    q, k = heads * head_dim, kv * head_dim
    t = {
        "input_layernorm.weight": _norm(g, hidden),
        "self_attn.q_proj.weight": _rand(g, q, hidden), "self_attn.k_proj.weight": _rand(g, k, hidden),
        "self_attn.v_proj.weight": _rand(g, k, hidden), "self_attn.o_proj.weight": _rand(g, hidden, q),
        "post_attention_layernorm.weight": _norm(g, hidden),
        "mlp.gate_proj.weight": _rand(g, inter, hidden), "mlp.up_proj.weight": _rand(g, inter, hidden),
        "mlp.down_proj.weight": _rand(g, hidden, inter),
    }
    if qkv_bias:
        t.update({"self_attn.q_proj.bias": _rand(g, q, scale=0.3), "self_attn.k_proj.bias": _rand(g, k, scale=0.3),
                  "self_attn.v_proj.bias": _rand(g, k, scale=0.3)})
    return {prefix + n: v for n, v in t.items()}


@dataclass
class Checkpoint:
    path: Path                      # directory with config.json
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    prefix: str                     # where the MTP layer lives
    shards: dict[str, list[str]] = field(default_factory=dict)  # file -> tensor names (sharded)

    @property
    def embed(self) -> torch.Tensor:
        return self.tensors["model.embed_tokens.weight"]

    @property
    def lm_head(self) -> torch.Tensor:
        return self.tensors["lm_head.weight"]

    def head_modules(self) -> tuple[torch.nn.Embedding, torch.nn.Linear]:
        """The target's embedding and lm_head as modules (what a draft shares at load time)."""
        emb = torch.nn.Embedding.from_pretrained(self.embed.clone(), freeze=True)
        lm = torch.nn.Linear(self.config["hidden_size"], self.config["vocab_size"], bias=False)
        lm.weight.data.copy_(self.lm_head)
        return emb, lm.requires_grad_(False)


def _main_model(g: torch.Generator, cfg: dict, qkv_bias: bool) -> dict[str, torch.Tensor]:
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    t = {"model.embed_tokens.weight": _rand(g, cfg["vocab_size"], cfg["hidden_size"], scale=1.0),
         "lm_head.weight": _rand(g, cfg["vocab_size"], cfg["hidden_size"]),
         "model.norm.weight": _norm(g, cfg["hidden_size"])}
    for i in range(cfg["num_hidden_layers"]):
        t.update(block_tensors(g, f"model.layers.{i}.", cfg["hidden_size"], cfg["intermediate_size"],
                               cfg["num_attention_heads"], cfg["num_key_value_heads"], hd, qkv_bias))
    return t


def _write(path: Path, cfg: dict, tensors: dict[str, torch.Tensor],
           shards: dict[str, list[str]] | None = None) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    if not shards:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
        return
    weight_map = {}
    for fname, names in shards.items():
        save_file({k: tensors[k].contiguous() for k in names}, str(path / fname))
        weight_map.update({k: fname for k in names})
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}, indent=2))


MIMO_CONFIG = {
    "architectures": ["MiMoForCausalLM"], "model_type": "mimo", "hidden_size": H,
    "intermediate_size": I, "num_hidden_layers": 2, "num_attention_heads": NH,
    "num_key_value_heads": NKV, "rms_norm_eps": 1e-5, "rope_theta": 640000.0, "rope_scaling": None,
    "max_position_embeddings": 512, "vocab_size": VOCAB, "hidden_act": "silu",
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "torch_dtype": "float32",
    "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
}  # no head_dim: Qwen2-style hidden / heads = 16


def _mimo_tensors(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = _main_model(g, MIMO_CONFIG, qkv_bias=True)
    p = "model.mtp_layers.0."
    t.update(block_tensors(g, p, H, I, NH, NKV, H // NH, qkv_bias=True))
    t.update({p + "token_layernorm.weight": _norm(g, H), p + "hidden_layernorm.weight": _norm(g, H),
              p + "input_proj.weight": _rand(g, H, 2 * H), p + "final_layernorm.weight": _norm(g, H)})
    return t


@pytest.fixture(scope="session")
def mimo_ckpt(tmp_path_factory) -> Checkpoint:
    """A MiMo-named base checkpoint in one model.safetensors (Qwen2 block with q/k/v bias)."""
    path = tmp_path_factory.mktemp("mimo") / "MiMo-tiny"
    t = _mimo_tensors()
    _write(path, MIMO_CONFIG, t)
    return Checkpoint(path, dict(MIMO_CONFIG), t, "model.mtp_layers.0.")


@pytest.fixture(scope="session")
def mimo_sharded(tmp_path_factory) -> Checkpoint:
    """The same MiMo checkpoint in four shards; only the last two hold MTP tensors."""
    path = tmp_path_factory.mktemp("mimo_sharded") / "MiMo-tiny-sharded"
    t = _mimo_tensors()
    mtp = sorted(k for k in t if k.startswith("model.mtp_layers."))
    rest = sorted(k for k in t if k not in mtp)
    shards = {
        "model-00001-of-00004.safetensors": [k for k in rest if "layers.0." in k or "embed" in k],
        "model-00002-of-00004.safetensors": [k for k in rest if not ("layers.0." in k or "embed" in k)],
        "model-00003-of-00004.safetensors": mtp[: len(mtp) // 2],
        "model-00004-of-00004.safetensors": mtp[len(mtp) // 2:],
    }
    _write(path, MIMO_CONFIG, t, shards)
    return Checkpoint(path, dict(MIMO_CONFIG), t, "model.mtp_layers.0.", shards)


DEEPSEEK_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H,
    "intermediate_size": I, "num_hidden_layers": 2, "num_attention_heads": NH,
    "num_key_value_heads": NKV, "head_dim": HD, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "max_position_embeddings": 512,
    "vocab_size": VOCAB, "hidden_act": "silu", "attention_bias": False,
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "torch_dtype": "float32",
}


def _deepseek_tensors(split: bool, seed: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = _main_model(g, DEEPSEEK_CONFIG, qkv_bias=False)
    p = "model.layers.2."
    t.update(block_tensors(g, p, H, I, NH, NKV, HD, qkv_bias=False))
    eh = _rand(g, H, 2 * H)
    t.update({p + "enorm.weight": _norm(g, H), p + "hnorm.weight": _norm(g, H),
              p + "shared_head.norm.weight": _norm(g, H),
              # V3 checkpoints repeat the target's embedding and head under the MTP prefix
              p + "embed_tokens.weight": t["model.embed_tokens.weight"].clone(),
              p + "shared_head.head.weight": t["lm_head.weight"].clone()})
    if split:  # the same matrix cut along its input dimension: [embed half | hidden half]
        t[p + "e_proj.weight"], t[p + "h_proj.weight"] = eh[:, :H].clone(), eh[:, H:].clone()
    else:
        t[p + "eh_proj.weight"] = eh
    return t


@pytest.fixture(scope="session")
def deepseek_ckpt(tmp_path_factory) -> Checkpoint:
    """DeepSeek-style dense checkpoint (Llama block): MTP layer at model.layers.{N}."""
    path = tmp_path_factory.mktemp("deepseek") / "ds-tiny"
    t = _deepseek_tensors(split=False)
    _write(path, DEEPSEEK_CONFIG, t)
    return Checkpoint(path, dict(DEEPSEEK_CONFIG), t, "model.layers.2.")


@pytest.fixture(scope="session")
def split_ckpt(tmp_path_factory) -> Checkpoint:
    """The deepseek checkpoint with eh_proj stored as e_proj / h_proj (V4 style)."""
    path = tmp_path_factory.mktemp("split") / "ds-split-tiny"
    t = _deepseek_tensors(split=True)
    _write(path, DEEPSEEK_CONFIG, t)
    return Checkpoint(path, dict(DEEPSEEK_CONFIG), t, "model.layers.2.")


# --------------------------------------------------------------------------------------------
# tiny transformers targets with a tokenizer
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    """A 300-entry byte-level BPE trained on a slice of Python's own docs (offline)."""
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([topics[k] for k in sorted(topics)][:40], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def _perturb_norms(model: torch.nn.Module, seed: int) -> None:
    """Random norm weights, so a norm taken from the wrong place shows up."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))


@dataclass
class TargetDir:
    path: Path
    model: Any
    config: dict[str, Any]


def _save_target(path: Path, model, tokenizer) -> TargetDir:
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return TargetDir(path, model.eval(), json.loads((path / "config.json").read_text()))


@pytest.fixture(scope="session")
def llama_target(tmp_path_factory, tiny_tokenizer) -> TargetDir:
    """LlamaForCausalLM: GQA 4/2, head_dim 24 != 64/4, llama3 rope scaling, untied head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=I, num_hidden_layers=2,
                      num_attention_heads=NH, num_key_value_heads=NKV, head_dim=HD,
                      max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 64},
                      eos_token_id=0, bos_token_id=None)
    model = LlamaForCausalLM(cfg)
    _perturb_norms(model, 4)
    return _save_target(tmp_path_factory.mktemp("llama") / "llama-tiny", model, tiny_tokenizer)


@pytest.fixture(scope="session")
def qwen2_target(tmp_path_factory, tiny_tokenizer) -> TargetDir:
    """Qwen2ForCausalLM: q/k/v bias, GQA 4/2, hidden 48 (differs from the Llama target), linear
    rope scaling, tied embeddings."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(5)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                      num_attention_heads=NH, num_key_value_heads=NKV, max_position_embeddings=512,
                      rms_norm_eps=1e-6, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "linear", "rope_theta": 1000000.0, "factor": 4.0},
                      eos_token_id=0, bos_token_id=None)
    model = Qwen2ForCausalLM(cfg)
    _perturb_norms(model, 6)
    return _save_target(tmp_path_factory.mktemp("qwen2") / "qwen2-tiny", model, tiny_tokenizer)


@pytest.fixture
def run_cli(capsys):
    """Run ``fastmtp ARGS`` in-process: (exit code, stdout, stderr). argparse exits become codes."""
    from fastmtp_sglang.cli import main

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()  # drop what earlier code printed
        try:
            rc = main([str(a) for a in args])
        except SystemExit as exc:  # argparse usage errors
            rc = exc.code if isinstance(exc.code, int) else 1
        out, err = capsys.readouterr()
        return rc, out, err

    return run


@contextlib.contextmanager
def reference_server_process(args: list[str], log_path: Path, startup_s: float = 90.0,
                             prelude: str | None = None):
    """Run `fastmtp serve --engine reference ARGS --host 127.0.0.1 --port 0` as a real process;
    yield (URL, Popen) once /health answers; stop it with SIGTERM on exit (kill after 20 s).

    ``prelude``: Python source run in the server process before the CLI (tests use it to inject
    faults into the engine); the process is then ``python -c`` instead of ``python -m``."""
    from fastmtp_sglang.serving import client

    # --dtype float32 (serve defaults to auto): the tests compare greedy output with the fp32 oracle
    cli = ["serve", "--engine", "reference", "--host", "127.0.0.1", "--port", "0", "--dtype",
           "float32", *args]
    if prelude is None:
        cmd = [sys.executable, "-m", "fastmtp_sglang", *cli]
    else:
        run = "\nimport sys\nfrom fastmtp_sglang.cli import main\nsys.exit(main(sys.argv[1:]))\n"
        cmd = [sys.executable, "-c", prelude + run, *cli]
    # one thread: the tiny models gain nothing from more, and the test process shares the cores
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        url, deadline = None, time.monotonic() + startup_s
        while url is None:
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", log_path.read_text())
            if m:
                url = m.group(1)
            elif proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"server did not start (exit {proc.poll()}):\n{log_path.read_text()}")
            else:
                time.sleep(0.1)
        client.wait_for_health(url, timeout=30, process=proc)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def reference_server(args: list[str], log_path: Path, startup_s: float = 90.0):
    """Run `python -m fastmtp_sglang serve --engine reference ARGS --port 0` as a real process on
    127.0.0.1; yield its URL once /health answers; stop it on exit."""
    with reference_server_process(args, log_path, startup_s) as (url, _):
        yield url


# --------------------------------------------------------------------------------------------
# holding a server's engine with events, not time windows (docs/STYLE.md, habit 13)
# --------------------------------------------------------------------------------------------

HANG_S = 60.0  # a hang guard only: how long a test waits for an event that must come


def gated_prefill(gate: list[int], flag: Path) -> str:
    """Python source for ``reference_server_process(prelude=...)``: a prefill holding a prompt
    that starts with ``gate`` waits until the file ``flag`` exists (HANG_S at most), so requests
    sent meanwhile queue behind it and join its batch together once the test creates the file."""
    return f"""
import os as _os, time as _time
from fastmtp_sglang.decode import engine as _gate_engine
_ungated = _gate_engine.ReferenceEngine._prefill

def _gated(self, requests, keys, on_tokens, *room):
    if any(list(r.input_ids[:{len(gate)}]) == {list(gate)!r} for r in requests):
        deadline = _time.monotonic() + {HANG_S!r}
        while not _os.path.exists({str(flag)!r}) and _time.monotonic() < deadline:
            _time.sleep(0.01)
    return _ungated(self, requests, keys, on_tokens, *room)

_gate_engine.ReferenceEngine._prefill = _gated
"""
