"""`python -m tether.runs.graceful_torchrun [TORCHRUN ARGS...]`: torchrun whose SIGTERM is a clean
stop, and whose exit code is the ranks' own.

Plain torchrun, sent SIGTERM (a pod deleted, `docker compose stop`), forwards it to its ranks,
SIGKILLs them after ``--shutdown-timeout`` (30 s by default in torch 2.x) and exits 1 whatever
they did: a learner whose final checkpoint takes longer loses it, and a clean stop reads as a
failure (a Job counts it against ``backoffLimit``; compose's ``on-failure`` restarts it).

This wrapper runs torchrun as a child in its own session and, on SIGTERM or SIGINT, sends
SIGTERM to the ranks only (torchrun's children), not to torchrun. The ranks stop the way they
do on their own (the learner finishes its cycle, checkpoints and exits ``EXIT_STOPPED``, 75, or
0 if the run was finished anyway). If the ranks have not exited after ``--shutdown-timeout``
seconds (pass it as you would to torchrun; it is passed on), they are SIGKILLed and the exit
code is torchrun's (non-zero). Set the timeout a little under the platform's grace period
(``terminationGracePeriodSeconds``, ``stop_grace_period``).

torchrun exits 1 when any rank exits non-zero, so a refused configuration (2) or a clean stop
(75) would read as a crash. The wrapper gives the ranks a folder (``TETHER_RANK_EXIT_DIR``)
where each ``tether`` rank writes its exit code, and exits with the ranks' code instead
(``common.service.exit_codes.combined``): 2 if any rank refused, 75 if every rank that reported
stopped cleanly, else torchrun's. A Kubernetes ``podFailurePolicy`` can then tell them apart.

Should this wrapper itself die, the kernel sends torchrun SIGTERM (``PR_SET_PDEATHSIG``), and
torchrun's own shutdown takes over.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

from common.service import exit_codes
import ctypes

DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0  # torchrun's own default


def shutdown_timeout(argv: list[str]) -> float:
    """The ``--shutdown-timeout``/``--shutdown_timeout`` value in torchrun's arguments."""
    for i, arg in enumerate(argv):
        for flag in ("--shutdown-timeout", "--shutdown_timeout"):
            if arg == flag and i + 1 < len(argv):
                return float(argv[i + 1])
            if arg.startswith(flag + "="):
                return float(arg.split("=", 1)[1])
    return float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", DEFAULT_SHUTDOWN_TIMEOUT_S))


def children(pid: int) -> list[int]:
    """Pids of ``pid``'s direct children (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # the command name (2nd field) may hold spaces and parentheses: split after the last ")"
        fields = stat[stat.rindex(b")") + 2 :].split()
        if int(fields[1]) == pid:
            out.append(int(entry))
    return out


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    timeout_s = shutdown_timeout(args)
    with tempfile.TemporaryDirectory(prefix="tether-rank-exit-") as folder:
        code, killed = _run(args, timeout_s, folder)
        if killed:
            return code
        return exit_codes.combined(code, exit_codes.reported(folder))


def _run(args: list[str], timeout_s: float, folder: str) -> tuple[int, bool]:
    """torchrun's exit code, and whether the ranks had to be SIGKILLed."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *args],
        start_new_session=True,  # a signal to our process group does not reach torchrun
        preexec_fn=_die_with_parent,
        env={**os.environ, exit_codes.RANK_EXIT_DIR_ENV: folder},
    )
    asked: list[float] = []
    told: set[int] = set()

    def tell_ranks() -> None:  # ranks started after the signal (torchrun was starting) too
        new = [p for p in children(proc.pid) if p not in told]
        told.update(new)
        _signal_all(new, signal.SIGTERM)

    def on_signal(signum: int, _frame: object) -> None:
        if not asked:
            asked.append(time.monotonic())
            print(
                f"graceful_torchrun: signal {signum}: SIGTERM to the ranks; SIGKILL after "
                f"{timeout_s:.0f} s",
                file=sys.stderr,
                flush=True,
            )
            tell_ranks()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    while True:
        try:
            code = proc.wait(timeout=1.0)
            break
        except subprocess.TimeoutExpired:
            if asked:
                tell_ranks()
            if asked and time.monotonic() - asked[0] > timeout_s:
                print("graceful_torchrun: ranks still running; SIGKILL", file=sys.stderr, flush=True)
                _signal_all(children(proc.pid), signal.SIGKILL)
                asked[0] = float("inf")  # once
    return (code if code >= 0 else 128 - code), asked == [float("inf")]


if __name__ == "__main__":
    raise SystemExit(main())
