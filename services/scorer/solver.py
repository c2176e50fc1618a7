"""Solver mode: a frozen LLM answers the question using the policy's response as a guideline.

The seed's pain (``001_*.txt``): 120 solver calls per step ran one at a time. Here every solver
request of a batch of groups — responses × ``solver_samples`` — is submitted to one vLLM async
engine at once, so the engine batches them continuously; the answers are graded together by the
math-verify ``GraderPool``. The reward's correctness is the mean (or majority) over the samples.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.config.scorer import ScorerConfig
from common.data.prompts import encode_prompt
from common.engine import GenerationEngine, SamplingSettings
from services.scorer.extract import (
    NOT_A_NUMBER,
    check_answer_form,
    extract_answer,
    gate_answer_form,
)
from services.scorer.rewards import Correctness, ScoreItem

if TYPE_CHECKING:
    from common.engine import EngineSettings

log = logging.getLogger(__name__)
_SCORER = ScorerConfig.model_fields


@dataclass(frozen=True, kw_only=True)
class SolverSettings:
    """How the solver asks and grades. The engine it runs on is ``common.engine``'s
    ``solver_engine_settings`` (``common.service.settings``), or a shared engine."""

    model: str  # the solver model's directory (its tokenizer)
    template: str  # uses {question} and {response}
    # defaults: the [scorer] section's, defined once there
    samples: int = _SCORER["solver_samples"].default  # answers per response
    aggregation: str = _SCORER["solver_aggregation"].default  # "mean" or "majority"
    temperature: float = _SCORER["solver_temperature"].default
    max_tokens: int = _SCORER["solver_max_tokens"].default
    answer_form: str = _SCORER["answer_form"].default  # applies to the solver's answers
    apply_chat_template: bool = True
    max_model_len: int = 1024  # the engine's context: a longer prompt keeps its end
    # Benchmarks only: every answer runs to max_tokens (the cost of a long-reasoning solver with
    # a small test model); the answer graded is still the text before the first end-of-sequence.
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if "{question}" not in self.template or "{response}" not in self.template:
            raise ValueError(
                "scorer.solver_template must contain {question} and {response}; got "
                f"{self.template!r}"
            )
        if self.aggregation not in ("mean", "majority"):
            raise ValueError(
                f"scorer.solver_aggregation must be mean or majority, not {self.aggregation!r}"
            )
        check_answer_form(self.answer_form)


class Solver:
    """Owns the solver engine; ``correctness(items)`` answers and grades a whole batch at once."""

    def __init__(
        self,
        settings: SolverSettings,
        *,
        pool,
        engine=None,
        engine_settings: EngineSettings | None = None,
    ) -> None:
        """``engine``: an already started ``GenerationEngine`` serving ``settings.model`` to share
        (tests, benchmarks); it is not shut down by ``shutdown()``. Otherwise ``start()`` starts
        one with ``engine_settings``."""
        self.s = settings
        self.pool = pool
        self.engine = engine
        self.engine_settings = engine_settings
        self._owns_engine = engine is None
        self.solver_tokens = 0
        self.last_batch_requests = 0

    async def start(self) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.s.model)
        if self.engine is not None:
            return
        if self.engine_settings is None:
            raise ValueError(
                "Solver.start: give an engine to share or engine_settings to start one"
            )
        self.engine = GenerationEngine(self.engine_settings)
        await self.engine.start()

    def prompt_ids(self, question: str, response: str) -> list[int]:
        text = self.s.template.format(question=question, response=response)
        chat = bool(self.s.apply_chat_template and getattr(self.tokenizer, "chat_template", None))
        ids = encode_prompt(self.tokenizer, text, apply_chat_template=chat)
        room = self.s.max_model_len - self.s.max_tokens
        return ids[-room:] if len(ids) > room else ids  # keep the end: the guideline's conclusion

    def _before_eos(self, token_ids: Sequence[int]) -> str:
        ids = list(token_ids)
        eos = self.tokenizer.eos_token_id
        if eos in ids:
            ids = ids[: ids.index(eos)]
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    async def answers(self, items: Sequence[ScoreItem]) -> list[list[str]]:
        """``samples`` solver answers per item; all requests go to the engine concurrently."""
        assert self.engine is not None, "Solver.start() first"
        sampling = SamplingSettings(
            n=self.s.samples,
            temperature=self.s.temperature,
            max_tokens=self.s.max_tokens,
            seed=None,
            ignore_eos=self.s.ignore_eos,
        )
        stamp = time.monotonic_ns()

        async def one(i: int, item: ScoreItem) -> list[str]:
            response = (
                item.response.decode("utf-8", "replace")
                if isinstance(item.response, bytes)
                else item.response
            )
            samples = await self.engine.generate_group(
                self.prompt_ids(item.prompt, response), sampling, request_id=f"solver-{stamp}-{i}"
            )
            self.solver_tokens += sum(len(s.token_ids) for s in samples)
            if self.s.ignore_eos:
                return [self._before_eos(s.token_ids) for s in samples]
            return [s.text for s in samples]

        self.last_batch_requests = len(items)
        return list(await asyncio.gather(*(one(i, it) for i, it in enumerate(items))))

    async def correctness(self, items: Sequence[ScoreItem]) -> list[Correctness]:
        answers = await self.answers(items)
        owners = [i for i, texts in enumerate(answers) for _ in texts]
        pairs, form_ok = gate_answer_form(
            [
                (extract_answer(text).answer, item.ground_truth)
                for item, texts in zip(items, answers, strict=True)
                for text in texts
            ],
            self.s.answer_form,
        )
        graded = await asyncio.to_thread(self.pool.grade_many, pairs) if pairs else []
        per_item: list[list[tuple[bool, str]]] = [[] for _ in items]
        for owner, result, ok in zip(owners, graded, form_ok, strict=True):
            per_item[owner].append((result.correct, result.reason) if ok else (False, NOT_A_NUMBER))
        return [self._aggregate(results) for results in per_item]

    def _aggregate(self, results: list[tuple[bool, str]]) -> Correctness:
        """Mean (fraction correct) or majority (1 if more than half correct) over the samples.
        The reason is ``correct`` when more than half are, else the most common failure."""
        if not results:
            return Correctness(0.0, "error")
        hits = sum(ok for ok, _ in results)
        failures = Counter(r for ok, r in results if not ok)
        reason = "correct" if hits * 2 > len(results) else failures.most_common(1)[0][0]
        if self.s.aggregation == "majority":
            return Correctness(1.0 if hits * 2 > len(results) else 0.0, reason)
        return Correctness(hits / len(results), reason)

    def shutdown(self) -> None:
        if self.engine is not None and self._owns_engine:
            self.engine.shutdown()
