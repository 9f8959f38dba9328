"""FastMTPForCausalLM inside the real sglang package, on CPU (no server: that needs a GPU).

- registration: in a fresh process with SGLANG_EXTERNAL_MODEL_PACKAGE=fastmtp_sglang.models,
  SGLang's registry resolves FastMTPForCausalLM, SGLang's ModelConfig accepts a draft directory,
  and the sglang.srt.plugins entry point registers the class too (when installed);
- the class builds on CPU, and load_weights consumes exactly a draft directory's tensors, read by
  SGLang's own safetensors iterator (missing / unexpected / mis-shaped -> one error naming them);
- forward: EXTEND, DECODE (fed its own hidden state, as EagleDraftWorker.draft_forward does) and
  EXTEND on a cached prefix (draft extend after verification), through SGLang's KV pool and
  TorchNativeAttnBackend, equal FastMTPHead's hidden states and logits in fp32, for every layout
  and both dense blocks (rope scalings of the conftest targets: llama3 and linear);
- a truncated head (SGLang's --speculative-token-map) and the compressed-vocabulary seam;
- every flag of the launch command exists in sglang 0.5.23's ServerArgs parser.

docs/design.md section 5.7 (running an SGLang model class on CPU) explains the harness.
Run: pytest tests/test_sglang_model.py (in an environment with `pip install -e .[sglang]`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from sglang_cpu import sglang_on_cpu  # noqa: E402

from fastmtp_sglang.core.draft_dir import load_draft_dir, load_head, make_draft_config, save_draft_dir  # noqa: E402
from fastmtp_sglang.core.errors import DraftFormatError, FastMTPError  # noqa: E402
from fastmtp_sglang.core.head import FastMTPHead, HeadConfig  # noqa: E402

pytestmark = pytest.mark.sglang

LAYOUTS = ("mimo", "deepseek", "split")


# --------------------------------------------------------------------------------------------
# draft directories
# --------------------------------------------------------------------------------------------

def make_draft(out, target_config: dict, layout: str, seed: int, **overrides) -> None:
    """A draft directory with random weights (random norms and biases too) for ``target_config``."""
    cfg = make_draft_config({**target_config, **overrides}, layout, dtype="float32")
    head = FastMTPHead(HeadConfig.from_dict(cfg))
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, t in head.state_dict().items():
        noise = torch.randn(t.shape, generator=g)
        sd[name] = 1.0 + 0.2 * noise if name.endswith("norm.weight") else noise / t.shape[-1] ** 0.5
    save_draft_dir(out, cfg, sd)


@pytest.fixture(scope="session")
def drafts(tmp_path_factory, llama_target, qwen2_target):
    """(block, layout) -> draft directory; plus ("llama-bias", "deepseek") with attention_bias."""
    root = tmp_path_factory.mktemp("sglang_drafts")
    out = {}
    for i, layout in enumerate(LAYOUTS):
        for block, target in (("llama", llama_target), ("qwen2", qwen2_target)):
            out[block, layout] = root / f"{block}-{layout}"
            make_draft(out[block, layout], target.config, layout, seed=10 + i)
    out["llama-bias", "deepseek"] = root / "llama-bias-deepseek"
    make_draft(out["llama-bias", "deepseek"], llama_target.config, "deepseek", seed=20,
               attention_bias=True)
    return out


# --------------------------------------------------------------------------------------------
# registration, in a fresh process (the registry reads the variable when it is imported)
# --------------------------------------------------------------------------------------------

_REGISTRY_SCRIPT = r"""
import json, os, sys
from importlib.metadata import entry_points

from sglang.srt.models.registry import ModelRegistry, import_model_classes

out = {}
cls, arch = ModelRegistry.resolve_model_cls(["FastMTPForCausalLM"])
out["resolved"] = f"{cls.__module__}.{cls.__name__}"
# the registry logs and skips a module that fails to import; strict mode raises instead
out["strict"] = sorted(import_model_classes("fastmtp_sglang.models", strict=True))

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_loader.utils import get_model_architecture

