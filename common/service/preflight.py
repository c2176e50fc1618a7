"""Preflight: what `tether train` and each service check before anything expensive starts.

Bad input must cost seconds and lose nothing, so every entry point calls ``preflight(cfg, role)``
after its config is resolved and before it starts Redis, a subprocess, an engine or a model:

====================================  =======  ==========  =========  ===========
check                                 train    learner     generator  scorer
====================================  =======  ==========  =========  ===========
transformers, vLLM versions (stack)   yes      yes (**)    yes        solver mode
learner.trackers installed            yes      yes         -          -
peft installed (learner.lora_rank)    yes      yes         -          -
router_replay: MoE; routing recorded  yes      MoE only    yes        -
policy model + tokenizer directories  yes      yes         yes        solver mode
solver model directory                solver   -           -          solver mode
data.train_path / eval_path exist     yes      rank 0      -          -
Redis URL answers one PING in 2 s     if set   rank 0 (*)  yes (*)    yes (*)
Redis maxmemory-policy cannot evict   if set   rank 0      yes        yes
Redis URL names a primary, no replica if set   rank 0 (*)  yes (*)    yes (*)
tokenizer loads; chat template        yes      rank 0      yes        -
episodes: tools, tool format, sandbox yes      -           yes        -
every dataset row, token lengths      yes      rank 0      -          -
====================================  =======  ==========  =========  ===========

(**) transformers only: the learner runs no vLLM (``common.service.stack``).
(*) Not when `tether train` started the service: it pinged (or started the server) itself, and
a service it restarts during a Redis outage must wait for Redis, not exit 2 and stop the run.
The eviction policy is checked by every service once its bus client is made (``check_server``:
it waits for Redis like any bus call), and by `tether train` for a ``run.redis_url`` of its own
(its embedded server never evicts).

The on-disk checks and the PING come first and are reported together; then the tokenizer is
loaded (transformers; a few seconds) and every row is read with the loader the learner uses
(``common.data.datasets.prompt_sets_for``). ``tether train`` with an empty ``run.redis_url`` starts
an embedded server, so there is nothing to ping. Any problem raises ``PreflightError`` (a
``ConfigError``): the CLI prints it as one paragraph and exits 2.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from common.config.errors import ConfigError

if TYPE_CHECKING:
    from common.config.schema import TetherConfig
    from common.data.datasets import PromptSet

Role = Literal["train", "learner", "generator", "scorer"]
PING_TIMEOUT_S = 2.0


class PreflightError(ConfigError):
    """Input Tether cannot run with; the message names the setting or the row and the fix."""


@dataclass
class Checked:
    """What the checks loaded and the caller may reuse instead of loading it again."""

    datasets: tuple[PromptSet, PromptSet | None] | None = None


def preflight(cfg: TetherConfig, role: Role) -> Checked:
    """Check ``cfg`` for ``role`` (see the module docstring); raise ``PreflightError``."""
    lead = role != "learner" or os.environ.get("RANK", "0") == "0"  # rank 0 reads data, Redis
    needs_data = role == "train" or (role == "learner" and lead)
    problems = _on_disk(cfg, role, needs_data=needs_data)
    if lead and not _supervised(role):
        problems += _redis(cfg, role)
    if len(problems) == 1:
        raise PreflightError(problems[0])
    if problems:
        numbered = " ".join(f"({i}) {p}" for i, p in enumerate(problems, 1))
        raise PreflightError(f"{len(problems)} problems: {numbered}")
    if not (needs_data or role == "generator"):
        return Checked()
    tokenizer = _tokenizer(cfg)
    if cfg.generator.max_turns > 1 and role in ("train", "generator"):
        _episodes(cfg, tokenizer)
    if not needs_data:
        return Checked()
    from common.data.datasets import DatasetError
    from common.service.settings import prompt_sets_for

    try:
        return Checked(datasets=prompt_sets_for(cfg, tokenizer))
    except (DatasetError, ValueError) as exc:
        raise PreflightError(str(exc)) from None


def _on_disk(cfg: TetherConfig, role: Role, *, needs_data: bool) -> list[str]:
    from common.service.settings import policy_paths, solver_path

    checks: list[Any] = []
    if role != "scorer" or cfg.scorer.mode == "solver":  # every role that loads a model
        from common.service.stack import check_stack

        vllm = role in ("train", "generator", "scorer")  # the engines; the learner has none
        checks.append(lambda: check_stack(generator=vllm))
    if role in ("train", "learner"):
        from common.service.settings import require_trackers

        checks.append(lambda: require_trackers(cfg))
    if role in ("train", "learner") and cfg.learner.lora_rank:
        checks.append(require_peft)
    if role != "scorer":
        checks.append(lambda: policy_paths(cfg))
    if role != "scorer" and cfg.learner.router_replay != "off":
        from common.service.settings import check_router_replay

        engine = role in ("train", "generator")
        checks.append(lambda: check_router_replay(cfg, engine=engine))
    if cfg.scorer.mode == "solver" and (role == "scorer" or cfg.scorer.solver_model):
        checks.append(lambda: solver_path(cfg))  # train: the policy, when empty, is checked above
    if needs_data:
        checks.append(lambda: _data_paths(cfg))
    problems = []
    for check in checks:
        try:
            check()
        except ConfigError as exc:
            problems.append(str(exc))
    return problems


def require_peft() -> None:
    """A LoRA learner (``learner.lora_rank > 0``) needs peft: ``ConfigError`` naming the fix."""
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        raise ConfigError(
            "learner.lora_rank > 0 needs the peft library, which is not installed. Fix: pip "
            "install 'tether-rl[lora]' (peft 0.21, the version Tether is tested with), or set "
            "learner.lora_rank = 0 for full fine-tuning."
        )


def _data_paths(cfg: TetherConfig) -> None:
    """The cheap part of the data check, before the tokenizer loads (importing transformers
    takes 5-20 s on a busy 2-core machine): the paths exist and, unless bad rows are to be
    dropped, every row has the right shape (the same loader, without token counts)."""
    from common.data.datasets import EMPTY_TRAIN_PATH, DatasetError
    from common.service.settings import prompt_sets_for

    d = cfg.data
    if not d.train_path:
        raise ConfigError(EMPTY_TRAIN_PATH)
    for setting, path in (("data.train_path", d.train_path), ("data.eval_path", d.eval_path)):
        if path and not Path(path).exists():
            raise ConfigError(
                f"{setting} = {path!r} does not exist. Fix: point it at a JSONL/Parquet file or "
                "a directory of them; in a deployment, stage it first: on Kubernetes set "
                "dataSource in deploy/k8s/params.yaml (the tether-staging Job fetches it into "
                "/models/data), with compose copy it under TETHER_MODELS_DIR (deploy/README.md)."
            )
    if d.overlong_prompt_policy == "error":
        try:
            prompt_sets_for(cfg, None)
        except DatasetError as exc:
            raise ConfigError(str(exc)) from None


def _supervised(role: Role) -> bool:
    """A service `tether train` started: the launcher checked the URL (or started the server)
    already, and a service it restarts while Redis is briefly down must wait for it (the bus
    reconnects with back-off), not exit 2, which stops the whole run."""
    from common.service.supervision import SUPERVISOR_ENV

    return role != "train" and bool(os.environ.get(SUPERVISOR_ENV))


def _redis(cfg: TetherConfig, role: Role) -> list[str]:
    """One PING of the Redis URL the role would use, with a short timeout and no retry."""
    import redis

    from common.bus.settings import ping_once, safe_url
    from common.service.settings import bus_settings_for

    if role == "train" and not cfg.run.redis_url:
        return []  # `tether train` starts an embedded server
    try:
        url = bus_settings_for(cfg).url
    except ConfigError as exc:
        return [str(exc)]
    except ValueError as exc:  # BusSettings: scheme, run name, timeouts
        raw = cfg.run.redis_url or os.environ.get("TETHER_REDIS_URL", "")
        text = str(exc).replace(raw, safe_url(raw)) if raw else str(exc)  # no password shown
        return [f"{text}; check run.redis_url, run.name and [bus]."]
    where = f"Redis at {safe_url(url)} (run.redis_url, --redis-url)"
    try:
        ping_once(url, timeout_s=PING_TIMEOUT_S)
    except redis.AuthenticationError as exc:  # a ConnectionError: first
        return [f"{where} refused the credentials ({exc}). Fix the user:password in the URL."]
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        if tls := _tls_problem(str(exc), tls=url.startswith("rediss://")):
            return [f"{where}: {tls} ({exc})."]
        fix = (
            "start the server, correct the URL, or leave run.redis_url empty so that `tether "
            "train` starts an embedded server"
            if role == "train"
            else "start the server or correct the URL"
        )
        return [f"{where} did not answer a PING within {PING_TIMEOUT_S:g} s ({exc}). Fix: {fix}."]
    except redis.ResponseError as exc:  # NOAUTH and the like
        return [f"{where} answered PING with an error ({exc}). Fix the URL's user:password."]
    except ValueError as exc:  # from_url: not a URL redis-py can use
        return [f"run.redis_url = {safe_url(url)!r} is not a usable Redis URL ({exc})."]
    return _server(cfg, url, where)


def _server(cfg: TetherConfig, url: str, where: str) -> list[str]:
    """After the PING worked: the server's ``maxmemory-policy`` (``INFO memory``), and that it
    is a primary (``INFO replication``): a replica refuses every write, which a service would
    retry for ``bus.reconnect_max_s`` before saying so."""
    import redis

    from common.bus.memory import check_policy, read_memory
    from common.bus.settings import make_client, safe_url

    client = make_client(url, socket_timeout_s=PING_TIMEOUT_S, connect_timeout_s=PING_TIMEOUT_S)
    try:
        memory = read_memory(client)
        check_policy(memory, url=safe_url(url), allow_evicting=cfg.bus.allow_evicting_policy)
        replication = client.info("replication")
    except ConfigError as exc:
        return [str(exc)]
    except redis.RedisError:  # INFO not allowed to this user: every service checks again
        return []
    finally:
        client.close()
    if replication.get("role") == "slave":
        primary = f"{replication.get('master_host')}:{replication.get('master_port')}"
        return [
            f"{where} is a replica of {primary}: it refuses writes. Fix: point the URL at the "
            "primary, or at a name that follows the primary through failovers (a DNS record or "
            "a Kubernetes Service your failover moves)."
        ]
    return []


def check_server(bus: Any) -> None:
    """A service's check of its Redis at start: ``maxmemory-policy`` must not evict Tether's
    keys (``common.bus.memory``); ``PreflightError`` (exit 2) otherwise."""
    try:
        bus.check_server()
    except ConfigError as exc:
        raise PreflightError(str(exc)) from None


def _tls_problem(error: str, *, tls: bool) -> str:
    """What a failed ``rediss://`` connection most likely means and how to fix it, or ''."""
    if not tls:
        return ""
    if "CERTIFICATE_VERIFY_FAILED" in error:
        return (
            "its TLS certificate is not trusted by this machine. Fix: name the CA that signed it "
            "in the URL, rediss://user:password@host:port/0?ssl_ca_certs=/path/to/ca.pem"
        )
    if "WRONG_VERSION_NUMBER" in error or "Timeout" in error:
        # a plain Redis reads a TLS hello as the start of a command and waits for the rest
        return (
            f"no TLS handshake within {PING_TIMEOUT_S:g} s: the port does not speak TLS, or "
            "nothing answers there. Fix: use redis:// for a plain port, or the server's TLS "
            "port (tls-port)"
        )
    return ""


