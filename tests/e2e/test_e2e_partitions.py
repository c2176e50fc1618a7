"""Partitions in a real run on emulated hosts (``tests.hosts_support``): Redis, the learner, a vLLM
generator and a scorer each on a host of its own, started as compose starts them, with their
real settings. A fault is made during the run's busiest moment (the learner training and
publishing, the generator sampling, the scorer grading) and healed; the run must finish with
every response accounted for once (0 lost, 0 trained twice) and the stall it caused bounded.
Each run is longer than its faults can last and ends early once they are over and what follows
them is seen (`tether finish`: the cycles dispatched are trained, then every service exits 0),
so it lasts as long as its faults whatever the machine's pace."""

from __future__ import annotations

import json
import secrets
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.hosts import Hosts
from common.protocol import streams
from common.weights.handshake import SECRET_ENV
from services.learner.loop import TEST_ONLY_STEP_DELAY_ENV
from tests.deploy_tools import UsersRedis
from tests.e2e_support import recovery_config
from tests.hosts_support import emulated_hosts, start_service, tether_json, tether_verb
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

PROMPTS, RESPONSES = 4, 4
CYCLES = 5000  # run.num_cycles: more than any run here reaches before `tether finish` ends it
# (host, service, arguments): each service on a host named by its id
SERVICES = (("learner", "learner", ()),
            ("generator-0", "generator", ("--id", "generator-0")),
            ("generator-1", "generator", ("--id", "generator-1")),
            ("scorer-0", "scorer", ("--id", "scorer-0")))  # fmt: skip
GENERATORS = ("generator-0", "generator-1")
WATCHED = ("tether_bus_claimed_messages_total", "tether_bus_duplicates_skipped_total")
VERSION = "tether_generator_policy_version"  # the version each generator's engine runs


@dataclass
class Window:
    """One fault: when it was made and when it was healed (monotonic seconds)."""

    name: str
    start: float = 0.0
    healed: float = 0.0


@dataclass
class Run:
    steps: list[dict] = field(default_factory=list)
    step_seen: dict[int, float] = field(default_factory=dict)  # step -> monotonic time seen
    books: dict = field(default_factory=dict)
    logs: Path = Path()
    windows: list[Window] = field(default_factory=list)
    counters: dict[str, dict[str, float]] = field(default_factory=dict)  # host -> WATCHED totals
    versions: dict[str, list[tuple[float, int]]] = field(default_factory=dict)  # host -> readings

    def recovery_s(self, w: Window) -> float:
        """Seconds from healing ``w`` to the next step the learner published."""
        after = [t for t in self.step_seen.values() if t > w.healed]
        return (min(after) - w.healed) if after else float("inf")

    def steps_during(self, w: Window) -> int:
        return sum(w.start <= t <= w.healed for t in self.step_seen.values())


