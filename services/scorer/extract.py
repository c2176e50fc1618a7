"""Final-answer extraction from a model response (rule rewards, step 1 of 2).

`extract_answer` turns a free-form response into the short answer string that the grader
(`grader_pool.GraderPool`, math-verify) compares with the ground truth. Strategies are tried in
the order given by ``fallbacks``; the first that finds something wins:

- ``"boxed"``: the LAST complete ``\\boxed{...}`` or ``\\fbox{...}`` (braces balanced, nesting
  allowed, ``\\{``/``\\}`` escapes ignored). ``\\boxed 5`` (no braces) is accepted too. A
  truncated box (unbalanced braces, typical of an over-long response) is skipped.
- ``"answer_is"``: the last "the (final) answer is X" / "Answer: X", up to the end of the line.
- ``"gsm8k"``: the last "#### X" line (GSM8K's convention).
- ``"last_number"``: the last number in the text (``-12``, ``3.5``, ``1,234``, ``7/8``).

``answer_form_ok`` is the optional check of the answer's form that comes before grading
(``scorer.answer_form``): with ``"number"``, when the ground truth is a plain number the answer
must be one too. math-verify evaluates what it parses, so without it ``\\boxed{983*4099}`` is
graded equal to ``4029317``: a policy can learn to box the question instead of answering it.

Pure Python and cheap: it runs in the scorer's main process, never in a grading worker.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

STRATEGIES = ("boxed", "answer_is", "gsm8k", "last_number")
ANSWER_FORMS = ("any", "number")
NOT_A_NUMBER = "not_a_number"  # the reason of an answer ``answer_form_ok`` rejects
DEFAULT_FALLBACKS = ("boxed", "answer_is", "last_number")
# Responses are capped before scanning so that a multi-megabyte garbage response costs O(cap).
MAX_SCAN_CHARS = 200_000
MAX_BOX_CANDIDATES = 32

_BOX_START = re.compile(r"\\(boxed|fbox)(?![A-Za-z])(\s*)")
_ANSWER_IS = re.compile(
    r"(?:final\s+answer|answer)\s*(?:is\s*[:=]?|[:=])\s*([^\n]+)",
    re.IGNORECASE,
)
_GSM8K = re.compile(r"####\s*([^\n]+)")
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:/\d+)?|-?\.\d+")
# A plain number: an integer (commas between thousands allowed), a decimal, a fraction a/b or
# \frac{a}{b} (\dfrac, \tfrac), with an optional sign; spaces and $...$ around it are ignored.
_PLAIN_NUMBER = re.compile(
    r"[-+−]?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d*)?|\.\d+)(?:\s*/\s*\d+)?"
    r"|[-+−]?\\[dt]?frac\{\s*\d+\s*\}\{\s*\d+\s*\}"
)
# Control characters other than tab/newline carry no answer and confuse the regexes.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


@dataclass(frozen=True)
class Extraction:
    """``answer`` is None when nothing was found; ``method`` names the strategy that matched,
    or why nothing did: ``"empty"`` (blank response) or ``"no_answer"``."""

    answer: str | None
    method: str


def extract_answer(
    text: str | bytes | None, *, fallbacks: tuple[str, ...] = DEFAULT_FALLBACKS
) -> Extraction:
    """Extract the final answer of ``text``. Bytes are decoded as UTF-8 with invalid sequences
    replaced (U+FFFD), so garbled responses are scored rather than crashing the scorer."""
    unknown = [name for name in fallbacks if name not in STRATEGIES]
    if unknown:
        raise ValueError(
            f"unknown answer-extraction fallback(s) {unknown}; choose from {list(STRATEGIES)} "
            "(setting: scorer answer fallbacks)"
        )
    clean = _normalise_text(text)
    if not clean.strip():
        return Extraction(None, "empty")
    for name in fallbacks:
        answer = _STRATEGY_FNS[name](clean)
        if answer:
            return Extraction(answer, name)
    return Extraction(None, "no_answer")


def _normalise_text(text: str | bytes | None) -> str:
    if text is None:
        return ""
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", errors="replace")
    elif not isinstance(text, str):
        raise TypeError(f"response text must be str or bytes, got {type(text).__name__}")
    # Lone surrogates (e.g. from a surrogateescape decode) cannot be encoded to UTF-8 later on.
    text = text.encode("utf-8", errors="replace").decode("utf-8")
    if len(text) > MAX_SCAN_CHARS:
        # The answer is at the end of a response; keep the tail.
        text = text[-MAX_SCAN_CHARS:]
    return _CONTROL.sub("", text)


def find_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}``/``\\fbox{...}`` in ``text``, or None."""
    matches = list(_BOX_START.finditer(text))
    # Last box first; a bounded number of candidates keeps adversarial text linear-time.
    for match in reversed(matches[-MAX_BOX_CANDIDATES:]):
        start = match.end()
        if start < len(text) and text[start] == "{":
            content = _balanced(text, start)
        elif match.group(2):
            # "\boxed 5": one token, up to whitespace or "$".
            token = re.match(r"[^\s$]+", text[start:])
            content = token.group(0) if token else None
        else:
            content = None  # a box at the very end of the text
        if content is not None and content.strip():
            return content.strip()
    return None


