"""The supervision loop of `tether train`: every service a child process in its own session,
restarted with back-off when it crashes (the same replica id, so it drains its own pending work
and rejoins the weight group), the whole run stopped when one service crashes too often or
refuses its configuration, and everything it left behind killed when its leader exits."""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from common.config.schema import TetherConfig
from common.protocol.run_dir import RunDir
from common.service.supervision import SUPERVISOR_ENV
from common.weights import handshake

log = logging.getLogger(__name__)


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    crashes: deque = field(default_factory=deque)
    restarts: int = 0
    next_start: float = 0.0
    done: bool = False  # exited 0: the run is finished (``common.service.run_end``)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        out = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        out.close()
        log.info("started %s (pid %d), log %s", self.name, self.proc.pid, self.log_path)

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def reap_group(self) -> None:
        """SIGKILL whatever is left of this child's process group once its leader has exited.

        A service killed with SIGKILL (OOM killer, a test, a node agent) cannot stop its own
        children: vLLM's engine-core process and the math-verify workers outlive it, orphaned,
        holding RAM (or GPU memory) until the machine reboots. Each child runs in its own session,
        so its process group id is its pid and survives the leader."""
        if self.proc is None or self.proc.poll() is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
            log.info("%s: killed the processes it left behind", self.name)
        except ProcessLookupError:
            pass  # nothing was left
        except PermissionError:  # pgid reused by someone else's group: not ours to kill
            pass


