"""Held-out evaluation, owned by the learner's rank 0: a round per evaluated policy version.

A round sends the held-out set (greedy by default) for weights ``>= version`` through the same
generators and scorers as training (``Dispatcher.dispatch_eval``); the scored groups come back on
``<run>:scored`` with ``split = "eval"`` and ``cycle = round``. The round is recorded (accuracy,
prompts, the policy versions that answered) once every prompt has come back or been
dead-lettered (``lost``), in ``metrics.jsonl``, Prometheus and the trackers.

A learner that dies during a round loses the round's state, and the groups already acknowledged.
Its successor runs the round again under prompt ids of its own (``eval<round>.<tag>/…``, a tag
per learner process), so the generators' de-duplication does not skip the prompts answered
before, and groups of the dead learner's round that still arrive are acknowledged and left out
(the generators counted them as evaluation groups, so the books still balance). A round already
in the checkpoint's history is not run again.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.protocol import wire

if TYPE_CHECKING:
    from common.bus.dead_letters import DeadLetters
    from common.telemetry.trackers import Trackers
    from services.learner.dispatch import Dispatcher

log = logging.getLogger(__name__)


class HeldOut:
    def __init__(
        self,
        dispatcher: Dispatcher,
        dead: DeadLetters,
        *,
        accuracy_gauge: Any,
        metrics_path: Path,
        trackers: Trackers,
    ) -> None:
        self.dispatcher, self.dead = dispatcher, dead
        self.accuracy_gauge, self.metrics_path, self.trackers = (
            accuracy_gauge,
            metrics_path,
            trackers,
        )
        self.rounds: dict[int, dict[str, Any]] = {}  # round -> {"expected", "results", ...}
        self.history: list[dict[str, Any]] = []
        self.tag = uuid.uuid4().hex[:8]  # this learner process's rounds

    def start(self, version: int) -> None:
        done = any(h.get("eval_round") == version for h in self.history)
        if version in self.rounds or done or self.dispatcher.eval_set is None:
            return
        n = self.dispatcher.dispatch_eval(version, version, tag=self.tag)
        self.rounds[version] = {"expected": n, "results": [], "started": time.time()}

    def outstanding(self) -> bool:
        return any(not r.get("done") for r in self.rounds.values())

    def result(self, round_id: int, sg: wire.ScoredGroup) -> None:
        ev = self.rounds.get(round_id)
        if ev is None or not sg.group.prompt_id.startswith(f"eval{round_id}.{self.tag}/"):
            return  # a round of a learner that died: this one runs the round afresh
        ev["results"].append(sg)
        self.maybe_finish(round_id)

    def check_all(self) -> None:
        """After new dead letters: finish the rounds they complete."""
        for round_id in list(self.rounds):
            self.maybe_finish(round_id)

    def maybe_finish(self, round_id: int) -> None:
        """Record the round once every held-out prompt has come back or been dead-lettered
        (``lost``: the accuracy is over the ``n`` that came back)."""
        ev = self.rounds.get(round_id)
        lost = len(self.dead.of("eval", round_id))
        if ev is None or ev.get("done") or len(ev["results"]) + lost < ev["expected"]:
            return
        ev["done"] = True
        self.dead.forget("eval", round_id)
        if not ev["results"]:
            log.warning("held-out round v%d: all %d prompts were dead-lettered", round_id, lost)
            return
        # one verdict per episode (an agent's episode of several segments is scored on its
        # last); an agent that returns one number is right when it is > 0
        correct = [
            c.get("correct", c.get("agent", 0.0)) > 0
            for r in ev["results"]
            for t, c in zip(r.group.samples, r.components, strict=True)
            if not any(u.sample_index == t.sample_index and u.segment > t.segment
                       for u in r.group.samples)
        ]  # fmt: skip
        versions = sorted({t.policy_version for r in ev["results"] for t in r.group.samples})
        acc = sum(correct) / max(len(correct), 1)
        rec = {
            "eval_round": round_id,
            "accuracy": acc,
            "n": len(correct),
            "lost": lost,
            "policy_versions": versions,
            "seconds": time.time() - ev["started"],
            "time": time.time(),
        }
        self.history.append(rec)
        self.accuracy_gauge.set(acc)
        append_jsonl(self.metrics_path, {"kind": "eval", **rec})
        self.trackers.log({"eval/accuracy": acc}, round_id)
        log.info(
            "held-out accuracy at v%d: %.3f (%d prompts%s)",
            round_id,
            acc,
            len(correct),
            f", {lost} dead-lettered" if lost else "",
        )


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
