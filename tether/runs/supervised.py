"""`python -m tether.runs.supervised PROGRAM [ARGS...]`: become PROGRAM under the launcher's watch.

`tether train` starts its services with ``TETHER_SUPERVISOR_PID`` set, and each service asks the
kernel for SIGTERM should the launcher die (``stop_with_supervisor``). A program that is
not ours cannot ask: ``torchrun``, which runs a multi-rank learner, would outlive a SIGKILLed
launcher together with its ranks. This shim asks on its behalf and then replaces itself with the
program (``execvp``: same pid; the parent-death signal survives the exec).
"""

from __future__ import annotations

import os
import sys

from common.service.supervision import stop_with_supervisor


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("usage: python -m tether.runs.supervised PROGRAM [ARGS...]", file=sys.stderr)
        return 2
    stop_with_supervisor()
    os.execvp(args[0], args)
    return 0  # not reached: execvp replaces this process or raises


if __name__ == "__main__":
    raise SystemExit(main())
