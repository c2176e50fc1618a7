"""The run's config resolved into the settings each part of the library takes.

Below the services' mains, the library (``common.bus``, ``common.engine``, ``common.data``,
``common.telemetry``, ``common.weights``) never receives the whole ``TetherConfig``: each part
has settings of its own (``BusSettings``, ``EngineSettings``, ``TrackerSettings``, the prompt
loader's arguments), and this module is where a config becomes them, once, after the cycle rules
are applied (``common.config.load``). It also checks, as it resolves them, what the settings
name on disk (model and tokenizer directories) so that a wrong path is refused at once, with the
setting named (``ConfigError``, exit 2). ``tests/unit/test_import_contracts.py`` holds the
library to it.
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING, Any

from common.bus.settings import BusSettings
from common.chat.tool_calls import ToolFormatError
from common.chat.tool_prompt import for_model
from common.config.errors import ConfigError
from common.data.datasets import EMPTY_TRAIN_PATH, DatasetError, PromptSet, load_prompts
from common.data.model_paths import (
    check_model_dir,
    check_tokenizer_dir,
    engine_returns_routed_experts,
    moe_routing_shape,
)
from common.engine import EngineSettings
from common.telemetry.trackers import INSTALL_HINTS, TrackerSettings
from common.tools.registry import tool_schemas

if TYPE_CHECKING:
    from common.config.schema import TetherConfig


def bus_settings_for(cfg: TetherConfig, *, redis_url: str | None = None) -> BusSettings:
    """The bus settings of ``cfg`` (``[bus]``, run.name) for ``redis_url``, else run.redis_url,
    else ``TETHER_REDIS_URL``; ``ConfigError`` when none is known."""
    url = redis_url or cfg.run.redis_url or os.environ.get("TETHER_REDIS_URL", "")
    if not url:
        raise ConfigError(
            "no Redis URL: set run.redis_url (--redis-url redis://host:6379/0) or start the service "
            "through `tether train`, which starts an embedded server."
        )
    b = cfg.bus
    return BusSettings(
        url=url,
        run=cfg.run.name,
        block_ms=b.block_ms,
        claim_idle_ms=int(b.claim_idle_s * 1000),
        max_deliveries=b.max_deliveries,
        max_message_bytes=int(b.max_message_mb * 1024 * 1024),
        max_backlog=b.max_backlog,
        socket_timeout_s=b.socket_timeout_s,
        allow_evicting_policy=b.allow_evicting_policy,
    )


def policy_engine_settings(cfg: TetherConfig, *, worker_extension_cls: str) -> EngineSettings:
    """The generator's engine: the policy model, room for the longest prompt and response, the
    ``[generator]`` engine settings (``dtype`` already settled at load), and the worker extension
    that receives weight updates in place."""
    g, run = cfg.generator, cfg.run
    model_dir, tok_dir = policy_paths(cfg)
    return EngineSettings(
        model=model_dir,
        tokenizer=tok_dir,
        dtype=g.dtype,
        max_model_len=run.max_prompt_tokens + run.max_response_tokens,
        gpu_memory_utilization=g.gpu_memory_utilization,
        kv_cache_gib=g.kv_cache_gib,
        enforce_eager=g.enforce_eager,
        max_num_seqs=g.max_num_seqs,
        seed=run.seed,
        tensor_parallel_size=g.tensor_parallel_size,
        worker_extension_cls=worker_extension_cls,
        max_lora_rank=g.max_lora_rank,
        return_routed_experts=cfg.learner.router_replay != "off",
    )


def solver_engine_settings(cfg: TetherConfig) -> EngineSettings:
    """The scorer's solver engine (solver mode): the frozen solver model with the ``[scorer]``
    section's ``solver_*`` engine settings; its weights never change."""
    s = cfg.scorer
    return EngineSettings(
        model=solver_path(cfg),
        dtype=s.solver_dtype,
        max_model_len=s.solver_max_model_len,
        gpu_memory_utilization=s.solver_gpu_memory_utilization,
        kv_cache_gib=s.solver_kv_cache_gib,
        seed=cfg.run.seed,
    )


def prompt_sets_for(cfg: TetherConfig, tokenizer: Any) -> tuple[PromptSet, PromptSet | None]:
    """(train, eval or None) as the config names them: the learner's data, and what `tether
    train` checks before it starts anything. Raises ``DatasetError`` naming the setting or row.
    Without a ``tokenizer`` rows are checked but not tokenised (no length check)."""
    d, run = cfg.data, cfg.run
    if not d.train_path:
        raise DatasetError(EMPTY_TRAIN_PATH)
    tools = tool_schemas(cfg.generator.tools) if tokenizer is not None else None
    if tools:  # rendered as the generator renders them (generator.tool_prompt)
        tokenizer = _tool_tokenizer(cfg, tokenizer)

    def load(path: str, split: str) -> PromptSet:
        return load_prompts(
            path,
            format=d.format,
            prompt_key=d.prompt_key,
            answer_key=d.answer_key,
            metadata_keys=d.metadata_keys,
            tokenizer=tokenizer,
            apply_chat_template=d.apply_chat_template,
            max_prompt_tokens=run.max_prompt_tokens if tokenizer is not None else None,
            overlong_policy=d.overlong_prompt_policy,
            split=split,
            setting=f"data.{split}_path",
            tools=tools,
        )

    return load(d.train_path, "train"), (load(d.eval_path, "eval") if d.eval_path else None)


