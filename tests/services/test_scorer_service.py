"""The scorer service end to end: `tether scorer` subprocesses, a real Redis-protocol server, real
math-verify grading workers, SIGKILL mid-batch. Rule mode (solver mode: test_solver.py)."""

from __future__ import annotations

import json
import time
import uuid

import pytest

from common.ports import free_port
from common.protocol import streams
from common.service.exit_codes import EXIT_STOPPED
from tests.procs.metrics_text import samples
from tests.procs.scorer_proc import (
    ScorerProc,
    dead,
    http_get,
    make_group,
    metric_value,
    pending,
    publish_all,
    scored,
    test_bus,
    wait_until,
)

pytestmark = pytest.mark.slow  # several processes per test

FORMAT = 0.1  # scorer.format_weight in the end-to-end test
SLEEP = "\\boxed{__tether_test_only_sleep__:%s}"  # the grader pool's test-only hang

# (ground truth, [(response, correct?, boxed?)]) per group.
CASES = {
    "half": ("1/2", [("so \\boxed{0.5}", 1, 1), ("\\boxed{\\frac{1}{2}}", 1, 1),
                     ("The answer is 0.25", 0, 0), ("", 0, 0)]),
    "three": ("3", [("x = \\boxed{3}", 1, 1), ("\\boxed{4}", 0, 1), ("it is 3", 1, 0),
                    ("\\boxed{3.0}", 1, 1)]),
    "interval": ("[1,2)", [("\\boxed{[1, 2)}", 1, 1), ("\\boxed{(1, 2]}", 0, 1)]),
    "frac": ("\\frac{3}{4}", [("\\boxed{0.75}", 1, 1), ("The answer is 75\\%", 1, 0),
                              ("\\boxed{3/4}", 1, 1)]),
}  # fmt: skip


def _run() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def procs(tmp_path):
    started: list[ScorerProc] = []

    def start(url, run, sid, *sets, **kw) -> ScorerProc:
        p = ScorerProc(url, run, sid, tmp_path, *sets, **kw)
        started.append(p)
        return p

    yield start
    for p in started:
        p.cleanup()


def test_rule_mode_end_to_end_metrics_and_dead_letter(redis_server, procs):
    run = _run()
    bus = test_bus(redis_server.url, run)
    for i, (gid, (gold, rows)) in enumerate(CASES.items()):
        bus.publish(streams.GROUPS, make_group(gid, [r[0] for r in rows], gold, index=i))
    bus.publish(streams.GROUPS, make_group("nogold", ["\\boxed{1}", "\\boxed{2}"], None, index=9))
    port = free_port()
    p = procs(redis_server.url, run, "scorer-0", f"scorer.format_weight={FORMAT}",
              metrics_port=port)  # fmt: skip
    wait_until(lambda: len(scored(bus)) >= len(CASES) and dead(bus), 90, "scoring", (p,))

    out = {m.group.group_id: m for m in scored(bus)}
    assert sorted(out) == sorted(CASES)  # whole groups, each once; the unscorable one is not here
    for gid, (_, rows) in CASES.items():
        m = out[gid]
        assert len(m.rewards) == len(m.group.samples) == len(rows)  # whole group
        assert m.scorer_id == "scorer-0"
        for (text, correct, boxed), reward, comps in zip(
            rows, m.rewards, m.components, strict=True
        ):
            assert comps == pytest.approx({"correct": correct, "format": FORMAT * boxed}), text
            assert reward == pytest.approx(correct + FORMAT * boxed), text
        assert m.group.samples[0].response_token_ids.dtype.str == "<u4"  # arrays survived
    assert out["half"].reasons[3] == "empty"  # the blank response says why it scored 0
    (letter,) = dead(bus)
    assert letter["reason"] == b"unscorable" and letter["ref"] == b"nogold"
    assert pending(bus) == 0

    assert http_get(port, "/healthz")[0] == 200
    assert http_get(port, "/readyz") == (200, "ready\n")
    _, text = http_get(port, "/metrics")
    n_correct = sum(r[1] for _, rows in CASES.values() for r in rows)
    assert metric_value(text, "tether_scorer_items_total", 'reason="correct"') == n_correct
    assert metric_value(text, "tether_scorer_items_total", 'reason="empty"') == 1
    assert metric_value(text, "tether_scorer_groups_total") == len(CASES)
    assert metric_value(text, "tether_scorer_batch_seconds_count") >= 1
    assert metric_value(text, "tether_scorer_queue_wait_seconds_count") == len(CASES)
    assert (
        metric_value(text, "tether_scorer_unscorable_groups_total", 'reason="missing_ground_truth"')
        == 1
    )
    assert metric_value(text, "tether_scorer_reward_mean", 'component="format"') is not None
    assert metric_value(text, "tether_scorer_grade_seconds_count") >= n_correct
    assert metric_value(text, "tether_scorer_phase_seconds_total", 'phase="working"') > 0
    # every series says which run, kind and replica it comes from (deploy/prometheus keys on them)
    identity = {"run": run, "kind": "scorer", "replica": "scorer-0"}
    assert all(identity.items() <= labels.items() for _, labels, _ in samples(text))
    assert metric_value(text, "tether_service_info") == 1
    # the heartbeat carries the same counts by reason (`tether status` sums them over scorers)
    wait_until(lambda: _beat_reasons(bus).get("correct") == n_correct, 30, "the heartbeat", (p,))
    assert _beat_reasons(bus)["empty"] == 1
    assert p.stop() == EXIT_STOPPED  # SIGTERM before the run's end


