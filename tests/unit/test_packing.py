"""Sequence packing (``services/learner/packing.py``): the layout by hand, and the packed forward
against the padded one through the learner's real loss — same loss, same gradients (fp32, 1e-5),
on real transformers models of three families."""

from __future__ import annotations

import pytest

from common.config.load import load_config
from services.learner import batching, logprobs, objective, packing
from services.learner.cycle import Sample, assign_advantages
from services.learner.main import training_settings
from services.learner.model import load_policy
from tether.demo.tiny_model import build_tiny_model


def test_rows_are_first_fit_decreasing():
    # longest first: 0 (5) alone; 2 (4) opens row 1; 1 (3) opens row 2; 3 (2) joins row 2;
    # 4 (1) fits row 1. Rows keep ascending indices.
    assert packing.pack_rows([5, 3, 4, 2, 1], width=5) == [[0], [2, 4], [1, 3]]
    assert packing.pack_rows([2, 2, 2], width=6) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="sample 1 has length 7"):
        packing.pack_rows([3, 7], width=6)
    with pytest.raises(ValueError, match="sample 0 has length 0"):
        packing.pack_rows([0], width=6)


def test_packed_layout_by_hand():
    fields = [
        {"prompt_ids": [1, 2], "response_ids": [3]},  # 3 tokens
        {"prompt_ids": [4], "response_ids": [5, 6, 7, 8]},  # 5 tokens: the width
        {"prompt_ids": [9], "response_ids": [10]},  # 2 tokens
    ]
    out = packing.add_packed(batching.collate(fields, [0, 1, 2], pad_id=0), pad_id=0)
    assert out["packed_input_ids"].tolist() == [[4, 5, 6, 7, 8], [1, 2, 3, 9, 10]]
    assert out["packed_position_ids"].tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]
    assert out["packed_index"].tolist() == [
        [5, 6, 7, -1, -1],
        [0, 1, 2, 3, 4],
        [8, 9, -1, -1, -1],
    ]
    # a row with room left ends in a segment of pads whose positions restart
    out = packing.add_packed(batching.collate(fields, [0, 1], pad_id=0), pad_id=0)
    assert out["packed_input_ids"].tolist() == [[4, 5, 6, 7, 8], [1, 2, 3, 0, 0]]
    assert out["packed_position_ids"].tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]
    # the padded tensors the loss reads are untouched
    assert out["loss_mask"].tolist() == [[0, 0, 1, 0, 0], [0, 1, 1, 1, 1]]


def _model(family: str, attn: str):
    """A randomly initialised fp32 causal LM of ``family`` with 2 layers (no download)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    small = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    config = {"qwen2": Qwen2Config, "llama": LlamaConfig, "qwen3": Qwen3Config}[family](**small)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)
    model.config.use_cache = False
    return model.train()


def _samples(n: int = 12, seed: int = 3) -> list[Sample]:
    """Lengths spread from a few tokens to ~60: several samples share a packed row."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        n_p = int(torch.randint(2, 12, (1,), generator=g))
        n_r = int(torch.randint(1, 50, (1,), generator=g))
        out.append(
            Sample(
                sample_id=f"{k // 4}/{k % 4}", group=k // 4,
                prompt_ids=torch.randint(3, 250, (n_p,), generator=g).tolist(),
                response_ids=torch.randint(3, 250, (n_r,), generator=g).tolist(),
                behaviour_logp=(-3 - torch.rand(n_r, generator=g)).tolist(),
                reward=float(k % 3 == 0), policy_version=0,
                ref_logp=(-3 - torch.rand(n_r, generator=g)).tolist(),
            )
        )  # fmt: skip
    out[5].weight = 0.0  # a dropped sample stays dropped when packed
    return out


def _config(pack: bool, *sets: str):
    return load_config(
        flags={"run.prompts_per_cycle": 3, "run.responses_per_prompt": 4},
        overrides=[
            f"learner.pack_sequences={str(pack).lower()}",
            "learner.micro_batch_size=6",
            "learner.kl_coef=0.1",
            "learner.entropy_coef=0.01",
            "generator.temperature=0.7",
            *sets,
        ],
        env={},
    ).config


