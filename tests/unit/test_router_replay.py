"""Routing replay (``services/learner/router_replay.py``) on a small random Qwen3-MoE built here:
replaying the model's own routing changes nothing; replaying other routing sends every token to
exactly the replayed experts, with the learner's gate weights over them and gradients where R3
puts them; tokens not recorded keep the learner's routing and are counted; the packed forward
replays the same routing as the padded one; a dense model is refused."""

from __future__ import annotations

import pytest
import torch

from services.learner import batching, packing
from services.learner.router_replay import NOT_RECORDED, RouterReplay, flat_routing

LAYERS, EXPERTS, TOP_K, VOCAB = 3, 8, 2, 96


def _moe(seed: int = 0, *, norm: bool = True):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         moe_intermediate_size=16, num_hidden_layers=LAYERS, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, num_experts=EXPERTS,
                         num_experts_per_tok=TOP_K, norm_topk_prob=norm, max_position_embeddings=64,
                         attn_implementation="eager")  # fmt: skip
    model = Qwen3MoeForCausalLM(cfg).float()
    with torch.no_grad():  # a random init of zeros routes every token alike: spread the routers
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    return model.eval()


def _ids(b: int = 2, t: int = 7, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def _own_routing(model, replay: RouterReplay, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), replay.recording() as per_layer:
        model(input_ids=ids, use_cache=False)
    return torch.stack(per_layer, dim=1)  # [N, L, K]


def _other_routing(own: torch.Tensor) -> torch.Tensor:
    """Different experts for every token and layer: each id moved by 3 (mod E), still distinct."""
    return (own + 3) % EXPERTS


def test_replaying_the_models_own_routing_changes_nothing():
    model = _moe()
    replay = RouterReplay(model)
    ids = _ids()
    own = _own_routing(model, replay, ids)
    assert own.shape == (ids.numel(), LAYERS, TOP_K)
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits
        with replay.replaying(own):
            replayed = model(input_ids=ids, use_cache=False).logits
    assert torch.equal(plain, replayed)
    counts = replay.take_counts()
    assert (counts.replayed_tokens, counts.fallback_tokens) == (ids.numel(), 0)
    assert counts.decisions == ids.numel() * LAYERS and counts.differing_decisions == 0


@pytest.mark.parametrize("norm", [True, False])
def test_other_routing_goes_to_exactly_the_replayed_experts_with_the_learners_gate(norm):
    model = _moe(norm=norm)
    replay = RouterReplay(model)
    ids = _ids()
    other = _other_routing(_own_routing(model, replay, ids))
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    logits_of: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.mlp.experts.register_forward_hook(
            lambda mod, args, out, i=i: seen.__setitem__(i, (args[1], args[2]))))  # fmt: skip
        hooks.append(layer.mlp.gate.register_forward_hook(
            lambda mod, args, out, i=i: logits_of.__setitem__(i, out[0])))  # fmt: skip
    with torch.no_grad(), replay.replaying(other):
        model(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()
    for i in range(LAYERS):
        experts, weights = seen[i]
        assert torch.equal(experts, other[:, i])
        want = torch.softmax(logits_of[i].float(), dim=-1).gather(-1, other[:, i])
        if norm:
            want = want / want.sum(-1, keepdim=True)
        torch.testing.assert_close(weights.float(), want)
    counts = replay.take_counts()
    assert counts.differing_decisions == counts.decisions == ids.numel() * LAYERS


def test_gradients_reach_the_router_and_only_the_replayed_experts():
    model = _moe()
    model.train()
    replay = RouterReplay(model)
    ids = _ids(b=1, t=3)
    own = _own_routing(model, replay, ids)
    other = _other_routing(own)
    with replay.replaying(other):
        model(input_ids=ids, use_cache=False).logits.sum().backward()
    layer = model.model.layers[0].mlp
    assert layer.gate.weight.grad is not None and layer.gate.weight.grad.abs().sum() > 0
    # per-expert gradient of the fused gate/up weights: non-zero exactly for the replayed experts
    grad = layer.experts.gate_up_proj.grad.abs().flatten(1).sum(-1)
    used = set(other[:, 0].flatten().tolist())
    assert {e for e in range(EXPERTS) if grad[e] > 0} == used


def test_tokens_not_recorded_keep_the_learners_routing_and_are_counted():
    model = _moe()
    replay = RouterReplay(model)
    ids = _ids()
    own = _own_routing(model, replay, ids)
    mixed = _other_routing(own)
    mixed[:4] = NOT_RECORDED  # the first four tokens: no routing recorded
    seen = {}
    hook = model.model.layers[1].mlp.experts.register_forward_hook(
        lambda mod, args, out: seen.__setitem__("e", args[1]))  # fmt: skip
    with torch.no_grad(), replay.replaying(mixed):
        model(input_ids=ids, use_cache=False)
    hook.remove()
    assert torch.equal(seen["e"][4:], mixed[4:, 1])
    counts = replay.take_counts()
    assert (counts.replayed_tokens, counts.fallback_tokens) == (ids.numel() - 4, 4)


def test_the_packed_forward_replays_the_same_routing_as_the_padded_one():
    from services.learner.model import token_logprobs_and_entropy

    model = _moe()
    replay = RouterReplay(model)
    samples = [{"prompt_ids": [5, 6, 7], "response_ids": [8, 9, 10, 11]},
               {"prompt_ids": [12, 13], "response_ids": [14, 15]}]  # fmt: skip
    mb = packing.add_packed(batching.collate(samples, [0, 1], pad_id=0), pad_id=0)
    ids, mask = mb["input_ids"], mb["attention_mask"]
    # routing per [B, T] position: the padded forward's own routing, moved
    own = _own_routing(model, replay, ids).reshape(*ids.shape, LAYERS, TOP_K)
    routing = _other_routing(own)
    resp = mb["loss_mask"].long()
    with torch.no_grad():
        with replay.replaying(flat_routing(routing, mask)):
            padded, _ = token_logprobs_and_entropy(model, ids, mask, resp,
                                                   position_ids=mb["position_ids"])  # fmt: skip
        packed_in = packing.packed_of(mb)
        with replay.replaying(flat_routing(routing, mask, packed_in)):
            packed, _ = token_logprobs_and_entropy(model, ids, mask, resp,
                                                   position_ids=mb["position_ids"],
                                                   packed=packed_in)  # fmt: skip
        plain, _ = token_logprobs_and_entropy(model, ids, mask, resp,
                                              position_ids=mb["position_ids"])  # fmt: skip
    torch.testing.assert_close(padded, packed, atol=1e-5, rtol=0)
    assert (padded - plain).abs().max() > 1e-3  # the replayed routing really was other routing


def test_a_dense_model_and_bad_routing_are_refused():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    dense = Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2))  # fmt: skip
    with pytest.raises(ValueError, match="learner.router_replay"):
        RouterReplay(dense)
    model = _moe()
    replay = RouterReplay(model)
    with pytest.raises(ValueError, match="installed"):
        RouterReplay(model)
    ids = _ids()
    with pytest.raises(ValueError, match=r"expected \[tokens, 3 MoE layers, top-2\]"):
        with replay.replaying(torch.zeros(ids.numel(), LAYERS, TOP_K + 1, dtype=torch.long)):
            pass
    with pytest.raises(ValueError, match="expert id >= 8"):
        with replay.replaying(torch.full((ids.numel(), LAYERS, TOP_K), EXPERTS)):
            pass
    with pytest.raises(ValueError, match="flat_routing"):
        with torch.no_grad(), replay.replaying(torch.zeros(3, LAYERS, TOP_K, dtype=torch.long)):
            model(input_ids=ids, use_cache=False)
