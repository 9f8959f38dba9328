"""Draft directories: the on-disk contract (docs/design.md section 4).

A draft directory holds ``config.json`` (the target family's HF config, reduced to one layer,
plus ``architectures: ["FastMTPForCausalLM"]``, ``num_nextn_predict_layers: 1`` and a ``fastmtp``
block) and ``model.safetensors`` with the MTP weights only. Loading is strict; writing is atomic.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator
from contextlib import contextmanager

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from fastmtp_sglang.core.errors import DraftFormatError, FastMTPError
from fastmtp_sglang.core.head import LAYOUTS, MODEL_TYPE_TO_BLOCK, FastMTPHead, HeadConfig

FORMAT_VERSION = 1
ARCHITECTURE = "FastMTPForCausalLM"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
CONCAT_ORDER = {"mimo": ["hidden", "embed"], "deepseek": ["embed", "hidden"], "split": None}

# keys of the target's HF config that describe the one block we keep
ARCH_KEYS = (
    "model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "vocab_size",
    "max_position_embeddings", "attention_bias", "mlp_bias", "hidden_act", "tie_word_embeddings",
    "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range",
)


def expected_shapes(cfg: HeadConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a draft directory must hold for ``cfg``, with its shape."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {"enorm.weight": (h,), "hnorm.weight": (h,)}
    if cfg.layout == "mimo":
        shapes["input_proj.weight"] = (h, 2 * h)
    elif cfg.layout == "deepseek":
        shapes["eh_proj.weight"] = (h, 2 * h)
    else:
        shapes["e_proj.weight"] = (h, h)
        shapes["h_proj.weight"] = (h, h)
    a = "layer.self_attn."
    shapes.update({
        "layer.input_layernorm.weight": (h,),
        a + "q_proj.weight": (q, h), a + "k_proj.weight": (kv, h), a + "v_proj.weight": (kv, h),
        a + "o_proj.weight": (h, q),
        "layer.post_attention_layernorm.weight": (h,),
        "layer.mlp.gate_proj.weight": (i, h), "layer.mlp.up_proj.weight": (i, h),
        "layer.mlp.down_proj.weight": (h, i),
        "final_norm.weight": (h,),
    })
    n_aux = len(cfg.aux_hidden_states)
    if n_aux:
        shapes["fc.weight"] = (h, (n_aux + 1) * h)
        shapes.update({f"aux_norms.{j}.weight": (h,) for j in range(n_aux)})
    if cfg.qkv_bias:
        shapes.update({a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,)})
    if cfg.o_bias:
        shapes[a + "o_proj.bias"] = (h,)
    if cfg.mlp_bias:
        shapes.update({"layer.mlp.gate_proj.bias": (i,), "layer.mlp.up_proj.bias": (i,),
                       "layer.mlp.down_proj.bias": (h,)})
    return shapes


def check_tensors(shapes: dict[str, tuple[int, ...]], got: dict[str, tuple[int, ...]], where: str) -> None:
    """Raise one error that names every missing, unexpected and mis-shaped tensor."""
    missing = sorted(set(shapes) - set(got))
    unexpected = sorted(set(got) - set(shapes))
    wrong = sorted(f"{k}: expected {list(shapes[k])}, found {list(got[k])}"
                   for k in set(shapes) & set(got) if tuple(got[k]) != tuple(shapes[k]))
    if missing or unexpected or wrong:
        lines = [f"{where} does not match the expected FastMTP tensors:"]
        if missing:
            lines.append("  missing: " + ", ".join(missing))
        if unexpected:
            lines.append("  unexpected: " + ", ".join(unexpected))
        if wrong:
            lines.append("  wrong shape: " + "; ".join(wrong))
        raise DraftFormatError("\n".join(lines))


def make_draft_config(target_config: dict[str, Any], layout: str, *, block: str | None = None,
                      model_type: str | None = None, base_model: dict[str, Any] | None = None,
                      trained_steps: int = 0, step_weights: list[float] | None = None,
                      vocab_tables: list[str] | None = None, dtype: str | None = None,
                      extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The draft's config.json from the target's HF config dict."""
    if layout not in LAYOUTS:
        raise FastMTPError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    cfg = {k: target_config[k] for k in ARCH_KEYS if target_config.get(k) is not None}
    src_type = model_type or cfg.get("model_type", "llama")
    block = block or MODEL_TYPE_TO_BLOCK.get(src_type)
    if block is None:
        raise FastMTPError(
            f"model_type {src_type!r} is not a dense Llama/Qwen2 family model; pass --model-type "
            "llama or qwen2 if its MTP block is one of those")
    cfg["model_type"] = "qwen2" if block == "qwen2" else "llama"  # a type transformers knows
    # legacy rope keys beside transformers 5's rope_parameters: SGLang and older readers use them
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict):
        cfg.setdefault("rope_theta", rp.get("rope_theta"))
        scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
        if scaling.get("rope_type", "default") != "default":
            cfg.setdefault("rope_scaling", scaling)
    cfg.setdefault("rope_scaling", None)
    cfg.update({
        "architectures": [ARCHITECTURE],
        "num_hidden_layers": 1,
        "num_nextn_predict_layers": 1,
        "torch_dtype": dtype or target_config.get("torch_dtype") or target_config.get("dtype") or "bfloat16",
    })
    cfg["fastmtp"] = {
        "format_version": FORMAT_VERSION,
        "layout": layout,
        "block": block,
        "concat_order": CONCAT_ORDER[layout],
        "trained_steps": trained_steps,
        "step_weights": step_weights or [],
        "base_model": base_model or {},
        "vocab_tables": vocab_tables or [],
        **(extra or {}),
    }
    return cfg