@pytest.mark.parametrize(
    ("family", "attn", "agg"),
    [
        ("qwen2", "sdpa", "token-mean"),
        ("qwen2", "eager", "seq-mean-token-mean"),
        ("llama", "sdpa", "seq-mean-token-sum"),
        ("qwen3", "sdpa", "token-mean"),
    ],
)
def test_packed_loss_and_gradients_match_padded(family, attn, agg):
    import torch

    torch.use_deterministic_algorithms(True)
    cpu = torch.device("cpu")
    model = _model(family, attn)
    samples = _samples()
    results = {}
    for pack in (False, True):
        cfg = _config(pack, f'learner.loss_agg="{agg}"')
        assign_advantages(samples, cfg.learner)
        for s, lp in zip(
            samples, logprobs.recompute_logprobs(model, training_settings(cfg), samples, pad_id=0, device=cpu),
            strict=True,
        ):  # fmt: skip
            s.old_logp = lp
        idx = list(range(len(samples)))
        mbs = objective.rank_micro_batches(cfg.learner, samples, idx, pad_id=0, device=cpu)
        assert all(("packed_index" in mb) == pack for mb in mbs)
        if pack:  # the point of packing: fewer token slots through the model
            slots = sum(mb["packed_input_ids"].numel() for mb in mbs)
            assert slots < 0.9 * sum(mb["input_ids"].numel() for mb in mbs)
        loss_fn = objective.make_loss_fn(
            training_settings(cfg),
            denominator=objective.step_denominator(cfg.learner, samples, idx),
            stats_out=[],
            proximal_from_forward=False,
        )
        model.zero_grad(set_to_none=True)
        loss = sum(loss_fn(model, mb) for mb in mbs)
        loss.backward()
        results[pack] = (
            float(loss.detach()),
            [s.old_logp for s in samples],
            {n: p.grad.clone() for n, p in model.named_parameters()},
        )
    (loss_pad, lp_pad, g_pad), (loss_pack, lp_pack, g_pack) = results[False], results[True]
    assert loss_pack == pytest.approx(loss_pad, abs=1e-5)
    assert abs(loss_pad) > 1e-3  # a loss that is ~0 would match trivially
    for a, b in zip(lp_pad, lp_pack, strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    for name, grad in g_pad.items():
        assert float(grad.abs().max()) > 0 or name.endswith("bias"), name
        assert torch.allclose(g_pack[name], grad, atol=1e-5, rtol=1e-5), (
            name,
            float((g_pack[name] - grad).abs().max()),
        )


def test_packing_without_boundaries_would_differ():
    """The comparison above can fail: a packed forward whose attention ignores the boundaries
    (transformers' packed-sequence detection switched off) gives other log-probs."""
    import torch
    import transformers.masking_utils as mu

    cpu = torch.device("cpu")
    model = _model("qwen2", "sdpa").eval()
    assert packing.check_packing(model, device=cpu, vocab_size=256, tolerance=1e-5) < 1e-5
    original = mu.find_packed_sequence_indices
    mu.find_packed_sequence_indices = lambda position_ids: None  # a fake: no boundaries
    try:
        with pytest.raises(ValueError, match="learner.pack_sequences = false"):
            packing.check_packing(model, device=cpu, vocab_size=256, tolerance=1e-3)
    finally:
        mu.find_packed_sequence_indices = original


def test_load_policy_probes_packing(tmp_path):
    import torch

    model_dir = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2)
    model = load_policy(model_dir, device=torch.device("cpu"), fsdp=False, pack_sequences=True)
    # no flash-attn on a CPU: transformers' default attention with a block-diagonal mask
    assert packing.attention_implementation(model) in ("sdpa", "eager")
    assert not packing.varlen_attention_available(torch.device("cpu"))
