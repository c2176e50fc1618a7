"""Entry of `tether learner`: the service loop is not built yet (see the learner issue)."""

from __future__ import annotations

import sys


def main(cfg, args) -> int:
    print("tether learner: the learner service loop is not implemented yet; --dry-run shows the resolved config.", file=sys.stderr)
    return 3