@dataclass
class DraftDir:
    path: Path
    config: dict[str, Any]
    head_config: HeadConfig
    state_dict: dict[str, torch.Tensor]

    @property
    def meta(self) -> dict[str, Any]:
        return self.config.get("fastmtp", {})


def read_json_file(path: Path, missing: str) -> Any:
    """The JSON value in ``path``. DraftFormatError: ``missing`` when it is not a file, or one
    naming the path when it is not valid (UTF-8) JSON."""
    if not path.is_file():
        raise DraftFormatError(missing)
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DraftFormatError(f"{path} is not valid JSON: {exc}") from None


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    if not path.is_dir():
        raise DraftFormatError(f"{path} is not a directory; a draft directory holds config.json "
                               "and model.safetensors")
    cfg_path = path / CONFIG_NAME
    cfg = read_json_file(cfg_path, f"{path} has no {CONFIG_NAME}: is it a draft directory?")
    if not isinstance(cfg, dict):
        raise DraftFormatError(f"{cfg_path} holds a JSON {type(cfg).__name__}, not an object: "
                               "is it a draft directory?")
    return cfg


def is_draft_dir(path: str | os.PathLike) -> bool:
    """True for a directory whose config.json is an object with a ``fastmtp`` block."""
    try:
        return isinstance(read_config(path).get("fastmtp"), dict)
    except (DraftFormatError, OSError):
        return False


def load_draft_dir(path: str | os.PathLike, device: str | torch.device = "cpu",
                   dtype: torch.dtype | None = None) -> DraftDir:
    """Read and validate a draft directory (strict: every tensor accounted for)."""
    path = Path(path)
    cfg = read_config(path)
    if "fastmtp" not in cfg:
        raise DraftFormatError(f"{path}/config.json has no 'fastmtp' block: not a FastMTP draft "
                               "directory (make one with `fastmtp convert` or `fastmtp init-head`)")
    version = cfg["fastmtp"].get("format_version")
    if version != FORMAT_VERSION:
        raise DraftFormatError(f"{path}: draft format version {version!r}, this fastmtp reads "
                               f"version {FORMAT_VERSION}")
    head_cfg = HeadConfig.from_dict(cfg)
    weights = path / WEIGHTS_NAME
    if not weights.is_file():
        raise DraftFormatError(f"{path} has no {WEIGHTS_NAME}")
    try:
        with safe_open(str(weights), framework="pt", device=str(device)) as f:
            got = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            check_tensors(expected_shapes(head_cfg), got, str(weights))
            sd = {k: f.get_tensor(k) for k in f.keys()}
    except SafetensorError as exc:
        raise DraftFormatError(f"{weights} is not a readable safetensors file: {exc}") from None
    if dtype is not None:
        sd = {k: v.to(dtype) for k, v in sd.items()}
    return DraftDir(path, cfg, head_cfg, sd)


