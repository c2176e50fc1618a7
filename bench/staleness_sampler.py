"""Sampling for the staleness study (``bench.staleness_run``): batched decoding with a KV cache
from a policy snapshot, in process, the way the generator samples with vLLM.

- Each response draws its randomness from its own stream, seeded as the generator seeds a
  request (``services.generator.seeds.request_seed`` of its prompt, plus its index in the
  group, as vLLM does with ``n`` responses): a response does not depend on what shares its
  batch, and two arms of one seed draw the same random numbers (common random numbers).
- A token is the argmax of ``logits / T`` plus Gumbel noise (exactly a draw from
  ``softmax(logits / T)``); its behaviour log-prob is that distribution's, as vLLM reports with
  ``logprobs_mode = "processed_logprobs"``. ``T = 0`` is greedy (held-out evaluation).
- A response ends with the end-of-sequence token (included, as vLLM includes it) or after
  ``max_tokens`` (``truncated``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch  # noqa: TID253 - a sampler of torch models


@dataclass
class Response:
    token_ids: list[int]
    logprobs: list[float]
    truncated: bool


def _noise(seeds: list[int], steps: int, vocab: int) -> torch.Tensor:
    """Gumbel noise [rows, steps, vocab], one generator per row."""
    out = torch.empty(len(seeds), steps, vocab)
    for row, seed in enumerate(seeds):
        g = torch.Generator().manual_seed(seed)
        u = torch.rand(steps, vocab, generator=g).clamp_(min=1e-20)
        out[row] = -torch.log(-torch.log(u))
    return out


@torch.inference_mode()
def generate(
    model: Any,
    prompts: list[list[int]],
    *,
    seeds: list[int] | None,
    temperature: float,
    max_tokens: int,
    eos_id: int,
    pad_id: int,
) -> list[Response]:
    """One response per prompt (repeat a prompt for a group); ``seeds`` one per row (None only
    for greedy decoding)."""
    if temperature > 0 and (seeds is None or len(seeds) != len(prompts)):
        raise ValueError("sampling at a temperature needs one seed per prompt row")
    rows, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((rows, width), pad_id, dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding: every prompt ends at the last column
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    vocab = int(model.config.vocab_size)
    noise = _noise(seeds, max_tokens, vocab) if temperature > 0 and seeds else None
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    cache, logits = out.past_key_values, out.logits[:, -1].float()
    tokens = torch.zeros(rows, max_tokens, dtype=torch.long)
    logps = torch.zeros(rows, max_tokens)
    done = torch.zeros(rows, dtype=torch.bool)
    length = torch.full((rows,), max_tokens, dtype=torch.long)
    alive = torch.arange(rows)  # the rows still decoding; a finished row leaves the batch
    next_pos = positions[:, -1] + 1
    for t in range(max_tokens):
        if temperature > 0:
            assert noise is not None
            scaled = logits / temperature
            tok = (scaled + noise[alive, t]).argmax(-1)
            logps[alive, t] = torch.log_softmax(scaled, -1).gather(-1, tok[:, None])[:, 0]
        else:
            tok = logits.argmax(-1)
        tokens[alive, t] = tok
        ended = tok == eos_id
        length[alive[ended]] = t + 1
        done[alive[ended]] = True
        if bool(ended.all()) or t == max_tokens - 1:
            break
        if bool(ended.any()):
            keep = (~ended).nonzero()[:, 0]
            cache.batch_select_indices(keep)
            alive, tok, mask, next_pos = alive[keep], tok[keep], mask[keep], next_pos[keep]
        mask = torch.cat([mask, torch.ones(len(alive), 1, dtype=torch.long)], dim=1)
        out = model(
            input_ids=tok[:, None],
            attention_mask=mask,
            position_ids=next_pos[:, None],
            past_key_values=cache,
            use_cache=True,
        )
        cache, logits = out.past_key_values, out.logits[:, -1].float()
        next_pos = next_pos + 1
    return [
        Response(
            token_ids=tokens[i, : length[i]].tolist(),
            logprobs=logps[i, : length[i]].tolist(),
            truncated=not bool(done[i]),
        )
        for i in range(rows)
    ]