def _run(tmp_path: Path, net: Hosts, name: str, at_step: int, faults: Callable[..., None],
         seen: Callable[[Run], bool], server: Any = None, step_delay_s: float = 0.0) -> Run:  # fmt: skip
    """A run of ``CYCLES`` at most; ``faults(net, run, stop, admin, name)`` runs on a thread of
    its own once the learner has published step ``at_step``: it makes each fault and heals it,
    and records its ``Window`` in ``run.windows`` (``stop``: the test is over, heal and return;
    ``admin``: a client of the server as its default user; ``name``: the run's). Once the faults
    are over and ``seen(run)`` (what must follow them), `tether finish` ends the run early.
    ``server``: the run's Redis (``url(kind)``, ``admin``, ``stop()``; ``status_url(kind)``
    where ``url`` names what this namespace cannot resolve), default one on host "redis".
    ``step_delay_s``: the learner sleeps this long after each step (a test hook standing for a
    real model's slower steps)."""
    if server is None:
        (tmp_path / "redis-data").mkdir()
        server = UsersRedis(tmp_path / "redis-data", address=net.hosts["redis"].address,
                            wrap=lambda argv: net.argv("redis", argv))  # fmt: skip
    config = recovery_config(tmp_path, name, cycles=CYCLES)
    env = {SECRET_ENV: secrets.token_hex(16), "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "TETHER_WEIGHTS__HOST": net.hosts["learner"].address,
           "TETHER_BUS__CLAIM_IDLE_S": str(CLAIM_IDLE_S),
           "TETHER_BUS__SOCKET_TIMEOUT_S": str(SOCKET_TIMEOUT_S),
           TEST_ONLY_STEP_DELAY_ENV: str(step_delay_s)}  # fmt: skip
    run = Run(logs=tmp_path / "logs")
    run.logs.mkdir()
    procs: dict[str, subprocess.Popen] = {}
    version_key = f"{name}:{streams.LEARNER_VERSION}"
    faulting: threading.Thread | None = None
    finishing = False
    stop = threading.Event()
    try:
        for host, kind, args in SERVICES:
            procs[host] = start_service(net, host, kind, config, server.url(kind), run.logs, env,
                                        *args)  # fmt: skip
        deadline = time.monotonic() + 900
        while procs["learner"].poll() is None and time.monotonic() < deadline:
            for host in (*GENERATORS, "scorer-0"):  # a crash fails at once (0: the run's end)
                assert procs[host].poll() in (None, 0), _tail(run, host)
            _watch(net, server.admin, name, run)
            step = int(server.admin.get(version_key) or 0)
            if step > 0:
                run.step_seen.setdefault(step, time.monotonic())
            if faulting is None and step >= at_step:
                faulting = threading.Thread(target=faults, daemon=True,
                                            args=(net, run, stop, server.admin, name))  # fmt: skip
                faulting.start()
            if not finishing and faulting is not None and not faulting.is_alive() and seen(run):
                finishing = True
                print(tether_verb(config, getattr(server, "status_url", server.url)("learner"),
                                  "finish"), f"at step {step}")  # fmt: skip
            time.sleep(0.25)
        assert faulting is not None and not faulting.is_alive(), (
            f"the faults did not end before the run: {_progress(run)}"
        )
        assert procs["learner"].wait(5) == 0, _tail(run, "learner")
        for host in (*GENERATORS, "scorer-0"):
            assert procs[host].wait(90) == 0, _tail(run, host)
        doc = tether_json(config, getattr(server, "status_url", server.url)("learner"), "status")
    finally:
        stop.set()
        if faulting is not None:
            faulting.join(30)
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(30)
        server.stop()
    metrics = tmp_path / "runs" / name / "metrics.jsonl"
    run.steps = [json.loads(x) for x in metrics.read_text().splitlines() if '"kind": "step"' in x]
    run.books = next(d for d in doc["services"] if d["service"] == "learner")["books"]
    return run


def _watch(net: Hosts, admin, name: str, run: Run) -> None:
    """The generators' ``WATCHED`` counters, read from their /metrics over the switch."""
    for raw in admin.hgetall(f"{name}:status").values():
        doc = json.loads(raw)
        if doc.get("id") not in GENERATORS or not doc.get("metrics_port"):
            continue
        url = f"http://{net.hosts[doc['id']].address}:{doc['metrics_port']}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                text = resp.read().decode()
        except OSError:  # cut off, or gone at the run's end: the last reading stays
            continue
        totals = dict.fromkeys(WATCHED, 0.0)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in totals:
                    totals[sample.name] += sample.value
                elif sample.name == VERSION:
                    run.versions.setdefault(doc["id"], []).append(
                        (time.monotonic(), int(sample.value))
                    )
        run.counters[doc["id"]] = totals


def _progress(run: Run) -> str:
    """The learner's step at each heal and at the end, for a run too short for its faults."""
    seen = run.step_seen.items()
    heals = {w.name: max((s for s, t in seen if t <= w.healed), default=0) for w in run.windows}
    return f"the step by each heal {heals}, the last step {max(run.step_seen, default=0)}"


