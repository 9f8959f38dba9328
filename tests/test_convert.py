"""`fastmtp convert` and `fastmtp init-head`: tiny checkpoints with exact MiMo and DeepSeek names ->
draft directory -> load -> the head's forward equals the hand-written forward on the ORIGINAL
checkpoint tensors; exact layout changes; init-head reproduces the target's last layer.

Run: .venv/bin/pytest tests/test_convert.py
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from fastmtp_sglang.core.convert import convert, extract
from fastmtp_sglang.core.draft_dir import expected_shapes, load_draft_dir, load_head
from fastmtp_sglang.core.head import FastMTPHead, HeadConfig
from fastmtp_sglang.training.init_head import _calibration_pairs, init_head, init_state_dict
from fastmtp_sglang.core.target import load_target

from conftest import HD  # noqa: E402


def tensors_of(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def sample_inputs(cfg: dict, b: int = 2, s: int = 11, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, s, cfg["hidden_size"], generator=g) * 3.0
    ids = torch.randint(0, cfg["vocab_size"], (b, s), generator=g)
    positions = torch.stack([torch.arange(s), torch.arange(s) + 17])[:b]
    return hidden, ids, positions


def dims_of(cfg: dict) -> dict:
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return {"n_heads": cfg["num_attention_heads"], "n_kv": cfg["num_key_value_heads"], "head_dim": hd}


def head_vs_reference(ref, ckpt, draft, w, order=None):
    """(head output, head logits, reference output, reference logits) on shared inputs."""
    emb, lm = ckpt.head_modules()
    head = load_head(draft, emb, lm)
    hidden, ids, positions = sample_inputs(ckpt.config)
    with torch.no_grad():
        out, logits = head(hidden, ids, positions)
        want = ref.mtp(w, hidden, ids, positions, ckpt.embed, ckpt.lm_head,
                       ref.rope_for_config(ckpt.config), dims_of(ckpt.config),
                       ckpt.config["rms_norm_eps"], order=order)
    return out, logits, *want


# ----------------------------------------------------------------------------------------------
# MiMo
# ----------------------------------------------------------------------------------------------

def test_mimo_convert_writes_the_contract(mimo_ckpt, tmp_path, run_cli):
    out = tmp_path / "draft"
    rc, stdout, stderr = run_cli("convert", "--format", "mimo", mimo_ckpt.path, out)
    assert rc == 0, stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["FastMTPForCausalLM"]
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["num_hidden_layers"] == 1
    assert cfg["model_type"] == "qwen2"  # a type transformers knows; MiMo's block is Qwen2's
    meta = cfg["fastmtp"]
    assert meta["layout"] == "mimo" and meta["block"] == "qwen2"
    assert meta["concat_order"] == ["hidden", "embed"]
    assert meta["format_version"] == 1
    assert meta["base_model"]["name"] and meta["base_model"]["config_sha256"]
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "rms_norm_eps", "rope_theta", "vocab_size", "max_position_embeddings"):
        assert cfg[key] == mimo_ckpt.config[key], key
    t = tensors_of(out)
    assert not any("embed" in k or "lm_head" in k or "shared_head.head" in k for k in t), sorted(t)
    assert {k: tuple(v.shape) for k, v in t.items()} == expected_shapes(HeadConfig.from_dict(cfg))
    # the tensors are the checkpoint's, bit for bit
    p = mimo_ckpt.prefix
    assert torch.equal(t["input_proj.weight"], mimo_ckpt.tensors[p + "input_proj.weight"])
    assert torch.equal(t["enorm.weight"], mimo_ckpt.tensors[p + "token_layernorm.weight"])
    assert torch.equal(t["hnorm.weight"], mimo_ckpt.tensors[p + "hidden_layernorm.weight"])
    assert torch.equal(t["final_norm.weight"], mimo_ckpt.tensors[p + "final_layernorm.weight"])
    assert torch.equal(t["layer.self_attn.q_proj.bias"], mimo_ckpt.tensors[p + "self_attn.q_proj.bias"])


def test_mimo_forward_equals_reference_on_original_tensors(ref, mimo_ckpt, tmp_path):
    draft = convert(mimo_ckpt.path, tmp_path / "d", fmt="mimo")
    w = ref.weights_mimo(mimo_ckpt.tensors)
    out, logits, want_out, want_logits = head_vs_reference(ref, mimo_ckpt, draft, w)
    torch.testing.assert_close(out, want_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(logits, want_logits, atol=2e-5, rtol=1e-5)
    # the check sees the concatenation order: hidden and embedding swapped is another function
    _, _, swapped, _ = head_vs_reference(ref, mimo_ckpt, draft, w, order="embed_first")
    assert (swapped - want_out).abs().max() > 0.1


def test_mimo_sharded_opens_only_mtp_shards(mimo_sharded, mimo_ckpt, tmp_path, run_cli):
    _, sd, layout, reader = extract(mimo_sharded.path, "mimo")
    mtp_shards = {mimo_sharded.path / f for f, names in mimo_sharded.shards.items()
                  if any(n.startswith("model.mtp_layers.") for n in names)}
    assert reader.opened == mtp_shards and len(mtp_shards) == 2
    # stronger: the other shards can be garbage and convert still works
    import shutil

    src = tmp_path / "sharded"
    shutil.copytree(mimo_sharded.path, src)
    for f in mimo_sharded.shards:
        if mimo_sharded.path / f not in mtp_shards:
            (src / f).write_bytes(b"not a safetensors file")
    rc, _, stderr = run_cli("convert", "--format", "mimo", src, tmp_path / "from_shards")
    assert rc == 0, stderr
    convert(mimo_ckpt.path, tmp_path / "from_single", fmt="mimo")
    a, b = tensors_of(tmp_path / "from_shards"), tensors_of(tmp_path / "from_single")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_convert_from_a_single_safetensors_file(mimo_ckpt, tmp_path):
    out = convert(mimo_ckpt.path / "model.safetensors", tmp_path / "d", fmt="mimo", dtype="bfloat16")
    t = tensors_of(out)
    assert {v.dtype for v in t.values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    p = mimo_ckpt.prefix
    assert torch.equal(t["input_proj.weight"], mimo_ckpt.tensors[p + "input_proj.weight"].bfloat16())


def test_mimo_deepseek_mimo_round_trip(ref, mimo_ckpt, tmp_path, run_cli):
    a, b, c = tmp_path / "mimo", tmp_path / "deepseek", tmp_path / "mimo_again"
    assert run_cli("convert", "--format", "mimo", mimo_ckpt.path, a)[0] == 0
    assert run_cli("convert", a, b, "--layout", "deepseek")[0] == 0
    assert run_cli("convert", b, c, "--layout", "mimo")[0] == 0
    ta, tb, tc = tensors_of(a), tensors_of(b), tensors_of(c)
    assert ta.keys() == tc.keys() and all(torch.equal(ta[k], tc[k]) for k in ta)
    h = mimo_ckpt.config["hidden_size"]
    w = ta["input_proj.weight"]  # [hidden | embed] columns -> [embed | hidden]
    assert torch.equal(tb["eh_proj.weight"], torch.cat([w[:, h:], w[:, :h]], 1))
    meta = json.loads((b / "config.json").read_text())["fastmtp"]
    assert meta["layout"] == "deepseek" and meta["concat_order"] == ["embed", "hidden"]
    assert meta["base_model"] == json.loads((a / "config.json").read_text())["fastmtp"]["base_model"]
    # every layout computes the same function
    emb, lm = mimo_ckpt.head_modules()
    hidden, ids, positions = sample_inputs(mimo_ckpt.config)
    with torch.no_grad():
        outs = [load_head(d, emb, lm)(hidden, ids, positions) for d in (a, b, c)]
    for out, logits in outs[1:]:
        torch.testing.assert_close(out, outs[0][0], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(logits, outs[0][1], atol=2e-5, rtol=1e-5)
    assert torch.equal(outs[0][0], outs[2][0])


# ----------------------------------------------------------------------------------------------
# DeepSeek / split
# ----------------------------------------------------------------------------------------------

def test_deepseek_forward_equals_reference(ref, deepseek_ckpt, tmp_path, run_cli):
    out_dir = tmp_path / "ds"
    rc, _, stderr = run_cli("convert", "--format", "deepseek", deepseek_ckpt.path, out_dir)
    assert rc == 0, stderr
    t = tensors_of(out_dir)
    # the repeated embedding / shared_head.head under the MTP prefix are not stored
    assert not any("embed" in k or "head.weight" in k for k in t), sorted(t)
    cfg = json.loads((out_dir / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["fastmtp"]["concat_order"] == ["embed", "hidden"]
    assert cfg["rope_scaling"] == {"rope_type": "linear", "factor": 2.0} and cfg["head_dim"] == HD
    w = ref.weights_deepseek(deepseek_ckpt.tensors, deepseek_ckpt.prefix)
    out, logits, want_out, want_logits = head_vs_reference(ref, deepseek_ckpt, out_dir, w)
    torch.testing.assert_close(out, want_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(logits, want_logits, atol=2e-5, rtol=1e-5)
    _, _, swapped, _ = head_vs_reference(ref, deepseek_ckpt, out_dir, w, order="hidden_first")
    assert (swapped - want_out).abs().max() > 0.1


def test_deepseek_split_deepseek_bit_exact(ref, deepseek_ckpt, split_ckpt, tmp_path, run_cli):
    ds, sp, ds2 = tmp_path / "ds", tmp_path / "sp", tmp_path / "ds2"
    assert run_cli("convert", "--format", "deepseek", deepseek_ckpt.path, ds)[0] == 0
    assert run_cli("convert", ds, sp, "--layout", "split")[0] == 0
    assert run_cli("convert", sp, ds2, "--layout", "deepseek")[0] == 0
    a, b, c = tensors_of(ds), tensors_of(sp), tensors_of(ds2)
    assert a.keys() == c.keys() and all(torch.equal(a[k], c[k]) for k in a)
    h = deepseek_ckpt.config["hidden_size"]
    assert torch.equal(b["e_proj.weight"], a["eh_proj.weight"][:, :h])
    assert torch.equal(b["h_proj.weight"], a["eh_proj.weight"][:, h:])
    # a split-named checkpoint converts to the same tensors
    direct = tmp_path / "direct_split"
    rc, _, stderr = run_cli("convert", "--format", "split", split_ckpt.path, direct)
    assert rc == 0, stderr
    d = tensors_of(direct)
    assert d.keys() == b.keys() and all(torch.equal(d[k], b[k]) for k in d)
    # and split and deepseek heads compute the same function as the reference
    w = ref.weights_deepseek(split_ckpt.tensors, split_ckpt.prefix)
    assert w["layout"] == "split"
    out, logits, want_out, want_logits = head_vs_reference(ref, split_ckpt, direct, w)
    torch.testing.assert_close(out, want_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(logits, want_logits, atol=2e-5, rtol=1e-5)


def test_deepseek_to_mimo_layout_from_checkpoint(ref, deepseek_ckpt, tmp_path):
    """--layout on a base checkpoint: extract and change layout in one go."""
    out = convert(deepseek_ckpt.path, tmp_path / "m", fmt="deepseek", layout="mimo")
    d = load_draft_dir(out)
    assert d.head_config.layout == "mimo" and d.head_config.block == "llama"
    w = ref.weights_deepseek(deepseek_ckpt.tensors, deepseek_ckpt.prefix)
    o, lg, want_o, want_lg = head_vs_reference(ref, deepseek_ckpt, out, w)
    torch.testing.assert_close(o, want_o, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lg, want_lg, atol=2e-5, rtol=1e-5)


def test_foreign_model_type_with_model_type_flag(deepseek_ckpt, tmp_path, run_cli):
    """A DeepSeek-V3-typed config with a dense block: --model-type llama says which block."""
    import shutil

    src = tmp_path / "v3"
    shutil.copytree(deepseek_ckpt.path, src)
    cfg = dict(deepseek_ckpt.config, model_type="deepseek_v3")
    (src / "config.json").write_text(json.dumps(cfg))
    rc, _, err = run_cli("convert", "--format", "deepseek", src, tmp_path / "no")
    assert rc == 1 and "--model-type" in err and not (tmp_path / "no").exists()
    rc, _, err = run_cli("convert", "--format", "deepseek", "--model-type", "llama", src, tmp_path / "yes")
    assert rc == 0, err
    assert json.loads((tmp_path / "yes" / "config.json").read_text())["model_type"] == "llama"


# ----------------------------------------------------------------------------------------------
# init-head
# ----------------------------------------------------------------------------------------------

def _last_layer_io(target_dir, ids):
    """(r: input of the target's last layer, final hidden, logits), captured with a hook."""
    model = target_dir.model
    cap = {}

    def pre(mod, args, kwargs):
        cap["r"] = args[0] if args else kwargs["hidden_states"]

    hook = model.model.layers[-1].register_forward_pre_hook(pre, with_kwargs=True)
    try:
        with torch.no_grad():
            out = model(input_ids=ids, output_hidden_states=True)
    finally:
        hook.remove()
    return cap["r"], out.hidden_states[-1], out.logits


@pytest.mark.parametrize("which", ["llama_target", "qwen2_target"])
def test_init_head_block_reproduces_target_last_layer(which, request, tmp_path):
    """The head's block and final norm are the target's last layer and norm: fed the target's
    residual stream r (what its last layer sees), the head outputs the target's final hidden state
    and logits at every position, including the target's rope scaling."""
    tdir = request.getfixturevalue(which)
    out = init_head(tdir.path, tmp_path / "head", layout="split", method="hidden", dtype="float32",
                    evaluate=False)  # the held-out evaluation is exercised by the lstsq test
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == tdir.config["model_type"]
    assert cfg["fastmtp"]["init"]["method"] == "hidden"
    assert cfg["fastmtp"]["base_model"]["tokenizer_sha256"]
    model = tdir.model
    sd = tensors_of(out)
    for k, v in model.model.layers[-1].state_dict().items():
        assert torch.equal(sd["layer." + k], v), k
    assert torch.equal(sd["final_norm.weight"], model.model.norm.weight)
    assert not any("embed" in k or "lm_head" in k for k in sd)

    head = load_head(out, model.get_input_embeddings(), model.get_output_embeddings())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, tdir.config["vocab_size"], (2, 80), generator=g)  # past llama3's 64
    r, final, logits = _last_layer_io(tdir, ids)
    positions = torch.arange(80).expand(2, 80)
    head.fuse = lambda hidden, embeds: r  # x = r: what the maths says the block then reproduces
    with torch.no_grad():
        got, got_logits = head(torch.zeros_like(r), ids, positions)
    torch.testing.assert_close(got, final, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got_logits, logits, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["mimo", "deepseek", "split"])
