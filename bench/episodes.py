"""Episodes benchmark: multi-turn, tool-using episodes against single-turn responses on the same
model, engine and prompts. ``tether bench episodes [--quick]``.

The model is the tools demo's (``tether demo --task tools``: the tiny Qwen2 warmed up on a
careful teacher, then on one that calls the calculator in 30 % of its episodes), so at
temperature 1 some episodes call the tool and some answer at once, as in the demo's first RL
cycles. Per round, every prompt gets ``n`` samples at once (continuous batching):

- single-turn: ``generate_group`` (the generator's single-turn path), one response each;
- episodes: ``EpisodeRunner`` with the real sandbox (calculator, ``tool_workers`` workers), up to
  3 assistant turns each — the generator's episode path without the bus.

Rounds alternate (single, episodes, single, ...) after one warm-up round each, so both see the
same load; each side's figure is its best round. Reported: responses (episodes) per second,
sampled tokens per second, turns and tool calls per episode, and the share of an episode's wall
time spent waiting for its tools (Σ tool seconds ÷ Σ episode seconds).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from common.chat.tool_calls import FORMATS
from common.chat.turns import TurnEncoder
from common.data.prompts import encode_prompt
from common.engine import EngineSettings, GenerationEngine, SamplingSettings
from common.tools.registry import resolve_tools
from common.tools.sandbox import ToolSandbox
from services.generator.agent.tool_loop import EpisodeRunner, EpisodeSettings
from tether.demo.run import prepare_assets
from tether.demo.tasks import read_jsonl

log = logging.getLogger(__name__)
# the tools demo's run.max_response_tokens (tether/demo/tools.toml): an episode's ids after the
# prompt
MAX_TOKENS = 128


def provenance() -> dict[str, Any]:
    """The git commit of the clone and whether its tree had uncommitted changes."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True).stdout.strip()

    return {"git_commit": git("rev-parse", "HEAD"), "git_dirty": bool(git("status", "--porcelain"))}


async def _single(engine: Any, prompts: list[list[int]], sampling: Any, tag: str) -> dict:
    t0 = time.perf_counter()
    groups = await asyncio.gather(*(
        engine.generate_group(ids, sampling, f"{tag}-{i}") for i, ids in enumerate(prompts)
    ))  # fmt: skip
    seconds = time.perf_counter() - t0
    samples = [s for g in groups for s in g]
    tokens = sum(len(s.token_ids) for s in samples)
    return {"seconds": seconds, "responses": len(samples), "sampled_tokens": tokens,
            "responses_per_s": len(samples) / seconds, "tokens_per_s": tokens / seconds}  # fmt: skip


async def _episodes(runner: Any, prompts: list, sampling: Any, n: int, tag: str) -> dict:
    walls: list[float] = []

    async def one(k: int, ids: list[int], messages: list[dict]) -> Any:
        t = time.perf_counter()
        rec = await runner.run(prompt_ids=ids, prompt_messages=messages, sampling=sampling,
                               request_id=f"{tag}-{k}", version=0)  # fmt: skip
        walls.append(time.perf_counter() - t)
        return rec

    t0 = time.perf_counter()
    recs = await asyncio.gather(*(
        one(k, ids, msgs) for k, (ids, msgs) in enumerate(p for p in prompts for _ in range(n))
    ))  # fmt: skip
    seconds = time.perf_counter() - t0
    tokens = sum(sum(r.mask) for r in recs)
    tool_s = sum(r.seconds["tool_s"] for r in recs)
    return {
        "seconds": seconds, "episodes": len(recs), "sampled_tokens": tokens,
        "episodes_per_s": len(recs) / seconds, "tokens_per_s": tokens / seconds,
        "turns_per_episode": sum(r.assistant_turns for r in recs) / len(recs),
        "tool_calls_per_episode": sum(len(r.tool_calls) for r in recs) / len(recs),
        "tool_call_rate": sum(1 for r in recs if r.tool_calls) / len(recs),
        "tool_time_share": tool_s / sum(walls),
        "tool_seconds_per_call": tool_s / max(1, sum(len(r.tool_calls) for r in recs)),
    }  # fmt: skip