mc = ModelConfig(model_path=sys.argv[1], is_draft_model=True, speculative_algorithm="EAGLE")
out["config"] = {
    "architectures": mc.hf_config.architectures, "nextn": mc.num_nextn_predict_layers,
    "layers": mc.num_hidden_layers, "vocab": mc.vocab_size,
    "layout": mc.hf_config.fastmtp["layout"], "arch": get_model_architecture(mc)[1],
}

# the other route: the sglang.srt.plugins entry point (present once the package declares it)
del ModelRegistry.models["FastMTPForCausalLM"]
names = [ep.name for ep in entry_points(group="sglang.srt.plugins")
         if ep.value.replace(" ", "") == "fastmtp_sglang.models.fastmtp:register_with_sglang"]
out["plugin"] = None
if names:
    os.environ["SGLANG_PLUGINS"] = names[0]
    from sglang.srt.plugins import load_plugins

    load_plugins()
    out["plugin"] = ModelRegistry.models.get("FastMTPForCausalLM") is cls
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="session")
def registry_proc(drafts):
    """Started first and collected last, so its ~20 s of imports overlap the in-process tests."""
    env = {**os.environ, "SGLANG_EXTERNAL_MODEL_PACKAGE": "fastmtp_sglang.models"}
    env.pop("SGLANG_PLUGINS", None)
    proc = subprocess.Popen([sys.executable, "-c", _REGISTRY_SCRIPT, str(drafts["qwen2", "mimo"])],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="session")
def registry_result(registry_proc):
    out, err = registry_proc.communicate(timeout=300)
    lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
    assert registry_proc.returncode == 0 and lines, f"registry subprocess failed:\n{err[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


# --------------------------------------------------------------------------------------------
# SGLang in this process: world-size-1 parallel state, CPU rotary
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def sgl(registry_proc):
    """SGLang's layers, pools and backend on CPU (imports shared by every test here)."""
    with sglang_on_cpu() as ns:
        yield ns


def sglang_config(path):
    """The config object SGLang hands a draft model class (its own config loading)."""
    from sglang.srt.configs.model_config import ModelConfig

    return ModelConfig(model_path=str(path), is_draft_model=True, speculative_algorithm="EAGLE").hf_config


def weights_of(sgl, path):
    """The draft directory's tensors as SGLang's loader streams them."""
    return sgl.safetensors_weights_iterator([str(path / "model.safetensors")])


def build(sgl, path, target):
    """FastMTPForCausalLM with the draft's weights and the target's embedding and lm_head."""
    model = sgl.fastmtp.FastMTPForCausalLM(sglang_config(path))
    model.load_weights(weights_of(sgl, path))
    model.set_embed_and_head(target.model.get_input_embeddings().weight.detach(),
                             target.model.get_output_embeddings().weight.detach())
    return model.eval()