def _tail(run: Run, host: str) -> str:
    return (run.logs / f"{host}.log").read_text(errors="replace")[-3000:]


def _trained_once(run: Run) -> None:
    """The run ended early (`tether finish`), after the steps seen during it; every step ran
    once, and every response of the cycles it dispatched was trained, filtered or dropped as
    stale exactly once: none lost, none trained twice."""
    cycles = len(run.steps)
    assert max(run.step_seen) <= cycles < CYCLES, (cycles, max(run.step_seen))
    assert [s["step"] for s in run.steps] == list(range(1, cycles + 1)), run.steps
    b = run.books
    assert b["trained_samples"] + b["filtered_samples"] + b["dropped_stale_samples"] == (
        cycles * PROMPTS * RESPONSES
    ), b


@pytest.fixture
def net():
    with emulated_hosts("redis", *(host for host, _, _ in SERVICES)) as hosts:
        yield hosts


# The runs' bus timings, shorter than the suite's other runs (tests.e2e_support.write_config) so
# that each fault, which must outlast them, is short too: both are set through the environment
CLAIM_IDLE_S = 10.0  # bus.claim_idle_s
SOCKET_TIMEOUT_S = 10.0  # bus.socket_timeout_s
WEIGHTS_TIMEOUT_S = 20.0  # weights.timeout_s of the run
FLAP_S, FLAPS = 3.0, 6  # a link down 3 s, up 3 s, six times
CUT_S = 20.0  # a service cut off
LONG_CUT_S = 3 * CLAIM_IDLE_S  # the learner, or a generator, cut off from Redis
# After a fault is healed the learner publishes a step within: a request or reply the partition
# dropped is retransmitted by TCP, or at worst its socket times out (bus.socket_timeout_s) and
# the call is made again on a new connection (back-off at most 2 s), then a cycle runs
RECOVERY_BOUND_S = SOCKET_TIMEOUT_S + 2.0 + 8.0
PAUSE_S = 5.0  # between two faults: the run goes on
# generator-0 cut off from the learner holds prompts that need a version it cannot get. A publish
# drops it (within weights.timeout_s); it is then behind, and lets the claims lapse once behind
# for a whole period of claim_idle_s / 3 without loading a version (checked every period: at
# most two periods); generator-1 takes them over claim_idle_s after their last refresh (at most a
# period before the lapse), at its next claim scan (every claim_idle_s / 4), and runs a cycle
TAKEOVER_S = WEIGHTS_TIMEOUT_S + 2 * CLAIM_IDLE_S / 3 + CLAIM_IDLE_S + CLAIM_IDLE_S / 4 + 8.0
WEIGHTS_CUT_S = 60.0  # past TAKEOVER_S (~47 s): the run must step while the cut still lasts
# generator-0's receive fails during the cut (each call to the learner's store is answered
# within common.weights.store_calls.CALL_LIMIT_S, or the connection is given up); healed, it
# joins again on a new connection (a try every 2 s) and takes the next publish: 1.9 s measured
CATCH_UP_S = WEIGHTS_TIMEOUT_S + RECOVERY_BOUND_S
# The learner of the partitions run sleeps this long after each step (a test hook). The faults
# last minutes whatever the run's pace; at full pace every service computes through them (two
# generators sampling, a scorer, a learner: 346 CPU-seconds in 442 s in a CI run), on the cores
# the suite's other worker needs. The generators stop at the staleness bound meanwhile, so a
# slower run computes less; it still steps during every fault that lets it, and ~2.5 s a step
# leaves the weights cut's takeover (at most TAKEOVER_S into its WEIGHTS_CUT_S) five steps
STEP_DELAY_S = 2.0


