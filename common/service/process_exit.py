"""How a process that ran gloo collectives ends: its work done, without interpreter finalization.

Why. A gloo process group runs each collective on a worker thread (``pt_gloo_runloop``), which
wakes the caller when the collective is done and only afterwards drops its own reference to the
work. When that work holds a tensor whose Python object the caller has freed meanwhile (``t =
torch.tensor(...)``; ``all_reduce(t)``; ``t.item()``), dropping it takes the GIL. If the main
thread has begun interpreter finalization by then, CPython before 3.14 ends that thread with
``pthread_exit``, whose unwinding through torch's ``noexcept`` destructors calls
``std::terminate``: "terminate called without an active exception", SIGABRT, after every byte
of the run's work was written. Core dumps of the failure show exactly that stack
(``PyThread_exit_thread`` under ``take_gil`` under ``TensorImpl::decref_pyobject`` under
``~AsyncAllreduceWork`` in ``ProcessGroupGloo::runLoop``). It needs the worker thread to be
descheduled at the wrong moment, so it shows under load: 2 of 9 two-rank saves of
``tests/services/test_checkpoint_ranks.py`` on a loaded 2-core machine. ``destroy_process_group``
does not wait for those threads, and the groups live as long as the model that holds them.

So such a process asks for ``skip_finalization`` where it starts its groups, and its entry point
ends with ``end(code)``: join the process's own non-daemon threads and run the ``atexit``
functions (logging's flush among them) while the interpreter is whole, flush stdout and stderr,
then ``os._exit(code)``. Nothing that finalization would still do for such a process is lost,
and no thread is killed inside a destructor.

Only an entry point asks for it: a ``__main__`` block, or a service's ``main``. Library code that
asked (``setup_distributed``, say) would make ``end`` end any process that later runs
``tether``'s ``main`` in-process, a test worker among them (tried once: an xdist worker vanished).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading

_reason: str | None = None


def skip_finalization(reason: str) -> None:
    """Ask that this process end through ``end`` (``reason``: what it runs that needs it)."""
    global _reason
    _reason = reason


def end(code: int) -> int:
    """End the process with ``code`` without interpreter finalization if ``skip_finalization``
    was asked; otherwise return ``code`` (the caller exits as usual)."""
    if _reason is None:
        return code
    logging.getLogger(__name__).debug("exit code %d without finalization (%s)", code, _reason)
    current = threading.current_thread()
    for thread in threading.enumerate():  # what threading's own shutdown would wait for
        if thread is not current and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # logging.shutdown and the other atexit functions, in their order
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more to say
            pass
    os._exit(code)