def cpu_thread_env(cfg: TetherConfig, env: dict[str, str]) -> dict[str, str]:
    """On a CPU-only machine, share the cores between the services instead of letting every
    process start one OpenMP thread per core: oversubscription made a learner micro-batch ~30×
    slower on the 2-core machine. A user's own OMP_NUM_THREADS wins."""
    if "OMP_NUM_THREADS" in env or cfg.generator.gpus_per_replica > 0:
        return {}
    processes = cfg.learner.nproc_per_node + cfg.generator.replicas + cfg.scorer.replicas
    threads = str(max(1, (os.cpu_count() or 1) // processes))
    return {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}


def tether_command(*args: str) -> list[str]:
    """The argv of ``tether ARGS`` run by this interpreter (``python -m tether.cli``): what the
    launcher starts its services with, and what benchmarks and tests start runs with."""
    return [sys.executable, "-m", "tether.cli", *args]


class RunFailed(RuntimeError):
    def __init__(self, message: str, *, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _tail(log_path: Path, nbytes: int = 16384) -> list[str]:
    try:
        with log_path.open("rb") as f:
            f.seek(max(0, log_path.stat().st_size - nbytes))
            return f.read().decode(errors="replace").splitlines()
    except OSError:
        return []


def _refusal(log_path: Path) -> str:
    """The last `tether ...` error line a service that exited 2 wrote to its log, if any."""
    lines = _tail(log_path)
    said = [ln for ln in lines if ln.startswith("tether") and ("error" in ln or "cannot" in ln)]
    return said[-1] if said else ""


def refused(name: str, log_path: Path) -> str:
    """What a service's exit code 2 means, in its own words: a learner that cannot go on
    (``LostCycle``: the run's data ran out, not its configuration) or a refused configuration."""
    said = _refusal(log_path)
    if ": cannot go on:" in said:
        why = said.split(": cannot go on: ", 1)[1]
        redrive = (
            " `tether bus redrive` returns re-drivable dead letters once their cause is fixed;"
            " then `tether train --resume`."
            if "dead-lettered" in why
            else ""
        )
        return f"{name} cannot go on (exit code 2): {why}{redrive} See {log_path}"
    return (
        f"{name} refused its configuration or data (exit code 2)"
        f"{': ' + said if said else ''}; see {log_path}"
    )


def _last_error(log_path: Path) -> str:
    """The last line of a crashed service's log that names an error (a traceback's last line)."""
    lines = [ln.strip() for ln in _tail(log_path)]
    said = [ln for ln in lines if ln and ("Error" in ln or "error" in ln)]
    return said[-1][:400] if said else ""


# Seconds the learner gets on stop to finish its cycle and write its final checkpoint.
LEARNER_DRAIN_S = 120.0
# Seconds the other services get on stop after the learner, then the wait after SIGKILL: with
# the learner's drain, the longest a launcher's shutdown takes (``Supervisor.shutdown``).
OTHERS_DRAIN_S = 30.0
KILL_WAIT_S = 5.0
SHUTDOWN_MAX_S = LEARNER_DRAIN_S + OTHERS_DRAIN_S + KILL_WAIT_S
# Seconds generators and scorers get to stop by themselves once the learner finished the run
# (they look for its record every 2 s; a generator then shuts its engine down).
RUN_END_WAIT_S = 60.0


class Supervisor:
    def __init__(
        self, cfg: TetherConfig, run_dir: Path, *, redis_url: str, config_path: Path, progress=None
    ) -> None:
        self.cfg, self.run_dir, self.redis_url = cfg, run_dir, redis_url
        self.progress = progress
        env = dict(os.environ, TETHER_RUN__REDIS_URL=redis_url, PYTHONUNBUFFERED="1")
        env[SUPERVISOR_ENV] = str(os.getpid())  # services stop if the launcher dies
        # only this run's processes join the learner's weight group (common.weights.handshake)
        env.setdefault(handshake.SECRET_ENV, secrets.token_hex(32))
        env.update(cpu_thread_env(cfg, env))
        cli = tether_command()
        conf = ["--config", str(config_path)]
        logs = RunDir(run_dir).logs
        ln = cfg.learner
        if ln.nproc_per_node > 1 or ln.nnodes > 1:
            learner_argv = [
                sys.executable,
                "-m",
                "tether.runs.supervised",  # torchrun and its ranks stop if the launcher dies
                sys.executable,
                "-m",
                "tether.runs.graceful_torchrun",  # SIGTERM: the ranks checkpoint; the ranks' exit code
                f"--shutdown-timeout={int(LEARNER_DRAIN_S) - 10}",
                "--nproc_per_node",
                str(ln.nproc_per_node),
                "-m",
                "tether.cli",
                "learner",
                *conf,
            ]
        else:
            learner_argv = [*cli, "learner", *conf]
        self.learner = Child("learner", learner_argv, logs / "learner.log", env)
        self.children = [self.learner]
        for i in range(cfg.generator.replicas):
            self.children.append(
                Child(
                    f"generator-{i}",
                    [*cli, "generator", *conf, "--id", f"generator-{i}"],
                    logs / f"generator-{i}.log",
                    env,
                )
            )
        for i in range(cfg.scorer.replicas):
            self.children.append(
                Child(
                    f"scorer-{i}",
                    [*cli, "scorer", *conf, "--id", f"scorer-{i}"],
                    logs / f"scorer-{i}.log",
                    env,
                )
            )
        self.stopping = False

    def start(self) -> None:
        for c in self.children:
            c.start()

    def _on_exit(self, c: Child, code: int) -> None:
        now = time.monotonic()
        window, limit = self.cfg.run.crash_window_s, self.cfg.run.max_crashes
        c.crashes.append(now)
        while c.crashes and now - c.crashes[0] > window:
            c.crashes.popleft()
        if code == 2:  # the preflight passed here, so the service found something it did not
            raise RunFailed(refused(c.name, c.log_path), exit_code=2)
        if len(c.crashes) >= limit:
            said = _last_error(c.log_path)
            raise RunFailed(
                f"{c.name} crashed {len(c.crashes)} times within {window:.0f} s (last exit code "
                f"{code}; run.max_crashes = {limit}, run.crash_window_s); stopping the run"
                f"{'. Its last error: ' + said if said else ''}. See its log: {c.log_path}"
            )
        delay = min(30.0, 2.0 ** len(c.crashes))
        c.next_start = now + delay
        c.restarts += 1
        c.proc = None
        log.warning(
            "%s exited with code %d; restarting in %.0f s (restart #%d, log %s)",
            c.name,
            code,
            delay,
            c.restarts,
            c.log_path,
        )

    def poll(self) -> bool:
        """One supervision pass; returns False when the run is over (learner finished)."""
        for c in self.children:
            if c.done:
                continue
            if c.proc is None:
                if not self.stopping and time.monotonic() >= c.next_start:
                    c.start()
                continue
            code = c.proc.poll()
            if code is None:
                continue
            c.reap_group()
            if c is self.learner and code == 0:
                return False
            if self.stopping:
                continue
            if code == 0:  # a generator or scorer saw the run finished: not a crash, no restart
                c.done = True
                continue
            self._on_exit(c, code)
        return True

    def run(self) -> int:
        self.start()
        last_progress = 0.0
        while self.poll():
            time.sleep(0.5)
            if self.progress is not None and time.monotonic() - last_progress >= 5.0:
                last_progress = time.monotonic()
                self.progress()
        self.await_run_end(RUN_END_WAIT_S)
        return 0

    def await_run_end(self, timeout_s: float) -> list[str]:
        """After the learner finished the run: give generators and scorers ``timeout_s`` to
        see the run-finished record and stop by themselves (exit 0), as they do in compose and
        on Kubernetes; ``shutdown`` stops whoever is left. Returns the names still running."""
        deadline = time.monotonic() + timeout_s
        waiting = [c for c in self.children if c is not self.learner and c.proc is not None]
        while waiting and time.monotonic() < deadline:
            for c in list(waiting):
                assert c.proc is not None
                code = c.proc.poll()
                if code is None:
                    continue
                waiting.remove(c)
                c.reap_group()
                if code == 0:
                    log.info("%s stopped by itself at the end of the run (exit code 0)", c.name)
                else:
                    log.warning("%s exited with code %d at the end of the run", c.name, code)
            time.sleep(0.2)
        for c in waiting:
            log.warning("%s still runs %.0f s after the run finished: stopping it", c.name, timeout_s)
        return [c.name for c in waiting]

    def shutdown(self, *, drain_s: float = LEARNER_DRAIN_S) -> None:
        """Learner first (final checkpoint), then the others; SIGKILL after ``drain_s``."""
        self.stopping = True
        self.learner.signal(signal.SIGTERM)
        _wait([self.learner], drain_s)
        others = [c for c in self.children if c is not self.learner]
        for c in others:
            c.signal(signal.SIGTERM)
        _wait(others, OTHERS_DRAIN_S)
        for c in self.children:
            c.signal(signal.SIGKILL)
        _wait(self.children, KILL_WAIT_S)
        for c in self.children:
            c.reap_group()


def _wait(children: list[Child], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for c in children:
        if c.proc is None:
            continue
        try:
            c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
