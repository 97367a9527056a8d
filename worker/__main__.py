"""``python -m worker`` (also ``prefixgate worker``): serve the inference worker over HTTP."""

from __future__ import annotations

import os

# Idle OpenMP threads sleep instead of spinning: a worker shares its cores with the gateway, the database
# and the HTTP loop (`prefixgate up`), and spinning threads delayed them measurably (docs/worker.md).
# Must be set before torch loads its OpenMP runtime; an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import logging
import sys

from aiohttp import web

from worker.config import ContextDoesNotFit, parse_args
from worker.server import create_app
from worker.tiers.disk_lock import DiskInUse


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    # handler_cancellation: a client that hangs up cancels its handler, which aborts its request.
    try:
        web.run_app(
            create_app(config), host=config.host, port=config.port, handler_cancellation=True, print=None
        )
    except (ContextDoesNotFit, DiskInUse) as exc:
        print(f"prefixgate worker: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
