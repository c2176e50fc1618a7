"""Micro-batching, rank balancing, collation, and split-invariance of the gradient."""

import random

import pytest
import torch  # noqa: TID253 - tests of torch code

from services.learner.batching import (
    balance_across_ranks,
    collate,
    common_micro_batch_count,
    pad_micro_batches,
    split_micro_batches,
)
from services.learner.losses import (
    aggregate_loss,
    kl_penalty,
    policy_loss,
    step_denominator,
    token_entropy,
    token_logprobs,
)


def test_split_by_count_is_consecutive_chunks():
    assert split_micro_batches([5, 1, 1, 1, 9], micro_batch_size=2) == [[0, 1], [2, 3], [4]]
    assert split_micro_batches([], micro_batch_size=2) == []


def test_split_by_token_budget_hand_packing():
    # lengths 5 3 4 2 6, budget 8. First-fit decreasing (6, 5, 4, 3, 2) needs 3 bins:
    # {6,2} {5,3} {4}. Dealing longest-first to the least-loaded of 3 bins:
    # 6->b0, 5->b1, 4->b2, 3->b2 (4 < 5, 6) = 7, 2->b1 (5 < 6, 7) = 7  =>  loads 6, 7, 7.
    mbs = split_micro_batches([5, 3, 4, 2, 6], max_tokens_per_micro_batch=8)
    assert mbs == [[0, 3], [1, 2], [4]]
    # Asking for at least 4 micro-batches: 6, 5, 4, 3 each alone, 2 joins the 3 -> 5.
    mbs = split_micro_batches([5, 3, 4, 2, 6], max_tokens_per_micro_batch=8, min_micro_batches=4)
    assert mbs == [[0], [1, 3], [2], [4]]


