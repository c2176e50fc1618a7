"""A whole run on emulated hosts (``bench.hosts``: a network namespace per host, joined by a
switch, each link shaped), with every service under its own Redis ACL user (``common.bus.acl``) on
Debian's Redis 7.0 started by deploy/compose's own Redis script: Redis, the learner, a vLLM
generator and a scorer each on a host of its own, as separate processes, as compose and
Kubernetes run them (no launcher), with their real settings only: the Redis URL with the
server's address and the service's user, the learner's address for the weight store
(``weights.host``), the run's weights secret. The run trains every cycle, the generator and the
scorer stop by themselves (exit 0) when the learner finishes, `tether status` and `tether bus
inspect` work from the machine's own namespace with the learner's user, the books balance, and
the server's ACL LOG stays empty: no command any service sent was outside its set."""

from __future__ import annotations

import json
import secrets
import time

import pytest

from common.bus import acl
from common.weights.handshake import SECRET_ENV
from tests.deploy_tools import UsersRedis
from tests.e2e_support import recovery_config
from tests.hosts_support import emulated_hosts, start_service, tether_json

pytestmark = pytest.mark.slow

CYCLES, PROMPTS, RESPONSES = 3, 4, 4
RUN = "acl"


@pytest.fixture
def net():
    with emulated_hosts("redis", "learner", "generator", "scorer") as hosts:
        yield hosts


def test_a_run_on_emulated_hosts_trains_with_each_service_under_its_own_user(tmp_path, net):
    (tmp_path / "redis-data").mkdir()
    server = UsersRedis(tmp_path / "redis-data", address=net.hosts["redis"].address,
                        wrap=lambda argv: net.argv("redis", argv))  # fmt: skip
    config = recovery_config(tmp_path, RUN, cycles=CYCLES)
    env = {SECRET_ENV: secrets.token_hex(16), "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "TETHER_WEIGHTS__HOST": net.hosts["learner"].address}  # fmt: skip
    logs = tmp_path / "logs"
    logs.mkdir()
    procs = {}
    try:
        for kind, args in (("learner", ()), ("generator", ("--id", "generator-0")),
                           ("scorer", ("--id", "scorer-0"))):  # fmt: skip
            procs[kind] = start_service(net, kind, kind, config, server.url(kind), logs, env, *args)
        deadline = time.monotonic() + 900
        clients: dict[str, set[str]] = {}  # Redis user -> the addresses it connected from
        while procs["learner"].poll() is None and time.monotonic() < deadline:
            for kind in ("generator", "scorer"):  # 0 once the learner wrote the run's end
                assert procs[kind].poll() in (None, 0), (logs / f"{kind}.log").read_text()[-3000:]
            for c in server.admin.client_list():
                clients.setdefault(c["user"], set()).add(c["addr"].rsplit(":", 1)[0])
            time.sleep(1)
        assert procs["learner"].wait(5) == 0, (logs / "learner.log").read_text()[-3000:]
        ended = time.monotonic()
        for kind in ("generator", "scorer"):  # the run-finished record, under their users
            assert procs[kind].wait(90) == 0, (logs / f"{kind}.log").read_text()[-3000:]
            assert "the run is finished" in (logs / f"{kind}.log").read_text()
        assert time.monotonic() - ended < 90
        doc = tether_json(config, server.url("learner"), "status")
        streams_seen = tether_json(config, server.url("learner"), "bus", "inspect")["streams"]
        assert server.denied() == []
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(30)
        server.stop()
    steps = [
        json.loads(line)
        for line in (tmp_path / "runs" / RUN / "metrics.jsonl").read_text().splitlines()
        if '"kind": "step"' in line
    ]
    assert [s["step"] for s in steps] == list(range(1, CYCLES + 1))
    # each service reached Redis from its own host, over the switch
    for kind in ("learner", "generator", "scorer"):
        assert clients.get(acl.user_name(kind)) == {net.hosts[kind].address}, clients
    learner = next(d for d in doc["services"] if d["service"] == "learner")
    books = learner["books"]
    trained = books["trained_samples"] + books["filtered_samples"]
    assert trained + books["dropped_stale_samples"] == CYCLES * PROMPTS * RESPONSES
    assert {s["stream"] for s in streams_seen} >= {"prompts", "groups"}
