"""`tether status`: the --json schema, the human format, finding a local run's embedded server,
and the status.json snapshot a finished run falls back to.

Live tests use the session's real Redis-protocol server. The services' heartbeats are written by
the real ``common.telemetry.heartbeat.StatusReporter`` with hand-set counters (a fake of the services, not of
Redis): what is under test is how status reads and presents them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import pytest
import redis

from common.bus.client import Bus
from common.bus.settings import BusSettings
from common.ports import free_port
from common.protocol.books import LearnerBooks
from common.protocol.streams import DEAD, GROUPS, WEIGHTS_EPOCH, WEIGHTS_PUBLISHING
from common.service import run_end
from common.telemetry.heartbeat import StatusReporter
from common.telemetry.metrics import PhaseTimer
from tests.paths import FIXTURES
from tether.cli.observe_verbs import add_observe_verbs
from tether.runs.launcher import finish_run
from tether.runs.status import STREAMS, grading, load_status_snapshot, save_status_snapshot

FIXTURE = FIXTURES / "run_thin"  # a real short run (3 steps, 2 evals)
EVAL_GROUPS = 32  # the fixture's metrics.jsonl: two held-out evaluations of 16 prompts


def tether(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="tether")
    add_observe_verbs(parser.add_subparsers())
    args = parser.parse_args(argv)
    code = args.func(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def make_run_dir(tmp_path: Path, name: str) -> Path:
    run_dir = tmp_path / name
    run_dir.mkdir()
    text = (FIXTURE / "config.toml").read_text().replace('name = "thin"', f'name = "{name}"')
    (run_dir / "config.toml").write_text(text)
    shutil.copy(FIXTURE / "metrics.jsonl", run_dir)
    return run_dir


# the fake scorer's responses by grading reason (59 groups × 4)
GRADED = {"correct": 40, "empty": 0, "no_answer": 190, "wrong": 6}


def fake_services(
    url: str, run: str, *, generator_restarted: bool = False, lost_round: int | None = None,
    no_progress_s: float = 3.0, end_cycle: int = 10,
) -> None:  # fmt: skip
    """Heartbeats of a learner, a generator and a scorer, plus queues and one dead letter.

    Books (responses_per_prompt = 4): generator groups 60 = 32 eval + 28 train = 112 trajectories
    = 100 trained + 4 dropped stale + 4 dead-lettered (1 group) + 4 in flight (1 queued group).
    The generator's run-long count (what ``Bus.count_generated`` keeps) is 60; with
    ``generator_restarted`` its live process has published only 7 of them since its restart.
    ``lost_round``: the generator counts its held-out groups apart (as generators do now), and a
    round of that many groups whose learner died (never in metrics.jsonl) is among them."""
    bus = Bus(BusSettings(url=url, run=run), service="test")
    now = time.time()
    beats = [
        ("learner", "learner-0", {"working": 60.0, "waiting_input": 30.0, "syncing_weights": 5.0},
         {"version": 7, "cycle": 4, "num_cycles": 10, "end_cycle": end_cycle, "ready": True, "no_progress_s": no_progress_s, "last_step": {"step": 7, "loss": 0.1, "reward_mean": 0.5, "staleness_max": 1},
          "books": LearnerBooks(trained_samples=100, dropped_stale_samples=4).to_dict()}),
        ("generator", "generator-0", {"working": 20.0, "waiting_input": 70.0, "blocked_staleness": 5.0},
         {"version": 7, "tokens": 5000, "groups": 7 if generator_restarted else 28 + EVAL_GROUPS,
          "ready": True}),
        ("scorer", "scorer-0", {"working": 2.0, "waiting_input": 90.0}, {"groups": 59, "ready": True, "mode": "rule", "reasons": GRADED}),
    ]  # fmt: skip
    for service, sid, phases, extra in beats:
        timer = PhaseTimer(service)
        timer.seconds.update(phases)  # set directly: PhaseTimer.add also feeds Prometheus
        # The heartbeat's time is pinned: rates are counters over (heartbeat - started), and a
        # wall-clock heartbeat made "50.00 tokens/s" depend on how busy the machine was.
        reporter = StatusReporter(bus, service, sid, timer, lambda e=extra: e | {"heartbeat": now})
        reporter.started = now - 100.0
        reporter.write()
    for stream, group in STREAMS:
        bus.ensure_group(stream, group)
    bus.redis.xadd(bus.key(GROUPS), {"m": b"a queued group"})
    # a group the scorer could not score (4 responses in the books), a prompt no generator could
    # encode (none) and an entry nobody could decode (none)
    dead = {"reason": b"unscorable", "stream": b"groups", "split": b"train", "cycle": 3,
            "index": 30, "raw": b""}  # fmt: skip
    bus.redis.xadd(bus.key(DEAD), dead)
    bus.redis.xadd(bus.key(DEAD), {**dead, "reason": b"unencodable_prompt", "stream": b"prompts"})
    bus.redis.xadd(bus.key(DEAD), {"reason": b"undecodable", "stream": b"groups", "split": b""})
    if lost_round is None:
        bus.count_generated("generator-0", 28 + EVAL_GROUPS)
    else:
        bus.count_generated("generator-0", 28)
        bus.count_generated("generator-0:eval", EVAL_GROUPS + lost_round)
    bus.set(WEIGHTS_PUBLISHING, 7)
    bus.set(WEIGHTS_EPOCH, 3)
    bus.close()


def test_status_json_schema_from_live_redis(redis_server, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TETHER_REDIS_URL", raising=False)
    run_dir = make_run_dir(tmp_path, "st_json")
    fake_services(redis_server.url, "st_json")
    code, out, err = tether(
        ["status", "--run", str(run_dir), "--redis-url", redis_server.url, "--json"], capsys
    )
    assert code == 0, err
    st = json.loads(out)
    assert st["source"] == "live" and st["run"] == "st_json"
    assert isinstance(st["time"], float)
    assert st["learner_version"] == 7 and st["cycle"] == 4
    assert st["generator_versions"] == {"generator-0": 7}
    assert isinstance(st["last_step"], dict) and st["last_step"]["step"] == 7
    assert {s["service"] for s in st["services"]} == {"learner", "generator", "scorer"}
    for s in st["services"]:
        assert isinstance(s["id"], str) and isinstance(s["alive"], bool) and s["alive"]
        assert isinstance(s["age_s"], float) and isinstance(s["heartbeat"], float)
        assert all(isinstance(v, float) for v in s["phases"].values())
        assert abs(sum(s["time_breakdown"].values()) - 1.0) < 1e-9
        assert s["rates"]["uptime_s"] == pytest.approx(100.0, abs=5.0)
    gen = next(s for s in st["services"] if s["service"] == "generator")
    assert gen["rates"]["tokens_per_s"] == pytest.approx(50.0, rel=0.05)
    assert set(st["streams"]) == {"prompts", "groups", "scored"}
    for q in st["streams"].values():
        assert (
            isinstance(q["group"], str)
            and isinstance(q["lag"], int)
            and isinstance(q["pending"], int)
        )
    assert st["streams"]["groups"]["lag"] == 1
    assert st["dead_letters"] == 3 and st["accounting"]["dead_letter_groups"] == 1
    assert st["weights"] == {"publishing": 7, "chain_epoch": 3}
    assert st["bottleneck"]["service"] == "learner"
    assert st["grading"] == GRADED
    assert st["end"] == {"num_cycles": 10, "end_cycle": 10, "finish_requested": False,
                         "finished": None}  # fmt: skip
    assert st["accounting_trajectories"] == {
        "generated": 112, "trained": 100, "dropped_stale": 4, "filtered": 0,
        "overlong_masked": 0, "refused_template": 0, "surplus": 0, "agent_failed": 0,
        "dead_lettered": 4, "in_flight": 4,
        "unaccounted": 0,
    }  # fmt: skip


def test_accounting_survives_a_generator_restart(redis_server, tmp_path, capsys, monkeypatch):
    # The restarted generator's own counter starts at 0; the books use the run-long count per
    # generator id kept in Redis, so they still balance (the old sum of the live processes'
    # counters made "generated" fall short and "unaccounted" negative).
    monkeypatch.delenv("TETHER_REDIS_URL", raising=False)
    run_dir = make_run_dir(tmp_path, "st_restart")
    fake_services(redis_server.url, "st_restart", generator_restarted=True)
    code, out, err = tether(
        ["status", "--run", str(run_dir), "--redis-url", redis_server.url, "--json"], capsys
    )
    assert code == 0, err
    st = json.loads(out)
    assert st["accounting"]["groups_generated"] == 28 + EVAL_GROUPS
    assert st["accounting_trajectories"]["generated"] == 112
    assert st["accounting_trajectories"]["unaccounted"] == 0


def test_books_balance_when_a_learner_died_during_a_held_out_round(
    redis_server, tmp_path, capsys, monkeypatch
):
    # A held-out round whose learner died is never recorded in metrics.jsonl; its groups were
    # counted by the generators as evaluation groups (``<id>:eval``), so they are not taken for
    # unaccounted training data (before, 16 such groups read as 64 unaccounted responses).
    monkeypatch.delenv("TETHER_REDIS_URL", raising=False)
    run_dir = make_run_dir(tmp_path, "st_deadround")
    fake_services(redis_server.url, "st_deadround", lost_round=16)
    code, out, err = tether(
        ["status", "--run", str(run_dir), "--redis-url", redis_server.url, "--json"], capsys
    )
    assert code == 0, err
    st = json.loads(out)
    assert st["accounting"]["eval_groups_generated"] == EVAL_GROUPS + 16
    assert st["accounting_trajectories"]["generated"] == 112
    assert st["accounting_trajectories"]["unaccounted"] == 0


def test_status_counts_the_redrivable_dead_letters(redis_server, tmp_path, capsys, monkeypatch):
    # whole training messages of a cycle the learner (at cycle 4) has still to train: 1 of 4
    monkeypatch.delenv("TETHER_REDIS_URL", raising=False)
    run_dir = make_run_dir(tmp_path, "st_redrive")
    fake_services(redis_server.url, "st_redrive")
    bus = Bus(BusSettings(url=redis_server.url, run="st_redrive"), service="test")
    whole = {"reason": b"max_deliveries", "stream": b"groups", "split": b"train", "cycle": 4,
             "index": 33, "raw": b"x", "complete": 1}  # fmt: skip
    bus.redis.xadd(bus.key(DEAD), whole)
    bus.close()
    code, out, err = tether(["status", "--run", str(run_dir), "--redis-url", redis_server.url],
                           capsys)  # fmt: skip
    assert code == 0, err
    assert "dead letters: 4 (2 generated group(s)" in out
    assert "1 re-drivable once their cause is fixed (`tether bus redrive`)" in out


def test_status_human_format(redis_server, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TETHER_REDIS_URL", raising=False)
    run_dir = make_run_dir(tmp_path, "st_human")
    fake_services(redis_server.url, "st_human")
    code, out, err = tether(
        ["status", "--run", str(run_dir), "--redis-url", redis_server.url], capsys
    )
    assert code == 0, err
    assert "run st_human: learner v7 cycle 4" in out
    assert "snapshot" not in out
    for line in (
        "stream groups",
        "group scorers",
        "dead letters: 3 (1 generated group(s)",
        "bottleneck: learner",
        "weights: v7 published last, chain epoch 3",
        "redis: used ",  # Redis memory against maxmemory (the session's server has none)
        "(no maxmemory), policy noeviction",
        "scored responses by reason: no_answer 190, correct 40, wrong 6 (since each scorer "
        "started)",
    ):
        assert line in out
    assert "no scored group, dead letter or step" not in out  # the learner moves
    assert "rate generator generator-0" in out and "50.00 tokens/s" in out
    assert "accounting (trajectories): generated 112 = trained 100" in out and "(balanced)" in out


def test_status_says_how_a_run_ends_early(redis_server, tmp_path, capsys, monkeypatch):
    """`tether finish` asked, the learner ending early, then the run-finished record: each shows
    on the line after the learner's (and nothing before the request)."""
    monkeypatch.delenv("TETHER_REDIS_URL", raising=False)
    run_dir = make_run_dir(tmp_path, "st_end")
    argv = ["status", "--run", str(run_dir), "--redis-url", redis_server.url]
    bus = Bus(BusSettings(url=redis_server.url, run="st_end"), service="test")
    try:
        fake_services(redis_server.url, "st_end")
        assert "run end:" not in tether(argv, capsys)[1]
        run_end.request_finish(bus)
        out = tether(argv, capsys)[1].splitlines()
        assert out[1] == (
            "  run end: asked to end early (tether finish); the learner takes the request at "
            "its next cycle"
        )
        fake_services(redis_server.url, "st_end", end_cycle=6)  # the learner took it
        out = tether(argv, capsys)[1].splitlines()
        assert out[1] == (
            "  run end: ending early (tether finish): no new cycle is dispatched; the run ends "
            "after cycle 6 of 10, once the cycles dispatched are trained"
        )
        run_end.mark_finished(bus, num_cycles=10, version=12, ended_early_at_cycle=6)
        code, text, err = tether([*argv, "--json"], capsys)
        assert code == 0, err
        end = json.loads(text)["end"]
        assert end["finished"]["ended_early_at_cycle"] == 6 and not end["finish_requested"]
        out = tether(argv, capsys)[1].splitlines()
        assert out[1] == (
            "  run end: finished at policy version v12, ended early after cycle 6 of 10 "
            "(tether finish)"
        )
        run_end.mark_finished(bus, num_cycles=10, version=20)  # a run that went to its end
        assert tether(argv, capsys)[1].splitlines()[1] == (
            "  run end: finished at policy version v20, all 10 cycles"
        )
    finally:
        bus.close()


