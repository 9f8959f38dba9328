"""The vLLM draft class (fastmtp_sglang.vllm_models) against vLLM 0.32's CPU build.

Skipped where vLLM does not import (the default `make test` venv). Run in the vLLM venv:

    /work/vllm-venv/bin/python -m pytest -q -m vllm tests/test_vllm.py     # incl. the e2e (~5 min)
    /work/vllm-venv/bin/python -m pytest -q tests/test_vllm.py             # fast ones only

The end-to-end test (marked slow too) runs bench/vllm_e2e.py on two prompts: vLLM serving the
demo target with the shipped head at K=3 must give exactly vLLM's K=0 greedy output in fp32, the
reference engine's output, and the reference engine's tau.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (launch/install_vllm_cpu.sh)")

from fastmtp_sglang.core.draft_dir import make_draft_config, save_draft_dir  # noqa: E402
from fastmtp_sglang.core.errors import DraftFormatError  # noqa: E402
from fastmtp_sglang.core.head import FastMTPHead, HeadConfig  # noqa: E402
from fastmtp_sglang.serving.vllm_launch import build_vllm_command  # noqa: E402

pytestmark = pytest.mark.vllm
REPO = Path(__file__).resolve().parents[1]

# a tiny Llama target: GQA, head_dim * heads != hidden, a vocabulary that is not a multiple of 64
TARGET_CFG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
    "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(target dir, draft dir, the head's state dict) for a tiny Llama."""
    root = tmp_path_factory.mktemp("vllm_tiny")
    target = root / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(TARGET_CFG))
    cfg = make_draft_config(TARGET_CFG, "deepseek", dtype="float32")
    torch.manual_seed(0)
    head = FastMTPHead(HeadConfig.from_dict(cfg))
    sd = {k: torch.randn_like(v) * 0.05 for k, v in head.state_dict().items()}
    draft = save_draft_dir(root / "draft", cfg, sd)
    return target, draft, sd


def _engine_config(argv: list[str]):
    """vLLM's own server parser and engine-config construction on our command line."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[3:])
    return args, AsyncEngineArgs.from_cli_args(args).create_engine_config()


def test_command_parses_and_resolves_our_class(tiny):
    target, draft, _ = tiny
    argv, env = build_vllm_command(target, draft, 3, 8000, "127.0.0.1",
                                   ["--enforce-eager", "--skip-tokenizer-init"], dtype="float32")
    args, cfg = _engine_config(argv)
    assert args.speculative_config["method"] == "eagle"
    spec = cfg.speculative_config
    assert spec.method == "eagle" and spec.num_speculative_tokens == 3
    # EAGLEConfig renames FastMTPForCausalLM; the plugin registered both names
    assert spec.draft_model_config.architectures == ["EagleFastMTPForCausalLM"]
    assert cfg.cache_config.kv_cache_memory_bytes == 1 << 30
    from vllm import ModelRegistry

    assert {"FastMTPForCausalLM", "EagleFastMTPForCausalLM"} <= set(
        ModelRegistry.get_supported_archs())


def test_mtp_method_cannot_take_a_fastmtp_directory(tiny):
    """Why the command uses method "eagle": vLLM 0.32's "mtp" takes a separate draft directory
    only with one of its in-tree MTP model_types, and ours is the target family's (llama)."""
    target, draft, _ = tiny
    argv, _ = build_vllm_command(target, draft, 3, 8000, "127.0.0.1",
                                 ["--enforce-eager", "--skip-tokenizer-init"], dtype="float32")
    i = argv.index("--speculative-config") + 1
    argv[i] = argv[i].replace('"eagle"', '"mtp"')
    with pytest.raises(NotImplementedError, match="Unsupported speculative method: 'mtp'"):
        _engine_config(argv)


