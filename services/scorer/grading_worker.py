"""The grading worker process of ``GraderPool`` (``grader_pool.py``): it warms math-verify up,
says ready, then grades one ``(answer, ground truth)`` item per message until told to stop. Its
math-verify timeouts are off: the pool's SIGKILL is the timeout. Messages are UTF-8 JSON over a
pipe (the protocol is in ``grader_pool.py``). The pool's forkserver preloads this module and
math-verify, so a replacement worker starts warm."""

from __future__ import annotations

import json
import logging
import resource
import signal
import sys
import time
from multiprocessing.connection import Connection

log = logging.getLogger(__name__)

# GradeResult.reason values.
CORRECT, WRONG = "correct", "wrong"
NO_ANSWER, UNPARSEABLE_ANSWER = "no_answer", "unparseable_answer"
BAD_GROUND_TRUTH, TIMEOUT, ERROR = "bad_ground_truth", "timeout", "error"
# Every reason an item's score can carry: the grader's, the extractor's "empty" (a blank
# response) and "not_a_number" (scorer.answer_form, extract.py); the scorer's items counter
# starts a series at 0 for each.
GRADING_REASONS = (CORRECT, WRONG, NO_ANSWER, UNPARSEABLE_ANSWER, BAD_GROUND_TRUTH, TIMEOUT, ERROR,
                   "empty", "not_a_number")  # fmt: skip
TEST_ONLY_SLEEP_PREFIX = "__tether_test_only_sleep__:"  # see GraderPool(test_only_sleep_hook=)


def _has_math(parsed: list) -> bool:
    """parse() returns the raw string as a fallback; only a sympy object means it parsed."""
    return any(not isinstance(x, str) for x in parsed)


def _grade_pair(
    answer: str, gold: str, parse, verify, gold_cache: dict, sleep_hook: bool = False
) -> tuple[bool, str]:
    """Runs in a worker. math-verify's own timeouts are off (None): the pool's kill is the timeout."""
    if gold not in gold_cache:
        parsed = parse(f"${gold}$", parsing_timeout=None) or parse(gold, parsing_timeout=None)
        if len(gold_cache) > 4096:
            gold_cache.clear()
        gold_cache[gold] = parsed
    gold_parsed = gold_cache[gold]
    if not _has_math(gold_parsed):
        return False, BAD_GROUND_TRUTH
    if sleep_hook and answer.startswith(TEST_ONLY_SLEEP_PREFIX):
        # Test-only hook (off unless the pool enables it): a hang that only SIGKILL ends.
        time.sleep(float(answer.split(":", 1)[1]))
    parsed = parse(f"\\boxed{{{answer}}}", parsing_timeout=None) or parse(
        answer, parsing_timeout=None
    )
    if not _has_math(parsed):
        return False, UNPARSEABLE_ANSWER
    ok = bool(verify(gold_parsed, parsed, timeout_seconds=None))
    return ok, CORRECT if ok else WRONG


def worker_main(conn: Connection, memory_limit_bytes: int | None, sleep_hook: bool) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the pool owns shutdown, not Ctrl-C
    if memory_limit_bytes:
        resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))
    for name in ("math_verify", "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.ERROR)  # "timeout is disabled" warnings
    from math_verify import parse, verify

    gold_cache: dict = {}
    # Warm up parsers and sympy, and refuse to serve if grading is broken here (math-verify
    # swallows exceptions, e.g. MemoryError under memory_limit_bytes, and would answer "wrong").
    if _grade_pair("\\frac{1}{2}", "0.5", parse, verify, gold_cache) != (True, CORRECT):
        sys.exit(3)
    conn.send_bytes(b'{"ready": true}')
    while True:
        try:
            msg = json.loads(conn.recv_bytes())
        except EOFError:
            return  # the pool went away
        if msg.get("stop"):
            return
        try:
            correct, reason = _grade_pair(
                msg["answer"], msg["gold"], parse, verify, gold_cache, sleep_hook
            )
        except Exception as exc:  # noqa: BLE001 - any grader failure is one item's "error"
            correct, reason = False, ERROR
            log.warning("grading raised %s: %s", type(exc).__name__, exc)
        reply = {"id": msg["id"], "correct": correct, "reason": reason}
        conn.send_bytes(json.dumps(reply).encode())
