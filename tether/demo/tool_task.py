"""The tools demo's task (`tether demo --task tools`): products the tiny model cannot compute in
its head but can with the calculator.

Each problem multiplies a ``a_digits``-digit number by a ``b_digits``-digit one whose product
has ``a_digits + b_digits`` digits (``What is 417*2593?``, 1081281). The reference episodes come
from a sloppy teacher: in ``teacher_tool_rate`` of the train problems it calls the calculator
and copies the result into its box (two assistant turns around a tool turn); otherwise it
guesses from a mental estimate (the product rounded to its two leading digits:
``Estimating: 417*2593 ≈ 1100000, so \\boxed{1100000}``), which is wrong but looks plausible. A
model warmed up on it guesses most of the time, so greedy decoding guesses and held-out accuracy
starts low; a verifier's reward pays only for the right product, which only the tool gives, so
RL has to raise the tool-call rate to raise accuracy.

**Why full-width products only.** Everything the tiny model copies then sits at a fixed offset:
the operands from the question into the call, the tool's answer into the box (a product of 6 or
7 digits moves the box's digits by one). Measured on the 2-layer model (hidden 128, seed 0,
batch 32, lr 3e-3): with products of 6 and 7 digits mixed, 900 warm-up steps left it copying
nothing (greedy episodes of the held-out problems exact 0 %, the call's operands right 0 %).

**Why a careful teacher first.** Copying emerges suddenly, after a number of steps that depends
on the seed; on the sloppy teacher's mix alone it took 250 to 800+ steps. The warm-up therefore
starts on ``careful.jsonl`` (the same train problems, each solved with the calculator) until the
model reproduces its episodes (``tether.demo.warmup``: 325 steps for seed 0, 400 for seed 1 with
the demo model's ``rope_theta`` of 500), then spends 100 steps on the sloppy teacher, which
bring the first token's tool-call probability on held-out prompts down to the teacher's ~0.3
(greedy: no call) while the copying stays (measured on seed 0 with rope_theta 10000: 100 % of
64 held-out tool episodes exact after them). The model can use the tool and mostly does not:
what RL has to change.

Files: ``train.jsonl``, ``careful.jsonl`` and ``eval.jsonl`` (``prompt``, ``answer``,
``turns``: the teacher's episode as ``{"role": "assistant", "text"}`` / ``{"role": "tool",
"content"}``, ``metadata``)
with ``task.json`` recording the parameters (reused when unchanged). Held-out episodes always
use the tool (never trained on; they document the intended behaviour).
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from common.tools.calculator import evaluate
from tether.demo.tasks import write_jsonl

logger = logging.getLogger(__name__)

PROMPT = "What is {a}*{b}?"
GUESS = "Estimating: "


@dataclass(frozen=True, kw_only=True)
class ToolTask:
    a_digits: int = 3
    b_digits: int = 4
    num_train: int = 2000
    num_eval: int = 200
    seed: int = 0
    teacher_tool_rate: float = 0.3  # share of train episodes in which the teacher uses the tool
    prompt: str = PROMPT  # the question, with {a} and {b}

    def __post_init__(self) -> None:
        if not (2 <= self.a_digits <= 6 and 2 <= self.b_digits <= 6):
            raise ValueError("a_digits and b_digits must be in 2..6")
        if not 0.0 <= self.teacher_tool_rate <= 1.0:
            raise ValueError(f"teacher_tool_rate={self.teacher_tool_rate} must be in [0, 1]")
        if self.num_train < 1 or self.num_eval < 1:
            raise ValueError("num_train and num_eval must both be >= 1")


def call_text(a: int, b: int) -> str:
    """The teacher's calculator call, in the Hermes format the demo model's template uses."""
    args = json.dumps({"name": "calculator", "arguments": {"expression": f"{a}*{b}"}})
    return f"<tool_call>{args}</tool_call>"


def estimate(value: int) -> int:
    """A mental estimate: ``value`` rounded to its two leading digits."""
    digits = len(str(value))
    return round(value, -(digits - 2)) if digits > 2 else value


def episode(a: int, b: int, *, use_tool: bool) -> list[dict[str, str]]:
    """The teacher's turns after the prompt. A guess restates the product and its estimate
    before boxing it: the operands and a number are copied in every episode, as a call and its
    answer copy them. It starts with a fixed word (``GUESS``), so the choice between guessing
    and calling is one token's: greedy decoding guesses when the teacher mostly did (a guess
    that started with the product's first digit split its probability over ten tokens, and
    greedy decoding then called the tool at a call rate of 0.18)."""
    if not use_tool:
        guess = estimate(a * b)
        text = f"{GUESS}{a}*{b} ≈ {guess}, so \\boxed{{{guess}}}"
        return [{"role": "assistant", "text": text}]
    result = evaluate(f"{a}*{b}")
    return [
        {"role": "assistant", "text": call_text(a, b)},
        {"role": "tool", "content": result},
        {"role": "assistant", "text": f"\\boxed{{{result}}}"},
    ]


def _problems(task: ToolTask) -> list[tuple[int, int]]:
    rng = random.Random(f"tether-tools-{task.seed}")
    seen: set[tuple[int, int]] = set()
    out: list[tuple[int, int]] = []
    while len(out) < task.num_train + task.num_eval:
        a = rng.randint(10 ** (task.a_digits - 1), 10**task.a_digits - 1)
        b = rng.randint(10 ** (task.b_digits - 1), 10**task.b_digits - 1)
        # full-width products only (the module docstring says why)
        if len(str(a * b)) == task.a_digits + task.b_digits and (a, b) not in seen:
            seen.add((a, b))
            out.append((a, b))
    return out


def _row(a: int, b: int, *, split: str, index: int, use_tool: bool,
         prompt: str = PROMPT) -> dict[str, Any]:  # fmt: skip
    return {
        "prompt": prompt.format(a=a, b=b),
        "answer": str(a * b),
        "turns": episode(a, b, use_tool=use_tool),
        "metadata": {"a": a, "b": b},
        "split": split,
        "index": index,
    }


def write_tool_task(out_dir: str | Path, task: ToolTask) -> dict[str, Path]:
    """Write ``train.jsonl`` and ``eval.jsonl`` (reused when up to date); their paths."""
    out = Path(out_dir)
    paths = {
        "train": out / "train.jsonl",
        "careful": out / "careful.jsonl",
        "eval": out / "eval.jsonl",
    }
    marker = out / "task.json"
    params = {"kind": "tools", "products": "full-width", "careful": True, "guess": GUESS,
              **asdict(task)}  # fmt: skip
    if marker.exists() and json.loads(marker.read_text()) == params:
        if all(p.exists() for p in paths.values()):
            return paths
    out.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    problems = _problems(task)
    held_out, train = problems[: task.num_eval], problems[task.num_eval :]
    teacher = random.Random(f"tether-tools-teacher-{task.seed}")
    write_jsonl(paths["train"], [
        _row(a, b, split="train", index=i, use_tool=teacher.random() < task.teacher_tool_rate,
             prompt=task.prompt)
        for i, (a, b) in enumerate(train)
    ])  # fmt: skip
    write_jsonl(paths["careful"], [
        _row(a, b, split="train", index=i, use_tool=True, prompt=task.prompt)
        for i, (a, b) in enumerate(train)
    ])  # fmt: skip
    write_jsonl(paths["eval"], [
        _row(a, b, split="eval", index=i, use_tool=True, prompt=task.prompt)
        for i, (a, b) in enumerate(held_out)
    ])  # fmt: skip
    marker.write_text(json.dumps(params, indent=2))
    logger.info("wrote %d train / %d eval tool problems to %s", len(train), len(held_out), out)
    return paths