def test_split_by_token_budget_random_respects_budget():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(0, 50) for _ in range(rng.randint(1, 40))]
        budget = rng.randint(50, 200)
        mbs = split_micro_batches(lengths, max_tokens_per_micro_batch=budget)
        assert sorted(i for mb in mbs for i in mb) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in mb) <= budget for mb in mbs)
        assert len(mbs) <= -(-sum(lengths) // budget) * 2 + 1  # never wildly more than needed


def test_split_errors():
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=8"):
        split_micro_batches([3, 9], max_tokens_per_micro_batch=8)
    with pytest.raises(ValueError, match="exactly one"):
        split_micro_batches([3], micro_batch_size=1, max_tokens_per_micro_batch=8)
    with pytest.raises(ValueError, match="exactly one"):
        split_micro_batches([3])


def test_balance_across_ranks_hand_case():
    # 10 and 9 go first to ranks 0 and 1; the six 1s then go to the lighter rank
    # (ties: fewer samples): r1 10, r0 11, r1 11, r0 12, r1 12 (full at 4), r0 13.
    ranks = balance_across_ranks([10, 1, 1, 1, 1, 1, 1, 9], 2)
    assert ranks == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_balance_across_ranks_counts_and_coverage():
    rng = random.Random(1)
    for _ in range(200):
        n, world = rng.randint(0, 30), rng.randint(1, 8)
        lengths = [rng.randint(1, 100) for _ in range(n)]
        ranks = balance_across_ranks(lengths, world)
        counts = sorted(len(r) for r in ranks)
        assert counts == sorted([n // world + (k < n % world) for k in range(world)])
        assert sorted(i for r in ranks for i in r) == list(range(n))
        loads = [sum(lengths[i] for i in r) for r in ranks]
        if n >= world:  # longest-first greedy: the spread is at most the longest sample
            assert max(loads) - min(loads) <= max(lengths)


def test_common_count_and_padding():
    assert common_micro_batch_count([2, 3, 0]) == 3
    assert common_micro_batch_count([0, 0]) == 1
    assert pad_micro_batches([[0, 1]], 3) == [[0, 1], [], []]
    with pytest.raises(ValueError, match="common_micro_batch_count"):
        pad_micro_batches([[0], [1]], 1)


def test_collate_layout():
    samples = [
        {"prompt_ids": [1, 2], "response_ids": [3, 4, 5], "blp": [-0.1, -0.2, -0.3], "adv": 1.5},
        {"prompt_ids": [6], "response_ids": [7], "blp": [-0.4], "adv": -2},
    ]
    out = collate(samples, [1, 0], pad_id=0, token_fields=["blp"], seq_fields=["adv"])
    assert out["input_ids"].tolist() == [[6, 7, 0, 0, 0], [1, 2, 3, 4, 5]]
    assert out["attention_mask"].tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert out["position_ids"].tolist() == [[0, 1, 0, 0, 0], [0, 1, 2, 3, 4]]
    assert out["loss_mask"].tolist() == [[0, 1, 0, 0, 0], [0, 0, 1, 1, 1]]
    torch.testing.assert_close(
        out["blp"], torch.tensor([[0, -0.4, 0, 0, 0], [0, 0, -0.1, -0.2, -0.3]])
    )
    assert out["adv"].tolist() == [-2.0, 1.5]
    dummy = collate(samples, [], pad_id=0, token_fields=["blp"])
    assert dummy["input_ids"].shape == (1, 1) and dummy["loss_mask"].sum() == 0
    with pytest.raises(ValueError, match="'blp' has 1 values for 2"):
        collate(
            [{"prompt_ids": [1], "response_ids": [2, 3], "blp": [0.0]}],
            [0],
            pad_id=0,
            token_fields=["blp"],
        )


# --- split invariance ------------------------------------------------------------------------


class ToyLM(torch.nn.Module):
    """A real (tiny) causal LM: embedding + causal mean of previous embeddings + head."""

    def __init__(self, vocab: int = 13, dim: int = 8):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, input_ids, attention_mask):
        h = self.emb(input_ids) * attention_mask.unsqueeze(-1)
        ctx = h.cumsum(dim=1) / attention_mask.cumsum(dim=1).clamp(min=1).unsqueeze(-1)
        return self.head(torch.tanh(ctx))


def _samples(model, rng):
    """12 samples with generator-like fields derived from the initial policy plus noise."""
    samples = []
    for _ in range(12):
        prompt = [rng.randint(1, 12) for _ in range(rng.randint(1, 5))]
        response = [rng.randint(1, 12) for _ in range(rng.randint(1, 9))]
        samples.append({"prompt_ids": prompt, "response_ids": response, "adv": rng.uniform(-2, 2)})
    with torch.no_grad():
        for s in samples:
            b = collate([s], [0], pad_id=0)
            lp = token_logprobs(model(b["input_ids"], b["attention_mask"]), b["input_ids"])
            resp = lp[0, len(s["prompt_ids"]) :]
            # proximal / behaviour / reference differ from the policy so clips and caps bite
            s["old"] = [v + rng.uniform(-0.4, 0.4) for v in resp.tolist()]
            s["beh"] = [v + rng.uniform(-0.4, 0.4) for v in resp.tolist()]
            s["ref"] = [v + rng.uniform(-0.4, 0.4) for v in resp.tolist()]
    return samples


def _micro_batch_loss(model, samples, idx, *, mode, denom):
    b = collate(samples, idx, pad_id=0, token_fields=["old", "beh", "ref"], seq_fields=["adv"])
    logits = model(b["input_ids"], b["attention_mask"])
    logp = token_logprobs(logits, b["input_ids"])
    pg, _ = policy_loss(
        logp=logp,
        old_logp=b["old"].double(),
        behaviour_logp=b["beh"].double(),
        off_policy="decoupled",
        is_cap=1.5,
        advantages=b["adv"].double(),
        mask=b["loss_mask"],
        clip_low=0.2,
        clip_high=0.28,
        dual_clip=3.0,
    )
    tok = pg + 0.1 * kl_penalty(logp, b["ref"].double(), kind="k3") - 0.01 * token_entropy(logits)
    return aggregate_loss(tok, b["loss_mask"], mode=mode, global_denominator=denom)


def _grads(model, samples, plan, mode):
    """plan: per simulated rank, a list of micro-batches (index lists; [] = zero-weight pass).

    Every rank uses the step-global denominator and the gradients of all ranks are summed, which
    is what FSDP's reduce-scatter computes once its 1/world averaging is undone.
    """
    lengths = [len(s["response_ids"]) for s in samples]
    denom = step_denominator(lengths, mode=mode)
    model.zero_grad()
    for rank_mbs in plan:
        for idx in rank_mbs:
            _micro_batch_loss(model, samples, idx, mode=mode, denom=denom).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_gradient_does_not_depend_on_the_split(mode):
    torch.manual_seed(0)
    model = ToyLM().double()
    samples = _samples(model, random.Random(0))
    n = len(samples)
    costs = [len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples]

    whole = _grads(model, samples, [[list(range(n))]], mode)
    by_count = _grads(model, samples, [split_micro_batches(costs, micro_batch_size=5)], mode)
    by_tokens = split_micro_batches(costs, max_tokens_per_micro_batch=16)
    assert len(by_tokens) > 3  # really split
    tokens = _grads(model, samples, [by_tokens], mode)
    ranks = balance_across_ranks(costs, 3)
    per_rank = [
        [
            [r[i] for i in mb]
            for mb in split_micro_batches([costs[i] for i in r], max_tokens_per_micro_batch=20)
        ]
        for r in ranks
    ]
    count = common_micro_batch_count([len(m) for m in per_rank])
    padded = [pad_micro_batches(m, count) for m in per_rank]
    three_ranks = _grads(model, samples, padded, mode)

    assert any(g.abs().sum() > 0 for g in whole)
    for other in (by_count, tokens, three_ranks):
        for g_whole, g_other in zip(whole, other, strict=True):
            torch.testing.assert_close(g_other, g_whole, rtol=1e-10, atol=1e-12)


def test_a_local_denominator_would_break_split_invariance():
    # The same check with per-micro-batch means (the common mistake) gives another gradient,
    # so the invariance test above can fail.
    torch.manual_seed(0)
    model = ToyLM().double()
    samples = _samples(model, random.Random(0))
    whole = _grads(model, samples, [[list(range(12))]], "token-mean")
    model.zero_grad()
    for idx in ([0, 1, 2], list(range(3, 12))):
        local = sum(len(samples[i]["response_ids"]) for i in idx)
        (_micro_batch_loss(model, samples, idx, mode="token-mean", denom=local) / 2).backward()
    assert not torch.allclose(model.head.weight.grad, whole[1])