def _faults(net: Hosts, run: Run, stop: threading.Event, admin, name: str) -> None:
    """The schedule, one fault after another, each healed before the next."""

    def hold(seconds: float) -> None:
        stop.wait(seconds)

    def window(name: str, make: Callable[[], object], heal: Callable[[], object], seconds: float):
        w = Window(name, start=time.monotonic())
        make()
        hold(seconds)
        heal()
        w.healed = time.monotonic()
        run.windows.append(w)
        hold(PAUSE_S)

    # the generator's link flapping: it is cut from Redis, the learner and the weight chain
    w = Window("generator-0's link flapping", start=time.monotonic())
    for _ in range(FLAPS):
        if stop.is_set():
            break
        net.cut("generator-0")
        hold(FLAP_S)
        net.heal("generator-0")
        hold(FLAP_S)
    w.healed = time.monotonic()
    run.windows.append(w)
    hold(PAUSE_S)

    # the learner cut off from Redis (it still reaches the generator: publishes go on)
    def both_ways(fn: Callable[[str, str], None], a: str, b: str) -> None:
        fn(a, b)
        fn(b, a)

    window("learner cut off from Redis", lambda: both_ways(net.block, "learner", "redis"),
           lambda: both_ways(net.unblock, "learner", "redis"), LONG_CUT_S)  # fmt: skip
    # one way: the generator's commands reach Redis, the replies do not (a write may have
    # landed that the generator cannot know of: its retry must not duplicate it)
    window(
        "generator-0 hears nothing from Redis (one way)",
        lambda: net.block("redis", "generator-0"),
        lambda: net.unblock("redis", "generator-0"),
        CUT_S,
    )
    # the scorer cut off from everyone, mid-batch: while it holds groups it read and has not
    # yet acked (grading them, or committing their scores)
    groups = f"{name}:{streams.GROUPS}"
    wait_until(lambda: admin.xpending_range(groups, streams.SCORERS, "-", "+", 10, "scorer-0"),
               timeout_s=60, what="scorer-0 holding a group", poll_s=0.01)  # fmt: skip
    window("scorer cut off", lambda: net.cut("scorer-0"), lambda: net.heal("scorer-0"), CUT_S)
    # generator-1 cut off from Redis past bus.claim_idle_s while it holds prompts: generator-0
    # claims them; healed, generator-1's late commit of the same groups publishes nothing
    key = f"{name}:{streams.PROMPTS}"
    wait_until(lambda: admin.xpending_range(key, streams.GENERATORS, "-", "+", 10, "generator-1"),
               timeout_s=60, what="generator-1 holding a prompt", poll_s=0.02)  # fmt: skip
    window("generator-1 cut off from Redis past bus.claim_idle_s",
           lambda: both_ways(net.block, "generator-1", "redis"),
           lambda: both_ways(net.unblock, "generator-1", "redis"), LONG_CUT_S)  # fmt: skip
    # generator-0, the chain's first member, cut off from the learner: the publish drops it and
    # sends the version down a new chain to generator-1; healed, generator-0 rejoins, catches up
    window("generator-0 cut off from the learner",
           lambda: both_ways(net.block, "generator-0", "learner"),
           lambda: both_ways(net.unblock, "generator-0", "learner"), WEIGHTS_CUT_S)  # fmt: skip


