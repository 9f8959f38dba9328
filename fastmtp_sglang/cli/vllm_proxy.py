"""`python -m fastmtp_sglang.cli.vllm_proxy`: SGLang's ``/generate`` API in front of a vLLM
server, for ``fastmtp bench --url`` (the adapter itself: fastmtp_sglang.serving.vllm_proxy).

    python -m fastmtp_sglang.cli.vllm_proxy --vllm http://127.0.0.1:8000 --steps 3 --port 30001
"""

from __future__ import annotations

import argparse

from fastmtp_sglang.serving.vllm_proxy import VLLMAdapter, serve


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="SGLang /generate API in front of a vLLM server")
    ap.add_argument("--vllm", required=True, help="vLLM server URL, e.g. http://127.0.0.1:8000")
    ap.add_argument("--steps", type=int, required=True,
                    help="K the vLLM server was started with (0 = no speculation)")
    ap.add_argument("--adaptive", action="store_true",
                    help="the vLLM server runs a K per batch size up to --steps (fastmtp serve "
                         "--steps auto --adaptive-config): `fastmtp bench` benches it as arm auto")
    ap.add_argument("--draft", default=None, help="the draft directory the vLLM server uses "
                    "(reported in /server_info, for the bench report)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on")
    ap.add_argument("--port", type=int, default=30000, help="port to listen on (0 = any)")
    args = ap.parse_args(argv)
    server = serve(VLLMAdapter(args.vllm, args.steps, draft=args.draft, adaptive=args.adaptive), args.host, args.port)
    print(f"fastmtp vllm-proxy: http://{args.host}:{server.server_address[1]} -> {args.vllm} "
          f"(K={args.steps}{' per batch size' if args.adaptive else ''})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
