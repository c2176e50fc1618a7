"""Emulated hosts on one machine: each host a Linux network namespace with one interface
(``eth0``) on a switch, each link shaped to its own rate, links that can be cut and healed.

The switch is a bridge inside a namespace of its own, so that the machine's firewall (Docker's
``FORWARD DROP`` with ``br_netfilter``) never sees the bridged traffic and nothing of the
machine's own network configuration is touched. The host namespace (where this process and
``tether status`` run) joins the switch as one more port with address ``.1``.

Each host's hostname resolves to its own address inside its namespace (``/etc/netns/<ns>/hosts``,
which ``ip netns exec`` mounts over ``/etc/hosts``), as on a real host: gloo binds the address
the hostname resolves to, and on this machine that is 127.0.0.1 otherwise. ``alias`` adds a name
that every host resolves to one host's address, and moves it (a DNS record a failover updates).

Shaping: a token bucket (``tc ... tbf``) on both directions of a host's link (egress of its
``eth0`` for what it sends, egress of the switch's port for what it receives), so a host at
1000 Mbit/s sends and receives at most that, whoever its peers are. The kernel here has no
``netem``: no emulated delay or loss. Cutting a link sets the switch's port down (the host is
cut from everyone); ``block(a, b)`` drops what ``a`` sends to ``b`` only (a one-way partition,
as a half-broken NIC or a firewall rule makes), with a blackhole route in ``a``.

Needs root and iproute2 (CI runs as root). Everything is created under a prefix of this
process's own (parallel test workers do not collide) and removed by ``close()``, processes left
in the namespaces included.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

NETNS_ETC = Path("/etc/netns")


def unavailable() -> str:
    """Why emulated hosts cannot be made here ("" when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    return ""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.213-10.254 that no route of the machine covers, chosen by this process id."""
    used = [ipaddress.IPv4Network(r.split()[0], strict=False)
            for r in _ip("-4", "route", "show").stdout.splitlines()
            if r and r.split()[0][0].isdigit()]  # fmt: skip
    start = os.getpid()
    for k in range(42 * 256):
        i = (start + k) % (42 * 256)
        net = ipaddress.IPv4Network(f"10.{213 + i // 256}.{i % 256}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free 10.x.y.0/24 for the emulated hosts")


@dataclass
class Host:
    name: str
    ns: str  # its network namespace
    address: str
    port: str  # its port's name in the switch namespace
    mbit: float | None = None


class Hosts:
    """A switch and the hosts on it; a context manager that removes everything on exit."""

    def __init__(self, *, latency_ms: float = 10.0) -> None:
        self.latency_ms = latency_ms  # the most a packet waits in a shaped link's queue
        why = unavailable()
        if why:
            raise RuntimeError(f"emulated hosts: {why}")
        self.prefix = f"t{os.getpid() % 100000}"
        self.subnet = _free_subnet()
        self._addrs = iter(self.subnet.hosts())
        self.switch = f"{self.prefix}-sw"
        self.hosts: dict[str, Host] = {}
        self._host_if = f"{self.prefix}h"
        self._blocks: set[tuple[str, str]] = set()
        self.aliases: dict[str, str] = {}  # a name every host resolves -> the host it names
        try:
            _ip("netns", "add", self.switch)
            self._in(self.switch, "link", "set", "lo", "up")
            self._in(self.switch, "link", "add", "br0", "type", "bridge")
            self._in(self.switch, "link", "set", "br0", "up")
            # the host namespace's own port: .1
            self.address = str(next(self._addrs))
            _ip("link", "add", self._host_if, "type", "veth", "peer", "name", "p0",
                "netns", self.switch)  # fmt: skip
            _ip("addr", "add", f"{self.address}/{self.subnet.prefixlen}", "dev", self._host_if)
            _ip("link", "set", self._host_if, "up")
            self._in(self.switch, "link", "set", "p0", "master", "br0")
            self._in(self.switch, "link", "set", "p0", "up")
        except BaseException:
            self.close()
            raise

    def _in(self, ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return _ip("-n", ns, *args, check=check)

    def add(self, name: str, *, mbit: float | None = None) -> Host:
        """A host on the switch, its link shaped to ``mbit`` Mbit/s each way (None: unshaped)."""
        if name in self.hosts:
            raise ValueError(f"host {name!r} exists")
        k = len(self.hosts) + 1
        host = Host(name, f"{self.prefix}-{name}", str(next(self._addrs)), f"p{k}")
        _ip("netns", "add", host.ns)
        self.hosts[name] = host
        (NETNS_ETC / host.ns).mkdir(parents=True, exist_ok=True)
        self._write_hosts(host)
        self._in(self.switch, "link", "add", host.port, "type", "veth", "peer", "name", "eth0",
                 "netns", host.ns)  # fmt: skip
        self._in(host.ns, "addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", "eth0")
        self._in(host.ns, "link", "set", "eth0", "up")
        self._in(host.ns, "link", "set", "lo", "up")
        self._in(self.switch, "link", "set", host.port, "master", "br0")
        self._in(self.switch, "link", "set", host.port, "up")
        if mbit is not None:
            self.shape(name, mbit)
        return host

    def _write_hosts(self, host: Host) -> None:
        """``host``'s ``/etc/hosts``: its own names, and the aliases. Written in place (the same
        file), since what runs in the namespace sees the file ``ip netns exec`` bind-mounted."""
        lines = ["127.0.0.1 localhost", f"{host.address} {socket.gethostname()} {host.name}"]
        lines += [f"{self._addr(target)} {alias}" for alias, target in self.aliases.items()]
        path = NETNS_ETC / host.ns / "hosts"
        path.touch()
        with path.open("r+") as f:  # overwritten, then cut: never empty for a reader
            f.write("\n".join(lines) + "\n")
            f.truncate()

    def alias(self, alias: str, target: str) -> None:
        """``alias`` resolves to host ``target``'s address on every host, at once for the next
        lookup (what a DNS record's change does once its TTL has passed: a failover that moves a
        service's name to another host)."""
        self.aliases[alias] = target
        for host in self.hosts.values():
            self._write_hosts(host)

    def shape(self, name: str, mbit: float) -> None:
        """Both directions of ``name``'s link at ``mbit`` Mbit/s (a token bucket whose burst is
        10 ms of the rate, at least 64 kB)."""
        host = self.hosts[name]
        burst = max(64 << 10, int(mbit * 1e6 / 8 / 100))
        spec = [
            "root",
            "tbf",
            "rate",
            f"{mbit}mbit",
            "burst",
            str(burst),
            "latency",
            f"{self.latency_ms}ms",
        ]
        for ns, dev in ((host.ns, "eth0"), (self.switch, host.port)):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev,
                            *spec], check=True, capture_output=True, timeout=30)  # fmt: skip
        host.mbit = mbit

    def cut(self, name: str) -> None:
        """``name`` cut from every other host (its switch port down)."""
        self._in(self.switch, "link", "set", self.hosts[name].port, "down")

    def heal(self, name: str) -> None:
        self._in(self.switch, "link", "set", self.hosts[name].port, "up")

    def block(self, src: str, dst: str) -> None:
        """What ``src`` sends to ``dst`` is dropped (``dst`` still reaches ``src``); ``dst`` may be
        a host's name or ``"host"`` (this namespace)."""
        self._in(self.hosts[src].ns, "route", "add", "blackhole", f"{self._addr(dst)}/32")
        self._blocks.add((src, dst))

    def unblock(self, src: str, dst: str) -> None:
        self._in(self.hosts[src].ns, "route", "del", "blackhole", f"{self._addr(dst)}/32")
        self._blocks.discard((src, dst))

    def _addr(self, name: str) -> str:
        return self.address if name == "host" else self.hosts[name].address

    def argv(self, name: str, argv: list[str]) -> list[str]:
        """``argv`` run on host ``name``."""
        return ["ip", "netns", "exec", self.hosts[name].ns, *argv]

    def popen(self, name: str, argv: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(self.argv(name, argv), **kw)

    def pids(self, name: str) -> list[int]:
        out = _ip("netns", "pids", self.hosts[name].ns, check=False).stdout
        return [int(p) for p in out.split()]

    def close(self) -> None:
        """Kill what still runs on the hosts, remove the namespaces, the switch and the host
        namespace's port; waits until the kernel has let go of the port."""
        for host in self.hosts.values():
            for pid in self.pids(host.name):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for host in self.hosts.values():
            _ip("netns", "del", host.ns, check=False)
            shutil.rmtree(NETNS_ETC / host.ns, ignore_errors=True)
        self.hosts = {}
        _ip("netns", "del", self.switch, check=False)
        _ip("link", "del", self._host_if, check=False)
        end = time.monotonic() + 10
        while _ip("link", "show", self._host_if, check=False).returncode == 0:
            if time.monotonic() > end:
                break
            time.sleep(0.05)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
