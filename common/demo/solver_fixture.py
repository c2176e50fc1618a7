"""A tiny solver model whose answers are predictable: it copies the guideline's number.

Tests and the scorer benchmark need a real solver LLM (served by vLLM) whose answers are known in
advance, so that a reward can be checked against what the solver *said*. No model can be
downloaded here, so this trains one: ``common.demo.tiny_model`` builds a random Qwen2 with a
byte-level tokenizer, and a short supervised pass (CPU, well under a minute of compute when the
machine is free) teaches it one skill:

    prompt (chat template of ``COPY_TEMPLATE``)      answer
    "Question: <no digits>\\nGuideline: <words> 7"  ->  "\\boxed{7}<|im_end|>"

The answer is one digit (1..9), the only digit anywhere in the prompt: questions and guidelines
must otherwise be digit-free. Copying "the digit" is content-based attention, which a 2-layer
model learns in a few hundred steps (copying multi-digit numbers by position took thousands). Use
``COPY_TEMPLATE`` as ``scorer.solver_template`` and ``build_copy_solver(dir)`` as
``scorer.solver_model``. A right number in the guideline makes the solver answer right (reward
1), a wrong number makes it answer wrong (reward 0). Training stops when the teacher-forced
accuracy on held-out prompts is 100 % with a low loss; a marker file makes a second call reuse
the result. Training runs on one thread with deterministic kernels, so a seed gives one model.
"""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path

from common.demo.warmup import sft_batch

log = logging.getLogger(__name__)

COPY_TEMPLATE = "Question: {question}\nGuideline: {response}"
MARKER = "tether_copy_solver.json"
_WORDS = ("apples", "cats", "boxes", "coins", "stars", "points", "sides", "roots", "pages")
_QUESTIONS = ("How many {w} are left?", "Count the {w}.", "What is the number of {w}?",
              "Solve for the {w}.", "Find x.", "How many {w} does Sam have now?")  # fmt: skip
_PHRASES = ("", "The answer is", "so we get", "Result:", "so x =", "I think it is", "final:")


def copy_example(rng: random.Random, number: int | None = None) -> tuple[str, str, int]:
    """(question, guideline, number): a digit-free question; the guideline ends with the digit."""
    n = rng.randint(1, 9) if number is None else number
    question = rng.choice(_QUESTIONS).format(w=rng.choice(_WORDS))
    return question, f"{rng.choice(_PHRASES)} {n}".strip(), n


def _encode(tok, question: str, guideline: str, answer: str) -> tuple[list[int], list[int]]:
    text = COPY_TEMPLATE.format(question=question, response=guideline)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    p = tok(prompt, add_special_tokens=False).input_ids
    a = tok(answer, add_special_tokens=False).input_ids + [tok.eos_token_id]
    return list(p), list(a)


def _examples(tok, rng: random.Random, n: int) -> list[tuple[list[int], list[int]]]:
    out = []
    for _ in range(n):
        q, g, num = copy_example(rng)
        out.append(_encode(tok, q, g, f"\\boxed{{{num}}}"))
    return out


def _held_out(model, batch) -> tuple[float, float]:
    """(exact, loss) on held-out prompts, teacher forced: the fraction of answers whose every
    token is the argmax, and the mean cross-entropy of the answer tokens."""
    import torch

    ids, mask, labels = batch  # common.demo.warmup.sft_batch order
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
    target = labels[:, 1:]
    hit = (out.logits[:, :-1].argmax(-1) == target) | (target == -100)
    return float(hit.all(dim=1).float().mean()), float(out.loss)


class _Deterministic:
    """One CPU thread and deterministic kernels while training, restored afterwards: the same
    seed gives the same model on a machine, and no race in a reduction changes the path."""

    def __enter__(self) -> None:
        import torch

        self.threads = torch.get_num_threads()
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(True)

    def __exit__(self, *exc: object) -> None:
        import torch

        torch.set_num_threads(self.threads)
        torch.use_deterministic_algorithms(self.deterministic)


def build_copy_solver(
    out_dir: str | Path, *, max_steps: int = 2000, batch_size: int = 16, lr: float = 1e-3,
    hidden_size: int = 128, seed: int = 0, target_loss: float = 0.01,
) -> Path:  # fmt: skip
    """Build (or reuse) the copy-the-number solver in ``out_dir``; returns the directory.

    Trains until every held-out answer is the argmax and the held-out answer loss is below
    ``target_loss`` (so sampled answers, at a low temperature, copy too). Measured on the 2-core
    CPU: seeds 0–3 reach it at 200 steps, a tenth of ``max_steps``. The previous recipe (hidden
    64, lr 3e-3) plateaued at 55–57 % on one CPU and passed on another.
    """
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    from common.demo.tiny_model import build_tiny_model

    out = Path(out_dir)
    params = {"max_steps": max_steps, "batch_size": batch_size, "lr": lr, "seed": seed,
              "hidden_size": hidden_size, "target_loss": target_loss, "v": 4}  # fmt: skip
    marker = out / MARKER
    if marker.exists() and json.loads(marker.read_text()).get("params") == params:
        return out
    # 2 heads: head_dim 64 (vLLM's CPU attention has no kernel for head_dim 16).
    build_tiny_model(out, hidden_size=hidden_size, num_layers=2, num_heads=2, seed=seed,
                     max_position_embeddings=512, overwrite=True)  # fmt: skip
    tok = AutoTokenizer.from_pretrained(str(out))
    started, exact, loss, step = time.monotonic(), 0.0, float("inf"), 0
    with _Deterministic():
        model = Qwen2ForCausalLM.from_pretrained(str(out), dtype=torch.float32)
        torch.manual_seed(seed)
        rng = random.Random(seed)
        held_out = sft_batch(_examples(tok, random.Random(seed + 1), 128), tok.pad_token_id)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        for step in range(1, max_steps + 1):
            for group in opt.param_groups:
                group["lr"] = lr * min(1.0, step / 50)
            ids, mask, labels = sft_batch(_examples(tok, rng, batch_size), tok.pad_token_id)
            train_loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            train_loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if step % 50 == 0:
                model.eval()
                exact, loss = _held_out(model, held_out)
                model.train()
                log.info("copy solver step %d: held-out exact %.3f, loss %.4f", step, exact, loss)
                if exact == 1.0 and loss < target_loss:
                    break
    if exact < 1.0 or loss >= target_loss:
        raise RuntimeError(
            f"copy solver reached held-out exact {exact:.1%} and loss {loss:.4f} (needs 100 % "
            f"and < {target_loss}) in {max_steps} steps; it reaches them in about 200 steps on "
            "the machines it was measured on, so this is a regression in the recipe or in the "
            "libraries, not bad luck"
        )
    model.save_pretrained(str(out), safe_serialization=True)
    report = {"steps": step, "seconds": round(time.monotonic() - started, 1),
              "exact": exact, "loss": round(loss, 5)}  # fmt: skip
    marker.write_text(json.dumps({"params": params, "report": report}))
    log.info("copy solver trained: %s", report)
    return out