class KVHarness:
    """Requests through SGLang's CPU KV pool: req_to_token rows 1.. (row 0 is padding), KV slots
    handed out in order from 1, one pass after another as the scheduler would."""

    def __init__(self, sgl, model, n_reqs: int = 2, max_len: int = 64):
        attn = model.model.layer.self_attn
        self.sgl, self.model = sgl, model
        self.req_pool = sgl.ReqToTokenPool(size=n_reqs, max_context_len=max_len, device="cpu",
                                           enable_memory_saver=False)
        self.kv_pool = sgl.MHATokenToKVPool(
            size=n_reqs * max_len + 1, page_size=1, dtype=torch.float32, head_num=attn.num_kv_heads,
            head_dim=attn.head_dim, layer_num=1, device="cpu", enable_memory_saver=False,
            enable_alt_stream=False)
        self.backend = sgl.TorchNativeAttnBackend(SimpleNamespace(
            device="cpu", req_to_token_pool=self.req_pool, token_to_kv_pool=self.kv_pool))
        self.rows = torch.arange(1, n_reqs + 1)
        self.lens = [0] * n_reqs
        self.next_slot = 1

    def run(self, ids: list[torch.Tensor], hidden: torch.Tensor, decode: bool = False):
        """One forward pass. ids: per request [n_r]; hidden: [sum n_r, H] (spec_info)."""
        sgl = self.sgl
        n = [len(x) for x in ids]
        prefix = list(self.lens)
        slots = []
        for r, k in enumerate(n):
            s = torch.arange(self.next_slot, self.next_slot + k)
            self.next_slot += k
            self.req_pool.req_to_token[self.rows[r], prefix[r]:prefix[r] + k] = s.to(torch.int32)
            slots.append(s)
        self.lens = [p + k for p, k in zip(prefix, n)]
        seq_lens = torch.tensor(self.lens)
        common = dict(
            batch_size=len(n), input_ids=torch.cat(ids), req_pool_indices=self.rows,
            seq_lens=seq_lens, seq_lens_cpu=seq_lens, seq_lens_sum=int(seq_lens.sum()),
            out_cache_loc=torch.cat(slots),
            positions=torch.cat([torch.arange(p, p + k) for p, k in zip(prefix, n)]),
            spec_info=SimpleNamespace(hidden_states=hidden),
        )
        if decode:
            assert all(k == 1 for k in n)
            fb = sgl.ForwardBatch(forward_mode=sgl.ForwardMode.DECODE,
                                  capture_hidden_mode=sgl.CaptureHiddenMode.LAST, **common)
        else:
            fb = sgl.ForwardBatch(
                forward_mode=sgl.ForwardMode.EXTEND, capture_hidden_mode=sgl.CaptureHiddenMode.FULL,
                extend_num_tokens=sum(n), extend_seq_lens=torch.tensor(n),
                extend_prefix_lens=torch.tensor(prefix),
                extend_start_loc=torch.tensor([0] + n[:-1]).cumsum(0),
                extend_seq_lens_cpu=n, extend_prefix_lens_cpu=prefix, **common)
        self.backend.init_forward_metadata(fb)
        with sgl.forward_context(self.backend, fb):
            return self.model(fb.input_ids, fb.positions, fb), fb.positions


# --------------------------------------------------------------------------------------------
# build and load
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key", [("llama", "deepseek"), ("qwen2", "mimo"), ("llama", "split"),
                                 ("llama-bias", "deepseek")])
def test_load_weights_consumes_exactly_the_draft(sgl, drafts, key):
    d = load_draft_dir(drafts[key])
    model = sgl.fastmtp.FastMTPForCausalLM(sglang_config(drafts[key]))
    loaded = model.load_weights(weights_of(sgl, drafts[key]))
    params = dict(model.named_parameters())
    assert loaded == set(params) - {"model.embed_tokens.weight", "lm_head.weight"}
    # the fused parameters hold the draft's tensors in SGLang's order
    attn = "model.layer.self_attn."
    q, k, v = (d.state_dict[f"layer.self_attn.{x}_proj.weight"] for x in "qkv")
    assert torch.equal(params[attn + "qkv_proj.weight"], torch.cat([q, k, v]))
    gate, up = (d.state_dict[f"layer.mlp.{x}_proj.weight"] for x in ("gate", "up"))
    assert torch.equal(params["model.layer.mlp.gate_up_proj.weight"], torch.cat([gate, up]))
    assert torch.equal(params["model.final_norm.weight"], d.state_dict["final_norm.weight"])
    assert (attn + "qkv_proj.bias" in params) == (key[0] == "qwen2" or key[0] == "llama-bias")
    assert (attn + "o_proj.bias" in params) == (key[0] == "llama-bias")