def load_head(path: str | os.PathLike, embed: torch.nn.Module | None = None,
              lm_head: torch.nn.Module | None = None, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu") -> FastMTPHead:
    """A ready FastMTPHead from a draft directory, sharing the target's embedding and head."""
    d = load_draft_dir(path)
    head = FastMTPHead(d.head_config, embed, lm_head)
    head.load_state_dict(d.state_dict, strict=True)
    head.draft_config = d.config
    return head.to(device=device, dtype=dtype).eval()


def _make_readable(root: Path) -> None:
    """Directories 0755 and files 0644, less the process umask (what a plain mkdir would give)."""
    mask = os.umask(0)
    os.umask(mask)
    for path in [root, *root.rglob("*")]:
        path.chmod((0o755 if path.is_dir() else 0o644) & ~mask)


# Temporary names beside an output directory OUT: ``.OUT.tmp-<pid>-<random>`` while it is
# written, ``.OUT.old-<pid>-<random>/OUT`` for the directory it replaces. The pid says whether
# the writer is still alive; a dead writer's leftovers (kill -9, power loss) are removed by the
# next write to OUT.
_TEMP_KINDS = ("tmp", "old")
LEGACY_STALE_S = 3600.0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def stale_temporaries(out: str | os.PathLike) -> list[tuple[Path, str]]:
    """Leftovers of writes to ``out`` whose writer process is gone: (path, "tmp" / "old")."""
    out = Path(out)
    parent = out.parent if str(out.parent) else Path(".")
    found = []
    for kind in _TEMP_KINDS:
        prefix = f".{out.name}.{kind}-"
        try:
            names = [p for p in parent.iterdir() if p.name.startswith(prefix) and p.is_dir()]
        except OSError:
            return []
        for p in names:
            rest = p.name[len(prefix):]
            pid = rest.split("-", 1)[0]
            if "-" in rest and pid.isdigit():
                stale = int(pid) != os.getpid() and not _pid_alive(int(pid))
            else:  # named before the pid was part of the name: stale once it is an hour old
                try:
                    stale = time.time() - p.stat().st_mtime > LEGACY_STALE_S
                except OSError:
                    stale = False
            if stale:
                found.append((p, kind))
    return sorted(found)


def clean_stale_temporaries(out: str | os.PathLike, log: Callable[[str], None] | None = None) -> list[Path]:
    """Remove what an interrupted write to ``out`` left beside it, and say so.

    A ``.old-`` directory holds the previous ``out``: when ``out`` itself is missing (the crash
    fell between the two renames) it is put back instead of removed."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    out = Path(out)
    removed = []
    for path, kind in stale_temporaries(out):
        previous = path / out.name
        if kind == "old" and not out.exists() and is_draft_dir(previous):
            os.replace(previous, out)
            log(f"restored {out} from {path.name}, left by an interrupted overwrite")
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
            log(f"removed {path}: a temporary directory left by an interrupted write to {out.name}")
    return removed


def check_output(out: str | os.PathLike, overwrite: bool,
                 replaceable: Callable[[Path], bool] | None = is_draft_dir) -> None:
    """Raise FastMTPError unless ``out`` may be written: it does not exist, or ``overwrite`` is
    set and it is replaceable (a draft directory, by default) or an empty directory."""
    out = Path(out)
    if not out.exists():
        return
    if not overwrite:
        raise FastMTPError(f"{out} already exists; choose another output path or pass --overwrite")
    if replaceable is not None and not replaceable(out) and not (
            out.is_dir() and not any(out.iterdir())):
        raise FastMTPError(f"{out} exists and is not a draft directory (no config.json with a "
                           "'fastmtp' block); --overwrite replaces only draft directories: "
                           "choose another output path, or remove it yourself")


@contextmanager
def atomic_dir(out: str | os.PathLike, overwrite: bool = False,
               replaceable: Callable[[Path], bool] | None = None) -> Iterator[Path]:
    """Yield a temporary directory beside ``out``; rename it to ``out`` only on success.

    Leftovers of an earlier, interrupted write to ``out`` are removed first (see
    ``clean_stale_temporaries``). With ``overwrite``, an existing ``out`` is replaced only when
    ``replaceable(out)`` (default: always) or when it is an empty directory."""
    out = Path(out)
    parent = out.parent if str(out.parent) else Path(".")
    if parent.is_dir():
        clean_stale_temporaries(out)
    check_output(out, overwrite, replaceable)
    if not parent.exists():
        try:
            parent.mkdir(parents=True)
        except OSError as exc:
            raise FastMTPError(f"cannot create {parent}: {exc.strerror}") from None
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=parent))
    except OSError as exc:
        raise FastMTPError(f"cannot write into {parent}: {exc.strerror}") from None
    try:
        yield tmp
        _make_readable(tmp)  # mkdtemp made it 0700: a served model directory is read by others
        if out.exists():  # overwrite: move the old one aside first so a crash keeps one of them
            trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-{os.getpid()}-", dir=parent))
            os.replace(out, trash / out.name)
            os.replace(tmp, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_draft_dir(out: str | os.PathLike, config: dict[str, Any],
                   state_dict: dict[str, torch.Tensor], overwrite: bool = False,
                   extra_files: dict[str, str] | None = None,
                   write_extra: Callable[[Path], None] | None = None) -> Path:
    """Validate and write a draft directory atomically. Tensors are stored in config's dtype.

    ``write_extra(tmp_dir)`` may add more files (the trainer's state) inside the same atomic write.
    """
    head_cfg = HeadConfig.from_dict(config)
    check_tensors(expected_shapes(head_cfg), {k: tuple(v.shape) for k, v in state_dict.items()},
                  "the head's weights")
    dtype = getattr(torch, str(config.get("torch_dtype", "bfloat16")).replace("torch.", ""))
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in state_dict.items()}
    try:
        with atomic_dir(out, overwrite=overwrite, replaceable=is_draft_dir) as tmp:
            (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=False) + "\n")
            save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt", "fastmtp": "1"})
            for name, text in (extra_files or {}).items():
                (tmp / name).write_text(text)
            if write_extra is not None:
                write_extra(tmp)
    except (OSError, SafetensorError) as exc:  # disk full, ...: atomic_dir removed its temp dir
        why = getattr(exc, "strerror", None) or exc
        raise FastMTPError(f"cannot write {out}: {why}; nothing was written") from None
    return Path(out)


def table_files(entries: Any) -> list[str]:
    """The vocab tables a head lists as files relative to its directory (each with a .json
    sidecar): they travel with the head; ``builtin:`` and absolute references need not."""
    if isinstance(entries, dict):
        entries = list(entries.values())
    refs = [e.get("path") if isinstance(e, dict) else e for e in entries or []]
    return [r for r in refs if isinstance(r, str) and not r.startswith("builtin:")
            and not Path(r).is_absolute()]


def copy_tables(entries: Any, src: Path, dst: Path) -> None:
    for ref in table_files(entries):
        for rel in (Path(ref), Path(ref).with_suffix(".json")):
            if (src / rel).is_file():
                (dst / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src / rel, dst / rel)
