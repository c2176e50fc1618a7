"""Emulated hosts (``bench.hosts``): network namespaces on a switch, links shaped by tc tbf, cut,
blocked one way and healed, and everything removed afterwards; then the weight chain across
them with the real publisher and receivers (``bench.weights_hosts``), counting the bytes on the
learner's own link. Needs root (CI runs as root)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bench.hosts import NETNS_ETC, Hosts, unavailable
from bench.weights_hosts import readme_row, run_hosts_bench

pytestmark = pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "available")

SERVER = textwrap.dedent("""
    import socket, sys, time
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 5001)); s.listen(4); print("listening", flush=True)
    while True:
        c, _ = s.accept(); n = 0; t0 = time.monotonic()
        while (b := c.recv(1 << 20)):
            n += len(b)
        print(n, time.monotonic() - t0, flush=True)
""")
CLIENT = textwrap.dedent("""
    import socket, sys
    s = socket.create_connection((sys.argv[1], 5001), timeout=3)
    s.settimeout(10)
    s.sendall(b"x" * int(sys.argv[2])); s.close()
""")


def _send(net: Hosts, src: str, dst_addr: str, nbytes: int) -> int:
    return subprocess.run(net.argv(src, [sys.executable, "-c", CLIENT, dst_addr, str(nbytes)]),
                          capture_output=True, timeout=60).returncode  # fmt: skip


def test_links_are_shaped_cut_blocked_healed_and_removed():
    with Hosts() as net:
        a, b = net.add("a", mbit=40), net.add("b", mbit=40)
        names = [h.ns for h in net.hosts.values()] + [net.switch]
        hostname = subprocess.run(net.argv("a", ["hostname", "-i"]), capture_output=True,
                                  text=True, timeout=30).stdout.split()  # fmt: skip
        assert a.address in hostname  # the host's name resolves to its own address, as gloo needs
        server = net.popen("b", [sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().strip() == "listening"
        assert _send(net, "a", b.address, 2_000_000) == 0
        n, seconds = server.stdout.readline().split()
        rate_mbit = int(n) * 8 / float(seconds) / 1e6
        assert int(n) == 2_000_000 and 20 < rate_mbit < 44, rate_mbit  # the 40 Mbit/s bucket
        net.cut("b")
        assert _send(net, "a", b.address, 1000) != 0  # no route through the switch's port
        net.heal("b")
        assert _send(net, "a", b.address, 1000) == 0
        server.stdout.readline()
        net.block("a", "b")  # a's packets to b dropped: a cannot even open the connection
        assert _send(net, "a", b.address, 1000) != 0
        net.unblock("a", "b")
        assert _send(net, "a", b.address, 1000) == 0
        assert net.pids("b")  # the server still runs there: close() must kill it
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names)
    assert not any((NETNS_ETC / ns).exists() for ns in names)
    assert server.wait(10) is not None
    assert subprocess.run(["ip", "link", "show", net._host_if], capture_output=True).returncode


def test_weight_chain_on_hosts_sends_the_model_once_from_the_learner(tmp_path: Path):
    out = tmp_path / "weights_hosts.json"
    r = run_hosts_bench(out_path=out, mbit=400, generators=(1, 2), mb=16, chunk_mb=2.0,
                        repeats=1, work_dir=tmp_path)  # fmt: skip
    assert json.loads(out.read_text()) == r
    chain, pairwise = r["scaling"]["chain"], r["scaling"]["pairwise"]
    # bytes on the learner's own link (its eth0 counter, headers and the store included)
    assert 0.99 < chain["2"]["link_copies"] < 1.1
    assert 1.98 < pairwise["2"]["link_copies"] < 2.2
    for fanout in (chain, pairwise):
        for n in ("1", "2"):
            # timed until every generator had it verified: never faster than the link allows
            assert 0.2 < fanout[n]["link_rate_share"] <= 1.0
    assert "weights (hosts)" in readme_row(r)