def _tool_tokenizer(cfg: TetherConfig, tokenizer: Any) -> Any:
    """The tokenizer the generator renders tool prompts with (``tool_prompt.for_model``); the
    plain one where the model has no call format (preflight refuses such a run by name)."""
    g = cfg.generator
    try:
        return for_model(tokenizer, model_dir=policy_paths(cfg)[0], format_setting=g.tool_format,
                         mode=g.tool_prompt)[0]  # fmt: skip
    except ToolFormatError:
        return tokenizer


def policy_prompt_sets(cfg: TetherConfig) -> tuple[PromptSet, PromptSet | None]:
    """``prompt_sets_for`` with the policy's tokenizer: the learner's (train, eval) prompt sets
    for callers that build a learner without `tether learner`'s preflight (which loads them the
    same way)."""
    return prompt_sets_for(cfg, policy_tokenizer(cfg))


def policy_paths(cfg: TetherConfig) -> tuple[str, str]:
    """(model directory, tokenizer directory), both checked on disk."""
    model = cfg.run.model
    if not model:
        raise ConfigError(
            "run.model is empty: set it to a local Hugging Face model directory (--model DIR); "
            "`tether demo` builds a tiny one and sets it for you."
        )
    check_model_dir(model, setting="run.model")
    tok = cfg.run.tokenizer or model
    check_tokenizer_dir(
        tok,
        setting="run.tokenizer"
        if cfg.run.tokenizer
        else "run.model (run.tokenizer is empty, so the tokenizer is read from the model)",
    )
    return model, tok


def solver_path(cfg: TetherConfig) -> str:
    """The frozen solver's directory (solver mode): scorer.solver_model, else the policy model.
    The solver reads its tokenizer from the same directory."""
    if not cfg.scorer.solver_model:
        model = policy_paths(cfg)[0]
        check_tokenizer_dir(model, setting="run.model (the solver, scorer.solver_model empty)")
        return model
    check_model_dir(cfg.scorer.solver_model, setting="scorer.solver_model")
    check_tokenizer_dir(cfg.scorer.solver_model, setting="scorer.solver_model")
    return cfg.scorer.solver_model


def policy_tokenizer(cfg: TetherConfig) -> Any:
    """The policy's tokenizer, loaded the one way every service loads it (transformers)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(policy_paths(cfg)[1])


def check_router_replay(cfg: TetherConfig, *, engine: bool) -> None:
    """``learner.router_replay`` needs a mixture-of-experts policy and, where a generator runs
    (``engine``), a vLLM that returns routed experts, or an eager one whose routers' choices the
    worker extension records (``common.engine_routing``): ``ConfigError`` otherwise."""
    model, _ = policy_paths(cfg)
    setting = f'learner.router_replay = "{cfg.learner.router_replay}"'
    if moe_routing_shape(model) is None:
        raise ConfigError(
            f"{setting} replays the experts a mixture-of-experts model routed each token to, but "
            f"run.model ({model}) is a dense model (its config.json names no experts). Set "
            'learner.router_replay = "off".'
        )
    if engine and not cfg.generator.enforce_eager and not engine_returns_routed_experts():
        raise ConfigError(
            f"{setting}: this vLLM cannot return the experts it routed each token to (its "
            "enable_return_routed_experts needs model runner v2, which needs Triton, and this "
            "vLLM has no Triton backend), so the generators record them through the routers' "
            "capture hook, which a compiled graph does not call. Set generator.enforce_eager = "
            'true, or learner.router_replay = "off".'
        )


def missing_trackers(cfg: TetherConfig) -> list[str]:
    """Configured trackers whose package is not importable, each with how to install it."""
    return [  # each tracker's package has the tracker's name
        f"learner.trackers includes {name!r} but the {name!r} package is not installed: "
        f"{INSTALL_HINTS[name]}, or remove {name!r} from learner.trackers."
        for name in cfg.learner.trackers
        if importlib.util.find_spec(name) is None
    ]


def require_trackers(cfg: TetherConfig) -> None:
    """Raise ``ConfigError`` (exit 2) naming each configured tracker that is not installed."""
    problems = missing_trackers(cfg)
    if problems:
        raise ConfigError("\n".join(problems))


def tracker_settings(cfg: TetherConfig) -> TrackerSettings:
    """The learner's trackers (``learner.trackers``) and their W&B run (the config goes with it)."""
    lc = cfg.learner
    return TrackerSettings(
        names=tuple(lc.trackers),
        run_name=cfg.run.name,
        wandb_project=lc.wandb_project or cfg.run.name,
        wandb_entity=lc.wandb_entity or None,
        wandb_mode=lc.wandb_mode,
        config=cfg.model_dump(mode="json"),
    )
