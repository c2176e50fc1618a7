"""Redis ACL users per service kind (``common.bus.acl``), against Debian's redis-server 7.0 started
by the deploy files' own script (deploy/compose's Redis command; deploy/k8s runs the same):
every user is refused a command outside its set, a real scorer scores and dead-letters under its
user, and redis_exporter scrapes under its own, with the server's ACL LOG empty throughout. (A
whole run with every service under its user: tests/e2e/test_e2e_acl.py.)"""

from __future__ import annotations

import os
import subprocess
import urllib.request
import uuid

import pytest
import redis

from common.bus import acl
from common.ports import free_port
from common.protocol import streams
from common.service import run_end
from tests import deploy_tools as dt
from tests.deploy_tools import UsersRedis, need_system_tool
from tests.procs.scorer_proc import ScorerProc, dead, make_group, scored, test_bus, wait_until


@pytest.fixture(scope="module")
def users_redis(tmp_path_factory):
    server = UsersRedis(tmp_path_factory.mktemp("acl"))
    yield server
    server.stop()


def test_the_deploy_files_give_each_kind_exactly_the_codes_rules():
    assert dt.acl_rules_in(dt.compose_redis_script()) == {k: acl.rules(k) for k in acl.KINDS}


# (kind, commands it must be refused: outside its set, each a plausible misuse)
REFUSED = [
    ("learner", [["FLUSHALL"], ["CONFIG", "SET", "maxmemory", "1"], ["KEYS", "*"],
                 ["EVAL", "return 1", "0"], ["ACL", "LIST"]]),
    ("generator", [["XTRIM", "x", "MAXLEN", "0"], ["DEL", "x"], ["SCAN", "0"], ["FLUSHDB"],
                   ["CONFIG", "GET", "requirepass"]]),
    ("scorer", [["SET", "tether:version:learner", "99"], ["DEL", "x"], ["XTRIM", "x", "MAXLEN", "0"],
                ["XCLAIM", "x", "g", "c", "0", "0-1"], ["SCRIPT", "FLUSH"]]),
    ("exporter", [["GET", "x"], ["XADD", "s", "*", "f", "v"], ["CONFIG", "SET", "save", ""],
                  ["SCAN", "0"]]),
]  # fmt: skip


@pytest.mark.parametrize("kind,commands", REFUSED, ids=[k for k, _ in REFUSED])
def test_each_user_is_refused_a_command_outside_its_set(users_redis, kind, commands):
    c = users_redis.client(kind)
    assert c.ping()
    for command in commands:
        with pytest.raises(redis.exceptions.NoPermissionError):
            c.execute_command(*command)
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=users_redis.port, username=acl.user_name(kind), password="wrong").ping()


# (kind, keys of run "r" it may write, keys it must be refused writing; every key readable
# except by the exporter)
KEYS = [
    ("generator", ["r:prompts", "r:groups", "r:dead", "r:status", "r:generated:groups",
                   "r:version:generator:tether-generator-3", "r:done:generators",
                   "r:inhand:prompts:generators", "r:strikes:prompts:generators"],
                  ["r:run:finished", "r:version:learner", "r:weights:addr", "r:weights:publishing",
                   "r:scored", "r:done:scorers", "r:inhand:groups:scorers", "other"]),
    ("scorer", ["r:groups", "r:scored", "r:dead", "r:status", "r:done:scorers",
                "r:inhand:groups:scorers", "r:strikes:groups:scorers"],
               ["r:run:finished", "r:prompts", "r:version:generator:g", "r:done:generators",
                "r:version:learner"]),  # (r:generated:groups matches its *:groups: a known gap)
    ("learner", ["r:run:finished", "r:prompts", "r:version:learner", "r:weights:addr"], []),
]  # fmt: skip


def _write(c: redis.Redis, key: str) -> None:
    """One write of the command family the services use on ``key`` (by its name)."""
    if key.endswith(("prompts", "groups", "scored", "dead")) and "generated" not in key:
        c.xadd(key, {"m": b"x"})
    elif key.endswith("generated:groups") or ":inhand:" in key or ":strikes:" in key:
        c.hset(key, "f", "1")
    elif ":done:" in key:
        c.zadd(key, {"id": 1.0})
    elif key.endswith(":status"):
        c.hset(key, "generator:g", "{}")
    else:
        c.set(key, "1")


