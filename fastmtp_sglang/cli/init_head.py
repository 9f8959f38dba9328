"""`fastmtp init-head`: flags for :func:`fastmtp_sglang.training.init_head.init_head` (its module
docstring is the help)."""

from __future__ import annotations

import argparse

from fastmtp_sglang.training import init_head as lib
from fastmtp_sglang.training.init_head import INIT_METHODS, init_head


def layer_list(text: str) -> list[int]:
    """'3,15' -> [3, 15] (argparse type: a clear error for anything else)."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices such as 3,15, "
                                         f"got {text!r}") from None


def _run(args: argparse.Namespace) -> int:
    out = init_head(args.target, args.out, layout=args.layout, method=args.init_proj,
                    calib_tokens=args.calib_tokens, dtype=args.dtype, overwrite=args.overwrite,
                    aux_layers=args.aux_layers, from_draft=args.from_draft)
    print(f"wrote draft directory {out}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("init-head", help="a new head for a target without an MTP layer",
                       description=lib.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target model directory (Hugging Face format)")
    p.add_argument("out", help="output draft directory")
    p.add_argument("--layout", choices=("mimo", "deepseek", "split"), default="deepseek",
                   help="input-projection layout to write (default deepseek)")
    p.add_argument("--init-proj", choices=INIT_METHODS, default="lstsq",
                   help="how to initialise the input projection (default lstsq; see above)")
    p.add_argument("--calib-tokens", type=int, default=16384,
                   help="tokens of calibration text for lstsq (default 16384)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16",
                   help="storage dtype (default bfloat16)")
    p.add_argument("--aux-layers", type=layer_list, default=None,
                   help="comma-separated middle layers whose residual streams the head also reads "
                   "(i = the stream leaving decoder layer i-1, as in transformers' hidden_states; "
                   "e.g. 3,15 for a 30-layer target); default none: the last hidden state only")
    p.add_argument("--from", dest="from_draft", default=None,
                   help="take the weights from this draft directory instead of fitting them "
                   "(with --aux-layers: the same start with a fused input)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.set_defaults(func=_run)