def test_partitions_during_a_run_lose_nothing_train_nothing_twice_and_stall_boundedly(
    tmp_path, net
):
    """One run with two generators, six faults one after another from its second step (the
    run's steady state: the generators sampling, the scorer grading, the learner training and
    publishing down the weight chain every cycle), each healed before the next: generator-0's
    link flapping (3 s down, 3 s up, six times), the learner cut off from Redis for 30 s (its
    weight publishes still reach the generators), a one-way partition for 20 s (generator-0's
    commands reach Redis, the replies do not: writes may land that it cannot know of, and its
    retries must not duplicate them), the scorer cut off from everyone for 20 s while it holds
    groups it has read and not acked, generator-1 cut off from Redis for 30 s while it holds
    prompts (past ``bus.claim_idle_s``, 10 s here: generator-0 claims them, and generator-1's
    late commit publishes nothing), and generator-0, the chain's first member, cut off from the
    learner for 60 s (dropped by the publish, which goes on to generator-1 down a new chain; the
    prompts it holds need a version it cannot get, so it lets their claims lapse and takes no
    more prompts, and generator-1 takes them over and runs on while the cut lasts; healed, it
    rejoins and runs the learner's version within ``CATCH_UP_S``). Every response is trained
    exactly once, the run finishes, and after each fault the run steps again within
    ``RECOVERY_BOUND_S``."""

    # the run ends once generator-0 caught up after the last heal, or CATCH_UP_S after it (the
    # assertions below tell which); with STEP_DELAY_S and one other busy process on the 2-core
    # machine, 54 steps by the last heal, generator-0 caught up 3.6 s after it
    def seen(run: Run) -> bool:
        return _caught_up_s(run) is not None or time.monotonic() > run.windows[-1].healed + (
            CATCH_UP_S
        )

    run = _run(tmp_path, net, "partitions", 2, _faults, seen, step_delay_s=STEP_DELAY_S)
    _trained_once(run)
    report = {w.name: {"steps during": run.steps_during(w),
                       "recovery s": round(run.recovery_s(w), 1),
                       "steps by its heal": sum(t <= w.healed for t in run.step_seen.values())}
              for w in run.windows}  # fmt: skip
    last = max(w.healed for w in run.windows)
    print("faults", json.dumps(report, indent=1), "books", run.books,
          "steps by the last heal", sum(t <= last for t in run.step_seen.values()))  # fmt: skip
    assert len(run.windows) == 6, report
    # generator-0 took over generator-1's prompts, and generator-1's late commit was skipped
    assert run.counters["generator-0"]["tether_bus_claimed_messages_total"] > 0, run.counters
    assert run.counters["generator-1"]["tether_bus_duplicates_skipped_total"] > 0, run.counters
    # while generator-0 was still cut off from the learner, generator-1 took its prompts over
    # and the run stepped again; generator-0 took no more prompts, so the run went on at
    # generator-1's pace, not one cycle per claim_idle_s (it took every prompt it could before)
    cut = run.windows[5]
    after = sorted(t for t in run.step_seen.values() if cut.start + CLAIM_IDLE_S < t < cut.healed)
    assert after and after[0] < cut.start + TAKEOVER_S, report
    assert len(after) >= 3 and after[-1] > cut.healed - CLAIM_IDLE_S, report
    for w in run.windows:
        assert run.recovery_s(w) <= RECOVERY_BOUND_S, report
    assert run.steps_during(run.windows[0]) > 0, report  # a flapping link slows the run only
    # healed, generator-0 rejoins and catches up: its engine runs the version the learner had
    # published by then, within CATCH_UP_S
    caught = _caught_up_s(run)
    print("generator-0 caught up", "never" if caught is None else f"{caught:.1f} s after the heal")
    assert caught is not None and caught <= CATCH_UP_S, run.versions.get("generator-0")


def _caught_up_s(run: Run) -> float | None:
    """Seconds from the last heal (generator-0's cut from the learner) to generator-0's engine
    running the version the learner had published by then; None before."""
    cut = run.windows[-1]
    at_heal = max((step for step, t in run.step_seen.items() if t <= cut.healed), default=0)
    caught = [t for t, v in run.versions.get("generator-0", []) if t > cut.healed and v >= at_heal]
    return caught[0] - cut.healed if caught else None


# ------------------------------------------------------------------------------ failover

PRIMARY = "redis-primary"  # the name the services' bus url holds (a DNS name, moved on failover)
REDIS_HOSTS = ("redis-a", "redis-b", "redis-c")
FENCE_LAG_S = 5  # min-replicas-max-lag: a primary cut from its replicas refuses writes after it


