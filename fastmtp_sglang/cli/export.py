"""`fastmtp export`: write a draft head where an engine serves it without our model class.

  fastmtp export --native SRC_TARGET HEAD OUT   the target's checkpoint with HEAD as its own MTP
                                                layer (MiMo; dense DeepSeek-V3 naming)
  fastmtp export --speculators HEAD OUT         a speculators-format directory (algorithm `mtp`,
                                                which vLLM detects)

docs/scale.md, "Export for native serving", says what each writes and how to serve it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _run(args: argparse.Namespace) -> int:
    head, out = args.head, args.out
    if args.native is not None:
        from fastmtp_sglang.core.export_native import EXPORT_KEY, export_native, serve_hint

        out = export_native(args.native, head, out, dtype=args.dtype)
        rec = json.loads((Path(out) / "config.json").read_text())[EXPORT_KEY]
        print(f"wrote {out}: {rec['family']} checkpoint, the head as {rec['mtp_prefix']}*")
        if rec["layout"] == "mimo":
            print("serve it natively (the checkpoint is its own draft):")
            print("  " + serve_hint(Path(out), rec.get("trained_steps")))
        else:
            print("no engine class serves a dense DeepSeek-V3 NextN layer (SGLang's "
                  "DeepseekV3ForCausalLMNextN builds MLA + MoE); serve the head EAGLE-style: "
                  f"fastmtp serve --target {args.native} --draft {head}")
        return 0
    from fastmtp_sglang.core.speculators_format import export_speculators

    out = export_speculators(head, out, algorithm=args.algorithm, verifier=args.verifier,
                             steps=args.steps, dtype=args.dtype)
    print(f"wrote speculators directory {out} (algorithm {args.algorithm}); vLLM detects it: "
          f"vllm serve {out}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a head where an engine serves it natively "
                       "(the target's own MTP layer, or the speculators format)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--native", metavar="SRC_TARGET", default=None,
                      help="the target's checkpoint directory: write it again with HEAD as its "
                      "MTP layer, in the family's own names (MiMo, dense DeepSeek-V3)")
    mode.add_argument("--speculators", action="store_true",
                      help="write HEAD as a speculators-format directory (speculators 0.9.0)")
    p.add_argument("head", metavar="HEAD", help="the draft directory to export")
    p.add_argument("out", metavar="OUT", help="the output directory (must not exist)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="storage dtype of the head's tensors (default: --native the target's "
                   "storage dtype, --speculators the head's)")
    p.add_argument("--algorithm", choices=("mtp",), default="mtp",
                   help="--speculators: the speculators algorithm (0.9.0 has one MTP algorithm, "
                   "mtp, trained FastMTP-style)")
    p.add_argument("--verifier", default=None,
                   help="--speculators: the target's checkpoint directory or hub id (org/name) "
                   "that vLLM loads as the verifier (default: the base model HEAD records, when it "
                   "is one of those; a bare name is refused); a directory's config.json gives the "
                   "architectures")
    p.add_argument("--steps", type=int, default=None,
                   help="--speculators: speculative tokens per cycle (default: HEAD's trained "
                   "steps, else 3)")
    p.set_defaults(func=_run)
