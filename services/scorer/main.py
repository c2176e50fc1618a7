"""Entry of `tether scorer`: the service loop is not built yet (see the scorer issue)."""

from __future__ import annotations

import sys


def main(cfg, args) -> int:
    print(
        "tether scorer: the scorer service loop is not implemented yet; --dry-run shows the resolved config.",
        file=sys.stderr,
    )
    return 3