# what the services' logs tell of the failovers: refusals by a demoted primary, reads of their
# own pending entries after a lost connection, timeouts on the one cut off
MET = ("read only replica", "UNBLOCKED", "NOREPLICAS", "own pending entries", "Timeout")


class Replicated:
    """Three Redis servers on hosts of their own, one primary and two replicas, every one set up
    as a Sentinel deployment sets them (``min-replicas-to-write 1``: a primary cut off from its
    replicas refuses writes after ``FENCE_LAG_S``, so that clients left on it cannot fork the
    run); the services reach the primary by the name ``PRIMARY``, which ``promote`` moves."""

    def __init__(self, tmp_path: Path, net: Hosts) -> None:
        self.net, self.servers, self.primary = net, {}, REDIS_HOSTS[0]
        self.watched = self.primary  # the server this test reads the run's progress from
        fence = ["--min-replicas-to-write", "1", "--min-replicas-max-lag", str(FENCE_LAG_S)]
        passwords = None
        try:
            for host in REDIS_HOSTS:
                (tmp_path / host).mkdir()
                extra = [*fence, "--masterauth", passwords["default"]] if passwords else [*fence]
                if host != self.primary:
                    extra += ["--replicaof", net.hosts[self.primary].address, "6379"]
                self.servers[host] = UsersRedis(
                    tmp_path / host, address=net.hosts[host].address, passwords=passwords,
                    wrap=lambda argv, h=host: net.argv(h, argv), extra=extra,
                )  # fmt: skip
                passwords = self.servers[host].passwords
            first = self.servers[self.primary]
            first.admin.config_set("masterauth", passwords["default"])  # for when it is demoted
            wait_until(lambda: first.admin.info("replication")["connected_slaves"] == 2,
                       timeout_s=30, what="both replicas in sync")  # fmt: skip
        except BaseException:
            self.stop()
            raise
        net.alias(PRIMARY, self.primary)

    @property
    def admin(self):
        return self.servers[self.watched].admin

    def url(self, kind: str) -> str:
        server = self.servers[self.primary]
        return server.url(kind).replace(f"@{server.address}:", f"@{PRIMARY}:")

    def status_url(self, kind: str) -> str:  # this namespace cannot resolve PRIMARY
        return self.servers[self.primary].url(kind)

    def role(self, host: str) -> str:
        return self.servers[host].admin.info("replication")["role"]

    def promote(self, host: str, *, replicas: tuple[str, ...]) -> None:
        """``host`` the primary, ``replicas`` its replicas, the name ``PRIMARY`` moved to it: what
        Sentinel does once a primary is gone."""
        self.servers[host].admin.replicaof("NO", "ONE")
        for r in replicas:
            self.servers[r].admin.replicaof(self.net.hosts[host].address, 6379)
        self.primary = self.watched = host
        self.net.alias(PRIMARY, host)

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()


