"""Reward composition: correctness + optional format reward, over-long penalty, tool-error
penalty and custom reward. For an episode, the response graded is its final assistant turn.

For each item, ``reward == sum(components.values())``; every component is already weighted:

- ``correct``: ``correct_weight × c`` with ``c`` in [0, 1]. In rule mode ``c`` is 1 when the
  extracted answer is equivalent to the ground truth (math-verify, via ``GraderPool``), else 0.
  Another mode (a solver model answering with the response as a guideline) computes its own
  ``Correctness`` list and passes it to ``RewardScorer.compose``; everything else is shared.
- ``format`` (only if ``format_weight != 0``): ``format_weight`` when the response ends its work
  with a complete ``\\boxed{...}`` answer, else 0.
- ``length_penalty`` (only if ``overlong_penalty > 0``): DAPO-style soft over-long penalty. With
  ``L = max_response_tokens``, ``B = overlong_buffer_tokens``, ``P = overlong_penalty`` and a
  response of ``n`` tokens: 0 for ``n <= L - B``; ``-P × (n - (L - B)) / B`` for
  ``L - B < n <= L`` (linear from 0 down to ``-P``); ``-P`` for ``n > L``.
- ``tool_errors`` (only if ``tool_error_penalty > 0``; episodes): ``-tool_error_penalty ×`` the
  episode's failed tool calls (malformed, unknown tool, bad arguments, the tool's own error, a
  timeout or another limit).
- ``custom`` (only if ``custom`` is set): ``custom_weight × fn(...)``. ``custom`` is a dotted path
  ``"package.module:function"`` imported with importlib, called as
  ``fn(*, prompt: str, response: str, ground_truth: str | None, metadata: dict)`` and returning a
  ``float`` (component ``custom``) or a ``dict[str, float]`` (components ``custom/<key>``).
  If it raises or returns a non-finite number for an item, that item's custom part is 0 and its
  reason gets ``";custom_error"`` appended (logged); a wrong return type is a ValueError.

``reason`` is the correctness reason: ``correct``, ``wrong``, ``empty`` (blank response),
``no_answer`` (nothing extractable), ``not_a_number`` (``answer_form = "number"``: the ground
truth is a plain number and the answer is an expression, e.g. ``3*4``; never graded),
``unparseable_answer``, ``bad_ground_truth``, ``timeout``, ``error``.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.scorer.extract import (
    DEFAULT_FALLBACKS,
    NOT_A_NUMBER,
    STRATEGIES,
    Extraction,
    check_answer_form,
    extract_answer,
    gate_answer_form,
)

log = logging.getLogger(__name__)

CustomRewardFn = Callable[..., "float | dict[str, float]"]


@dataclass(frozen=True, kw_only=True)
class RewardSpec:
    """Reward weights and shaping. Units: weights and penalty are reward units; lengths tokens."""

    correct_weight: float = 1.0
    format_weight: float = 0.0
    overlong_penalty: float = 0.0  # P above; 0 disables the over-long penalty
    overlong_buffer_tokens: int = 0  # B above
    max_response_tokens: int | None = None  # L above (the generator's response limit)
    tool_error_penalty: float = 0.0  # per failed tool call of an episode; 0 disables it
    custom: str | None = None  # "package.module:function"
    custom_weight: float = 1.0
    fallbacks: tuple[str, ...] = DEFAULT_FALLBACKS  # answer extraction order, see extract.py
    answer_form: str = "any"  # "number": a plain-number gold needs a plain-number answer

    def __post_init__(self) -> None:
        for name in ("correct_weight", "format_weight", "overlong_penalty", "custom_weight",
                     "tool_error_penalty"):  # fmt: skip
            if not math.isfinite(getattr(self, name)):
                raise ValueError(
                    f"reward {name} must be a finite number, got {getattr(self, name)}"
                )
        if self.overlong_penalty < 0:
            raise ValueError(
                f"reward overlong_penalty is a magnitude and must be >= 0, got "
                f"{self.overlong_penalty} (the component it produces is negative)"
            )
        if self.overlong_penalty > 0:
            limit, buffer = self.max_response_tokens, self.overlong_buffer_tokens
            if limit is None or limit <= 0:
                raise ValueError(
                    "reward overlong_penalty > 0 needs max_response_tokens (> 0): set it to the "
                    "generator's maximum response length in tokens"
                )
            if not 0 < buffer <= limit:
                raise ValueError(
                    f"reward overlong_buffer_tokens must be in (0, max_response_tokens={limit}] "
                    f"when overlong_penalty > 0, got {buffer}"
                )
        unknown = [f for f in self.fallbacks if f not in STRATEGIES]
        if unknown:
            raise ValueError(f"reward fallbacks {unknown} unknown; choose from {list(STRATEGIES)}")
        check_answer_form(self.answer_form, "reward answer_form")


@dataclass(frozen=True)
class ScoreItem:
    prompt: str
    response: str | bytes
    ground_truth: str | None
    response_tokens: int | None = None  # needed only for the over-long penalty
    metadata: dict = field(default_factory=dict)
    tool_errors: int = 0  # the episode's failed tool calls


@dataclass(frozen=True)
class Correctness:
    """How correct one response is: ``value`` in [0, 1] (a mean over solver samples is fine)."""

    value: float
    reason: str


@dataclass(frozen=True)
class ScoredItem:
    reward: float
    components: dict[str, float]
    reason: str
    answer: str | None  # the extracted answer (for logs), None when nothing was found


def load_custom_reward(path: str) -> CustomRewardFn:
    """Import ``"package.module:function"``; ValueError saying what is wrong if it does not load."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"custom reward {path!r} is not a 'package.module:function' path "
            "(example: 'my_rewards.math:brevity_bonus')"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"custom reward {path!r}: cannot import module {module_name!r} ({exc}); "
            "is it installed or on PYTHONPATH?"
        ) from exc
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise ValueError(f"custom reward {path!r}: module {module_name!r} has no function {attr!r}")
    try:
        inspect.signature(fn).bind(prompt="", response="", ground_truth=None, metadata={})
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"custom reward {path!r} must accept keyword arguments prompt, response, "
            f"ground_truth, metadata ({exc})"
        ) from exc
    return fn


