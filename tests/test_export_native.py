"""`fastmtp export --native`: a target checkpoint written again with a trained head as its own MTP
layer, in the family's names (MiMo; DeepSeek-V3 with a dense block).

- SGLang 0.5.23's own ModelConfig picks MiMoMTP for the exported MiMo checkpoint, which loads
  every tensor of it through SGLang's safetensors iterator; its forward equals FastMTPHead's
  logits (fp32, 1e-5);
- `fastmtp convert` round-trips: import -> export -> import is equal bit for bit;
- every original tensor is byte-equal, shards stay the source's files (+ one MTP shard), the index
  names every tensor, the write is atomic;
- a swapped concatenation, a wrong layer index and a dropped tensor each fail the checks here;
- bad input (no native MTP class, MLA/MoE DeepSeek, hidden size, existing OUT) is one line.

Run: .venv/bin/pytest tests/test_export_native.py
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from sglang_cpu import extend, sglang_on_cpu

from fastmtp_sglang.core import export_native as ex
from fastmtp_sglang.core.convert import change_layout, convert
from fastmtp_sglang.core.draft_dir import load_draft_dir, load_head, make_draft_config, save_draft_dir
from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.core.head import FastMTPHead, HeadConfig

# the names the brief and SGLang's mimo_mtp.py give, written out (not taken from convert's map)
MIMO_NAMES = {
    "model.mtp_layers.0." + n for n in (
        "token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight",
        "input_layernorm.weight", "post_attention_layernorm.weight", "final_layernorm.weight",
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.bias",
        "self_attn.v_proj.bias", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight")}
DEEPSEEK_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                "input_layernorm.weight", "post_attention_layernorm.weight",
                "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                "mlp.down_proj.weight")


def all_tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def random_head(out, target_config: dict, layout: str, seed: int, model_type: str | None = None,
                **overrides):
    """A 'trained' head for the target: random weights, random norms and biases."""
    cfg = make_draft_config({**target_config, **overrides}, layout, dtype="float32",
                            model_type=model_type, trained_steps=3, step_weights=[0.51, 0.31, 0.18])
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, t in FastMTPHead(HeadConfig.from_dict(cfg)).state_dict().items():
        noise = torch.randn(t.shape, generator=g)
        sd[name] = 1.0 + 0.2 * noise if name.endswith("norm.weight") else noise / t.shape[-1] ** 0.5
    return save_draft_dir(out, cfg, sd)


def deepseek_v3_copy(ckpt, dst):
    """The dense deepseek fixture relabelled as a DeepSeek-V3 checkpoint (no MLA, no MoE keys)."""
    shutil.copytree(ckpt.path, dst)
    cfg = dict(ckpt.config, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def mimo_head(tmp_path_factory, mimo_ckpt):
    """A deepseek-layout head for the MiMo target: the export must move its columns."""
    return random_head(tmp_path_factory.mktemp("heads") / "mimo-head", mimo_ckpt.config,
                       "deepseek", seed=7)


def check_mimo_export(src, head, out):
    """What an export must satisfy, checked independently of the exporter's own name map."""
    before, after = all_tensors(src.path), all_tensors(out)
    mtp = {k for k in after if k.startswith("model.mtp_layers.")}
    assert mtp == MIMO_NAMES, sorted(mtp ^ MIMO_NAMES)
    kept = {k for k in before if not k.startswith("model.mtp_layers.")}
    assert set(after) - mtp == kept
    assert all(same_bytes(before[k], after[k]) for k in kept)
    # our importer reads the head back, bit for bit, in MiMo's order (hidden columns first)
    d = load_draft_dir(head)
    want = change_layout(d.state_dict, d.head_config.layout, "mimo")
    back = load_draft_dir(convert(out, out.parent / (out.name + "-reimported"), fmt="mimo"))
    assert back.state_dict.keys() == want.keys()
    for k in want:
        assert same_bytes(back.state_dict[k], want[k]), k


# ------------------------------------------------------------------------------------------------
# what is written
# ------------------------------------------------------------------------------------------------