def _tokenizer(cfg: TetherConfig) -> Any:
    """The policy tokenizer; refuses data.apply_chat_template without a chat template."""
    from common.service.settings import policy_paths, policy_tokenizer

    try:
        tokenizer = policy_tokenizer(cfg)
    except (OSError, ValueError) as exc:
        raise PreflightError(
            f"cannot load the tokenizer from {policy_paths(cfg)[1]!r} ({exc}); point "
            "run.tokenizer (or run.model) at a Hugging Face tokenizer directory."
        ) from None
    if cfg.data.apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise PreflightError(
            f"data.apply_chat_template is true but the tokenizer in {policy_paths(cfg)[1]!r} has "
            "no chat template (a base model?). Fix: set data.apply_chat_template = false "
            "(--set data.apply_chat_template=false) to feed raw text, or use a tokenizer that "
            "has one."
        )
    return tokenizer


def _episodes(cfg: TetherConfig, tokenizer: Any) -> None:
    """Episodes can run: every generator.tools entry resolves to a tool, the model has a tool
    format (generator.tool_format), its chat template renders tools, appends turns by
    difference and plays a scripted episode with one and two calls (``common.chat.rehearsal``),
    and the sandbox can isolate when generator.tool_sandbox requires it."""
    import json
    import shutil

    from common.chat.rehearsal import rehearse
    from common.chat.tool_calls import ToolFormatError, tool_format
    from common.chat.tool_prompt import for_tools
    from common.chat.turns import TemplateDeltaError, TurnEncoder, end_of_turn_ids
    from common.service.settings import policy_paths
    from common.tools.functions import ToolDefinitionError
    from common.tools.registry import tool_schemas

    g = cfg.generator
    model_dir = policy_paths(cfg)[0]
    try:
        schemas = tool_schemas(g.tools)
        model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type", "")
        fmt = tool_format(g.tool_format, model_type=model_type, vocab=tokenizer.get_vocab())
        tokenizer = for_tools(tokenizer, mode=g.tool_prompt, fmt=fmt)  # generator.tool_prompt
        enc = TurnEncoder(tokenizer, end_ids=end_of_turn_ids(tokenizer, model_dir), tools=schemas)
        rehearse(tokenizer, enc, fmt)  # one call, two calls, through the real template
    except (ToolDefinitionError, ToolFormatError, TemplateDeltaError, OSError) as exc:
        raise PreflightError(f"episodes cannot run: {exc}") from None
    if g.tool_sandbox == "namespaces" and (os.geteuid() != 0 or not shutil.which("unshare")):
        raise PreflightError(
            "generator.tool_sandbox = 'namespaces' needs the generator to run as root with "
            "util-linux's `unshare` (network, PID and mount namespaces). Fix: run it so, or set "
            "generator.tool_sandbox = 'auto' (per-call limits only where namespaces cannot be "
            "made; the log says so)."
        )
