#!/usr/bin/env python3
"""Docker HEALTHCHECK probe: exit 0 when ``GET http://127.0.0.1:PORT/healthz`` answers 200, else 1.

Usage: ``prefixgate-healthcheck ENV_VAR DEFAULT_PORT``. The port is read from ``ENV_VAR`` (the variable the
service itself reads: ``PREFIXGATE_PORT`` for the gateway, ``PREFIXGATE_WORKER_PORT`` for a worker), else
``DEFAULT_PORT``. Standard library only: the slim images have no curl.

The gateway answers 503 until its policies are loaded and at least one worker is healthy, so an unhealthy
gateway container means "cannot serve", not necessarily "crashed".
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: prefixgate-healthcheck ENV_VAR DEFAULT_PORT", file=sys.stderr)
        return 2
    port = os.environ.get(argv[1]) or argv[2]
    url = f"http://127.0.0.1:{int(port)}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=4) as response:
            body = response.read(2000).decode(errors="replace")
            ok = response.status == 200
    except urllib.error.HTTPError as exc:
        body, ok = exc.read(2000).decode(errors="replace"), False
    except OSError as exc:
        body, ok = str(exc), False
    print(body.strip())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
