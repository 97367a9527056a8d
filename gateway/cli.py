"""`prefixgate` command line (the gateway issue grows it into `up`, `gateway`, `tenant`, `report` …)."""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help"}:
        print("usage: prefixgate {up,worker} [options]")
        return 0
    command, rest = args[0], args[1:]
    if command in {"worker", "up"}:
        # The worker runs in its own process (it imports torch; the gateway never does).
        os.execvp(sys.executable, [sys.executable, "-m", "worker", *rest])
    print(f"prefixgate: unknown command {command!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