def test_status_shows_memory_against_maxmemory_and_a_learner_without_progress(
    redis_server, tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv("TETHER_REDIS_URL", raising=False)
    run_dir = make_run_dir(tmp_path, "st_stall")
    fake_services(redis_server.url, "st_stall", no_progress_s=640.0)
    admin = redis.Redis.from_url(redis_server.url)
    admin.config_set("maxmemory", 512 * 2**20)
    try:
        code, out, err = tether(
            ["status", "--run", str(run_dir), "--redis-url", redis_server.url], capsys
        )
    finally:
        admin.config_set("maxmemory", 0)
    assert code == 0, err
    assert "of maxmemory 512.0 MiB (" in out and "policy noeviction" in out
    assert "learner: no scored group, dead letter or step for 640 s" in out


def test_status_finds_a_local_runs_embedded_server(redis_server, tmp_path, capsys, monkeypatch):
    """No --redis-url: the port comes from <run dir>/redis/server.conf, as `tether train` writes it."""
    monkeypatch.delenv("TETHER_REDIS_URL", raising=False)
    run_dir = make_run_dir(tmp_path, "st_local")
    fake_services(redis_server.url, "st_local")
    (run_dir / "redis").mkdir()
    (run_dir / "redis" / "server.conf").write_text(f"bind 127.0.0.1\nport {redis_server.port}\n")
    code, out, err = tether(["status", "--run", str(run_dir), "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["source"] == "live" and json.loads(out)["learner_version"] == 7


def test_status_falls_back_to_the_snapshot(redis_server, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TETHER_REDIS_URL", raising=False)
    run_dir = make_run_dir(tmp_path, "st_snap")
    fake_services(redis_server.url, "st_snap")
    code, out, _ = tether(
        ["status", "--run", str(run_dir), "--redis-url", redis_server.url, "--json"], capsys
    )
    live = json.loads(out)
    save_status_snapshot(run_dir, live)
    # The run's embedded server is gone: nothing listens on the port in server.conf.
    (run_dir / "redis").mkdir()
    (run_dir / "redis" / "server.conf").write_text(f"port {free_port()}\n")
    code, out, err = tether(["status", "--run", str(run_dir), "--json"], capsys)
    assert code == 0, err
    snap = json.loads(out)
    assert snap["source"] == "snapshot" and isinstance(snap["snapshot_time"], float)
    for key in (
        "learner_version",
        "streams",
        "dead_letters",
        "weights",
        "accounting_trajectories",
        "bottleneck",
    ):
        assert snap[key] == live[key], key
    code, out, _ = tether(["status", "--run", str(run_dir)], capsys)
    assert code == 0 and out.startswith("(snapshot of ") and "run st_snap: learner v7" in out
    # A Redis that answers but holds nothing of this run (name "st_gone"): the snapshot.
    (run_dir / "status.json").write_text(
        json.dumps({**live, "run": "st_snap", "learner_version": 9})
    )
    code, out, _ = tether(
        [
            "status",
            "--run",
            str(run_dir),
            "--redis-url",
            redis_server.url,
            "--name",
            "st_gone",
            "--json",
        ],
        capsys,
    )
    assert (
        code == 0
        and json.loads(out)["source"] == "snapshot"
        and json.loads(out)["learner_version"] == 9
    )


def test_status_without_redis_or_snapshot_says_what_to_do(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TETHER_REDIS_URL", raising=False)
    run_dir = make_run_dir(tmp_path, "st_none")
    url = f"redis://127.0.0.1:{free_port()}/0"
    code, out, err = tether(["status", "--run", str(run_dir), "--redis-url", url], capsys)
    assert code == 1 and out == ""
    assert "does not answer" in err and "status.json" in err and "--redis-url" in err


def test_snapshot_is_written_atomically_and_read_back(tmp_path):
    path = save_status_snapshot(tmp_path, {"run": "x", "learner_version": 3})
    assert path == tmp_path / "status.json"
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]  # no temporary file left
    doc = load_status_snapshot(tmp_path)
    assert doc["learner_version"] == 3 and doc["snapshot_time"] <= time.time()
    assert load_status_snapshot(tmp_path / "elsewhere") is None
    path.write_text('{"run": "x", "learner_ver')  # torn by hand
    with pytest.raises(ValueError, match="status.json is not valid JSON"):
        load_status_snapshot(tmp_path)


def test_finish_run_saves_the_snapshot_and_writes_the_report(redis_server, tmp_path):
    """What the launcher calls at the end of a run, while its Redis is still up."""
    run_dir = make_run_dir(tmp_path, "st_finish")
    fake_services(redis_server.url, "st_finish")
    bus = Bus(BusSettings(url=redis_server.url, run="st_finish"), service="launcher")
    path = finish_run(run_dir, bus)
    bus.close()
    assert path == run_dir / "report.html"
    assert load_status_snapshot(run_dir)["learner_version"] == 7
    page = path.read_text(encoding="utf-8")
    assert page.count('<img src="data:image/png;base64,') == 6
    assert '<tr class="ok"><td>unaccounted</td><td class="num">0<' in page
    # Redis already gone: the report is still written, from metrics.jsonl and the old snapshot.
    (run_dir / "report.html").unlink()
    dead = Bus(
        BusSettings(url=f"redis://127.0.0.1:{free_port()}/0", run="st_finish", reconnect_max_s=0.5),
        service="launcher",
    )
    assert finish_run(run_dir, dead) == run_dir / "report.html"


def test_grading_sums_the_scorers_reasons_and_ignores_other_services():
    beats = [{"service": "scorer", "reasons": {"correct": 2, "no_answer": 5}},
             {"service": "scorer", "reasons": {"not_a_number": 1, "no_answer": 3}},
             {"service": "scorer"},  # a heartbeat from before scorers counted reasons
             {"service": "generator", "reasons": {"correct": 100}}]  # fmt: skip
    assert grading(beats) == {"correct": 2, "no_answer": 8, "not_a_number": 1}
