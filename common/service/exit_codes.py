"""What a service's exit code says, and how a rank's code reaches past torchrun.

- ``0``: done. For the learner: the run is finished (every cycle trained); nothing should
  restart it (a Kubernetes Job counts the index complete; compose's ``on-failure`` leaves it).
- ``2`` (``EXIT_REFUSED``): the configuration or the data was refused, or the run cannot go on
  (``LostCycle``). Restarting does not help: the launcher stops the run, the Job fails at once.
- ``75`` (``EXIT_STOPPED``, ``EX_TEMPFAIL``): the learner was asked to stop (SIGTERM or SIGINT:
  a node drain, an eviction, ``docker compose stop``, Ctrl-C) before the run was finished, and
  stopped cleanly: the final checkpoint is written, and a restart resumes from it. Not a
  failure (the Job's ``podFailurePolicy`` ignores it), and not a finished run either.
- anything else: a crash; restart with back-off.

torchrun exits 1 whenever a rank exits non-zero, whatever the rank's code, so under torchrun
the codes above would all read as a crash. ``tether.runs.graceful_torchrun`` therefore sets
``RANK_EXIT_DIR_ENV`` to a directory of its own; each rank's ``tether`` CLI writes its exit
code there (``report``), and the wrapper exits with the ranks' code (``combined``) when
torchrun's is not 0.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

EXIT_REFUSED = 2
EXIT_STOPPED = 75
RANK_EXIT_DIR_ENV = "TETHER_RANK_EXIT_DIR"


def report(code: int) -> None:
    """Write this process's exit code under ``$TETHER_RANK_EXIT_DIR`` (if set) as ``<pid>``."""
    folder = os.environ.get(RANK_EXIT_DIR_ENV)
    if not folder:
        return
    try:
        tmp = Path(folder) / f".{os.getpid()}.tmp"
        tmp.write_text(f"{int(code)}\n")
        tmp.rename(Path(folder) / str(os.getpid()))
    except OSError:  # the wrapper is gone or its folder too: torchrun's own code stands
        pass


def reported(folder: str | Path) -> list[int]:
    """The codes the ranks wrote under ``folder`` (``report``), in no particular order."""
    codes = []
    for f in Path(folder).iterdir():
        if f.name.isdigit():
            try:
                codes.append(int(f.read_text().strip()))
            except (OSError, ValueError):
                continue
    return codes


def combined(torchrun_code: int, codes: Iterable[int]) -> int:
    """The exit code for ranks that exited with ``codes`` under a torchrun that exited with
    ``torchrun_code``: 0 when torchrun succeeded; ``EXIT_REFUSED`` if any rank refused;
    ``EXIT_STOPPED`` if every rank that reported stopped cleanly or finished (at least one
    stopped); otherwise torchrun's own code (a crash, or a rank that reported nothing)."""
    if torchrun_code == 0:
        return 0
    codes = list(codes)
    if EXIT_REFUSED in codes:
        return EXIT_REFUSED
    if codes and EXIT_STOPPED in codes and set(codes) <= {0, EXIT_STOPPED}:
        return EXIT_STOPPED
    return torchrun_code
