"""Entry of `tether generator`: one vLLM engine serving prompts from the bus (see loop.py)."""

from __future__ import annotations

from common.config.schema import TetherConfig
from common.protocol.run_dir import RunDir
from common.service.preflight import check_server, preflight
from common.service.serve import serve_async, service_id
from common.service.settings import bus_settings_for, policy_engine_settings, policy_paths
from services.generator.agent.tool_loop import EpisodeSettings
from services.generator.loop import GeneratorService
from services.generator.settings import (
    WORKER_EXT,
    AgentSettings,
    GeneratorSettings,
    SamplingPlan,
    ToolLoopSettings,
)


def generator_settings(cfg: TetherConfig, *, redis_url: str | None = None) -> GeneratorSettings:
    """The generator's settings from the run's config (the cycle rules already applied): the bus,
    the policy's engine and tokenizer (their directories checked on disk), sampling, weights, and
    the tool loop or your agent when the config turns one on."""
    g, run = cfg.generator, cfg.run
    engine = policy_engine_settings(cfg, worker_extension_cls=WORKER_EXT)
    model_dir, tokenizer_dir = policy_paths(cfg)
    tool_loop = agent = None
    if cfg.agent.enabled:
        agent = agent_settings(cfg, model_dir)
    elif g.max_turns > 1:
        tool_loop = ToolLoopSettings(
            model_dir=model_dir, tools=tuple(g.tools), tool_format=g.tool_format,
            tool_prompt=g.tool_prompt, workers=g.tool_workers, timeout_s=g.tool_timeout_s, memory_mb=g.tool_memory_mb,
            isolation=g.tool_sandbox, run_dir=str(RunDir.of(run).root),
            episode=EpisodeSettings(
                max_turns=g.max_turns, max_tokens=run.max_response_tokens,
                tool_output_max_chars=g.tool_output_max_chars, template_check=g.template_check,
            ),
        )  # fmt: skip
    return GeneratorSettings(
        bus=bus_settings_for(cfg, redis_url=redis_url),
        engine=engine,
        tokenizer=tokenizer_dir,
        liveness_s=g.liveness_s,
        apply_chat_template=cfg.data.apply_chat_template,
        sampling=sampling_plan(cfg),
        weights=cfg.weights,
        max_prompts_in_flight=g.max_prompts_in_flight,
        tool_loop=tool_loop,
        agent=agent,
    )


def agent_settings(cfg: TetherConfig, model_dir: str) -> AgentSettings:
    """Your agent's settings (``[agent]``, the run's lengths, the model's tool-call format)."""
    run = cfg.run
    return AgentSettings(
        agent=cfg.agent, model_dir=str(model_dir), tool_format=cfg.generator.tool_format,
        tool_prompt=cfg.generator.tool_prompt,
        max_prompt_tokens=run.max_prompt_tokens, max_response_tokens=run.max_response_tokens,
    )  # fmt: skip


def sampling_plan(cfg: TetherConfig) -> SamplingPlan:
    """How the generator samples every prompt (``[generator]``, the run's group and length)."""
    g, run = cfg.generator, cfg.run
    return SamplingPlan(
        run_seed=run.seed, responses_per_prompt=run.responses_per_prompt,
        max_response_tokens=run.max_response_tokens, temperature=g.temperature, top_p=g.top_p,
        top_k=g.top_k, stop=tuple(g.stop), ignore_eos=g.ignore_eos,
        eval_temperature=g.eval_temperature,
    )  # fmt: skip


def main(cfg: TetherConfig, args) -> int:
    preflight(cfg, "generator")  # model, tokenizer, Redis: exit 2 before the engine starts

    sid = service_id("generator", getattr(args, "service_id", None))
    svc = GeneratorService(generator_settings(cfg), sid=sid)
    check_server(svc.bus)  # an evicting maxmemory-policy: exit 2 before the engine starts

    def cleanup() -> None:
        engine = getattr(svc, "engine", None)
        if engine is not None:
            engine.shutdown()

    return serve_async(
        svc,
        "generator",
        sid,
        cfg.generator.metrics_port,
        num_cycles=cfg.run.num_cycles,
        cleanup=cleanup,
    )
