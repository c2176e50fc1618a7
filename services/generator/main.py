"""Entry of `tether generator`: the service loop is not built yet (see the generator issue)."""

from __future__ import annotations

import sys


def main(cfg, args) -> int:
    print("tether generator: the generator service loop is not implemented yet; --dry-run shows the resolved config.", file=sys.stderr)
    return 3
