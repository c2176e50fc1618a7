"""`tether demo`: placeholder until the end-to-end launcher lands (issue 7)."""

from __future__ import annotations

import sys


def main(args) -> int:
    print("tether demo: the end-to-end demo is not built yet.", file=sys.stderr)
    return 3