def test_mimo_single_file_export(mimo_ckpt, mimo_head, tmp_path, run_cli):
    src = tmp_path / "src"
    shutil.copytree(mimo_ckpt.path, src)
    (src / "tokenizer_config.json").write_text('{"x": 1}')
    (src / "extra").mkdir()
    (src / "extra" / "notes.txt").write_text("kept")
    src_ck = SimpleNamespace(path=src)
    out = tmp_path / "out"
    rc, stdout, err = run_cli("export", "--native", src, mimo_head, out)
    assert rc == 0, err
    assert "--speculative-draft-model-path" in stdout and "--speculative-num-steps 3" in stdout
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "extra", "model.safetensors", "tokenizer_config.json"]
    assert (out / "extra" / "notes.txt").read_text() == "kept"
    check_mimo_export(src_ck, mimo_head, out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["architectures"] == ["MiMoForCausalLM"]
    assert {k: v for k, v in cfg.items() if k != ex.EXPORT_KEY} == {
        **mimo_ckpt.config, "num_nextn_predict_layers": 1}
    assert cfg[ex.EXPORT_KEY]["mtp_prefix"] == "model.mtp_layers.0."
    assert "fastmtp" not in cfg  # not a draft directory
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.mtp_layers.0.input_proj.weight").dtype == torch.float32


def test_mimo_sharded_export_keeps_shards(mimo_sharded, mimo_head, tmp_path):
    out = ex.export_native(mimo_sharded.path, mimo_head, tmp_path / "out")
    files = sorted(p.name for p in out.glob("*.safetensors"))
    # shards 3 and 4 held only the old MTP layer; 1 and 2 are the source's files, byte for byte
    assert files == ["model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors",
                     ex.MTP_SHARD]
    for f in files[:2]:
        assert (out / f).read_bytes() == (mimo_sharded.path / f).read_bytes()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    on_disk = {}
    for f in files:
        with safe_open(str(out / f), framework="pt") as h:
            on_disk.update({k: f for k in h.keys()})
    assert index["weight_map"] == on_disk
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in all_tensors(out).values())
    check_mimo_export(mimo_sharded, mimo_head, out)


