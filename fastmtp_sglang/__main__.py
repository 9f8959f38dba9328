from fastmtp_sglang.cli import main

raise SystemExit(main())
