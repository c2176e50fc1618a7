"""Services stop when the launcher dies (``tether train``): the parent-death signal."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

log = logging.getLogger(__name__)

SUPERVISOR_ENV = "TETHER_SUPERVISOR_PID"  # set by `tether train` for the services it starts


def stop_with_supervisor() -> None:
    """Under `tether train`: have the kernel send this service SIGTERM if the launcher dies.

    A launcher killed with SIGKILL cannot stop its services; without this they would keep running
    (and holding their engines' memory) with nobody supervising them. SIGTERM, not SIGKILL, so
    each service shuts down the way it does on Ctrl-C: its engine and workers go with it. Linux
    only (``prctl(PR_SET_PDEATHSIG)``); elsewhere, and outside `tether train`, a no-op. The signal
    follows the parent process: for learner ranks under ``torchrun`` that is torchrun, which the
    launcher starts through ``tether.runs.supervised`` so that it, too, stops with the launcher."""
    supervisor = os.environ.get(SUPERVISOR_ENV)
    if not supervisor or not sys.platform.startswith("linux"):
        return

    pr_set_pdeathsig = 1
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0):
        log.warning("prctl(PR_SET_PDEATHSIG) failed: this service would outlive a killed launcher")
        return
    try:  # the launcher may have died before the request above: then nobody will signal us
        os.kill(int(supervisor), 0)
    except ProcessLookupError:
        log.warning("the launcher (pid %s) is gone; stopping", supervisor)
        os.kill(os.getpid(), signal.SIGTERM)