def _failovers(redis: Replicated, windows: list[Window], stop: threading.Event) -> None:
    """The two failovers of ``test_redis_failovers_to_another_host_lose_nothing_and_fork_nothing``,
    each recorded in ``windows`` (healed: once the name names the new primary)."""
    a, b, c = REDIS_HOSTS
    # 1. coordinated: the primary pauses writes, waits for its replica to catch up, hands over and
    # becomes a replica itself (Redis's FAILOVER, what Sentinel's manual failover does); clients
    # still connected to it meet a replica
    w = Window("failover a -> b, the old primary reachable", start=time.monotonic())
    redis.servers[a].admin.execute_command("FAILOVER", "TO", redis.net.hosts[b].address, 6379,
                                           "TIMEOUT", 10_000)  # fmt: skip
    wait_until(lambda: redis.role(a) == "slave" and redis.role(b) == "master", timeout_s=30,
               what="the FAILOVER to end", poll_s=0.05)  # fmt: skip
    redis.promote(b, replicas=(c,))  # b is the primary already: c follows it, the name moves
    w.healed = time.monotonic()
    windows.append(w)
    stop.wait(PAUSE_S)
    # 2. the primary cut off from everyone: c is promoted, the name moved; the old primary, healed
    # past FENCE_LAG_S, refuses writes (its replicas are gone) until it is made a replica of c
    w = Window("failover b -> c, the old primary cut off", start=time.monotonic())
    redis.watched = c  # the test's own reads go on (a replica serves them)
    redis.net.cut(b)
    stop.wait(2 * FENCE_LAG_S)  # Sentinel's down-after-milliseconds: the primary is down
    redis.promote(c, replicas=(a,))
    w.healed = time.monotonic()
    windows.append(w)
    stop.wait(CUT_S)
    redis.net.heal(b)
    fenced = redis.servers[b]
    wait_until(lambda: fenced.admin.info("replication")["min_slaves_good_slaves"] == 0,
               timeout_s=10, what="the old primary fenced")  # fmt: skip
    with pytest.raises(Exception, match="NOREPLICAS"):  # a client left on it writes nothing
        fenced.admin.set("tether-fence-check", "1")
    fenced.admin.replicaof(redis.net.hosts[c].address, 6379)
    # one history: both old primaries replicas of the last one
    wait_until(lambda: redis.role(a) == redis.role(b) == "slave"
               and redis.servers[c].admin.info("replication")["connected_slaves"] == 2,
               timeout_s=30, what="both old primaries replicas of the last")  # fmt: skip


@pytest.fixture
def replicated_net():
    with emulated_hosts(*REDIS_HOSTS, *(host for host, _, _ in SERVICES)) as hosts:
        yield hosts


def test_redis_failovers_to_another_host_lose_nothing_and_fork_nothing(tmp_path, replicated_net):
    """Redis behind a name (``redis-primary`` in the bus url, as a DNS name or a Kubernetes
    Service gives it), three servers set up as Sentinel sets them, two failovers during a run:
    a coordinated one (the primary hands over and becomes a replica: the services' connections
    to it meet a replica, whose READONLY and UNBLOCKED refusals send them to a new connection,
    which resolves the name afresh), and one after the primary is cut off from everyone (a
    replica promoted, the name moved; the services' commands in flight on the old primary time
    out, ``bus.socket_timeout_s``; healed, the old primary refuses writes, NOREPLICAS, so a
    client left on it cannot fork the run, and becomes a replica of the new one). Writes the old
    primary took but had not yet sent to its replicas are lost with it (replication is
    asynchronous); the bus makes that the case of an entry delivered again. Every response is
    trained exactly once, the run finishes, and after each failover the run steps again within
    ``RECOVERY_BOUND_S``."""
    net = replicated_net
    server = Replicated(tmp_path, net)

    def faults(net: Hosts, run: Run, stop: threading.Event, admin, name: str) -> None:
        _failovers(server, run.windows, stop)

    def seen(run: Run) -> bool:  # a step after the last failover
        return run.recovery_s(run.windows[-1]) < float("inf")

    run = _run(tmp_path, net, "failover", 2, faults, seen, server=server)
    _trained_once(run)
    report = {w.name: {"steps during": run.steps_during(w),
                       "recovery s": round(run.recovery_s(w), 1)} for w in run.windows}  # fmt: skip
    print("failovers", json.dumps(report, indent=1), "books", run.books)
    assert len(run.windows) == 2, report
    for w in run.windows:
        assert run.recovery_s(w) <= RECOVERY_BOUND_S, report
    # the services did meet the demoted primary and followed the name
    logs = "".join(
        (run.logs / f"{host}.log").read_text(errors="replace") for host, _, _ in SERVICES
    )
    met = {needle: logs.count(needle) for needle in MET}
    print("what the services met", met)
    assert met["read only replica"] + met["UNBLOCKED"] > 0, logs[-3000:]
