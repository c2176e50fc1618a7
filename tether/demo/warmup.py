"""A short supervised warm-up so the demo's tiny random model starts RL with reward above zero.

``warmup_sft`` trains on prompt -> reference-solution pairs from the task's train split (loss on
the completion tokens only, prompts through the chat template; for the tools task, on the
teacher's episodes with the loss on its assistant turns only), on CPU in fp32 with
transformers, and saves the model back as safetensors with the same tokenizer. A marker file
(``tether_warmup.json``) records the settings and the report, so a re-run reuses the result.

``measure_accuracy`` grades an engine's answers on held-out items (exact integer match of the
``\\boxed{}`` content: the same verdict math-verify gives for these integer answers).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common.chat.turns import TurnEncoder
from common.data.prompts import encode_prompt
from common.tools.registry import tool_schemas
from tether.demo.tasks import is_correct, read_jsonl

logger = logging.getLogger(__name__)
MARKER = "tether_warmup.json"


Example = tuple[list[int], list[int], list[int]]  # prompt ids, completion ids, their loss mask


def _examples(tokenizer: Any, rows: list[dict], tools: list[str] | None = None) -> list[Example]:
    """(prompt ids, completion ids + eos, loss mask) per row. A row with ``turns`` is an episode
    (``tether.demo.tool_task``), assembled exactly as the generator assembles one: assistant
    turns as their ids and eos (loss), tool turns by template difference (no loss)."""
    schemas = tool_schemas(tools or [])
    encoder = None
    out = []
    for row in rows:
        prompt = encode_prompt(tokenizer, row["prompt"], tools=schemas)
        if "turns" not in row:
            completion = tokenizer(row["solution"], add_special_tokens=False).input_ids
            ids = list(completion) + [tokenizer.eos_token_id]
            out.append((prompt, ids, [1] * len(ids)))
            continue
        if encoder is None:
            encoder = TurnEncoder(tokenizer, end_ids={tokenizer.eos_token_id}, tools=schemas)
        ids, mask = [], []
        for turn in row["turns"]:
            if turn["role"] == "assistant":
                part = [*tokenizer(turn["text"], add_special_tokens=False).input_ids,
                        tokenizer.eos_token_id]  # fmt: skip
            else:
                part = encoder.env_turn([{"role": turn["role"], "content": turn["content"]}])
            ids += part
            mask += [int(turn["role"] == "assistant")] * len(part)
        out.append((prompt, ids, mask))
    return out


def sft_batch(examples: Sequence[Example | tuple[list[int], list[int]]], pad_id: int):
    """(input ids, attention mask, labels) of examples ``(prompt, completion[, loss mask])``."""
    import torch

    width = max(len(e[0]) + len(e[1]) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        p, c = e[0], e[1]
        m = e[2] if len(e) == 3 else [1] * len(c)
        seq = p + c
        ids[i, : len(seq)] = torch.tensor(seq)
        # loss on the completion's own tokens only (not the prompt, not tool turns)
        labels[i, len(p) : len(seq)] = torch.tensor(
            [t if k else -100 for t, k in zip(c, m, strict=True)]
        )
        mask[i, : len(seq)] = 1
    return ids, mask, labels


CONSTANT_RAMP = 30  # steps of the constant schedule's linear warm-up, at most
CHECK_EVERY = 25  # steps between ``stop_at_exact`` checks
CHECK_EPISODES = 64  # train episodes each check runs (one forward pass, no gradient)


def episode_exactness(model: Any, episodes: Sequence[Example], pad_id: int) -> float:
    """Share of ``episodes`` whose loss-bearing tokens after the first are all the model's
    greedy choice, teacher-forced: the episode is reproduced exactly once its first token (the
    decision to call a tool or to answer) is taken."""
    import torch

    was_training = model.training
    model.eval()
    with torch.no_grad():
        ids, mask, labels = sft_batch(episodes, pad_id)
        guess = model(input_ids=ids, attention_mask=mask).logits[:, :-1].argmax(-1)
    model.train(was_training)
    target = labels[:, 1:]
    exact = 0
    for row in range(len(episodes)):
        where = (target[row] != -100).nonzero().flatten()[1:]
        exact += int(bool((guess[row, where] == target[row, where]).all()))
    return exact / len(episodes)


def _sha256(*paths: str | Path) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def _lr_at(step: int, steps: int, lr: float, schedule: str = "cosine") -> float:
    """Linear warm-up over the first 5% of steps, then cosine decay to 10% of ``lr``
    (``schedule="cosine"``) or ``lr`` to the end (``"constant"``: the tools demo's copying
    emerges late in the warm-up, and a decayed rate delays it). The constant schedule's ramp
    is at most ``CONSTANT_RAMP`` steps: its runs may stop early (``stop_at_exact``), and the
    steps they take must not depend on the cap."""
    warm = max(1, steps // 20 if schedule != "constant" else min(steps // 20, CONSTANT_RAMP))
    if step < warm:
        return lr * (step + 1) / warm
    if schedule == "constant":
        return lr
    progress = (step - warm) / max(1, steps - warm)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def warmup_sft(
    model_dir: str | Path,
    train_jsonl: str | Path,
    *,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    out_dir: str | Path | None = None,
    num_threads: int | None = 1,
    tools: list[str] | None = None,
    schedule: str = "cosine",
    stop_at_exact: float | None = None,
    first_jsonl: str | Path | None = None,
    first_steps: int = 0,
) -> dict:
    """Train ``steps`` AdamW steps on the reference solutions; save to ``out_dir`` (default:
    in place). Returns a report: first/last loss (mean over 20 steps), seconds, tokens, steps
    run.

    ``first_jsonl`` (the tools task): a first stage on these rows, ``first_steps`` at most,
    before the ``steps`` on ``train_jsonl`` (each stage with an optimizer and a schedule of its
    own). ``stop_at_exact``: the first stage (or, without one, the only stage) stops at a check
    every ``CHECK_EVERY`` steps once the model reproduces at least this share of
    ``CHECK_EPISODES`` of its episodes with tool turns exactly (``episode_exactness``). Copying
    the operands and the tool's answer emerges suddenly, after a seed-dependent number of
    steps; stopping there spends no more CPU than the seed needs.

    ``num_threads`` caps torch's intra-op threads while training (None = torch's default). One
    thread is the default: the tiny model gains little from more, and on a busy CPU extra
    threads spin against other processes (measured here under load: 0.8 s per step with one
    thread, 19 s with two)."""
    import torch

    if steps < 1 or batch_size < 1 or lr <= 0:
        raise ValueError(f"steps={steps}, batch_size={batch_size}, lr={lr} must all be > 0.")
    out = Path(out_dir or model_dir)
    settings = {
        "train_jsonl": str(Path(train_jsonl).resolve()),
        # the rows themselves: a task rewritten in place must not reuse the old warm-up
        "data_sha256": _sha256(train_jsonl, *([first_jsonl] if first_jsonl is not None else [])),
        "steps": steps,
        "lr": lr,
        "batch_size": batch_size,
        "seed": seed,
        **({"tools": tools} if tools else {}),
        **({"schedule": schedule} if schedule != "cosine" else {}),  # older markers still match
        **({"stop_at_exact": stop_at_exact} if stop_at_exact is not None else {}),
        **(
            {"first_jsonl": str(Path(first_jsonl).resolve()), "first_steps": first_steps}
            if first_jsonl is not None
            else {}
        ),
        # The base model's build parameters: a different base invalidates the warmed-up copy.
        "base": _read_json(Path(model_dir) / "tether_tiny.json"),
    }
    marker = out / MARKER
    if marker.exists():
        saved = json.loads(marker.read_text())
        if saved.get("settings") == settings:
            logger.info("reusing warmed-up model in %s", out)
            return {**saved["report"], "reused": True}

    previous_threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        return _train(
            model_dir,
            train_jsonl,
            out,
            settings,
            steps=steps,
            lr=lr,
            batch_size=batch_size,
            seed=seed,
            tools=tools,
            schedule=schedule,
            stop_at_exact=stop_at_exact,
            first_jsonl=first_jsonl,
            first_steps=first_steps,
        )
    finally:
        torch.set_num_threads(previous_threads)


class _Stage:
    """One stage of the warm-up: its rows, an AdamW of its own, its schedule."""

    def __init__(self, model: Any, tokenizer: Any, examples: list[Example], *, steps: int,
                 lr: float, batch_size: int, seed: int, schedule: str) -> None:  # fmt: skip
        import torch

        self.model, self.tokenizer, self.examples = model, tokenizer, examples
        self.steps, self.lr, self.batch_size, self.schedule = steps, lr, batch_size, schedule
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0,
                                     betas=(0.9, 0.98))  # fmt: skip
        self.gen = torch.Generator().manual_seed(seed)
        self.losses: list[float] = []
        self.tokens = 0

    def step(self, step: int) -> None:
        import torch

        pick = torch.randint(len(self.examples), (self.batch_size,), generator=self.gen).tolist()
        ids, mask, labels = sft_batch([self.examples[i] for i in pick], self.tokenizer.pad_token_id)
        for group in self.opt.param_groups:
            group["lr"] = _lr_at(step, self.steps, self.lr, self.schedule)
        loss = self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.losses.append(loss.item())
        self.tokens += int(mask.sum())

    def run(self, name: str, stop_at_exact: float | None = None) -> float | None:
        """Up to ``steps`` steps; with ``stop_at_exact``, until a check passes. Returns the
        last check's share of exact episodes (None without checks)."""
        episodes = [e for e in self.examples if 0 in e[2]][:CHECK_EPISODES]  # with tool turns
        exact = None
        for step in range(self.steps):
            self.step(step)
            if step % 100 == 0 or step == self.steps - 1:
                logger.info("warm-up %s step %d/%d loss %.4f", name, step + 1, self.steps,
                            self.losses[-1])  # fmt: skip
            if stop_at_exact is not None and episodes and (step + 1) % CHECK_EVERY == 0:
                exact = episode_exactness(self.model, episodes, self.tokenizer.pad_token_id)
                logger.info("warm-up %s step %d: %.2f of %d episodes with a tool call exact",
                            name, step + 1, exact, len(episodes))  # fmt: skip
                if exact >= stop_at_exact:
                    break
        return exact