@pytest.mark.parametrize("kind,own,others", KEYS, ids=[k for k, _, _ in KEYS])
def test_each_user_writes_only_its_own_keys(users_redis, kind, own, others):
    """On the real server with the deploy script's users: a generator is refused a write to the
    run-finished record (which would stop every service), the learner's keys and the scored
    stream; a scorer likewise outside its stage; both still read every key."""
    users_redis.admin.acl_log_reset()
    admin = users_redis.admin
    admin.set("r:run:finished", '{"num_cycles": 1}')
    c = users_redis.client(kind)
    for key in own:
        _write(c, key)
    for key in others:
        with pytest.raises(redis.exceptions.NoPermissionError) as refused:
            _write(c, key)
        if kind == "generator":  # it may SET, XADD, HSET: refused for the key itself
            assert "no permissions to access one of the keys" in str(refused.value), key
    if "r:run:finished" not in own:  # the learner writes it; nobody else can
        assert admin.get("r:run:finished") == b'{"num_cycles": 1}'
    assert c.get("r:run:finished") == admin.get("r:run:finished")  # every service watches it
    denied = {e["object"] for e in admin.acl_log() if e["reason"] == "key"}
    assert denied <= set(others), denied  # a refused command (a scorer's SET) logs the command
    if kind == "generator":
        assert denied == set(others), denied
    with pytest.raises(redis.exceptions.NoPermissionError):
        users_redis.client("exporter").get("r:run:finished")  # the exporter reads no key
    for key in own + ["other"]:
        admin.delete(key)


def test_a_scorer_scores_and_dead_letters_under_its_user(users_redis, tmp_path):
    users_redis.admin.acl_log_reset()
    run = f"acl{uuid.uuid4().hex[:6]}"
    bus = test_bus(users_redis.url("learner"), run)  # the learner's user publishes upstream here
    bus.ensure_group(streams.SCORED, streams.LEARNER)
    bus.publish(streams.GROUPS, make_group("g0", ["\\boxed{3}", "\\boxed{4}"], "3"))
    bus.publish(streams.GROUPS, make_group("nogold", ["\\boxed{1}"], None, index=1))
    bus.redis.xadd(bus.key(streams.GROUPS), {b"m": b"\xc1 not msgpack"})  # poison
    p = ScorerProc(users_redis.url("scorer"), run, "scorer-0", tmp_path, "run.num_cycles=2")
    try:
        wait_until(lambda: scored(bus) and len(dead(bus)) == 2, 90, "scoring", (p,))
        assert scored(bus)[0].rewards == [1.0, 0.0]
        assert {d["reason"] for d in dead(bus)} == {b"unscorable", b"undecodable"}
        bus.set(streams.RUN_FINISHED, "{}")  # malformed: ignored, not a reason to stop
        run_end.mark_finished(bus, num_cycles=2, version=2)  # the learner's user writes it
        assert p.proc.wait(30) == 0, p.tail()
    finally:
        p.cleanup()
    assert users_redis.denied() == []


def test_redis_exporter_scrapes_under_its_user(users_redis, tmp_path):
    exe = need_system_tool("prometheus-redis-exporter", "prometheus-redis-exporter")
    users_redis.admin.acl_log_reset()
    users_redis.admin.config_set("maxmemory", "256mb")  # what TetherRedisMemoryNearLimit needs
    port = free_port()
    env = {**os.environ, "REDIS_USER": acl.user_name("exporter"),
           "REDIS_PASSWORD": users_redis.passwords["exporter"]}  # fmt: skip
    proc = subprocess.Popen(
        [exe, "-redis.addr", f"redis://127.0.0.1:{users_redis.port}",
         "-web.listen-address", f"127.0.0.1:{port}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        dt.wait_http(f"http://127.0.0.1:{port}/metrics", timeout_s=15, proc=proc)
        for _ in range(2):  # two scrapes: the exporter's first-scrape-only commands too
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                text = r.read().decode()
    finally:
        proc.terminate()
        proc.wait(10)
    values = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines()
              if ln and not ln.startswith("#") and len(ln.split()) == 2}  # fmt: skip
    assert values["redis_up"] == 1
    assert values["redis_memory_max_bytes"] == 256 * 1024 * 1024
    assert users_redis.denied() == []
