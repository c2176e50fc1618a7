"""How ``make test``'s pytest-xdist workers share the suite, and where their time went.

- What runs together (``test_scope``, the scheduler ``--dist loadfile`` gets): a test module
  whole, or every end-to-end run in one scope.
- Who runs what (``pick_scope``): with three workers or more, the last one takes only the
  modules that mostly wait (``WAITING``: timers, slow links, idle collectives; their CPU is a
  fraction of their time), the others everything else (and the waiting modules too, once
  nothing else is left), so the waiting is not on the computing workers' time.
- Where the time went, printed after pytest's 30 slowest tests: how long each worker was busy
  and the scopes that kept it busy, each with the CPU-seconds it used (its worker's and its
  finished subprocesses', ``resource.getrusage``: a scope using far less CPU than its time
  mostly waits). The suite's wall time is at least its busiest worker's, so this says which
  scope to shorten or move when the suite is slow (on the controller only: a worker's reports
  reach it with their node and the CPU it measured).

Hooks imported by ``tests/conftest.py``."""

from __future__ import annotations

import resource
from collections import defaultdict
from collections.abc import Iterable, Iterator

import pytest

# Modules outside tests/e2e that use the session's e2e run (``short_run``): on its worker.
USES_SHORT_RUN = ("tests/services/test_deploy_prometheus.py",)
# End-to-end modules that are a scope of their own, which the other computing worker takes beside
# the e2e scope: the partitions module's two runs (fault windows held for minutes, two generators)
# are ~1/3 of the end-to-end time (678 s of 1,892 s, CPU 521 s, in the last fresh-clone run);
# in the one e2e scope they made it the suite's critical path
E2E_APART = ("tests/e2e/test_e2e_partitions.py",)
# Modules that mostly wait (the summary's CPU column, fresh-clone run at eb3f67e: time, CPU):
# a slow member sleeping over every unit (186 s, 53 CPU-s), a learner idle past its collective
# timeout (94 s, 16 CPU-s), scorers sleeping in grading workers and claim timeouts (43 s, 7 CPU-s).
# Then, measured alone on a quiet machine (machine-wide CPU, /proc/stat): Redis ACL refusals
# (23 s, 4 CPU-s), lost replies waiting out socket timeouts (21 s, 2.5 CPU-s), Redis at
# maxmemory (18 s, 5 CPU-s). Not the partitions module: its CPU is ~60 % of its time, and on the
# waiting lane its runs compute beside both computing workers from the first minute. Two
# fresh-clone runs with it there could not tell whether that pays (one ran beside other work, in
# the other a full disk failed a test); it stays on a computing worker, where it was measured.
WAITING = (
    "tests/services/test_weight_slow_link.py",
    "tests/services/test_learner_shutdown.py",
    "tests/services/test_scorer_service.py",
    "tests/services/test_redis_acl.py",
    "tests/services/test_bus_lost_replies.py",
    "tests/services/test_redis_memory.py",
)


def test_scope(nodeid: str) -> str:
    """What ``make test``'s two workers (pytest-xdist, ``--dist loadfile``) keep together: a
    test module whole (its shared engine or cluster starts once), and every end-to-end run that
    computes in one scope, one run after another on one worker (two such runs at once would
    fight over a 2-core machine's cores). A long e2e module (``E2E_APART``) is a scope of its
    own."""
    path = nodeid.split("::", 1)[0]
    if path in E2E_APART:
        return path
    return "tests/e2e" if path.startswith("tests/e2e/") or path in USES_SHORT_RUN else path


test_scope.__test__ = False  # a helper, not a test


def waiting_lane(workers: Iterable[str]) -> str | None:
    """Which of ``workers`` (pytest-xdist ids, ``gw<n>``) is the waiting lane: the last of three
    or more; None with fewer."""
    ids = sorted(int(w[2:]) for w in workers if w.startswith("gw"))
    return f"gw{ids[-1]}" if len(ids) >= 3 else None


def pick_scope(queue: Iterable[str], *, waiting_lane: bool) -> str | None:
    """The scope a worker takes next from ``queue`` (in order): the waiting lane's worker only a
    ``WAITING`` module (None once there is none), another worker the first other scope, else a
    waiting one."""
    scopes = list(queue)
    mine = [s for s in scopes if (s in WAITING) == waiting_lane]
    if mine:
        return mine[0]
    return None if waiting_lane or not scopes else scopes[0]


try:
    from xdist.scheduler import LoadFileScheduling
except ImportError:  # without pytest-xdist the suite runs in one process
    SCHEDULER: object | None = None
