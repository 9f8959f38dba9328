"""Heads that fuse the target's middle layers (``aux_hidden_states``, EAGLE-3 style): a new fused
head is exactly the head it was made from, the engine stays lossless with one, the feature cache
stores the extra layers (and refuses a cache without them), training and strict loading work,
and the SGLang / vLLM launchers refuse such a head with a pointer to the reference engine."""

from __future__ import annotations

import json

import pytest
import torch

from fastmtp_sglang.core.draft_dir import load_draft_dir, load_head, make_draft_config, save_draft_dir
from fastmtp_sglang.core.errors import DraftFormatError, FastMTPError
from fastmtp_sglang.core.head import FastMTPHead, HeadConfig, head_input
from fastmtp_sglang.core.target import load_target, require_fits
from fastmtp_sglang.decode.engine import ReferenceEngine, Request
from fastmtp_sglang.decode.sampling import SamplingParams
from fastmtp_sglang.training.data import HiddenStates, load_examples
from fastmtp_sglang.training.features import build_features, make_key, open_or_build
from fastmtp_sglang.training.init_head import add_aux_layers
from fastmtp_sglang.training.train import train
from test_train import greedy, one_thread, small_cfg, tiny_target  # noqa: F401  (fixtures)

V, LAYERS, AUX = 320, 4, (1, 2)  # V: the tiny tokenizer (300 entries) fits


def _random(head: FastMTPHead, seed: int) -> FastMTPHead:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:  # enorm, hnorm, final_norm, the layer norms, aux_norms
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(1.5 * torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return head.eval()


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_tokenizer):
    """A 4-layer target saved as a model directory, greedy data from it, a base head and the
    same head with aux layers 1 and 2 added ([0 | 0 | I] fc)."""
    root = tmp_path_factory.mktemp("aux")
    target = tiny_target(vocab=V, hidden=32, layers=LAYERS, lm_scale=30.0)
    tdir = root / "target"
    target.model.save_pretrained(str(tdir))
    tiny_tokenizer.save_pretrained(str(tdir))
    target = load_target(tdir, dtype="float32")
    target.model.requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    seqs = greedy(target, torch.randint(0, V, (12, 4), generator=g), 20)
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt_ids": s[:4].tolist(), "response_ids": s[4:].tolist()})
                            + "\n" for s in seqs))
    cfg = make_draft_config(target.config, "deepseek", dtype="float32")
    base = _random(FastMTPHead(HeadConfig.from_dict(cfg), target.embed, target.lm_head), seed=2)
    sd = {k: v.clone() for k, v in base.state_dict().items()}
    fused_cfg = add_aux_layers(base.cfg, sd, list(AUX), LAYERS)
    fused = FastMTPHead(fused_cfg, target.embed, target.lm_head)
    fused.load_state_dict(sd)
    return target, tdir, data, base, fused.eval(), root


def _acc(results) -> list[int]:
    return [c.accepted for c in results[0].metrics.cycles]


def _feats(target, ids: torch.Tensor, aux=AUX) -> torch.Tensor:
    with torch.no_grad():
        return head_input(target.model.model(input_ids=ids, output_hidden_states=True), aux)


def test_a_new_fused_head_is_the_head_it_was_made_from(world):
    target, _, _, base, fused, _ = world
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(4))
    feats = _feats(target, ids)                                       # [2, 9, 3 H]
    assert feats.shape[-1] == 3 * 32
    assert torch.equal(feats[..., -32:], target.model.model(input_ids=ids).last_hidden_state)
    pos = torch.arange(9)[None].expand(2, 9)
    with torch.no_grad():
        g0, l0 = base(feats[..., -32:], ids, pos)
        g1, l1 = fused(feats, ids, pos)
        assert torch.equal(g0, g1) and torch.equal(l0, l1)
        # the recursion (width H) skips fc; a wrong width is an error that says what fits
        assert torch.equal(fused(g0, ids, pos)[0], base(g0, ids, pos)[0])
        with pytest.raises(ValueError, match="takes 32 or 96"):
            fused(feats[..., :64], ids, pos)


def test_engine_with_a_fused_head_is_lossless_and_reads_the_middle_layers(world):
    target, _, _, base, fused, _ = world
    head = _random(FastMTPHead(fused.cfg, target.embed, target.lm_head), seed=5)
    prompts = [[3, 14, 15, 9, 2], [6, 5], [35, 8, 9, 7, 9, 3, 2]]
    ref = ReferenceEngine(target, None, 0).generate(
        [Request(p, SamplingParams(max_new_tokens=16)) for p in prompts])
    for steps in (1, 3):
        out = ReferenceEngine(target, head, steps).generate(
            [Request(p, SamplingParams(max_new_tokens=16)) for p in prompts])
        assert [r.output_ids for r in out] == [r.output_ids for r in ref]
    # the fused head at its init drafts exactly as the base head does (same acceptance)
    a = ReferenceEngine(target, base, 3).generate([Request(prompts[2], SamplingParams(max_new_tokens=16))])
    b = ReferenceEngine(target, fused, 3).generate([Request(prompts[2], SamplingParams(max_new_tokens=16))])
    assert _acc(a) == _acc(b)
    # the engine hands the head the middle layers at the prefill and every draft extend (fc sees
    # the fused width there), never at the recursive steps
    widths: list[int] = []
    hook = head.fc.register_forward_hook(lambda m, inp, out: widths.append(inp[0].shape[-1]))
    try:
        res = ReferenceEngine(target, head, 3).generate([Request(prompts[2], SamplingParams(max_new_tokens=16))])
    finally:
        hook.remove()
    cycles = len(res[0].metrics.cycles)
    assert set(widths) == {96} and len(widths) >= cycles  # prefill + one extend per cycle


