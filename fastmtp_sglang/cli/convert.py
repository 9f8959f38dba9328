"""`fastmtp convert`: flags for :func:`fastmtp_sglang.core.convert.convert` (its docstring is the help)."""

from __future__ import annotations

import argparse

from fastmtp_sglang.core import convert as lib
from fastmtp_sglang.core.convert import FORMATS, convert
from fastmtp_sglang.core.head import LAYOUTS


def _run(args: argparse.Namespace) -> int:
    out = convert(args.src, args.out, fmt=args.format, layout=args.layout, mtp_index=args.mtp_index,
                  model_type=args.model_type, dtype=args.dtype, name=args.name,
                  overwrite=args.overwrite)
    print(f"wrote draft directory {out}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="extract an MTP layer into a draft directory, or change a "
                       "draft directory's layout", description=lib.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="base checkpoint (directory or .safetensors file with config.json "
                   "beside it; sharded checkpoints need model.safetensors.index.json), a draft dir, or a "
                   "speculators (mtp) dir")
    p.add_argument("out", help="output draft directory (must not exist unless --overwrite)")
    p.add_argument("--format", choices=FORMATS, default=None,
                   help="how SRC names its MTP layer (omit for a draft or speculators directory)")
    p.add_argument("--layout", choices=LAYOUTS, default=None,
                   help="layout to write (default: the source's); conversions are exact")
    p.add_argument("--mtp-index", type=int, default=0, help="which MTP layer, for checkpoints "
                   "with several (default 0)")
    p.add_argument("--model-type", choices=("llama", "qwen2"), default=None,
                   help="block family when the checkpoint's model_type is not llama/qwen2/mimo")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="storage dtype (default: the checkpoint's)")
    p.add_argument("--name", default=None, help="base model name recorded in the draft's metadata")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT if it exists (only a draft directory is ever replaced)")
    p.set_defaults(func=_run)