@pytest.mark.parametrize("change, named", [
    ("drop", "layer.mlp.up_proj.weight"),
    ("drop", "layer.self_attn.k_proj.bias"),  # qwen2 draft: q/k/v bias is required
    ("add", "embed_tokens.weight"),            # the embedding belongs to the target
    ("add", "layer.mlp.extra.weight"),
    ("reshape", "enorm.weight"),
    ("reshape", "layer.self_attn.v_proj.weight"),
])
def test_load_weights_is_strict(sgl, drafts, change, named):
    path = drafts["qwen2", "mimo"]
    tensors = dict(weights_of(sgl, path))
    if change == "drop":
        del tensors[named]
    elif change == "add":
        tensors[named] = torch.zeros(4, 4)
    else:
        tensors[named] = torch.zeros(tensors[named].shape[0] + 1, *tensors[named].shape[1:])
    model = sgl.fastmtp.FastMTPForCausalLM(sglang_config(path))
    with pytest.raises(DraftFormatError, match=named.replace(".", r"\.")) as err:
        model.load_weights(tensors.items())
    kind = {"drop": "missing", "add": "unexpected", "reshape": "wrong shape"}[change]
    assert kind in str(err.value)


def test_wrong_layout_is_named(sgl, drafts):
    """A deepseek directory's tensors offered to a mimo config: eh_proj unexpected, input_proj missing."""
    model = sgl.fastmtp.FastMTPForCausalLM(sglang_config(drafts["llama", "split"]))
    with pytest.raises(DraftFormatError) as err:
        model.load_weights(weights_of(sgl, drafts["llama", "deepseek"]))
    assert "eh_proj.weight" in str(err.value) and "e_proj.weight" in str(err.value)


# --------------------------------------------------------------------------------------------
# forward == FastMTPHead
# --------------------------------------------------------------------------------------------

def _reference_pass(heads, caches, ids, hidden, positions):
    """FastMTPHead, one request at a time: (hidden [T, H], last-token logits [B, V])."""
    outs, last = [], []
    off = 0
    for r, x in enumerate(ids):
        k = len(x)
        h, logits = heads(hidden[None, off:off + k], x[None], positions[None, off:off + k],
                          cache=caches[r])
        outs.append(h[0])
        last.append(logits[0, -1])
        off += k
    return torch.cat(outs), torch.stack(last)


@pytest.mark.parametrize("key", [(b, lay) for b in ("llama", "qwen2") for lay in LAYOUTS]
                         + [("llama-bias", "deepseek")])
def test_forward_matches_fastmtp_head(sgl, drafts, llama_target, qwen2_target, key):
    target = qwen2_target if key[0] == "qwen2" else llama_target
    model = build(sgl, drafts[key], target)
    head = load_head(drafts[key], target.model.get_input_embeddings(),
                     target.model.get_output_embeddings())
    hsz, vocab = model.head_config.hidden_size, model.head_config.vocab_size
    caches = [head.new_cache(1, 64) for _ in range(2)]
    kv = KVHarness(sgl, model)
    g = torch.Generator().manual_seed(0)

    def ids(*lens):
        return [torch.randint(0, vocab, (n,), generator=g) for n in lens]

    with torch.no_grad():
        # 1. EXTEND over the prompts, with the target's hidden states
        x, hidden = ids(5, 3), torch.randn(8, hsz, generator=g)
        out, pos = kv.run(x, hidden)
        ref_h, ref_logits = _reference_pass(head, caches, x, hidden, pos)
        torch.testing.assert_close(out.hidden_states, ref_h, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.next_token_logits, ref_logits, rtol=1e-5, atol=1e-5)
        assert out.next_token_logits.shape == (2, vocab)

        # 2. DECODE, fed back its own last hidden state per request (a recursive draft step)
        x, hidden = ids(1, 1), out.hidden_states[torch.tensor([4, 7])]
        out, pos = kv.run(x, hidden, decode=True)
        ref_h, ref_logits = _reference_pass(head, caches, x, hidden, pos)
        torch.testing.assert_close(out.hidden_states, ref_h, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.next_token_logits, ref_logits, rtol=1e-5, atol=1e-5)

        # 3. EXTEND on the cached prefix (draft extend over accepted tokens after a verify)
        x, hidden = ids(2, 3), torch.randn(5, hsz, generator=g)
        out, pos = kv.run(x, hidden)
        assert pos.tolist() == [6, 7, 4, 5, 6]
        ref_h, ref_logits = _reference_pass(head, caches, x, hidden, pos)
        torch.testing.assert_close(out.hidden_states, ref_h, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.next_token_logits, ref_logits, rtol=1e-5, atol=1e-5)