def test_feature_cache_stores_the_aux_layers_and_refuses_a_cache_without_them(world, tmp_path):
    target, tdir, data, _, fused, _ = world
    ex = load_examples(data, None, V, 64)[0]
    key = make_key(target, tdir, data, 64, None, "float32", 0, AUX)
    store = build_features(target, ex, tmp_path / "fused", key, batch_tokens=50, progress=False)
    hs = HiddenStates(target.model, aux_layers=AUX)
    for i in (0, len(ex) - 1):
        assert store(i).shape == (len(ex[i].ids), 96)
        torch.testing.assert_close(store(i), hs(i, ex[i].ids), rtol=1e-5, atol=1e-5)
    build_features(target, ex, tmp_path / "plain", make_key(target, tdir, data, 64, None, "float32", 0),
                   progress=False)
    with pytest.raises(FastMTPError, match="aux_layers: cache \\[\\], now \\[1, 2\\]"):
        open_or_build(target, tdir, data, ex, tmp_path / "plain", 64, None, "float32", 0, False,
                      aux_layers=AUX)


def test_training_a_fused_head_from_features_saves_a_strict_draft(world):
    target, tdir, data, _, fused, root = world
    init = root / "fused-init"
    cfg = make_draft_config(target.config, "deepseek", dtype="float32",
                            extra={"aux_hidden_states": list(AUX)})
    save_draft_dir(init, cfg, fused.state_dict(), overwrite=True)
    res = train(small_cfg(epochs=2, heldout_fraction=0.2, max_len=64), target, data, root / "fused-out",
                init=init, progress=False, features=root / "fused-feats", target_dir=tdir,
                feature_dtype="float32", overwrite=True)
    steps = [r for r in res.log if r["event"] == "step"]
    assert steps[-1]["loss"] < steps[0]["loss"]
    d = load_draft_dir(root / "fused-out")
    assert d.head_config.aux_hidden_states == AUX and tuple(d.state_dict["fc.weight"].shape) == (32, 96)
    assert not torch.equal(d.state_dict["fc.weight"][:, :64], torch.zeros(32, 64))  # it learned
    head = load_head(root / "fused-out", target.embed, target.lm_head)
    reqs = [Request(p, SamplingParams(max_new_tokens=12)) for p in ([5, 6, 7], [9, 10, 11, 12])]
    out = ReferenceEngine(target, head, 2).generate(reqs)
    plain = ReferenceEngine(target, None, 0).generate(reqs)
    assert [r.output_ids for r in out] == [r.output_ids for r in plain]
    # strict: a fused config without fc (or with a stray one) is refused, naming the tensors
    sd = {k: v for k, v in d.state_dict.items() if k != "fc.weight"}
    with pytest.raises(DraftFormatError, match="missing: fc.weight"):
        save_draft_dir(root / "broken", d.config, sd, overwrite=True)
    assert not (root / "broken").exists()
    import shutil

    shutil.copytree(root / "fused-out", root / "unfused-config")
    cfg = json.loads((root / "unfused-config" / "config.json").read_text())
    del cfg["fastmtp"]["aux_hidden_states"]
    (root / "unfused-config" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftFormatError, match="unexpected: aux_norms.0.weight, aux_norms.1.weight, fc.weight"):
        load_draft_dir(root / "unfused-config")


def test_aux_layers_must_be_middle_layers_of_the_target(world):
    target, *_ = world
    cfg = make_draft_config(target.config, "deepseek", extra={"aux_hidden_states": [1, LAYERS]})
    with pytest.raises(FastMTPError, match="aux_hidden_states \\[1, 4\\]: the target has 4 decoder layers"):
        require_fits(cfg, target.config)
    with pytest.raises(DraftFormatError, match="distinct layer indices"):
        HeadConfig.from_dict(make_draft_config(target.config, "deepseek",
                                               extra={"aux_hidden_states": [2, 2]}))
    with pytest.raises(FastMTPError, match="middle layers"):
        add_aux_layers(HeadConfig.from_dict(make_draft_config(target.config, "deepseek")), {}, [0], LAYERS)


def test_sglang_and_vllm_launchers_refuse_a_fused_head(world, tmp_path):
    from fastmtp_sglang.serving.launch import read_fastmtp_config

    target, *_ = world
    d = tmp_path / "fused"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(make_draft_config(
        target.config, "deepseek", extra={"aux_hidden_states": [1, 2]})))
    with pytest.raises(FastMTPError, match="--engine reference"):
        read_fastmtp_config(d)


def test_init_head_cli_adds_aux_layers_to_an_existing_draft(world, run_cli, tmp_path):
    target, tdir, _, base, _, root = world
    src = root / "base-init"
    save_draft_dir(src, make_draft_config(target.config, "deepseek", dtype="float32"),
                   base.state_dict(), overwrite=True)
    rc, _, err = run_cli("init-head", "--target", tdir, "--from", src, "--aux-layers", "1,2",
                         "--dtype", "float32", tmp_path / "out")
    assert rc == 0, err
    d = load_draft_dir(tmp_path / "out")
    assert d.meta["aux_hidden_states"] == [1, 2] and d.meta["init"]["from"] == str(src)
    for k, v in base.state_dict().items():
        assert torch.equal(d.state_dict[k], v), k
    rc, out, _ = run_cli("inspect", tmp_path / "out")
    assert rc == 0 and "aux layers [1, 2]" in out
    rc, _, err = run_cli("init-head", "--target", tdir, "--from", src, "--aux-layers", "1,9",
                         tmp_path / "bad")
    assert rc != 0 and "middle layers" in err and not (tmp_path / "bad").exists()