def overlong_penalty(
    response_tokens: int, *, max_response_tokens: int, buffer_tokens: int, penalty: float
) -> float:
    """The DAPO-style soft penalty described in the module docstring (a value <= 0)."""
    start = max_response_tokens - buffer_tokens
    if response_tokens <= start:
        return 0.0
    if response_tokens > max_response_tokens:
        return -penalty
    return -penalty * (response_tokens - start) / buffer_tokens


class RewardScorer:
    """Turns responses into rewards. ``pool`` is a ``GraderPool`` (anything with
    ``grade_many(list[(answer, ground_truth)]) -> list[GradeResult]``)."""

    def __init__(self, spec: RewardSpec, *, pool) -> None:
        self.spec = spec
        self.pool = pool
        self.custom_fn = load_custom_reward(spec.custom) if spec.custom else None

    def score_items(self, items: Sequence[ScoreItem]) -> list[ScoredItem]:
        """Rule mode: extract each response's answer, grade it with math-verify, compose."""
        extractions = [extract_answer(it.response, fallbacks=self.spec.fallbacks) for it in items]
        pairs, form_ok = gate_answer_form(
            [(ex.answer, it.ground_truth) for ex, it in zip(extractions, items, strict=True)],
            self.spec.answer_form,
        )
        graded = self.pool.grade_many(pairs) if pairs else []
        correctness = []
        for ex, result, ok in zip(extractions, graded, form_ok, strict=True):
            if not ok:
                correctness.append(Correctness(0.0, NOT_A_NUMBER))
            elif ex.answer is None and result.reason != "bad_ground_truth":
                correctness.append(Correctness(0.0, ex.method))  # "empty" or "no_answer"
            else:
                correctness.append(Correctness(1.0 if result.correct else 0.0, result.reason))
        return self.compose(items, correctness, extractions=extractions)

    def score_group(
        self,
        *,
        prompt: str,
        responses: Sequence[str | bytes],
        ground_truth: str | None,
        response_tokens: Sequence[int] | None = None,
        metadata: dict | None = None,
    ) -> list[ScoredItem]:
        """One prompt's responses (a GRPO group), in order."""
        if response_tokens is not None and len(response_tokens) != len(responses):
            raise ValueError(
                f"score_group: {len(responses)} responses but {len(response_tokens)} token counts"
            )
        items = [
            ScoreItem(
                prompt=prompt,
                response=response,
                ground_truth=ground_truth,
                response_tokens=None if response_tokens is None else response_tokens[i],
                metadata=dict(metadata or {}),
            )
            for i, response in enumerate(responses)
        ]
        return self.score_items(items)

    def compose(
        self,
        items: Sequence[ScoreItem],
        correctness: Sequence[Correctness],
        *,
        extractions: Sequence[Extraction] | None = None,
    ) -> list[ScoredItem]:
        """Combine a correctness per item (from any mode) with the shaping terms."""
        assert len(items) == len(correctness)
        if extractions is None:
            extractions = [
                extract_answer(it.response, fallbacks=self.spec.fallbacks) for it in items
            ]
        return [
            self._compose_one(*args) for args in zip(items, correctness, extractions, strict=True)
        ]

    def _compose_one(self, item: ScoreItem, corr: Correctness, ex: Extraction) -> ScoredItem:
        spec = self.spec
        components = {"correct": spec.correct_weight * corr.value}
        reason = corr.reason
        if spec.format_weight:
            components["format"] = spec.format_weight if ex.method == "boxed" else 0.0
        if spec.overlong_penalty > 0:
            if item.response_tokens is None:
                raise ValueError(
                    "reward overlong_penalty is set but a scored item has no response_tokens; "
                    "pass the response's token count with every item"
                )
            assert spec.max_response_tokens is not None
            components["length_penalty"] = overlong_penalty(
                item.response_tokens,
                max_response_tokens=spec.max_response_tokens,
                buffer_tokens=spec.overlong_buffer_tokens,
                penalty=spec.overlong_penalty,
            )
        if spec.tool_error_penalty > 0:
            components["tool_errors"] = -spec.tool_error_penalty * item.tool_errors
        if self.custom_fn is not None:
            custom, ok = self._custom(item)
            components.update(custom)
            reason = reason if ok else f"{reason};custom_error"
        return ScoredItem(sum(components.values()), components, reason, ex.answer)

    def _custom(self, item: ScoreItem) -> tuple[dict[str, float], bool]:
        assert self.custom_fn is not None
        response = item.response
        if isinstance(response, (bytes, bytearray)):
            response = bytes(response).decode("utf-8", errors="replace")
        try:
            value = self.custom_fn(
                prompt=item.prompt,
                response=response,
                ground_truth=item.ground_truth,
                metadata=item.metadata,
            )
        except Exception:  # noqa: BLE001 - a user function failing on one item must not stop scoring
            log.exception(
                "custom reward %s raised; its component is 0 for this item", self.spec.custom
            )
            return {"custom": 0.0}, False
        if isinstance(value, dict):
            raw = {f"custom/{key}": v for key, v in value.items()}
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            raw = {"custom": value}
        else:
            raise ValueError(
                f"custom reward {self.spec.custom} returned {type(value).__name__}; "
                "it must return a float or a dict[str, float]"
            )
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in raw.values()):
            log.warning("custom reward %s returned a non-finite value %r", self.spec.custom, value)
            return {key: 0.0 for key in raw}, False
        return {key: self.spec.custom_weight * float(v) for key, v in raw.items()}, True