def _beat_reasons(bus) -> dict[str, int]:
    """The reasons in scorer-0's last heartbeat; none before its first one is written."""
    beat = bus.read_statuses().get("scorer:scorer-0")
    return json.loads(beat).get("reasons", {}) if beat else {}


def test_pathological_input_times_out_and_service_keeps_going(redis_server, procs):
    run = _run()
    bus = test_bus(redis_server.url, run)
    bus.publish(streams.GROUPS, make_group("tower", ["\\boxed{9^{9^{9^{9}}}}", "\\boxed{7}"], "7"))
    port = free_port()
    p = procs(redis_server.url, run, "scorer-0", "scorer.grader_timeout_s=2", metrics_port=port)
    t0 = time.monotonic()
    wait_until(lambda: len(scored(bus)) == 1, 90, "the tower group", (p,))
    (m,) = scored(bus)
    assert m.rewards == [0.0, 1.0] and m.reasons == ["timeout", ""]
    bus.publish(streams.GROUPS, make_group("after", ["\\boxed{7}", "\\boxed{8}"], "7"))
    wait_until(lambda: len(scored(bus)) == 2, 30, "the group after the timeout", (p,))
    assert scored(bus)[1].rewards == [1.0, 0.0]
    assert time.monotonic() - t0 < 60
    _, text = http_get(port, "/metrics")
    assert metric_value(text, "tether_scorer_grade_timeouts_total") == 1
    assert metric_value(text, "tether_scorer_items_total", 'reason="timeout"') == 1
    assert metric_value(text, "tether_scorer_grade_worker_restarts_total", 'cause="timeout"') == 1
    assert p.stop() == EXIT_STOPPED  # SIGTERM before the run's end


def _slow_group(gid: str, i: int, sleep_s: float) -> object:
    """One slow sample (the grading worker sleeps) and three graded normally."""
    return make_group(gid, [SLEEP % sleep_s, "\\boxed{7}", "\\boxed{8}", "7"], "7", index=i)