def test_mixed_shard_is_rewritten_byte_equal(mimo_ckpt, mimo_head, tmp_path):
    """A shard holding the old MTP layer beside target tensors: the target tensors survive, with
    the shard's metadata; the file keeps its name."""
    from safetensors.torch import save_file

    src = tmp_path / "mixed"
    src.mkdir()
    shutil.copyfile(mimo_ckpt.path / "config.json", src / "config.json")
    t = mimo_ckpt.tensors
    names = sorted(t)
    first = [k for k in names if "layers.0." in k or "embed" in k]
    second = [k for k in names if k not in first]  # the rest of the model and the MTP layer
    save_file({k: t[k].contiguous() for k in first}, str(src / "a.safetensors"), metadata={"format": "pt"})
    save_file({k: t[k].contiguous() for k in second}, str(src / "b.safetensors"),
              metadata={"format": "pt", "note": "kept"})
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {**{k: "a.safetensors" for k in first},
                                        **{k: "b.safetensors" for k in second}}}))
    out = ex.export_native(src, mimo_head, tmp_path / "out")
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["a.safetensors", "b.safetensors",
                                                                 ex.MTP_SHARD]
    with safe_open(str(out / "b.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "note": "kept"}
        assert not any(k.startswith("model.mtp_layers.") for k in f.keys())
    check_mimo_export(SimpleNamespace(path=src), mimo_head, out)


@pytest.mark.parametrize("kind", ["mimo", "deepseek"])
def test_import_export_import_is_bit_exact(kind, mimo_ckpt, deepseek_ckpt, tmp_path, run_cli):
    """native -> draft dir -> native -> draft dir: the same tensors, bit for bit."""
    if kind == "mimo":
        src, fmt, extra = mimo_ckpt.path, "mimo", []
    else:
        src, fmt, extra = deepseek_v3_copy(deepseek_ckpt, tmp_path / "v3"), "deepseek", [
            "--model-type", "llama"]
    d1, out, d2 = tmp_path / "d1", tmp_path / "native", tmp_path / "d2"
    assert run_cli("convert", "--format", fmt, *extra, src, d1)[0] == 0
    rc, _, err = run_cli("export", "--native", src, d1, out)
    assert rc == 0, err
    rc, _, err = run_cli("convert", "--format", fmt, *extra, out, d2)
    assert rc == 0, err
    a, b = load_draft_dir(d1), load_draft_dir(d2)
    assert a.state_dict.keys() == b.state_dict.keys()
    assert all(same_bytes(a.state_dict[k], b.state_dict[k]) for k in a.state_dict)
    assert replace(a.head_config, hf_config={}) == replace(b.head_config, hf_config={})
    before, after = all_tensors(src), all_tensors(out)
    assert before.keys() == after.keys()  # the head replaced the layer it was taken from
    assert all(same_bytes(before[k], after[k]) for k in before)


def test_deepseek_export_names_and_order(deepseek_ckpt, tmp_path):
    """Dense DeepSeek-V3: the head at model.layers.{num_hidden_layers}, embedding columns first;
    the target's embedding and head repeated at that prefix stay byte-equal."""
    src = deepseek_v3_copy(deepseek_ckpt, tmp_path / "v3")
    head = random_head(tmp_path / "head", deepseek_ckpt.config, "mimo", seed=3, model_type="llama")
    out = ex.export_native(src, head, tmp_path / "out")
    before, after = all_tensors(src), all_tensors(out)
    n = deepseek_ckpt.config["num_hidden_layers"]
    p = f"model.layers.{n}."
    assert {k for k in after if k.startswith(p)} == {p + s for s in DEEPSEEK_OWN} | {
        p + "embed_tokens.weight", p + "shared_head.head.weight"}
    for k in before:
        if not k.startswith(p) or k.endswith(("embed_tokens.weight", "shared_head.head.weight")):
            assert same_bytes(before[k], after[k]), k
    sd = load_draft_dir(head).state_dict
    h = deepseek_ckpt.config["hidden_size"]
    w = sd["input_proj.weight"]  # mimo: [hidden | embed] -> deepseek: [embed | hidden]
    assert torch.equal(after[p + "eh_proj.weight"], torch.cat([w[:, h:], w[:, :h]], 1))
    assert torch.equal(after[p + "enorm.weight"], sd["enorm.weight"])
    assert torch.equal(after[p + "shared_head.norm.weight"], sd["final_norm.weight"])


def test_dtype_override_touches_only_the_head(mimo_ckpt, mimo_head, tmp_path):
    out = ex.export_native(mimo_ckpt.path, mimo_head, tmp_path / "out", dtype="bfloat16")
    after = all_tensors(out)
    mtp = {k for k in after if k.startswith("model.mtp_layers.")}
    assert {after[k].dtype for k in mtp} == {torch.bfloat16}
    assert all(same_bytes(after[k], mimo_ckpt.tensors[k]) for k in set(after) - mtp)
    d = load_draft_dir(mimo_head)
    want = change_layout(d.state_dict, "deepseek", "mimo")["input_proj.weight"].bfloat16()
    assert torch.equal(after["model.mtp_layers.0.input_proj.weight"], want)


def test_failure_leaves_nothing(mimo_sharded, mimo_head, tmp_path, monkeypatch):
    calls = []

    def full_disk(tensors, path, metadata=None):
        calls.append(path)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ex, "save_file", full_disk)
    with pytest.raises(FastMTPError, match="nothing was written"):
        ex.export_native(mimo_sharded.path, mimo_head, tmp_path / "out")
    assert calls and list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------
# the checks catch a wrong export
# ------------------------------------------------------------------------------------------------

def _swap_concat(t):
    k = "model.mtp_layers.0.input_proj.weight"
    h = t[k].shape[1] // 2
    t[k] = torch.cat([t[k][:, h:], t[k][:, :h]], 1).contiguous()


def _layer_index(t):
    for k in list(t):
        t[k.replace("mtp_layers.0.", "mtp_layers.1.")] = t.pop(k)


def _drop(t):
    del t["model.mtp_layers.0.final_layernorm.weight"]


MUTATIONS = {"swapped concat order": _swap_concat, "wrong layer index": _layer_index,
             "dropped tensor": _drop}


def export_mutated(monkeypatch, mutation: str, src, head, out):
    """export_native with one mistake injected into the tensors it writes."""
    real = ex.native_tensors

    def wrong(*args, **kwargs):
        t = real(*args, **kwargs)
        MUTATIONS[mutation](t)
        return t

    monkeypatch.setattr(ex, "native_tensors", wrong)
    return ex.export_native(src, head, out)


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_checks_catch_a_wrong_export(mutation, mimo_ckpt, mimo_head, tmp_path, monkeypatch):
    out = export_mutated(monkeypatch, mutation, mimo_ckpt.path, mimo_head, tmp_path / "out")
    with pytest.raises((AssertionError, FastMTPError)):
        check_mimo_export(mimo_ckpt, mimo_head, out)


# ------------------------------------------------------------------------------------------------
# bad input: one line that says what to do
# ------------------------------------------------------------------------------------------------

def _one_line_error(run_cli, *args) -> str:
    rc, _, err = run_cli(*args)
    assert rc == 1, err
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_refuses_a_family_without_native_mtp(deepseek_ckpt, tmp_path, run_cli):
    head = random_head(tmp_path / "head", deepseek_ckpt.config, "deepseek", seed=1)
    err = _one_line_error(run_cli, "export", "--native", deepseek_ckpt.path, head, tmp_path / "o")
    assert "LlamaForCausalLM" in err and "fastmtp serve" in err and f"--draft {head}" in err
    assert not (tmp_path / "o").exists()


def test_refuses_mla_moe_deepseek(deepseek_ckpt, tmp_path, run_cli):
    src = deepseek_v3_copy(deepseek_ckpt, tmp_path / "v3")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "kv_lora_rank": 16, "n_routed_experts": 4}))
    head = random_head(tmp_path / "head", deepseek_ckpt.config, "deepseek", seed=1)
    err = _one_line_error(run_cli, "export", "--native", src, head, tmp_path / "o")
    assert "MLA + MoE" in err and "kv_lora_rank=16" in err and "fastmtp serve" in err