@pytest.fixture(scope="module")
def built(tiny):
    """The vLLM class built in this process (world size 1, gloo), with its VllmConfig."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (cleanup_dist_env_and_memory, init_distributed_environment,
                                  initialize_model_parallel)

    from fastmtp_sglang.vllm_models.fastmtp import FastMTPForCausalLM

    target, draft, sd = tiny
    argv, _ = build_vllm_command(target, draft, 3, 8000, "127.0.0.1",
                                 ["--enforce-eager", "--skip-tokenizer-init"], dtype="float32")
    _, cfg = _engine_config(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(cfg):  # layers read it at build and at forward time
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(1, 1)
        model = FastMTPForCausalLM(vllm_config=cfg, prefix="")
        yield model, cfg, sd
        cleanup_dist_env_and_memory()


def test_holds_only_head_parameters_and_layer_name(built):
    model, cfg, sd = built
    names = {n for n, _ in model.named_parameters()}
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)
    # the attention registers under layers.{target layers}: no clash with the target's 0..1
    attn = [k for k in cfg.compilation_config.static_forward_context if k.endswith(".attn")]
    assert attn == ["model.layers.2.self_attn.attn"]


def test_strict_load_and_fused_shards(built):
    model, _, sd = built
    loaded = model.load_weights(iter(sd.items()))
    assert loaded == {n for n, _ in model.named_parameters()}
    qkv = model.model.layer.self_attn.qkv_proj.weight
    a = "layer.self_attn."
    assert torch.equal(qkv, torch.cat([sd[a + "q_proj.weight"], sd[a + "k_proj.weight"],
                                       sd[a + "v_proj.weight"]]))
    gate_up = model.model.layer.mlp.gate_up_proj.weight
    assert torch.equal(gate_up, torch.cat([sd["layer.mlp.gate_proj.weight"],
                                           sd["layer.mlp.up_proj.weight"]]))
    assert torch.equal(model.model.eh_proj.weight, sd["eh_proj.weight"])


def test_fuse_and_mlp_match_the_pure_torch_head(built):
    """The parts below attention, on vLLM's layers, == FastMTPHead (fp32)."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    model, cfg, sd = built
    model.load_weights(iter(sd.items()))
    # what vLLM's loader does next (on CPU it picks the linear kernels here)
    process_weights_after_loading(model, cfg.speculative_config.draft_model_config,
                                  torch.device("cpu"))
    head = FastMTPHead(model.head_config)
    head.load_state_dict(sd)
    torch.manual_seed(1)
    h, e = torch.randn(5, 64), torch.randn(5, 64)
    torch.testing.assert_close(model.model.fuse(h, e), head.fuse(h, e), rtol=1e-5, atol=1e-5)
    x = torch.randn(5, 64)
    torch.testing.assert_close(model.model.layer.mlp(x), head.layer.mlp(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.model.final_norm(x), head.final_norm(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mutate, message", [
    (lambda sd: sd.pop("eh_proj.weight"), "missing: eh_proj.weight"),
    (lambda sd: sd.update({"extra.weight": torch.zeros(3)}), "unexpected: extra.weight"),
    (lambda sd: sd.update({"final_norm.weight": torch.zeros(63)}), "final_norm.weight: expected"),
])
def test_load_refuses_wrong_tensors(built, mutate, message):
    model, _, sd = built
    bad = dict(sd)
    mutate(bad)
    with pytest.raises(DraftFormatError, match=message):
        model.load_weights(iter(bad.items()))


def test_placeholders_refuse_use_before_binding(built):
    model, _, _ = built
    with pytest.raises(RuntimeError, match="has not been bound"):
        model.embed_input_ids(torch.tensor([1, 2]))


@pytest.mark.slow
def test_end_to_end_demo_target(tmp_path):
    """vLLM's EAGLE proposer runs the shipped head on the demo target: fp32 greedy identity with
    K=0 and with the reference engine, and the same acceptance: in fp32 both engines verify the
    same drafts, so the verify cycles and the accepted drafts at each position are equal."""
    pytest.importorskip("gguf", reason="the demo target needs gguf (launch/install_vllm_cpu.sh)")
    out = tmp_path / "e2e"
    cmd = [sys.executable, str(REPO / "bench" / "vllm_e2e.py"), "--dtypes", "float32",
           "--categories", "coding,math_reasoning", "--max-new-tokens", "32", "--out", str(out)]
    subprocess.run(cmd, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=1500)
    s = json.loads((out / "results.json").read_text())["summary"][0]
    assert s["identical_to_k0"] == s["prompts"] == 2
    assert s["identical_to_reference"] == 2
    assert s["drafts_vllm"] > 0 and s["tau_vllm"] > 1.0
    assert s["drafts_vllm_same_output"] == s["cycles_reference_same_output"]
    assert s["accepted_per_pos_vllm_same_output"] == s["accepted_per_pos_reference_same_output"]
    assert s["tau_vllm_same_output"] == s["tau_reference_same_output"]


@pytest.mark.slow
def test_k0_steps_write_the_drafts_kv_only(tmp_path):
    """vLLM with K per batch size ([1, 1, 3], [2, 256, 0]) on the demo target, three prompts in
    one batch, the first answering longest: the K=0 steps of our draft write its KV cache only
    (FASTMTP_VLLM_K0=kv) or run vLLM's whole draft forward (full). Outputs are K=0's in both
    (fp32 greedy), and the first prompt, left alone, drafts over KV slots written at K=0 and
    accepts exactly the same drafts at every position in both modes."""
    pytest.importorskip("gguf", reason="the demo target needs gguf (launch/install_vllm_cpu.sh)")
    out = tmp_path / "k0"
    subprocess.run([sys.executable, str(REPO / "bench" / "vllm_k0_check.py"), "--out", str(out)],
                   check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=1500)
    s = json.loads((out / "results.json").read_text())["summary"]
    assert s["kv_only_logged"] == {"kv": True, "full": False}  # each mode took its own path
    assert s["kv_same_as_k0"] and s["full_same_as_k0"]
    assert s["draft_kv_same"]  # the draft's whole KV cache, bit for bit
    assert s["drafts"]["kv"] == s["drafts"]["full"] > 0
    assert s["accepted_per_pos"]["kv"] == s["accepted_per_pos"]["full"]
    assert sum(s["accepted_per_pos"]["kv"]) > 0
