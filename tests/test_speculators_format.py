"""The speculators format (algorithm `mtp`, speculators 0.9.0): `fastmtp export --speculators` and
`fastmtp convert --format speculators`.

Without the package: round trips are exact both ways, the names are speculators', input_proj
holds the embedding columns first, vocabulary tables travel with the head, bad input is one line.
With the package (skipped when `speculators` is not importable; .ci/run runs this file in a venv
that has it): its own config classes load our export, its MTPDraftModel names its tensors as we
do, its own MTP layer mixin computes what FastMTPHead computes from our tensors, and a directory
written with its classes converts to a draft directory and back unchanged.

Run: .venv/bin/pytest tests/test_speculators_format.py   (package tests skip)
     $SPEC_VENV/bin/python -m pytest tests/test_speculators_format.py   (see .ci/run)
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fastmtp_sglang.core import speculators_format as sf
from fastmtp_sglang.core.convert import change_layout
from fastmtp_sglang.core.draft_dir import load_draft_dir, load_head, make_draft_config, save_draft_dir
from fastmtp_sglang.core.head import FastMTPHead, HeadConfig

P = "mtp_layers.0."
LLAMA_NAMES = {P + n for n in (
    "token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight",
    "final_layernorm.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
    "mlp.down_proj.weight")}


def tensors_of(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def random_head(out, target_config: dict, layout: str, seed: int, dtype: str = "float32",
                tables: bool = False, base: str = "org/tiny-target"):
    cfg = make_draft_config(target_config, layout, dtype=dtype, trained_steps=4,
                            step_weights=[0.46, 0.28, 0.17, 0.1],
                            base_model={"name": base, "config_sha256": "0" * 16},
                            vocab_tables=["tables/en-16.pt", "builtin:smollm2/zh-4096"] if tables else None)
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, t in FastMTPHead(HeadConfig.from_dict(cfg)).state_dict().items():
        noise = torch.randn(t.shape, generator=g)
        sd[name] = 1.0 + 0.2 * noise if name.endswith("norm.weight") else noise / t.shape[-1] ** 0.5

    def write_tables(tmp):
        (tmp / "tables").mkdir()
        torch.save(torch.arange(16), tmp / "tables" / "en-16.pt")
        (tmp / "tables" / "en-16.json").write_text('{"size": 16}')

    return save_draft_dir(out, cfg, sd, write_extra=write_tables if tables else None)


# ------------------------------------------------------------------------------------------------
# without the package
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["mimo", "deepseek", "split"])
def test_export_import_is_exact(layout, deepseek_ckpt, tmp_path, run_cli):
    head = random_head(tmp_path / "head", deepseek_ckpt.config, layout, seed=1, tables=True)
    spec, back = tmp_path / "spec", tmp_path / "back"
    rc, out, err = run_cli("export", "--speculators", head, spec)
    assert rc == 0, err
    assert "vllm serve" in out
    t = tensors_of(spec)
    assert set(t) == LLAMA_NAMES
    # input_proj holds the embedding columns first (MTPLayerMixin: cat[token, hidden])
    d = load_draft_dir(head)
    ds = change_layout(d.state_dict, layout, "deepseek")
    assert torch.equal(t[P + "input_proj.weight"], ds["eh_proj.weight"])
    assert torch.equal(t[P + "token_layernorm.weight"], d.state_dict["enorm.weight"])
    assert torch.equal(t[P + "final_layernorm.weight"], d.state_dict["final_norm.weight"])
    cfg = json.loads((spec / "config.json").read_text())
    assert cfg["speculators_model_type"] == "mtp" and cfg["architectures"] == ["MTPDraftModel"]
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert cfg["transformer_layer_config"]["model_type"] == "llama"
    assert "fastmtp" not in cfg
    assert (spec / "tables" / "en-16.pt").is_file() and (spec / "tables" / "en-16.json").is_file()
    # auto-detected by convert; the head comes back bit for bit, in its own layout
    rc, _, err = run_cli("convert", spec, back)
    assert rc == 0, err
    b = load_draft_dir(back)
    assert b.head_config.layout == layout
    assert b.state_dict.keys() == d.state_dict.keys()
    assert all(same_bytes(b.state_dict[k], d.state_dict[k]) for k in d.state_dict)
    for key in ("trained_steps", "step_weights", "base_model", "vocab_tables"):
        assert b.meta[key] == d.meta[key], key
    assert torch.equal(torch.load(back / "tables" / "en-16.pt"), torch.arange(16))


def test_bfloat16_head_stays_bfloat16(qwen2_target, tmp_path):
    head = random_head(tmp_path / "head", qwen2_target.config, "mimo", seed=2, dtype="bfloat16")
    spec = sf.export_speculators(head, tmp_path / "spec")
    t = tensors_of(spec)
    assert set(t) == LLAMA_NAMES | {P + f"self_attn.{x}_proj.bias" for x in "qkv"}  # qwen2 bias
    assert {v.dtype for v in t.values()} == {torch.bfloat16}
    back = load_draft_dir(sf.import_speculators(spec, tmp_path / "back", layout="deepseek"))
    assert back.head_config.block == "qwen2" and back.config["torch_dtype"] == "bfloat16"
    ds = change_layout(load_draft_dir(head).state_dict, "mimo", "deepseek")
    assert all(same_bytes(back.state_dict[k], ds[k]) for k in ds)


def _one_line(run_cli, *args) -> str:
    rc, _, err = run_cli(*args)
    assert rc == 1 and len(err.strip().splitlines()) == 1, err
    return err


def test_bad_input(deepseek_ckpt, qwen2_target, tmp_path, run_cli):
    head = random_head(tmp_path / "head", deepseek_ckpt.config, "deepseek", seed=3)
    (tmp_path / "exists").mkdir()
    assert "already exists" in _one_line(run_cli, "export", "--speculators", head, tmp_path / "exists")
    err = _one_line(run_cli, "export", "--speculators", head, tmp_path / "d", "--verifier",
                    qwen2_target.path)
    assert "hidden_size 64" in err and "48" in err and "--verifier" in err
    spec = sf.export_speculators(head, tmp_path / "spec")
    # a qwen3 block (q/k norms) is not one FastMTPHead has
    cfg = json.loads((spec / "config.json").read_text())
    cfg["transformer_layer_config"]["model_type"] = "qwen3"
    (spec / "config.json").write_text(json.dumps(cfg))
    assert "qwen3" in _one_line(run_cli, "convert", spec, tmp_path / "a")
    cfg["transformer_layer_config"]["model_type"] = "llama"
    cfg["speculators_model_type"] = "eagle3"
    (spec / "config.json").write_text(json.dumps(cfg))
    assert "'eagle3'" in _one_line(run_cli, "convert", spec, tmp_path / "b")
    cfg["speculators_model_type"] = "mtp"
    (spec / "config.json").write_text(json.dumps(cfg))
    t = tensors_of(spec)
    del t[P + "mlp.up_proj.weight"]
    save_file(t, str(spec / "model.safetensors"))
    rc, _, err = run_cli("convert", spec, tmp_path / "c")
    assert rc == 1 and "missing: mtp_layers.0.mlp.up_proj.weight" in err
    assert not any((tmp_path / x).exists() for x in "abcd")


def test_the_verifier_recorded_is_one_vllm_can_load(deepseek_ckpt, tmp_path, run_cli,
                                                    monkeypatch):
    """Without --verifier the head's recorded base model is written only when it resolves: a
    model directory here (as an absolute path) or a hub id. A bare name (a directory's last
    component, as a target loaded from ./models/x records "x") is refused with what to pass, and
    nothing is written; so is a --verifier that is neither."""
    bare = random_head(tmp_path / "bare", deepseek_ckpt.config, "deepseek", seed=5, base="x")
    err = _one_line(run_cli, "export", "--speculators", bare, tmp_path / "out")
    assert "records its base model only as 'x'" in err and "pass --verifier" in err
    err = _one_line(run_cli, "export", "--speculators", bare, tmp_path / "out", "--verifier", "y")
    assert "--verifier y: no model directory" in err and "hub id" in err
    assert not (tmp_path / "out").exists()
    rc, _, err = run_cli("export", "--speculators", bare, tmp_path / "out", "--verifier",
                         "org/real-target")
    assert rc == 0, err
    v = json.loads((tmp_path / "out" / "config.json").read_text())["speculators_config"]["verifier"]
    assert v["name_or_path"] == "org/real-target"
    # a recorded local directory, relative to here: written absolute (vLLM may start elsewhere)
    monkeypatch.chdir(deepseek_ckpt.path.parent)
    local = random_head(tmp_path / "local", deepseek_ckpt.config, "deepseek", seed=6,
                        base=deepseek_ckpt.path.name)
    spec = sf.export_speculators(local, tmp_path / "spec")
    v = json.loads((spec / "config.json").read_text())["speculators_config"]["verifier"]
    assert os.path.isabs(v["name_or_path"]) and deepseek_ckpt.path.samefile(v["name_or_path"])


# ------------------------------------------------------------------------------------------------
# with the package's own classes
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def spx():
    if os.environ.get("FASTMTP_REQUIRE_SPECULATORS"):  # .ci/run: a missing package is a failure
        import speculators
    else:
        speculators = pytest.importorskip("speculators", reason="speculators is not installed "
                                          "here (.ci/run runs this file in a venv that has 0.9.0)")
    from speculators import SpeculatorModelConfig, SpeculatorsConfig, VerifierConfig
    from speculators.models import MTPDraftModel, MTPSpeculatorConfig
    from speculators.models.mtp import model_definitions
    from speculators.proposals import GreedyTokenProposalConfig

    return type("SPX", (), dict(
        version=speculators.__version__ if hasattr(speculators, "__version__") else None,
        SpeculatorModelConfig=SpeculatorModelConfig, SpeculatorsConfig=SpeculatorsConfig,
        VerifierConfig=VerifierConfig, MTPDraftModel=MTPDraftModel,
        MTPSpeculatorConfig=MTPSpeculatorConfig, model_definitions=model_definitions,
        Greedy=GreedyTokenProposalConfig))


def test_package_config_classes_load_our_export(spx, deepseek_ckpt, tmp_path):
    head = random_head(tmp_path / "head", deepseek_ckpt.config, "mimo", seed=4)
    spec = sf.export_speculators(head, tmp_path / "spec", verifier=str(deepseek_ckpt.path))
    cfg = spx.SpeculatorModelConfig.from_pretrained(str(spec))
    assert isinstance(cfg, spx.MTPSpeculatorConfig)
    assert cfg.num_speculative_steps == 4 and cfg.num_nextn_predict_layers == 1
    assert cfg.draft_vocab_size == cfg.vocab_size == deepseek_ckpt.config["vocab_size"]
    tc = cfg.transformer_layer_config
    assert type(tc).__name__ == "LlamaConfig"
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "rms_norm_eps"):
        assert getattr(tc, key) == deepseek_ckpt.config[key], key
    v = cfg.speculators_config.verifier
    assert v.name_or_path == str(deepseek_ckpt.path) and v.architectures == ["LlamaForCausalLM"]
    assert cfg.speculators_config.algorithm == "mtp"
    assert tc.num_hidden_layers == deepseek_ckpt.config["num_hidden_layers"]  # from --verifier
    # and it survives the package's own save / load
    again = tmp_path / "again"
    cfg.save_pretrained(str(again))
    assert spx.SpeculatorModelConfig.from_pretrained(str(again)).speculators_config == cfg.speculators_config


def test_package_model_names_its_tensors_as_we_do(spx, deepseek_ckpt, tmp_path):
    """MTPDraftModel builds qwen3 blocks only; its names, less qwen3's q/k norms and the verifier's
    tensors, are the ones we write for a llama block."""
    from transformers import Qwen3Config

    c = deepseek_ckpt.config
    tc = Qwen3Config(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
                     intermediate_size=c["intermediate_size"], num_hidden_layers=2,
                     num_attention_heads=c["num_attention_heads"],
                     num_key_value_heads=c["num_key_value_heads"], head_dim=c["head_dim"])
    sc = spx.SpeculatorsConfig(algorithm="mtp", proposal_methods=[spx.Greedy(speculative_tokens=3)],
                               default_proposal_method="greedy",
                               verifier=spx.VerifierConfig(name_or_path="t", architectures=["X"]))
    model = spx.MTPDraftModel(spx.MTPSpeculatorConfig(transformer_layer_config=tc, speculators_config=sc))
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items()
              if k.startswith(P) and not k.endswith(("q_norm.weight", "k_norm.weight"))}
    head = random_head(tmp_path / "head", c, "deepseek", seed=5)
    ours = {k: tuple(v.shape) for k, v in tensors_of(sf.export_speculators(head, tmp_path / "s")).items()}
    assert ours == theirs


def _package_layer(spx, spec):
    """The package's own MTP layer (MTPLayerMixin over transformers' Llama decoder layer), built
    from the config its own classes parse out of our export, holding our exported tensors."""
    from transformers.models.llama.modeling_llama import (
        LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding,
    )

    tc = spx.SpeculatorModelConfig.from_pretrained(str(spec)).transformer_layer_config
    tc._attn_implementation = "sdpa"  # what MTPDraftModel sets
    cls = spx.model_definitions._create_mtp_layer_class("LlamaMTPLayer", LlamaDecoderLayer, LlamaRMSNorm)
    layer = cls(tc, layer_idx=0)
    layer.load_state_dict({k[len(P):]: v for k, v in tensors_of(spec).items()}, strict=True)
    return layer.eval(), LlamaRotaryEmbedding(config=tc)


def test_package_layer_computes_our_head(spx, deepseek_ckpt, tmp_path):
    head_dir = random_head(tmp_path / "head", deepseek_ckpt.config, "mimo", seed=6)
    spec = sf.export_speculators(head_dir, tmp_path / "spec")
    layer, rope = _package_layer(spx, spec)
    emb, lm = deepseek_ckpt.head_modules()
    head = load_head(head_dir, emb, lm)
    g = torch.Generator().manual_seed(0)
    hidden = 3.0 * torch.randn(2, 9, deepseek_ckpt.config["hidden_size"], generator=g)
    ids = torch.randint(0, deepseek_ckpt.config["vocab_size"], (2, 9), generator=g)
    pos = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        want, _ = head(hidden, ids, pos)
        got = layer(hidden_states=hidden, token_embeddings=emb(ids), attention_mask=None,
                    position_ids=pos, position_embeddings=rope(hidden, pos))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        # the test sees the concatenation order: MiMo's (hidden first) is another function
        h = deepseek_ckpt.config["hidden_size"]
        w = layer.input_proj.weight.data.clone()
        layer.input_proj.weight.data = torch.cat([w[:, h:], w[:, :h]], 1)
        swapped = layer(hidden_states=hidden, token_embeddings=emb(ids), attention_mask=None,
                        position_ids=pos, position_embeddings=rope(hidden, pos))
    assert (swapped - want).abs().max() > 0.1


def test_package_written_directory_round_trips(spx, deepseek_ckpt, tmp_path, run_cli):
    """A directory written with the package's classes -> draft directory -> export: the same
    tensors bit for bit and the same speculators config."""
    from transformers import LlamaConfig

    c = deepseek_ckpt.config
    tc = LlamaConfig(**{k: c[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                          "num_attention_heads", "num_key_value_heads", "head_dim",
                                          "rms_norm_eps", "rope_theta", "max_position_embeddings")},
                     num_hidden_layers=2)
    sc = spx.SpeculatorsConfig(
        algorithm="mtp", proposal_methods=[spx.Greedy(speculative_tokens=2)],
        default_proposal_method="greedy",
        verifier=spx.VerifierConfig(name_or_path="org/tiny-llama", architectures=["LlamaForCausalLM"]))
    src = tmp_path / "theirs"
    spx.MTPSpeculatorConfig(transformer_layer_config=tc, speculators_config=sc).save_pretrained(str(src))
    head = random_head(tmp_path / "h", c, "deepseek", seed=7)
    tensors = tensors_of(sf.export_speculators(head, tmp_path / "tmp-export"))
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})

    draft, again = tmp_path / "draft", tmp_path / "again"
    rc, _, err = run_cli("convert", "--format", "speculators", src, draft)
    assert rc == 0, err
    d = load_draft_dir(draft)
    assert d.meta["base_model"]["name"] == "org/tiny-llama" and d.meta["trained_steps"] == 2
    rc, _, err = run_cli("export", "--speculators", draft, again)
    assert rc == 0, err
    a, b = tensors_of(src), tensors_of(again)
    assert a.keys() == b.keys() and all(same_bytes(a[k], b[k]) for k in a)
    ca = spx.SpeculatorModelConfig.from_pretrained(str(src))
    cb = spx.SpeculatorModelConfig.from_pretrained(str(again))
    assert ca.speculators_config == cb.speculators_config
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "rms_norm_eps", "vocab_size", "max_position_embeddings",
                "num_hidden_layers"):
        assert getattr(ca.transformer_layer_config, key) == getattr(cb.transformer_layer_config, key)
    assert ca.transformer_layer_config.rope_parameters == cb.transformer_layer_config.rope_parameters