def test_truncated_head_from_a_token_map(sgl, drafts, llama_target):
    """set_embed_and_head with head rows [hot] (what --speculative-token-map hands the draft):
    logits are [N, len(hot)] and equal the full logits at those ids."""
    path = drafts["llama", "mimo"]
    model = build(sgl, path, llama_target)
    embed, head_w = model.get_embed_and_head()
    g = torch.Generator().manual_seed(1)
    x, hidden = [torch.randint(0, 320, (4,), generator=g)], torch.randn(4, 64, generator=g)
    with torch.no_grad():
        full, _ = KVHarness(sgl, model, n_reqs=1).run(x, hidden)
        hot = torch.tensor([3, 17, 250, 5, 99])
        model.set_embed_and_head(embed, head_w[hot])
        small, _ = KVHarness(sgl, model, n_reqs=1).run(x, hidden)
    assert small.next_token_logits.shape == (1, 5)
    torch.testing.assert_close(small.next_token_logits, full.next_token_logits[:, hot])
    torch.testing.assert_close(small.hidden_states, full.hidden_states)
    with pytest.raises(ValueError, match="speculative-token-map"):
        model.set_draft_projection(torch.nn.Linear(1, 1))


class _MaskedHeadMethod:
    """Test double for the compressed-vocabulary projection: full logits, -inf off a set."""

    def __init__(self, allowed: torch.Tensor):
        self.allowed = allowed  # [V] bool

    def apply(self, layer, x, bias=None):  # x [N, H] -> [N, V]
        return (x @ layer.weight.T).masked_fill(~self.allowed, float("-inf"))


def test_draft_projection_seam_goes_through_logits_processor(sgl, drafts, qwen2_target):
    """A projection installed with set_draft_projection replaces the lm_head inside SGLang's own
    LogitsProcessor: fixed full width, -inf off the row's table, hidden states unchanged."""
    model = build(sgl, drafts["qwen2", "deepseek"], qwen2_target)
    g = torch.Generator().manual_seed(2)
    x, hidden = [torch.randint(0, 320, (3,), generator=g)] * 2, torch.randn(6, 48, generator=g)
    allowed = torch.zeros(320, dtype=torch.bool)
    allowed[::3] = True
    proj = torch.nn.Module()
    proj.weight = model.lm_head.weight
    proj.quant_method = _MaskedHeadMethod(allowed)
    with torch.no_grad():
        full, _ = KVHarness(sgl, model).run(x, hidden)
        model.set_draft_projection(proj)
        masked, _ = KVHarness(sgl, model).run(x, hidden)
        model.set_draft_projection(None)
    assert masked.next_token_logits.shape == full.next_token_logits.shape
    torch.testing.assert_close(masked.next_token_logits[:, allowed], full.next_token_logits[:, allowed])
    assert torch.isinf(masked.next_token_logits[:, ~allowed]).all()
    torch.testing.assert_close(masked.hidden_states, full.hidden_states)


# --------------------------------------------------------------------------------------------
# launch command: every flag is one of sglang 0.5.23's
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server_parser(sgl):
    parser = argparse.ArgumentParser()
    sgl.ServerArgs.add_cli_args(parser)
    return parser