else:

    class _Scopes(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return test_scope(nodeid)

        def _waiting_lane(self, node) -> bool:
            return node.gateway.id == waiting_lane(n.gateway.id for n in self.nodes)

        def _assign_work_unit(self, node) -> None:
            scope = pick_scope(self.workqueue, waiting_lane=self._waiting_lane(node))
            if scope is None:
                return
            work_unit = self.workqueue.pop(scope)
            self.assigned_work.setdefault(node, {})[scope] = work_unit
            collection = self.registered_collections[node]
            node.send_runtest_some(
                [collection.index(nodeid) for nodeid, done in work_unit.items() if not done]
            )

        def _reschedule(self, node) -> None:
            """As pytest-xdist's, and the waiting lane's worker ends once no waiting module is
            left to take (it finishes what it holds first)."""
            lane = self._waiting_lane(node)
            if (
                lane
                and not node.shutting_down
                and pick_scope(self.workqueue, waiting_lane=True) is None
            ):
                node.shutdown()
                return
            super()._reschedule(node)

    class _Scheduler:
        """The plugin ``tests/conftest.py`` registers while pytest-xdist is active (a hook of
        xdist's own: with ``-p no:xdist`` pytest would refuse it as unknown)."""

        @staticmethod
        def pytest_xdist_make_scheduler(config: pytest.Config, log) -> object | None:
            """``--dist loadfile`` with ``test_scope``'s scopes, handed out in collection order
            (other modes as pytest-xdist has them). pytest-xdist's default orders scopes by
            their number of tests, which put the partitions module (2 tests, ~10 minutes) last:
            started after ~27 minutes of a CI run, it could have run on alone for its whole
            length. In collection order the e2e scope goes first, the partitions module second
            (to the other worker), then tests/services and the quick tests/unit last, where
            they even out the end."""
            if config.getvalue("dist") != "loadfile":
                return None
            config.option.loadscopereorder = False
            return _Scopes(config, log)

    SCHEDULER = _Scheduler()


_BUSY: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # worker -> [seconds, CPU-s]
_SCOPE: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])  # (worker, scope)
TOP_SCOPES = 30  # as many as pytest's slowest tests (--durations=30)
CPU_S = "cpu_s"  # the report's user property: CPU-seconds since this process's last report
_last_cpu_s = [0.0]


def cpu_seconds() -> float:
    """CPU-seconds (user + system) of this process and of its subprocesses that have ended and
    been waited for (a server still running is counted once it is stopped)."""
    own, ended = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + ended.ru_utime + ended.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """Each phase's report carries the CPU used since the one before (so a module's shared
    engine counts where it starts and where it stops)."""
    outcome = yield
    now = cpu_seconds()
    outcome.get_result().user_properties.append((CPU_S, now - _last_cpu_s[0]))
    _last_cpu_s[0] = now


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    node = getattr(report, "node", None)  # set on the controller for a worker's report
    worker = getattr(getattr(node, "gateway", None), "id", None) or "main"
    cpu = sum(v for k, v in report.user_properties if k == CPU_S)
    for totals in (_BUSY[worker], _SCOPE[(worker, test_scope(report.nodeid))]):
        totals[0] += report.duration
        totals[1] += cpu


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or not _BUSY:
        return
    tr = terminalreporter
    tr.section("time per worker and scope (setup + call + teardown), and the CPU it used")
    for worker, (seconds, cpu) in sorted(_BUSY.items()):
        tr.write_line(f"{worker}: busy {seconds:7.0f} s, CPU {cpu:7.0f} s")
    scopes = sorted(_SCOPE.items(), key=lambda kv: -kv[1][0])[:TOP_SCOPES]
    for (worker, scope), (seconds, cpu) in scopes:
        tr.write_line(f"  {seconds:7.0f} s  CPU {cpu:7.0f} s  {worker}  {scope}")
    idle = mostly_waiting(_SCOPE, waiting_lane=waiting_lane(_BUSY))
    if idle:
        tr.write_line("mostly waiting on a computing worker (CPU under half the time; WAITING?):")
        for scope, seconds, cpu in idle:
            tr.write_line(f"  {seconds:7.0f} s  CPU {cpu:7.0f} s  {scope}")


def mostly_waiting(
    scopes: dict[tuple[str, str], list[float]], *, waiting_lane: str | None
) -> list[tuple[str, float, float]]:
    """Scopes (``(worker, scope) -> [seconds, CPU-s]``) of 10 s or more that a computing worker
    ran and whose CPU was under half their time, those with the most time spent waiting first:
    what ``WAITING`` could take off the computing workers. (A scope's CPU misses grandchildren
    their parent never waited for, so check one alone before moving it.)"""
    found = [
        (scope, seconds, cpu)
        for (worker, scope), (seconds, cpu) in scopes.items()
        if worker != waiting_lane and scope not in WAITING and seconds >= 10 and cpu < seconds / 2
    ]
    return sorted(found, key=lambda x: x[2] - x[1])
