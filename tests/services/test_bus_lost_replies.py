"""Writes whose outcome the writer cannot know, made for real: a TCP proxy between the bus and a
real server forwards a command, waits until the server has answered it (so the write landed),
and then withholds the answer, either by cutting the client's connection or by holding it until
the client's socket timeout fires. The bus's own retry (``Bus.call``) then makes the command
again. What must hold, for each kind of write the services make:

- an XADD of a prompt made twice leaves two entries with one prompt id, and downstream the
  group is published once (the commit's done-set) and both entries are acknowledged;
- the Lua commit made twice publishes nothing the second time and acknowledges the same entries;
- an XREADGROUP whose reply is lost leaves entries delivered to a consumer that never saw them:
  it reads its own pending entries again, so they are not stranded until another consumer's claim.

Each runs against every server of ``conftest.server_binaries()`` (valkey, and Redis 7.0 in CI).
"""

from __future__ import annotations

import socket
import threading
import uuid

import pytest

from common.bus.client import Bus
from common.bus.consumer import Consumer
from common.bus.server import EmbeddedRedis
from common.bus.settings import BusSettings
from common.protocol.wire import PromptMsg
from tests.conftest import checked_binary, server_params
from tests.waiting import wait_until


@pytest.fixture(scope="module", params=server_params())
def redis_server(request, tmp_path_factory):
    """This module's server, one per binary (shadows the session-wide valkey fixture)."""
    binary = checked_binary(request.param)
    with EmbeddedRedis(tmp_path_factory.mktemp("redis"), binary=binary) as server:
        yield server


class ReplyWithholdingProxy:
    """A real TCP proxy in front of a Redis server. ``arm(command)``: the next time a client sends
    ``command`` (its RESP name, e.g. ``b"XADD"``), the command goes to the server and the server's
    first answer that is not an error (``-NOSCRIPT`` is passed on: nothing was written) is kept
    from the client: ``mode="cut"`` closes the client's connection, ``mode="hold"`` leaves it
    open and silent, so the client's socket timeout fires. ``withheld`` is set once that happened.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.trigger: bytes | None = None
        self.mode = "cut"
        self.withheld = threading.Event()
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, command: bytes, *, mode: str) -> None:
        with self.lock:
            self.trigger, self.mode = command, mode
            self.withheld.clear()

    def close(self) -> None:
        self.listener.close()
        for s in self.sockets:
            s.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream_port))
            self.sockets += [client, server]
            state: dict = {"dropping": False}
            threading.Thread(
                target=self._to_server, args=(client, server, state), daemon=True
            ).start()
            threading.Thread(
                target=self._to_client, args=(client, server, state), daemon=True
            ).start()

    def _to_server(self, client: socket.socket, server: socket.socket, state: dict) -> None:
        while data := _recv(client):
            with self.lock:
                name = self.trigger
                if (
                    name is not None
                    and f"${len(name)}\r\n".encode() + name + b"\r\n" in data.upper()
                ):
                    state["dropping"], self.trigger = name, None
            server.sendall(data)
        server.close()

    def _to_client(self, client: socket.socket, server: socket.socket, state: dict) -> None:
        while data := _recv(server):
            if state["dropping"] and data.startswith(b"-"):  # refused: nothing written, wait on
                with self.lock:
                    state["dropping"], self.trigger = False, state["dropping"]
            elif state["dropping"]:
                state["dropping"] = False
                self.withheld.set()
                if self.mode == "cut":
                    break
                state["held"] = True
            if not state.get("held"):
                client.sendall(data)
        client.close()


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(1 << 16)
    except OSError:
        return b""


@pytest.fixture
def proxied(redis_server):
    proxy = ReplyWithholdingProxy(redis_server.port)
    url = redis_server.url.replace(f":{redis_server.port}/", f":{proxy.port}/")
    settings = BusSettings(url=url, run="t" + uuid.uuid4().hex[:8], block_ms=100,
                           socket_timeout_s=1.5, reconnect_max_s=10)  # fmt: skip
    bus = Bus(settings, service="test")
    try:
        yield proxy, bus
    finally:
        bus.close()
        proxy.close()


def prompt(i: int) -> PromptMsg:
    return PromptMsg(prompt_id=f"p{i}", cycle=0, index=i, text=f"question {i}")


@pytest.mark.parametrize("mode", ["cut", "hold"])
def test_an_xadd_whose_reply_is_lost_is_made_again_and_its_prompt_is_published_downstream_once(
    proxied, mode
):
    proxy, bus = proxied
    consumer = Consumer(bus, "prompts", "gen", "c1")
    proxy.arm(b"XADD", mode=mode)
    bus.publish("prompts", prompt(7))
    assert proxy.withheld.is_set() and bus.connection_losses >= 1
    assert bus.redis.xlen(bus.key("prompts")) == 2  # it landed, and the retry landed again
    first, second = consumer.read(1), consumer.read(1)
    assert [d.msg.prompt_id for d in first + second] == ["p7", "p7"]
    out = [("groups", prompt(7))]
    assert consumer.commit(first, publish=out, dedupe_ids=["p7"]) == 1
    assert consumer.commit(second, publish=out, dedupe_ids=["p7"]) == 0
    assert bus.redis.xlen(bus.key("groups")) == 1
    assert bus.backlog("prompts", "gen") == (0, 0)


@pytest.mark.parametrize("mode", ["cut", "hold"])
def test_a_commit_whose_reply_is_lost_is_made_again_and_publishes_nothing_twice(proxied, mode):
    proxy, bus = proxied
    consumer = Consumer(bus, "prompts", "gen", "c1")
    for i in range(3):
        bus.publish("prompts", prompt(i))
    held = consumer.read(3)
    assert len(held) == 3
    proxy.arm(b"EVALSHA", mode=mode)
    out = [("groups", prompt(i)) for i in range(3)]
    published = consumer.commit(held, publish=out, dedupe_ids=[f"p{i}" for i in range(3)])
    assert proxy.withheld.is_set() and bus.connection_losses >= 1
    assert published == 0  # the retry found every id done: the first, unseen run published them
    assert bus.redis.xlen(bus.key("groups")) == 3
    assert bus.backlog("prompts", "gen") == (0, 0)
    assert all(consumer.is_done(f"p{i}") for i in range(3))


@pytest.mark.parametrize("mode", ["cut", "hold"])
def test_a_read_whose_reply_is_lost_is_read_again_from_the_readers_own_pending_entries(
    proxied, mode
):
    proxy, bus = proxied
    consumer = Consumer(bus, "prompts", "gen", "c1")
    for i in range(2):
        bus.publish("prompts", prompt(i))
    proxy.arm(b"XREADGROUP", mode=mode)
    seen: list = []
    # the read that lost its reply raises nothing: Bus.call made it again on a new connection
    wait_until(lambda: seen.extend(consumer.read(2)) or len(seen) >= 2, timeout_s=20,
               what="the two entries delivered by the read whose reply was lost")  # fmt: skip
    assert proxy.withheld.is_set()
    assert sorted(d.msg.prompt_id for d in seen) == ["p0", "p1"]
    assert consumer.commit(seen) == 0
    assert bus.backlog("prompts", "gen") == (0, 0)