def test_refuses_a_head_of_another_size(mimo_ckpt, tmp_path, run_cli):
    head = random_head(tmp_path / "head", mimo_ckpt.config, "mimo", seed=2, hidden_size=32,
                       num_attention_heads=2, num_key_value_heads=1)
    err = _one_line_error(run_cli, "export", "--native", mimo_ckpt.path, head, tmp_path / "o")
    assert "hidden_size 32" in err and "64" in err
    head2 = random_head(tmp_path / "head2", mimo_ckpt.config, "mimo", seed=2, intermediate_size=32)
    err = _one_line_error(run_cli, "export", "--native", mimo_ckpt.path, head2, tmp_path / "o")
    assert "intermediate_size" in err


def test_refuses_an_existing_output(mimo_ckpt, mimo_head, tmp_path, run_cli):
    (tmp_path / "o").mkdir()
    err = _one_line_error(run_cli, "export", "--native", mimo_ckpt.path, mimo_head, tmp_path / "o")
    assert "already exists" in err and list((tmp_path / "o").iterdir()) == []


# ------------------------------------------------------------------------------------------------
# SGLang's own MiMoMTP serves the export (CPU; docs/design.md section 5.7)
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sgl():
    with sglang_on_cpu(MiMoMTP="mimo_mtp:MiMoMTP") as ns:
        yield ns


# what MiMo checkpoints ship so that transformers reads model_type "mimo" (remote code): a Qwen2
# config with one more key. Written here, not fetched.
_MIMO_CONFIG_PY = '''from transformers.models.qwen2.configuration_qwen2 import Qwen2Config


class MiMoConfig(Qwen2Config):
    model_type = "mimo"

    def __init__(self, *args, num_nextn_predict_layers=0, **kwargs):
        self.num_nextn_predict_layers = num_nextn_predict_layers
        super().__init__(*args, **kwargs)
'''


@pytest.fixture(scope="module")
def mimo_remote(tmp_path_factory, mimo_ckpt):
    """The MiMo fixture as MiMo ships: configuration_mimo.py and auto_map in config.json."""
    path = tmp_path_factory.mktemp("mimo_remote") / "MiMo-tiny"
    shutil.copytree(mimo_ckpt.path, path)
    (path / "configuration_mimo.py").write_text(_MIMO_CONFIG_PY)
    cfg = dict(mimo_ckpt.config, auto_map={"AutoConfig": "configuration_mimo.MiMoConfig"})
    (path / "config.json").write_text(json.dumps(cfg))
    return SimpleNamespace(path=path, config=mimo_ckpt.config, embed=mimo_ckpt.embed,
                           lm_head=mimo_ckpt.lm_head)


def sglang_mimo(sgl, out, embed_w, lm_w):
    """The draft SGLang makes of a checkpoint: its own ModelConfig (draft, EAGLE) picks the class
    from config.json, and its safetensors iterator feeds load_weights every tensor."""
    from sglang.srt.configs.model_config import ModelConfig
    mc = ModelConfig(model_path=str(out), is_draft_model=True, speculative_algorithm="EAGLE",
                     trust_remote_code=True)
    # the registry resolves an architecture to the EntryClass of that name
    assert mc.hf_config.architectures == [sgl.MiMoMTP.__name__] and mc.num_nextn_predict_layers == 1
    model = sgl.MiMoMTP(mc.hf_config)
    model.load_weights(sgl.weights(sorted(str(f) for f in out.glob("*.safetensors"))))
    model.set_embed_and_head(embed_w, lm_w)
    return model.eval()