def _balanced(text: str, open_at: int) -> str | None:
    """Text between the brace at ``open_at`` and its matching close, or None if unbalanced."""
    depth = 0
    i = open_at
    while i < len(text):
        char = text[i]
        if char == "\\" and i + 1 < len(text) and text[i + 1] in "{}":
            i += 2  # escaped brace, e.g. the set \{1, 2\}
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : i]
        i += 1
    return None


def _clean_tail(raw: str) -> str | None:
    # Up to the end of the sentence ("3.5" keeps its point), minus markdown emphasis.
    answer = re.split(r"\.(?=\s|$)", raw, maxsplit=1)[0]
    answer = answer.strip().strip("*_ ").strip()
    if answer.startswith("$") and answer.endswith("$") and len(answer) > 1:
        answer = answer.strip("$").strip()
    if answer.startswith("\\(") and answer.endswith("\\)"):
        answer = answer[2:-2].strip()
    boxed = find_boxed(answer)
    return boxed or answer or None


def _find_answer_is(text: str) -> str | None:
    matches = _ANSWER_IS.findall(text)
    return _clean_tail(matches[-1]) if matches else None


def _find_gsm8k(text: str) -> str | None:
    matches = _GSM8K.findall(text)
    return _clean_tail(matches[-1]) if matches else None


def _find_last_number(text: str) -> str | None:
    matches = _NUMBER.findall(text)
    return matches[-1] if matches else None


_STRATEGY_FNS = {
    "boxed": find_boxed,
    "answer_is": _find_answer_is,
    "gsm8k": _find_gsm8k,
    "last_number": _find_last_number,
}


def is_plain_number(text: str | None) -> bool:
    """True when ``text`` is one number written out (``12``, ``-3``, ``1,234``, ``3.5``, ``7/8``,
    ``\\frac{7}{8}``), not an expression to evaluate (``3*4``, ``10-2``, ``2^3``)."""
    if text is None:
        return False
    core = text.strip()
    if len(core) > 1 and core.startswith("$") and core.endswith("$"):
        core = core.strip("$").strip()
    core = core.rstrip(".").strip()
    return _PLAIN_NUMBER.fullmatch(core) is not None


def check_answer_form(form: str, setting: str = "scorer.answer_form") -> None:
    """Raise ``ValueError`` naming ``setting`` when ``form`` is not one of ``ANSWER_FORMS``."""
    if form not in ANSWER_FORMS:
        raise ValueError(f"{setting} {form!r} unknown; choose from {list(ANSWER_FORMS)}")


def answer_form_ok(answer: str | None, ground_truth: str | None, form: str) -> bool:
    """Whether ``answer`` may be graded under ``scorer.answer_form``: always with ``"any"``;
    with ``"number"``, unless the ground truth is a plain number and the answer is not. A
    missing answer or ground truth passes (the grader gives it its own reason)."""
    check_answer_form(form)
    return _form_ok(answer, ground_truth, form)


def _form_ok(answer: str | None, ground_truth: str | None, form: str) -> bool:
    if form == "any" or answer is None or not is_plain_number(ground_truth):
        return True
    return is_plain_number(answer)


def gate_answer_form(
    pairs: Sequence[tuple[str | None, str | None]], form: str
) -> tuple[list[tuple[str | None, str | None]], list[bool]]:
    """``(pairs to grade, kept)``: each ``(answer, ground_truth)`` whose answer fails
    ``answer_form_ok`` has its answer blanked, so it is never sent to math-verify, and
    ``kept[i]`` is False; the caller scores it 0 with reason ``NOT_A_NUMBER``."""
    check_answer_form(form)  # once for the batch, not per response
    kept = [_form_ok(answer, gold, form) for answer, gold in pairs]
    gated = [(answer if ok else None, gold) for (answer, gold), ok in zip(pairs, kept, strict=True)]
    return gated, kept
