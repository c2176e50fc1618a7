"""The demo's synthetic, verifiable math task: small-integer arithmetic with ``\\boxed{}`` answers.

Deterministic for a seed. Train and held-out (eval) splits never share a problem. Each item has
the prompt, the ground-truth answer (a string math-verify parses), a reference solution text for
the supervised warm-up (``\\boxed{579}``) and metadata (operands, operator, split).

Files (JSONL, one item per line) go into a directory together with ``task.json``, which records
the parameters that made them; a later call with the same parameters reuses the files.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
PROMPT_TEMPLATE = "What is {a}{op}{b}? Answer in \\boxed{{}}."
# Prompt formats: "question" is the full sentence; "short" (``23+45=``) has a fifth of its tokens,
# which makes the demo's CPU warm-up and RL steps cheaper; "instruct" is a question as a person
# would write it to a pretrained chat model (spaces around the operator, the answer's format asked
# for in words), for the real-model demo, which has no warm-up.
PROMPT_STYLES = {
    "question": PROMPT_TEMPLATE,
    "short": "{a}{op}{b}=",
    "instruct": "What is {a} {op} {b}?",
}
# One worked exchange before the question (``ArithmeticTask.one_shot``): a chat model sees the
# answer's format in use rather than described. SmolLM2-135M-Instruct, asked for the format in a
# system turn or in the question instead (with or without an example), boxed next to none of its
# greedy answers in development probes; with the exchange it boxes many (the demo's results give
# its held-out accuracy before RL).
ONE_SHOT = (
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "2 + 3 = 5. The answer is \\boxed{5}."},
)
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


@dataclass(frozen=True, kw_only=True)
class ArithmeticTask:
    """Parameters of the task; ``digits`` is the largest operand length for + and -."""

    digits: int = 2  # operands of + and - have 1..digits digits
    operators: str = "+"  # any of "+-*"; "*" multiplies a (1..digits)-digit number by one digit
    num_train: int = 2000  # problems in the train split
    num_eval: int = 200  # problems in the held-out split (disjoint from train)
    seed: int = 0
    prompt_style: str = "question"  # a key of PROMPT_STYLES
    # False: operands uniform in 0..10**digits-1 (mostly full length). True: each operand's
    # length is drawn first (uniform in 1..digits), which puts many easy short problems in the mix.
    mixed_lengths: bool = False
    # "boxed": the reference solution is just ``\boxed{124}``. "scratchpad" (``+`` only): column
    # addition from the ones digit up, then the box — ``9+5=14, 3+8+1=12, \boxed{124}``. Each
    # step is a one-digit sum plus a carry, which a tiny model learns for unseen problems.
    solution_style: str = "boxed"
    # A sloppy teacher (scratchpad only): in this fraction of the train split's carry steps the
    # reference solution writes "+0" instead of "+1" and carries its mistake into the box. The
    # warm-up imitates the sloppiness; a verifier reward does not pay for it, so RL removes it.
    # Held-out solutions are always correct (they are never trained on).
    teacher_carry_error: float = 0.0
    # ONE_SHOT's exchange before each question (the prompt becomes a chat of three turns)
    one_shot: bool = False

    def __post_init__(self) -> None:
        if self.prompt_style not in PROMPT_STYLES:
            raise ValueError(
                f"prompt_style={self.prompt_style!r}: use one of {sorted(PROMPT_STYLES)}."
            )
        if not 1 <= self.digits <= 6:
            raise ValueError(f"digits={self.digits} must be in 1..6.")
        bad = set(self.operators) - set(OPERATORS)
        if not self.operators or bad:
            raise ValueError(f"operators={self.operators!r}: use a non-empty subset of '+-*'.")
        if self.num_train < 1 or self.num_eval < 1:
            raise ValueError("num_train and num_eval must both be >= 1.")
        if self.solution_style not in ("boxed", "scratchpad"):
            raise ValueError(
                f"solution_style={self.solution_style!r}: use 'boxed' or 'scratchpad'."
            )
        if self.solution_style == "scratchpad" and self.operators != "+":
            raise ValueError("solution_style='scratchpad' is implemented for operators='+' only.")
        if not 0.0 <= self.teacher_carry_error <= 1.0:
            raise ValueError(f"teacher_carry_error={self.teacher_carry_error} must be in [0, 1].")
        if self.teacher_carry_error and self.solution_style != "scratchpad":
            raise ValueError("teacher_carry_error needs solution_style='scratchpad'.")
        space = self.problem_space_size()
        if self.num_train + self.num_eval > space // 2:
            raise ValueError(
                f"num_train + num_eval = {self.num_train + self.num_eval} is more than half of "
                f"the {space} distinct problems with digits={self.digits}, "
                f"operators={self.operators!r}; raise digits or lower the split sizes."
            )

    def problem_space_size(self) -> int:
        n = 10**self.digits
        per_op = {"+": n * n, "-": n * (n + 1) // 2, "*": n * 10}
        return sum(per_op[op] for op in set(self.operators))


@dataclass(frozen=True)
class Problem:
    a: int
    op: str
    b: int

    @property
    def answer(self) -> int:
        return OPERATORS[self.op](self.a, self.b)

    def prompt(self, style: str = "question") -> str:
        return PROMPT_STYLES[style].format(a=self.a, op=self.op, b=self.b)

    def solution(self) -> str:
        return f"\\boxed{{{self.answer}}}"

    def scratchpad(self, drop_carry: random.Random | None = None, error: float = 0.0) -> str:
        """Column addition, ones digit first: ``9+5=14, 3+8+1=12, \\boxed{124}``.

        With ``error`` > 0, each carry into a column is written as 0 with that probability
        (drawn from ``drop_carry``), and the sum follows the mistake."""
        assert self.op == "+", "scratchpads are for additions"
        a, b = str(self.a)[::-1], str(self.b)[::-1]
        steps, digits, carry = [], [], 0
        for i in range(max(len(a), len(b))):
            x = int(a[i]) if i < len(a) else 0
            y = int(b[i]) if i < len(b) else 0
            if i == 0:
                total = x + y
                steps.append(f"{x}+{y}={total}")
            else:
                if carry and drop_carry is not None and drop_carry.random() < error:
                    carry = 0  # the sloppy teacher forgets it
                total = x + y + carry
                steps.append(f"{x}+{y}+{carry}={total}")
            digits.append(total % 10)
            carry = total // 10
        value = int(("1" if carry else "") + "".join(str(d) for d in reversed(digits)))
        return ", ".join(steps) + f", \\boxed{{{value}}}"


def _operand(rng: random.Random, task: ArithmeticTask) -> int:
    if not task.mixed_lengths:
        return rng.randint(0, 10**task.digits - 1)
    n = rng.randint(1, task.digits)
    return rng.randint(0 if n == 1 else 10 ** (n - 1), 10**n - 1)


def _draw(rng: random.Random, task: ArithmeticTask) -> Problem:
    op = rng.choice(task.operators)
    if op == "*":
        return Problem(_operand(rng, task), op, rng.randint(0, 9))
    a, b = _operand(rng, task), _operand(rng, task)
    if op == "-" and b > a:
        a, b = b, a  # answers stay non-negative
    return Problem(a, op, b)


def make_problems(task: ArithmeticTask) -> tuple[list[Problem], list[Problem]]:
    """(train, eval) lists of distinct problems; deterministic for ``task``."""
    rng = random.Random(f"tether-arith-{task.seed}")
    seen: set[Problem] = set()
    ordered: list[Problem] = []
    total = task.num_train + task.num_eval
    while len(ordered) < total:
        p = _draw(rng, task)
        if p not in seen:
            seen.add(p)
            ordered.append(p)
    return ordered[task.num_eval :], ordered[: task.num_eval]


def item(
    problem: Problem,
    *,
    split: str,
    index: int,
    prompt_style: str = "question",
    solution: str | None = None,
    one_shot: bool = False,
) -> dict:
    """One JSONL record: prompt (a chat, ``ONE_SHOT``'s exchange then the question, when
    ``one_shot``), answer, reference solution and metadata."""
    question = problem.prompt(prompt_style)
    chat = [*map(dict, ONE_SHOT), {"role": "user", "content": question}]
    return {
        "prompt": chat if one_shot else question,
        "answer": str(problem.answer),
        "solution": problem.solution() if solution is None else solution,
        "metadata": {"a": problem.a, "op": problem.op, "b": problem.b},
        "split": split,
        "index": index,
    }


def write_jsonl(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def write_task(out_dir: str | Path, task: ArithmeticTask) -> dict[str, Path]:
    """Write ``train.jsonl`` and ``eval.jsonl`` into ``out_dir`` (reused when up to date).

    Returns ``{"train": path, "eval": path}``.
    """
    out = Path(out_dir)
    paths = {"train": out / "train.jsonl", "eval": out / "eval.jsonl"}
    marker = out / "task.json"
    params = asdict(task)
    if (
        marker.exists()
        and json.loads(marker.read_text()) == params
        and all(p.exists() for p in paths.values())
    ):
        logger.info("reusing task files in %s", out)
        return paths
    out.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)  # files below are out of date until the marker is rewritten
    train, held_out = make_problems(task)
    style = task.prompt_style
    sloppy = random.Random(f"tether-teacher-{task.seed}")

    def solution(p: Problem, split: str) -> str | None:
        if task.solution_style == "boxed":
            return None
        error = task.teacher_carry_error if split == "train" else 0.0
        return p.scratchpad(sloppy, error)

    for split, problems in (("train", train), ("eval", held_out)):
        rows = [
            item(
                p,
                split=split,
                index=i,
                prompt_style=style,
                solution=solution(p, split),
                one_shot=task.one_shot,
            )
            for i, p in enumerate(problems)
        ]
        write_jsonl(paths[split], rows)
    marker.write_text(json.dumps(params, indent=2))
    logger.info("wrote %d train / %d eval problems to %s", len(train), len(held_out), out)
    return paths


def read_jsonl(path: str | Path) -> list[dict]:
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` (no nested braces), or None."""
    found = _BOXED.findall(text)
    return found[-1].strip() if found else None


def is_correct(text: str, answer: str) -> bool:
    """Exact integer match of the boxed answer: a quick check for the demo's measurements.

    The scorer grades with math-verify; for this task's integer answers the two agree.
    """
    got = extract_boxed(text)
    if got is None:
        return False
    try:
        return int(got) == int(answer)
    except ValueError:
        return False
