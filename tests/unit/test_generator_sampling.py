"""What the generator asks vLLM for and what it labels a response with: a seed per request
derived from the response's place in the data (``services.generator.seeds``), and the version a
response without version spans gets (the one its request started on)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from common.config.load import load_config
from common.engine import Sample
from common.protocol import wire
from services.generator.loop import GeneratorService
from services.generator.seeds import episode_seed, request_seed
from tests.engine_support import generator_without_engine


def _service(*sets: str) -> GeneratorService:
    cfg = load_config(overrides=["run.seed=7", *sets], env={}).config
    return generator_without_engine(cfg)  # nothing here reaches Redis or a model


def _prompt(cycle: int, index: int, split: str = "train") -> wire.PromptMsg:
    return wire.PromptMsg(prompt_id=f"p{index}", cycle=cycle, index=index, split=split, text="1+1=")


def test_each_prompt_has_its_own_seed_from_its_coordinates():
    base = {"run_seed": 7, "split": "train", "cycle": 3, "index": 24}
    seed = request_seed(**base)
    assert seed == request_seed(**base)  # the same in every process and every run
    assert 0 <= seed < 2**62  # vLLM adds the response index; torch's generators take < 2**64
    others = [
        request_seed(**{**base, key: value})
        for key, value in (("run_seed", 8), ("split", "eval"), ("cycle", 4), ("index", 25))
    ]
    assert len({seed, *others}) == 5


def test_the_sampling_settings_carry_the_prompts_seed():
    svc = _service()
    train = svc._sampling(_prompt(2, 17))
    assert train.seed == request_seed(run_seed=7, split="train", cycle=2, index=17)
    held_out = svc._sampling(_prompt(0, 17, split="eval"))
    assert held_out.seed == request_seed(run_seed=7, split="eval", cycle=0, index=17)
    assert held_out.seed != train.seed


class _FakeEngine:
    """A fake of ``GenerationEngine.generate_group`` (a real vLLM always reports version spans,
    so the fallback label cannot be reached with it): the learner publishes a new version while
    the request runs, and the responses come back with no spans."""

    def __init__(self, weights: SimpleNamespace) -> None:
        self.weights = weights

    async def generate_group(self, ids, sampling, request_id):
        self.weights.version += 1  # an in-flight update lands mid-request
        return [Sample(token_ids=[5, 6], logprobs=[-0.1, -0.2], finish_reason="stop", text="2",
                       seconds=0.1)]  # fmt: skip


def test_a_response_without_spans_carries_the_version_its_request_started_on():
    svc = _service()
    svc.weights = SimpleNamespace(version=3)  # type: ignore[assignment]
    svc.engine = _FakeEngine(svc.weights)  # type: ignore[assignment]
    msg = _prompt(1, 9)
    trajectories = asyncio.run(svc._sample(msg, [1, 2, 3], request_id="r"))
    # read after generation it would say 4, and the learner would under-count its staleness
    assert [t.policy_version for t in trajectories] == [3]
    assert trajectories[0].version_spans == [(0, 3)]


def test_every_turn_of_every_episode_has_its_own_seed():
    seeds = {episode_seed(99, response=r, turn=t) for r in range(4) for t in range(3)}
    assert len(seeds) == 12 and all(0 <= s < 2**62 for s in seeds if s is not None)
    assert episode_seed(99, response=1, turn=2) == episode_seed(99, response=1, turn=2)
    assert episode_seed(None, response=0, turn=0) is None


def test_ready_once_joined_and_running_weights_not_before():
    """A first receive that timed out (the learner slower to start than weights.timeout_s)
    leaves the generator joined on no weights: /readyz stays 503 until a version loads."""
    svc = _service()
    assert not svc.ready  # not yet joined
    svc._joined = True
    svc.weights = SimpleNamespace(version=None)  # joined; the receive timed out
    assert not svc.ready
    svc.weights.version = 0
    assert svc.ready
