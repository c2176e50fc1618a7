"""``free_port``: a TCP port free on the loopback interface right now, for a server Tether starts
itself (the embedded Redis-protocol server, the learner's weight store, a one-rank process
group) when the config leaves the port to it (0)."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