async def _measure(assets: Any, *, prompts: int, n: int, rounds: int, workers: int) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(assets.model_dir))
    specs = resolve_tools(["calculator"])
    schemas = [s.schema() for s in specs]
    rows = read_jsonl(assets.data_dir / "eval.jsonl")
    engine = GenerationEngine(EngineSettings(
        model=str(assets.model_dir), dtype="float32", max_model_len=400 + MAX_TOKENS,
        gpu_memory_utilization=0.2, kv_cache_gib=1, seed=0,
    ))  # fmt: skip
    await engine.start()
    try:
        async with ToolSandbox(specs, workers=workers) as sandbox:
            runner = EpisodeRunner(
                engine=engine, tokenizer=tok, sandbox=sandbox, tool_format=FORMATS["hermes"],
                encoder=TurnEncoder(tok, end_ids={tok.eos_token_id}, tools=schemas),
                settings=EpisodeSettings(max_turns=3, max_tokens=MAX_TOKENS,
                                         tool_output_max_chars=2000, template_check="warn"),
            )  # fmt: skip

            def batch(offset: int, count: int) -> list[tuple[list[int], list[dict]]]:
                return [(encode_prompt(tok, r["prompt"], tools=schemas),
                         [{"role": "user", "content": r["prompt"]}])
                        for r in rows[offset : offset + count]]  # fmt: skip

            group = SamplingSettings(n=n, temperature=1.0, max_tokens=MAX_TOKENS, seed=None)
            one = SamplingSettings(n=1, temperature=1.0, max_tokens=MAX_TOKENS)
            warm = batch(len(rows) - 4, 4)
            await _single(engine, [ids for ids, _ in warm], group, "warm-s")
            await _episodes(runner, warm, one, n, "warm-e")
            main = batch(0, prompts)
            single, episodes = [], []
            for r in range(rounds):
                single.append(await _single(engine, [ids for ids, _ in main], group, f"s{r}"))
                episodes.append(await _episodes(runner, main, one, n, f"e{r}"))
                isolation = sandbox.isolation
    finally:
        engine.shutdown()
    return {"single": single, "episodes": episodes, "isolation": isolation}


def derive(r: dict[str, Any]) -> dict[str, Any]:
    """The figures computed from the rounds (``single_rounds``, ``episode_rounds``): each mode's
    best round, and episodes against single-turn responses (a test recomputes them)."""
    single = max(r["single_rounds"], key=lambda x: x["responses_per_s"])
    episodes = max(r["episode_rounds"], key=lambda x: x["episodes_per_s"])
    return {
        "single_turn_responses_per_s": single["responses_per_s"],
        "episodes_per_s": episodes["episodes_per_s"],
        "episodes_vs_single_ratio": episodes["episodes_per_s"] / single["responses_per_s"],
        "sampled_tokens_ratio": episodes["tokens_per_s"] / single["tokens_per_s"],
        "tool_time_share": episodes["tool_time_share"],
        "tool_call_rate": episodes["tool_call_rate"],
        "turns_per_episode": episodes["turns_per_episode"],
    }


def run_episodes_bench(
    *, prompts: int = 32, n: int = 8, rounds: int = 3, workers: int = 2,
    work_dir: Path = Path("bench/work"), out_path: str | Path | None = None,
) -> dict:  # fmt: skip
    """Measure (see the module docstring); print a summary; write JSON to ``out_path``."""
    load_before = os.getloadavg()
    assets = prepare_assets(Path(work_dir) / "tools-demo-assets", preset="tools", seed=0)
    raw = asyncio.run(_measure(assets, prompts=prompts, n=n, rounds=rounds, workers=workers))
    result = {
        "bench": "episodes",
        "settings": {
            "prompts": prompts,
            "n": n,
            "rounds": rounds,
            "tool_workers": workers,
            "max_turns": 3,
            "max_response_tokens": MAX_TOKENS,
            "temperature": 1.0,
            "model": "tools demo (careful then sloppy teacher: 30% calculator calls)",
            "sandbox": raw["isolation"],
        },  # fmt: skip
        **derive({"single_rounds": raw["single"], "episode_rounds": raw["episodes"]}),
        "single_rounds": raw["single"],
        "episode_rounds": raw["episodes"],
        "load_average": load_before,
        "load_average_after": os.getloadavg(),
        "cpus": len(os.sched_getaffinity(0)),
        **provenance(),
    }
    print(readme_row(result))
    if out_path:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(result, indent=2))
    return result


def readme_row(r: dict[str, Any]) -> str:
    """The bench/README.md row of a result."""
    s = r["settings"]
    measured = (
        f"{r['episodes_per_s']:.1f} episodes/s vs {r['single_turn_responses_per_s']:.1f} "
        f"single-turn responses/s; {r['turns_per_episode']:.2f} turns and "
        f"{r['tool_call_rate']:.0%} calling the calculator per episode; "
        f"{r['tool_time_share']:.2%} of an episode's time in tools ({s['sandbox']} sandbox)"
    )
    ratio = (f"episodes/s ÷ responses/s **{r['episodes_vs_single_ratio']:.2f}**, sampled "
             f"tokens/s **{r['sampled_tokens_ratio']:.2f}**")  # fmt: skip
    load = r["load_average"][0]
    return (f"| episodes | tools demo model | {measured} | {ratio} | {s['prompts']} prompts × "
            f"{s['n']}, best of {s['rounds']} alternating rounds | {load:.1f} | "
            "`tether bench episodes` |")  # fmt: skip
