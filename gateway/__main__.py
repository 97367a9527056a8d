"""``python -m gateway …`` is ``prefixgate …``."""

from gateway.cli import main

raise SystemExit(main())
