"""`fastmtp serve`: serve a target with a FastMTP draft head, on SGLang (GPU) or the reference
engine (CPU, or anywhere: the oracle).

    fastmtp serve --engine reference --target T --draft D --steps 3 --port 30000
    fastmtp serve --engine sglang --target T --draft D --steps 3 -- --mem-fraction-static 0.8

``--engine auto`` (the default) picks SGLang when CUDA is available and ``import sglang`` works,
and the reference engine otherwise, and says which and why. Arguments after ``--`` go to
SGLang's launcher unchanged (the reference engine refuses them).

The reference server speaks SGLang's native API (POST /generate, POST /abort_request, GET
/health, /server_info, /get_model_info; see fastmtp_sglang.serving.protocol) on FastAPI + uvicorn, SGLang's
own HTTP stack, and batches continuously: requests join the running engine batch between verify
cycles (up to ``--max-batch`` rows) and leave it when done; the engine runs on the process's main
thread, HTTP on its own. Without ``--draft`` it serves the head shipped for the demo target when
given that target, and plain decoding otherwise (it says which). It applies no chat template, and samples at temperature 1.0 when a request gives
none, as SGLang does. It is meant to sit behind a load balancer: at most ``--max-queue`` requests
wait (more get 503 + Retry-After), bodies over ``--max-body-mb`` get 413 before they are read, a
client that disconnects aborts its request, and SIGTERM / Ctrl-C stops accepting, gives requests
in flight ``--shutdown-timeout`` seconds, aborts the rest with a final answer and exits 0.

A draft whose recorded base model (config or tokenizer hash, see `fastmtp inspect --target`)
is not this target is refused; ``--allow-base-mismatch`` serves it anyway.

``--dtype auto`` (the default, as in `fastmtp demo` and `fastmtp bench`) is bfloat16 on CUDA and
on CPUs with bf16 units, float32 elsewhere; the start line says which. ``--dtype float32`` gives
greedy output bit-equal to the target's own greedy decoding (bf16 can part from it at near-ties).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path
from typing import NoReturn

from fastmtp_sglang.decode.auto_setup import AutoSpec, parse_steps
from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.serving.options import ServerOptions
from fastmtp_sglang.serving.sglang_versions import PINNED, adaptive_candidates, installed_version


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def pick_engine(requested: str) -> tuple[str, str]:
    """(engine, reason). ``auto``: sglang when CUDA is available and sglang imports."""
    if requested != "auto":
        return requested, "asked for with --engine"
    if not cuda_available():
        return "reference", "no CUDA device (SGLang serves on GPU only)"
    try:
        importlib.import_module("sglang")
    except Exception as exc:  # ImportError, or a broken install failing inside its import
        return "reference", f"CUDA is available but `import sglang` failed ({type(exc).__name__}: {exc})"
    return "sglang", "CUDA is available and sglang imports"


def pick_dtype(requested: str, device: str, flags: frozenset[str] | None = None) -> tuple[str, str]:
    """(dtype name, the start line that says it) for ``--dtype`` on ``device``.

    ``auto``: bfloat16 on CUDA and on CPUs with bf16 units, float32 elsewhere
    (core.hardware.auto_dtype_name; ``flags``: the CPU's, read from /proc/cpuinfo when None).
    Only float32 keeps speculative greedy output bit-equal to the target's own greedy decoding:
    a bf16 forward over several positions rounds differently from one position at a time, so
    a near-tie can tip (docs/design.md section 6.3)."""
    from fastmtp_sglang.core.hardware import auto_dtype_name

    if requested == "auto":
        name = auto_dtype_name(device, flags)
        if str(device).startswith("cuda"):
            why = "auto: CUDA"
        elif name == "bfloat16":
            why = "auto: this CPU has bf16 units"
        else:
            why = "auto: no bf16 units on this CPU, where emulated bf16 is slower than fp32"
    else:
        name, why = requested, "asked for with --dtype"
    if name == "float32":
        exact = "greedy output bit-equal to the target's own greedy decoding"
    else:
        exact = ("greedy output can part from the target's own greedy decoding at near-ties; "
                 "--dtype float32 gives output bit-equal to it")
    return name, f"fastmtp serve: dtype {name} ({why}); {exact}"


def _extra_args(rest: list[str]) -> list[str]:
    if rest and rest[0] == "--":
        return rest[1:]
    if rest:
        raise FastMTPError(f"unexpected arguments {rest}; put SGLang arguments after `--`")
    return []


def check_sglang_can_run() -> None:
    """Raise FastMTPError (one line) when SGLang cannot serve here: no CUDA device, or no
    importable sglang. Checked before anything starts (else: ~40 lines of SGLang traceback)."""
    if not cuda_available():
        raise FastMTPError("--engine sglang needs a CUDA device and this machine has none "
                           "(torch.cuda.is_available() is False); serve on CPU with "
                           "--engine reference")
    try:
        importlib.import_module("sglang")
    except Exception as exc:  # ImportError, or a broken install failing inside its import
        raise FastMTPError(f"--engine sglang: `import sglang` failed ({type(exc).__name__}: "
                           f"{exc}); install fastmtp-sglang[sglang], or use --engine reference"
                           ) from None


def sglang_auto_args(args: argparse.Namespace) -> list[str]:
    """``--steps auto`` on SGLang: its own adaptive speculation (EAGLE worker, topk 1): batch-size
    tiers, each switching between its candidate K by an EMA of accepted drafts. Our K must be
    one of the candidates (SGLang refuses to start otherwise): checked here for the built-in
    tiers; a ``--adaptive-config`` file (from ``fastmtp bench --emit-engine-config``) is SGLang's
    to check."""
    if not args.auto:
        if args.adaptive_config:
            raise FastMTPError("--adaptive-config goes with --steps auto")
        return []
    out = ["--speculative-adaptive"]
    if args.adaptive_config:
        return out + ["--speculative-adaptive-config", str(Path(args.adaptive_config).resolve())]
    candidates = adaptive_candidates()  # the installed SGLang's (0.5.17 and 0.5.23 differ)
    if args.steps not in candidates:
        raise FastMTPError(f"--steps auto on SGLang starts at --auto-max-steps {args.steps}, which "
                           f"SGLang {installed_version() or PINNED}'s built-in adaptive tiers do not "
                           f"hold: pick one of {', '.join(map(str, candidates[1:]))}, or give "
                           "--adaptive-config")
    return out


def vllm_auto_table(args: argparse.Namespace):
    """``--steps auto`` on vLLM: its ``num_speculative_tokens_per_batch_size`` (K per number of
    running requests, vLLM 0.32) from an ``--adaptive-config`` file that ``fastmtp bench
    --concurrency ... --emit-engine-config`` wrote (``vllm_k_per_batch_size.json``); K is the
    table's largest. vLLM has no adaptive tiers of its own, so the file is required. Returns the
    ranges, or None without ``--steps auto``."""
    if not args.auto:
        if args.adaptive_config:
            raise FastMTPError("--adaptive-config goes with --steps auto")
        return None
    if not args.adaptive_config:
        raise FastMTPError("--steps auto on vLLM needs --adaptive-config FILE: vLLM's K per batch "
                           "size, measured on this machine by `fastmtp bench --concurrency ... "
                           "--emit-engine-config` (vllm_k_per_batch_size.json in its --out)")
    from fastmtp_sglang.serving.engine_config import read_vllm_table

    try:
        ranges, args.steps = read_vllm_table(args.adaptive_config)
    except ValueError as exc:
        raise FastMTPError(str(exc)) from None
    print("fastmtp serve: vLLM K per batch size: "
          + ", ".join(f"{a}-{b}: K={k}" for a, b, k in ranges), flush=True)
    return ranges


def build_reference_server(args: argparse.Namespace):
    """Check the flags, then load target + head, check they fit, and build (not start) the
    ReferenceServer (fastmtp_sglang.serving.reference, which refuses a target that is not a
    model directory and a port it cannot have before any weights load)."""
    from fastmtp_sglang.serving.reference import load_reference_server

    default_draft(args)
    if args.steps < 0:
        raise FastMTPError(f"--steps must be >= 0, got {args.steps}")
    if args.max_context is not None and args.max_context < 2:
        raise FastMTPError(f"--max-context must be >= 2 tokens, got {args.max_context}")
    options = server_options(args)
    if args.draft is None and args.steps > 0:
        raise FastMTPError("--steps > 0 needs --draft DIR (or --steps 0 for plain decoding)")
    width = getattr(args, "draft_width", 1)
    if width < 1:
        raise FastMTPError(f"--draft-width must be >= 1, got {width}")
    if width > 1 and (args.auto is not None or args.steps < 1):
        raise FastMTPError("--draft-width goes with --steps K >= 1 and a draft (with --steps auto: "
                           "--auto-width)")
    return load_reference_server(
        args.target, args.draft, args.steps, options, auto=args.auto, width=width,
        vocab=args.vocab, dtype=args.dtype, device=args.device,
        max_context=args.max_context, allow_base_mismatch=args.allow_base_mismatch)


def server_options(args: argparse.Namespace):
    """The reference server's ServerOptions from its flags; a bad value names the flag."""
    from fastmtp_sglang.serving.options import OptionError

    try:
        return ServerOptions.from_cli_args(args)
    except OptionError as exc:
        raise FastMTPError(str(exc)) from None


def run_reference(args: argparse.Namespace, extra: list[str]) -> NoReturn:
    """Serve until SIGTERM / SIGINT, then exit the process with 0 (does not return)."""
    if extra:
        raise FastMTPError(f"the reference engine takes no SGLang arguments, got {extra}")
    server = build_reference_server(args)
    eng = server.engine
    print(f"fastmtp serve: reference engine, target {args.target}, "
          + (f"draft {args.draft}, K={describe_steps(server)}" if eng.steps else "no drafts (K=0)")
          + f", {str(eng.model.dtype).replace('torch.', '')} on {args.device}, context {eng.max_context}, "
          f"max batch {server.options.max_batch}", flush=True)
    print(f"fastmtp serve: listening on {server.url} (Ctrl-C or SIGTERM to stop)", flush=True)
    stopped = server.serve_forever(exit_if_stuck=True)
    info = server.server_info()
    print(f"fastmtp serve: stopped: {info['requests_served']} served, {info['requests_failed']} "
          f"refused or failed, {info['requests_aborted']} aborted", flush=True)
    if not stopped:  # the HTTP side died: say so with the exit code
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    # Every client has its answer and the log is flushed: skip the interpreter's teardown of
    # torch and transformers (2-7 s on a busy 2-core machine, measured) and, if the engine is
    # still inside a long forward pass, that too (a daemon thread in torch at teardown is what
    # used to end Ctrl-C with SIGABRT).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def describe_steps(server) -> str:
    """K as the start line says it: a number, or ``auto (0..K per cycle)``."""
    info = server.worker.steps_info()
    if info["steps"] == "auto":
        return f"auto ({info['steps_range'][0]}..{info['steps_range'][1]} per cycle)"
    return str(info["steps"])


def _made_for(draft, target) -> bool:
    """Whether a draft directory was made for this target (sizes, config and tokenizer hash)."""
    from transformers import AutoTokenizer

    from fastmtp_sglang.core.draft_dir import read_config
    from fastmtp_sglang.core.target import check_fits

    try:
        cfg = json.loads((Path(target) / "config.json").read_text())
        tok = AutoTokenizer.from_pretrained(str(target))
        return all(ok for _, ok, _ in check_fits(read_config(draft), cfg, tok))
    except Exception:  # an unreadable target is reported by the loader, with its own message
        return False


def parse_serve_steps(args: argparse.Namespace) -> None:
    """``--steps`` is K, or ``auto``: then ``args.auto`` is its AutoSpec (None otherwise) and
    ``args.steps`` the largest K it may pick: ``--auto-max-steps``, else on SGLang 3 (where its
    tiers start) and on the reference engine the ceiling it chooses its range under (from the
    costs it measures at start, decode/auto_setup.py)."""
    args.auto = None
    if args.steps is None or isinstance(args.steps, int):
        return
    steps, auto = parse_steps(args.steps)
    if len(steps) + auto != 1:
        raise FastMTPError(f"--steps takes one K (an integer >= 0) or auto; got {args.steps!r}")
    if auto:
        args.auto = AutoSpec.from_cli_args(args)
        args.steps = args.auto_max_steps or (3 if args.engine == "sglang" else args.auto.ceiling)
        return
    args.steps = steps[0]


def default_draft(args: argparse.Namespace) -> None:
    """Without --draft: the head shipped with the package when it was made for this target
    (the demo target), else plain decoding; says which in one line. --steps defaults to 3
    with a draft, 0 without."""
    parse_serve_steps(args)
    if args.draft is not None:
        args.steps = 3 if args.steps is None else args.steps
        return
    if args.steps != 0:
        from fastmtp_sglang.cli.demo import shipped_head

        shipped = shipped_head()
        if shipped is not None and _made_for(shipped, args.target):
            args.draft, args.steps = str(shipped), 3 if args.steps is None else args.steps
            print(f"fastmtp serve: no --draft: serving the head shipped for this target "
                  f"({shipped}) at K={args.steps}", flush=True)
            return
        if args.steps is not None:
            raise FastMTPError("--steps > 0 needs --draft DIR (or --steps 0 for plain decoding)")
    if args.auto:
        raise FastMTPError("--steps auto drafts with a head: give --draft DIR")
    args.steps = 0
    print("fastmtp serve: no --draft: plain decoding (K=0); give --draft DIR to speculate",
          flush=True)


def _run(args: argparse.Namespace) -> int:
    extra = _extra_args(args.sglang_args)
    engine, why = pick_engine(args.engine)
    if args.engine == "auto":
        print(f"fastmtp serve: engine {engine}: {why}", flush=True)
    args.engine = engine
    for flag, width in (("--auto-width", getattr(args, "auto_width", None) or 1), ("--draft-width", args.draft_width)):
        if engine != "reference" and width > 1:
            raise FastMTPError(f"{flag} (leaves beside the head's drafts) runs on the reference "
                               f"engine only; {engine} drafts its own way (SGLang: a tree with "
                               "--speculative-eagle-topk after `--`)")
    if engine == "sglang":
        check_sglang_can_run()
    if engine != "reference":
        default_draft(args)
    if engine in ("reference", "vllm"):  # SGLang takes its own --dtype, after `--`
        device = args.device if engine == "reference" else "cuda" if cuda_available() else "cpu"
        args.dtype, line = pick_dtype(args.dtype, device)
        print(line, flush=True)
    # what each engine's flags mean, settled here before anything is loaded or launched
    flags = sglang_auto_args(args) if engine == "sglang" else []
    table = vllm_auto_table(args) if engine == "vllm" else None
    if engine == "reference" and args.adaptive_config:
        raise FastMTPError("--adaptive-config is SGLang's or vLLM's K-per-batch-size table: the "
                           "reference engine measures its own costs (drop it)")
    if engine == "sglang":
        extra = extra + flags
        if args.enable_return_hidden_states and "--enable-return-hidden-states" not in extra:
            extra = extra + ["--enable-return-hidden-states"]  # SGLang's flag of the same name
        try:
            from fastmtp_sglang.serving import sglang_launch
        except ModuleNotFoundError as exc:
            if exc.name != "fastmtp_sglang.serving.sglang_launch":
                raise
            raise FastMTPError("this installation has no SGLang launcher "
                               "(fastmtp_sglang.serving.sglang_launch); use --engine reference") from None
        return sglang_launch.run_sglang(args.target, args.draft, args.steps, args.port, args.host,
                                        extra, vocab=args.vocab)
    if engine == "vllm":  # vLLM's server (CPU build too), draft via its EAGLE proposer
        from fastmtp_sglang.serving.vllm_launch import run_vllm

        return run_vllm(args.target, args.draft, args.steps, args.port, args.host, extra,
                        dtype=args.dtype, vocab=args.vocab,
                        allow_base_mismatch=args.allow_base_mismatch, k_per_batch_size=table)
    return run_reference(args, extra)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a target with a draft head (SGLang, or the reference "
                       "engine on CPU)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=("auto", "reference", "sglang", "vllm"), default="auto",
                   help="auto (default): sglang when CUDA is available and sglang imports, "
                        "else reference; vllm: `vllm serve` with the draft as its EAGLE "
                        "speculative model (docs/vllm_backend.md; --dtype applies, arguments "
                        "after `--` go to vllm serve)")
    p.add_argument("--target", required=True, help="target model directory (Hugging Face format)")
    p.add_argument("--draft", default=None,
                   help="draft directory (FastMTP head); default: the head shipped for the demo "
                        "target when serving it, else none (plain decoding)")
    p.add_argument("--steps", default=None,
                   help="K, tokens drafted per verification (default 3 with a draft, 0 without); "
                        "0 = plain decoding; auto = K chosen per cycle (reference engine: from "
                        "this machine's costs measured at start, per batch size; SGLang: its "
                        "--speculative-adaptive; vLLM: a measured table, --adaptive-config)")
    AutoSpec.add_cli_args(p, "--steps auto on the reference engine", "; on SGLang the K it starts at, "
                   "default 3, one of its tiers' candidates")
    p.add_argument("--draft-width", type=int, default=1,
                   help="reference engine, --steps K: candidates per drafted position, the head's "
                        "draft and width - 1 leaves beside it (its next choices), verified in the "
                        "same forward (default 1: a chain; with --steps auto: --auto-width)")
    p.add_argument("--adaptive-config", default=None,
                   help="--steps auto on SGLang: a --speculative-adaptive-config JSON file; on "
                        "vLLM (required): a K-per-batch-size table; fastmtp bench --concurrency "
                        "--emit-engine-config writes both (sglang_adaptive.json, "
                        "vllm_k_per_batch_size.json)")
    p.add_argument("--vocab", default=None,
                   help="draft vocabulary, picked per request from the prompt's script: "
                        "default the draft's own tables if it lists any, else full; full; auto "
                        "(the draft's tables, else the shipped ones for the target's tokenizer); "
                        "or table files. SGLang's global --speculative-token-map can go after `--`")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="weights dtype of the reference engine and of vLLM (default auto: "
                        "bfloat16 on CUDA and on CPUs with bf16 units (avx512_bf16, AMX), "
                        "float32 elsewhere; the start line says which); float32 = greedy output "
                        "bit-equal to the target's own greedy decoding. SGLang: give its own "
                        "--dtype after `--`")
    p.add_argument("--device", default="cpu", help="reference engine: torch device (default cpu)")
    p.add_argument("--max-context", type=int, default=None,
                   help="reference engine: tokens a request may use, prompt + output (default: "
                        "the target's max_position_embeddings)")
    p.add_argument("--allow-base-mismatch", action="store_true",
                   help="serve a draft whose recorded base model (config / tokenizer hash) is "
                        "not this target's")
    # --host, --port and the reference server's limits: their defaults, help and checks are
    # ServerOptions' (fastmtp_sglang.serving.options)
    ServerOptions.add_cli_args(p)
    p.add_argument("sglang_args", nargs=argparse.REMAINDER,
                   help="after `--`: arguments passed to SGLang's launcher unchanged")
    p.set_defaults(func=_run)