@pytest.mark.parametrize("restart", ["other_id", "same_id"])
def test_sigkill_mid_batch_every_group_scored_exactly_once(redis_server, procs, restart):
    run = _run()
    bus = test_bus(redis_server.url, run)
    env = {"TETHER_TEST_ONLY_GRADER_SLEEP": "1"}
    claim = "bus.claim_idle_s=1" if restart == "other_id" else "bus.claim_idle_s=300"
    first = procs(redis_server.url, run, "scorer-0", claim, env=env)
    wave_a = [f"a{i}" for i in range(4)]
    for i, gid in enumerate(wave_a):
        bus.publish(streams.GROUPS, _slow_group(gid, i, 0.2))
    wait_until(lambda: len(scored(bus)) == 4, 90, "wave A", (first,))
    wave_b = [f"b{i}" for i in range(8)]  # one batch of ~8 × 1.5 s / 2 workers = 6 s
    publish_all(bus, [_slow_group(gid, 10 + i, 1.5) for i, gid in enumerate(wave_b)])
    wait_until(lambda: pending(bus) == 8, 30, "wave B to be taken", (first,))
    time.sleep(1.5)
    assert len(scored(bus)) == 4, "wave B finished before the kill; make it slower"
    first.sigkill()  # mid-batch: wave B is pending, half graded, nothing of it committed

    second = procs(redis_server.url, run, "scorer-1" if restart == "other_id" else "scorer-0",
                   claim, env=env)  # fmt: skip
    wave_c = [f"c{i}" for i in range(4)]
    for i, gid in enumerate(wave_c):
        bus.publish(streams.GROUPS, _slow_group(gid, 20 + i, 0.1))
    everything = set(wave_a + wave_b + wave_c)
    wait_until(lambda: {m.group.group_id for m in scored(bus)} >= everything, 120,
               "every group after the restart", (second,))  # fmt: skip
    time.sleep(1.0)  # a duplicate publish would show up now
    ids = [m.group.group_id for m in scored(bus)]
    assert sorted(ids) == sorted(everything)  # each exactly once, none lost
    assert pending(bus) == 0 and dead(bus) == []
    for m in scored(bus):
        assert m.rewards == [0.0, 1.0, 0.0, 1.0] and m.reasons[0] == "unparseable_answer"
        if m.group.group_id in wave_b:
            assert m.scorer_id == ("scorer-1" if restart == "other_id" else "scorer-0")
    assert second.stop() == EXIT_STOPPED


def test_slow_but_alive_scorer_loses_its_entries_and_duplicates_are_dropped(redis_server, procs):
    """claim_idle_s shorter than a batch: a second scorer claims entries the first is still
    grading; both finish and commit, and the done-set keeps exactly one ScoredGroup per id."""
    run = _run()
    bus = test_bus(redis_server.url, run)
    env = {"TETHER_TEST_ONLY_GRADER_SLEEP": "1"}
    ports = [free_port(), free_port()]
    first = procs(redis_server.url, run, "scorer-0", "bus.claim_idle_s=1", env=env,
                  metrics_port=ports[0])  # fmt: skip
    second = procs(redis_server.url, run, "scorer-1", "bus.claim_idle_s=1", env=env,
                   metrics_port=ports[1])  # fmt: skip
    for port in ports:
        wait_until(lambda p=port: http_get(p, "/readyz")[0] == 200, 60, "ready", (first, second))
    ids = [f"s{i}" for i in range(6)]
    publish_all(bus, [_slow_group(gid, i, 1.0) for i, gid in enumerate(ids)])
    wait_until(lambda: {m.group.group_id for m in scored(bus)} == set(ids), 120, "all groups",
               (first, second))  # fmt: skip
    wait_until(lambda: pending(bus) == 0, 60, "the entries to be acked", (first, second))
    labels = 'group="scorers",stream="groups"'

    def total(name: str) -> float:
        return sum(metric_value(http_get(p, "/metrics")[1], name, labels) or 0 for p in ports)

    assert total("tether_bus_claimed_messages_total") > 0, "no claim: the test did not race"
    # The slower of the two commits the same groups again: the done-set must drop them all.
    wait_until(lambda: total("tether_bus_duplicates_skipped_total") >= len(ids), 60,
               "the second commit to be dropped as duplicates", (first, second))  # fmt: skip
    assert sorted(m.group.group_id for m in scored(bus)) == sorted(ids)
    assert first.stop() == second.stop() == EXIT_STOPPED
