"""`fastmtp curve`: flags for :func:`fastmtp_sglang.training.curve.learning_curve` (its module
docstring is the help); each ``--arm``'s flags, with the common ones after ``--``, are parsed as
`fastmtp train` parses them."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from fastmtp_sglang.cli.train import config_from_args
from fastmtp_sglang.cli.train import register as register_train
from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.training import curve as lib
from fastmtp_sglang.training.curve import Arm, learning_curve


def parse_arm(text: str) -> Arm:
    name, _, flags = text.partition("=")
    name = name.strip()
    if not name or not name.replace("-", "").replace("_", "").replace("+", "").isalnum():
        raise FastMTPError(f"--arm takes NAME=FLAGS with a plain name (letters, digits, - _ +), "
                           f"got {text!r}")
    return Arm(name, shlex.split(flags))


def _train_parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="fastmtp")
    register_train(root.add_subparsers(dest="command"))
    return root


def _run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokens = _ints(args.tokens, "--tokens")
    serve_steps = _ints(args.serve_steps, "--serve-steps")
    arms = [parse_arm(a) for a in (args.arm or ["fastmtp="])]
    if len({a.name for a in arms}) != len(arms):
        raise FastMTPError("two --arm share a name")
    common = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    parser = _train_parser()
    base = ["train", "--target", args.target, "--data", args.data, "--out", "x", "--init", args.init]
    for arm in arms:  # what `fastmtp train` would run with the arm's flags
        ns = parser.parse_args(base + common + arm.flags)
        arm.cfg = config_from_args(ns, None)
        arm.target_dtype, arm.vocab, arm.device = ns.dtype, ns.vocab, ns.device
        arm.allow_base_mismatch = getattr(ns, "allow_base_mismatch", False)
    learning_curve(args.target, args.init, args.data, out, tokens, arms, serve_steps,
                   heldout_rows=args.heldout_rows, features=args.features,
                   feature_dtype=args.feature_dtype, dev_prompts=args.dev_prompts,
                   dev_per_category=args.dev_per_category,
                   dev_max_new_tokens=args.dev_max_new_tokens, progress=not args.no_progress,
                   command="fastmtp " + " ".join(shlex.quote(a) for a in sys.argv[1:]))
    print(f"wrote {out}/curve.json, curve.md, curve.png")
    return 0


def _ints(text: str, flag: str) -> list[int]:
    try:
        vals = [int(float(x)) for x in text.split(",") if x.strip()]
    except ValueError:
        raise FastMTPError(f"{flag} takes comma-separated numbers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise FastMTPError(f"{flag} needs numbers >= 1, got {text!r}")
    return vals


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("curve", help="learning curves: tau against training tokens, per arm",
                       description=lib.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target model directory")
    p.add_argument("--init", required=True, help="draft directory every point starts from")
    p.add_argument("--data", required=True, help="training JSONL (prefixes are taken in file order)")
    p.add_argument("--out", required=True, help="results and per-point checkpoints")
    p.add_argument("--tokens", default="84000,250000,500000,1000000",
                   help="response tokens per point, comma-separated (default 84000,250000,500000,1000000)")
    p.add_argument("--arm", action="append", help="NAME=TRAIN-FLAGS, repeatable (default "
                   "fastmtp=, i.e. the defaults); e.g. --arm vanilla=--vanilla")
    p.add_argument("--heldout-rows", type=int, default=100, help="rows at the end of the data "
                   "scored at every point and never trained on (default 100)")
    p.add_argument("--features", default=None, help="feature cache over the whole data "
                   "(default OUT/features; built once)")
    p.add_argument("--feature-dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--serve-steps", default="3", help="K values scored (default 3)")
    p.add_argument("--dev-prompts", nargs="+", default=None, help="prompt files for served tau "
                   "(e.g. bench/data/spec_bench.jsonl); default: no served tau")
    p.add_argument("--dev-per-category", type=int, default=1, help="dev prompts per category (default 1)")
    p.add_argument("--dev-max-new-tokens", type=int, default=64, help="tokens per dev prompt (default 64)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="-- then `fastmtp train` flags for every arm")
    p.set_defaults(func=_run)