def test_init_identity_projections_land_in_the_right_columns(layout, llama_target):
    """--init-proj hidden: x = hnorm(h) = h / rms(h) (h already left the target's final norm);
    --init-proj embed: x = the target's first-layer input norm of e (how the target sees e)."""
    target = load_target(llama_target.path, tokenizer=False)
    eps = llama_target.config["rms_norm_eps"]
    g = torch.Generator().manual_seed(1)
    h = torch.randn(2, 5, llama_target.config["hidden_size"], generator=g) * 3
    ids = torch.randint(0, 300, (2, 5), generator=g)
    e = target.embed(ids)
    for method in ("hidden", "embed"):
        head_cfg, sd, info = init_state_dict(target, layout, method, 0)
        assert head_cfg.layout == layout and info["method"] == method
        head = FastMTPHead(head_cfg, target.embed, target.lm_head)
        head.load_state_dict(sd)
        with torch.no_grad():
            x = head.fuse(h, e)
            want = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) if method == "hidden"
                    else target.model.model.layers[0].input_layernorm(e))
        torch.testing.assert_close(x, want, atol=1e-5, rtol=1e-5)


def test_init_head_lstsq(llama_target, tmp_path, run_cli):
    out = tmp_path / "lstsq"
    rc, _, err = run_cli("init-head", "--target", llama_target.path, out, "--calib-tokens", "1024",
                         "--dtype", "float32")
    assert rc == 0, err
    assert "step-1 top-1" in err
    cfg = json.loads((out / "config.json").read_text())
    init = cfg["fastmtp"]["init"]
    assert init["method"] == "lstsq" and init["calibration_tokens"] >= 1000
    assert 0.0 <= init["heldout_step1_top1"] <= 1.0
    assert cfg["fastmtp"]["layout"] == "deepseek"
    # the ridge fit is at least as good on its own data as either identity init, up to the
    # ridge penalty it pays: ||FW - R||^2 <= ||FW_id - R||^2 + lam * ||W_id||^2 (lam * H here)
    target = load_target(llama_target.path)
    hh, ee, rr, _ = _calibration_pairs(target, 1024)
    h_size = hh.shape[-1]
    head = load_head(out, target.embed, target.lm_head)
    sse = {}
    for method in ("hidden", "embed"):
        cfg_m, sd_m, _ = init_state_dict(target, "deepseek", method, 0)
        alt = FastMTPHead(cfg_m, target.embed, target.lm_head)
        alt.load_state_dict(sd_m)
        with torch.no_grad():
            sse[method] = float((alt.fuse(hh, ee) - rr).double().pow(2).sum())
    with torch.no_grad():
        fused = head.fuse(hh, ee)
        sse_fit = float((fused - rr).double().pow(2).sum())
        feats = torch.cat([head.enorm(ee), head.hnorm(hh)], -1).double()
    lam = 1e-3 * float(feats.pow(2).sum()) / (2 * h_size)
    slack = 1e-4 * sse_fit + 1e-6
    assert sse_fit <= min(sse.values()) + lam * h_size + slack, (sse_fit, sse, lam * h_size)


def test_init_head_refuses_existing_output_early(llama_target, tmp_path, run_cli):
    out = tmp_path / "exists"
    out.mkdir()
    rc, _, err = run_cli("init-head", "--target", llama_target.path, out)
    assert rc == 1 and "--overwrite" in err