def _train(
    model_dir,
    train_jsonl,
    out: Path,
    settings: dict,
    *,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    tools: list[str] | None,
    schedule: str,
    stop_at_exact: float | None = None,
    first_jsonl: str | Path | None = None,
    first_steps: int = 0,
) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.train()
    stages: list[tuple[str, _Stage, float | None]] = []
    if first_jsonl is not None and first_steps > 0:
        rows = _examples(tokenizer, read_jsonl(first_jsonl), tools)
        stages.append(("first", _Stage(model, tokenizer, rows, steps=first_steps, lr=lr,
                                       batch_size=batch_size, seed=seed, schedule=schedule),
                       stop_at_exact))  # fmt: skip
        stop_at_exact = None
    rows = _examples(tokenizer, read_jsonl(train_jsonl), tools)
    main_seed = seed + len(stages)  # a single stage draws its batches as it always has
    stages.append(("main", _Stage(model, tokenizer, rows, steps=steps, lr=lr,
                                  batch_size=batch_size, seed=main_seed, schedule=schedule),
                   stop_at_exact))  # fmt: skip
    started = time.perf_counter()
    exact = {name: stage.run(name, stop) for name, stage, stop in stages}
    seconds = time.perf_counter() - started
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    losses = [x for _, stage, _ in stages for x in stage.losses]
    report = {
        "steps": len(losses),
        "seconds": round(seconds, 2),
        "loss_first": sum(losses[:20]) / len(losses[:20]),
        "loss_last": sum(losses[-20:]) / len(losses[-20:]),
        "tokens": sum(stage.tokens for _, stage, _ in stages),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "out_dir": str(out),
        "reused": False,
    }
    if len(stages) == 2:
        report["first_steps"] = len(stages[0][1].losses)
        report["first_exact"] = exact["first"]
    (out / MARKER).write_text(json.dumps({"settings": settings, "report": report}, indent=2))
    return report


async def measure_accuracy(engine: Any, tokenizer: Any, rows: list[dict], sampling: Any) -> dict:
    """Fraction of ``rows`` answered correctly by ``engine.generate_group`` (all responses of
    every prompt count). ``engine`` is a ``common.engine.GenerationEngine``."""
    started = time.perf_counter()
    groups = await asyncio.gather(
        *(
            engine.generate_group(encode_prompt(tokenizer, row["prompt"]), sampling, f"acc-{i}")
            for i, row in enumerate(rows)
        )
    )
    verdicts = [
        is_correct(s.text, row["answer"])
        for row, group in zip(rows, groups, strict=True)
        for s in group
    ]
    return {
        "accuracy": sum(verdicts) / len(verdicts),
        "responses": len(verdicts),
        "seconds": round(time.perf_counter() - started, 2),
    }