@pytest.mark.parametrize("steps, extra", [(3, []), (1, ["--mem-fraction-static", "0.7"]),
                                          (5, ["--speculative-token-map", "hot.pt"]), (0, [])])
def test_launch_flags_exist_in_server_args(server_parser, drafts, steps, extra):
    from fastmtp_sglang.serving.sglang_launch import build_launch_command, format_command

    draft = drafts["llama", "deepseek"]
    argv, env = build_launch_command("/models/target", draft, steps, 30001, "127.0.0.1", extra)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    flags = [a for a in argv[3:] if a.startswith("--")]
    unknown = [f for f in flags if f not in server_parser._option_string_actions]
    assert not unknown, f"not flags of sglang's launch_server: {unknown}"
    args = server_parser.parse_args(argv[3:])
    assert (args.model_path, args.port, args.host) == ("/models/target", 30001, "127.0.0.1")
    if steps:
        assert args.speculative_algorithm == "EAGLE"
        assert args.speculative_draft_model_path == str(draft.resolve())
        assert (args.speculative_num_steps, args.speculative_eagle_topk,
                args.speculative_num_draft_tokens) == (steps, 1, steps + 1)
        assert not args.enable_multi_layer_eagle
        assert env == {"SGLANG_EXTERNAL_MODEL_PACKAGE": "fastmtp_sglang.models"}
        assert format_command(argv, env).startswith(
            "SGLANG_EXTERNAL_MODEL_PACKAGE=fastmtp_sglang.models " + sys.executable)
    else:
        assert args.speculative_algorithm is None and env == {}


@pytest.mark.parametrize("extra, message", [
    (["--speculative-num-steps", "2"], "--speculative-num-steps"),
    (["--port=1234"], "--port"),
    (["--enable-multi-layer-eagle"], "one head"),
])
def test_launch_refuses_conflicting_flags(drafts, extra, message):
    from fastmtp_sglang.serving.sglang_launch import build_launch_command

    with pytest.raises(FastMTPError, match=message):
        build_launch_command("T", drafts["llama", "mimo"], 3, 30000, "127.0.0.1", extra)


def test_launch_needs_a_draft_directory(tmp_path):
    from fastmtp_sglang.serving.sglang_launch import build_launch_command

    with pytest.raises(FastMTPError, match="--draft"):
        build_launch_command("T", None, 3, 30000, "127.0.0.1", [])
    with pytest.raises(DraftFormatError, match="config.json"):
        build_launch_command("T", tmp_path, 3, 30000, "127.0.0.1", [])
    with pytest.raises(FastMTPError, match="compressed"):
        build_launch_command("T", None, 0, 30000, "127.0.0.1", [], vocab="en")


# --------------------------------------------------------------------------------------------
# registration (collected last: the subprocess ran alongside the tests above)
# --------------------------------------------------------------------------------------------

def test_registry_resolves_through_environment_variable(registry_result):
    assert registry_result["resolved"] == "fastmtp_sglang.models.fastmtp.FastMTPForCausalLM"
    assert registry_result["strict"] == ["FastMTPForCausalLM"]


def test_sglang_model_config_accepts_a_draft_directory(registry_result):
    cfg = registry_result["config"]
    assert cfg["architectures"] == ["FastMTPForCausalLM"] and cfg["arch"] == "FastMTPForCausalLM"
    assert (cfg["nextn"], cfg["layers"], cfg["vocab"]) == (1, 1, 320)  # one-layer draft KV pool
    assert cfg["layout"] == "mimo"


def test_plugin_entry_point_registers(registry_result):
    if registry_result["plugin"] is None:
        pytest.skip("no sglang.srt.plugins entry point for fastmtp_sglang.models.fastmtp:"
                    "register_with_sglang in this installation (pyproject.toml declares it; "
                    "reinstall with `pip install -e .`)")
    assert registry_result["plugin"] is True