def sglang_extend(sgl, model, cfg, ids: list[torch.Tensor], hidden: torch.Tensor):
    """One EXTEND pass of fresh requests through SGLang's CPU KV pool, the draft's input
    hidden states beside them."""
    return extend(sgl, model, ids, cfg["num_key_value_heads"],
                  cfg["hidden_size"] // cfg["num_attention_heads"], 1, hidden)


def head_reference(head_dir, embed_w, lm_w, ids, hidden):
    """FastMTPHead per request: (hidden [T, H], last-token logits [B, V])."""
    emb = torch.nn.Embedding.from_pretrained(embed_w, freeze=True)
    lm = torch.nn.Linear(lm_w.shape[1], lm_w.shape[0], bias=False)
    lm.weight.data.copy_(lm_w)
    head = load_head(head_dir, emb, lm)
    outs, last, off = [], [], 0
    with torch.no_grad():
        for x in ids:
            k = len(x)
            h, logits = head(hidden[None, off:off + k], x[None], torch.arange(k)[None])
            outs.append(h[0])
            last.append(logits[0, -1])
            off += k
    return torch.cat(outs), torch.stack(last)


def _inputs(cfg, zero_token: int, seed: int = 0):
    """Two prompts; position 0 holds ``zero_token`` (MiMoMTP zeroes the embedding there)."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, cfg["vocab_size"], (k,), generator=g) for k in (5, 3)]
    for x in ids:
        x[0] = zero_token
    return ids, 3.0 * torch.randn(8, cfg["hidden_size"], generator=g)


@pytest.mark.sglang
def test_sglang_mimomtp_serves_the_export(sgl, mimo_remote, mimo_head, tmp_path):
    out = ex.export_native(mimo_remote.path, mimo_head, tmp_path / "out")
    assert (out / "configuration_mimo.py").read_text() == _MIMO_CONFIG_PY
    cfg = mimo_remote.config
    # SGLang's MiMoMTP zeroes the embedding at position 0 (FastMTPHead does not, design 4.3):
    # put a token whose embedding row is zero there, so the two compute the same function
    embed_w, lm_w = mimo_remote.embed.clone(), mimo_remote.lm_head.clone()
    embed_w[5] = 0.0
    model = sglang_mimo(sgl, out, embed_w, lm_w)
    ids, hidden = _inputs(cfg, zero_token=5)
    got = sglang_extend(sgl, model, cfg, ids, hidden)
    want_h, want_logits = head_reference(mimo_head, embed_w, lm_w, ids, hidden)
    torch.testing.assert_close(got.next_token_logits, want_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.hidden_states, want_h, atol=1e-5, rtol=1e-5)
    # the head, not the checkpoint's old MTP layer, is what SGLang loaded
    old = sglang_mimo(sgl, mimo_remote.path, embed_w, lm_w)
    assert (sglang_extend(sgl, old, cfg, ids, hidden).next_token_logits - want_logits).abs().max() > 0.1


@pytest.mark.sglang
@pytest.mark.parametrize("mutation", ["swapped concat order", "dropped tensor"])
def test_sglang_sees_a_wrong_export(mutation, sgl, mimo_remote, mimo_head, tmp_path, monkeypatch):
    """SGLang's logits catch these two; a wrong layer index it does not (MiMoMTP maps every
    mtp_layers.{i} onto its one layer), which is why the name check above exists."""
    out = export_mutated(monkeypatch, mutation, mimo_remote.path, mimo_head, tmp_path / "out")
    embed_w, lm_w = mimo_remote.embed.clone(), mimo_remote.lm_head.clone()
    embed_w[5] = 0.0
    torch.manual_seed(0)  # a dropped tensor leaves SGLang's parameter as constructed
    got = sglang_extend(sgl, sglang_mimo(sgl, out, embed_w, lm_w), mimo_remote.config,
                        *_inputs(mimo_remote.config, zero_token=5))
    _, want = head_reference(mimo_head, embed_w, lm_w, *_inputs(mimo_remote.config, zero_token=5))
    assert not torch.allclose(got.next_token_logits, want, atol=1e-3)


def test_source_checkpoint_config_errors(tmp_path):
    """A source without config.json, or with one that is not JSON (or not UTF-8): one
    DraftFormatError naming the file, as draft directories get."""
    from fastmtp_sglang.core.draft_dir import read_config
    from fastmtp_sglang.core.errors import DraftFormatError

    with pytest.raises(DraftFormatError, match="has no config.json"):
        ex.SourceCheckpoint.open(tmp_path)
    for name, blob in (("not_json", b"{oops"), ("not_utf8", b'{"a": "\xff"}')):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_bytes(blob)
        with pytest.raises(DraftFormatError, match=rf"{name}/config.json is not valid JSON"):
            ex.SourceCheckpoint.open(d)
        with pytest.raises(DraftFormatError, match=rf"{name}/config.json is not valid JSON"):
            read_config(d)
