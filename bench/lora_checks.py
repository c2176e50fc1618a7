"""LoRA through Tether's real parts: an adapter-only publish into a vLLM engine, log-prob parity
with the learner's LoRA model, and prefix-cache reuse across adapter versions.

Shared by ``tests/services/test_lora_generator.py``, ``tests/services/test_lora_families.py``
(CI) and ``tether bench models`` (the LoRA columns). Everything is the production path: the
learner's ``load_policy(lora=…)`` (peft under FSDP2 over a one-rank gloo group) and
``lora.publish_state``, ``WeightPublisher`` down to the engine's worker extension
(``tether_receive_update`` -> ``services.generator.adapter.load``), and requests built by
``GenerationEngine._request`` (the adapter's id and a prefix-cache salt per version).

The adapter is made visible before it is compared: ``perturb_adapter`` gives ``lora_B`` (zero
at init, which would make the adapter a no-op) and ``lora_A`` noise of a fixed size, so a
generator that ignored the adapter, applied a stale one, or scaled it differently would be off
by far more than ``PARITY_MEAN_ABS``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from bench.family_checks import (
    EXT,
    PARITY_MEAN_ABS,
    PROMPTS,
    Sampled,
    compare,
    join_engine,
    learner_logprobs,
    prompt_ids,
    rpc,
    stop_engine,
    sync_engine,
)
from common.engine import (
    ADAPTER_ID,
    ADAPTER_NAME,
    IN_MEMORY_PATH,
    SamplingSettings,
    sample_from_completion,
)
from common.weights.publisher import WeightPublisher
from services.learner.lora import (
    LoraSettings,
    adapter_disabled,
    adapter_params,
    adapter_state,
    load_adapter_state,
    publish_state,
)
from services.learner.model import load_policy

ADAPTER_STD = 0.05  # the noise put into lora_A and lora_B (their values after some training)


def start_lora_engine(
    model_dir: str | Path, *, max_lora_rank: int, max_model_len: int = 512, seed: int = 0
) -> Any:
    """A vLLM engine (fp32, eager, Tether's worker extension) serving one LoRA adapter, as
    ``common.engine.GenerationEngine.start`` configures it for a LoRA run."""
    return sync_engine(
        model=str(model_dir), dtype="float32", enforce_eager=True, gpu_memory_utilization=0.2,
        max_model_len=max_model_len, seed=seed, worker_extension_cls=EXT, enable_lora=True,
        max_lora_rank=max_lora_rank, max_loras=1, max_cpu_loras=1,
    )  # fmt: skip


def perturb_adapter(model: Any, *, seed: int, std: float = ADAPTER_STD) -> list[str]:
    """Set every adapter parameter of the learner's (FSDP2) model to N(0, std²) noise, in
    place on each rank's shard. Returns the names changed (the adapter's, all of them)."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():  # a forward without backward leaves the root unsharded
        if isinstance(module, FSDPModule):
            module.reshard()
    gen = torch.Generator().manual_seed(seed)
    changed = []
    with torch.no_grad():
        for name, p in adapter_params(model):
            local = p.to_local() if hasattr(p, "to_local") else p
            local.copy_(torch.randn(local.shape, generator=gen, dtype=local.dtype) * std)
            changed.append(name)
    return changed


def publish_adapter(llm: Any, model: Any, *, version: int, timeout_s: float = 60.0) -> dict:
    """One real adapter-only update: ``lora.publish_state`` through ``WeightPublisher`` into the
    engine's worker extension. Returns the worker's answer with the publisher's report, the
    published names and the bytes the learner sent."""
    state = publish_state(model)
    pub = WeightPublisher("127.0.0.1", 0, timeout_s=timeout_s, auto_accept=False)
    try:
        join_engine(llm, pub, member="lora", timeout_s=timeout_s)
        box: dict[str, Any] = {}
        sender = threading.Thread(
            target=lambda: box.setdefault("report", pub.publish(state.items(), version))
        )
        sender.start()
        res = rpc(llm, "tether_receive_update", timeout_s)
        sender.join(timeout_s)
    finally:
        pub.close()
    report = box.get("report")
    return {
        **res,
        "published": sorted(state),
        "per_member": report.per_member if report else {},
        "sent_checksum": report.checksum if report else None,
        "root_bytes": report.root_bytes if report else 0,
    }


def lora_request() -> Any:
    """The request's adapter, as ``GenerationEngine._request`` names it."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(ADAPTER_NAME, ADAPTER_ID, IN_MEMORY_PATH)


def sample_lora(
    llm: Any,
    tokenizer: Any,
    *,
    version: int,
    n: int = 8,
    max_tokens: int = 40,
    seed: int = 0,
    prompts: list[list[int]] | None = None,
    salt: bool = True,
) -> list[Sampled]:
    """``n`` responses to each of ``PROMPTS`` (or ``prompts``) through the adapter, at
    temperature 1 with behaviour log-probs, salted with ``version`` as the generator does."""
    params = SamplingSettings(n=n, max_tokens=max_tokens, seed=seed).to_vllm()
    ids = prompts or [prompt_ids(tokenizer, p) for p in PROMPTS]
    extra = {"cache_salt": f"tether-adapter-v{version}"} if salt else {}
    outs = llm.generate(
        [{"prompt_token_ids": p, **extra} for p in ids],
        params,
        use_tqdm=False,
        lora_request=lora_request(),
    )
    samples = []
    for p, out in zip(ids, outs, strict=True):
        for c in sorted(out.outputs, key=lambda c: c.index):
            s = sample_from_completion(c, 0.0)
            samples.append(Sampled(p, s.token_ids, s.logprobs))
    return samples


def parity(llm: Any, tokenizer: Any, policy: Any, *, version: int, seed: int) -> dict[str, Any]:
    """``compare`` of the engine's behaviour log-probs (through the adapter) against the
    learner's LoRA model, and against the base model (the adapter must matter: the gap to the
    base is reported as ``base_mean_abs``)."""
    samples = sample_lora(llm, tokenizer, version=version, seed=seed)
    result = compare(samples, learner_logprobs(policy, samples))
    with adapter_disabled(policy):
        base = compare(samples, learner_logprobs(policy, samples))
    return {**result, "base_mean_abs": base["mean_abs"]}


INSIDE_AFTER = 4  # tokens each request samples before the in-flight update lands


def in_flight_parity(
    llm: Any, tokenizer: Any, policy: Any, *, version: int, seed: int
) -> dict[str, Any]:
    """Requests running through the adapter of ``version`` receive the adapter of
    ``version + 1`` after ``INSIDE_AFTER`` tokens, the way the generator applies an update in
    flight (``WeightFollower.apply_update``: pause keeping the requests and dropping every
    cached KV, swap the adapter, relabel, resume). Each sampled token is scored by the learner
    under the adapter of the version it carries. Returns ``compare``'s numbers and the
    versions seen. ``policy`` ends on the new adapter."""
    from vllm.sampling_params import RequestOutputKind

    core = llm.llm_engine.engine_core
    llm.llm_engine.set_weight_version(str(version))
    params = SamplingSettings(n=1, max_tokens=24, seed=seed, ignore_eos=True).to_vllm()
    params.output_kind = RequestOutputKind.CUMULATIVE  # to see each request's progress
    ids = {f"inflight-{k}": prompt_ids(tokenizer, p) for k, p in enumerate(PROMPTS)}
    for rid, p in ids.items():
        prompt = {"prompt_token_ids": p, "cache_salt": f"tether-adapter-v{version}"}
        llm.llm_engine.add_request(rid, prompt, params, lora_request=lora_request())
    seen = dict.fromkeys(ids, 0)
    while min(seen.values()) < INSIDE_AFTER:
        for o in llm.llm_engine.step():
            assert not o.finished, "a request finished before the update could land in it"
            seen[o.request_id] = len(o.outputs[0].token_ids)
    before = adapter_state(policy)
    core.call_utility("pause_scheduler", "keep", True)
    try:
        perturb_adapter(policy, seed=seed + 1)
        res = publish_adapter(llm, policy, version=version + 1)
        if not res["ok"]:
            raise RuntimeError(res["error"])
        llm.llm_engine.set_weight_version(str(version + 1))
    finally:
        core.call_utility("resume_scheduler")
    done: dict[str, Any] = {}
    while len(done) < len(ids):
        done.update({o.request_id: o for o in llm.llm_engine.step() if o.finished})
    return _score_by_version(ids, done, policy, before)


def _score_by_version(ids: dict, done: dict, policy: Any, before: dict) -> dict[str, Any]:
    """``compare`` with each token scored under the adapter of its version label: ``policy``'s
    current adapter for the newest label, ``before`` (put back for the pass) for the others."""
    samples, labels = [], []
    for rid, p in ids.items():
        s = sample_from_completion(done[rid].outputs[0], 0.0)
        tags = [""] * len(s.token_ids)
        for v, start, end in s.weight_versions:
            tags[start:end] = [v] * (end - start)
        samples.append(Sampled(p, s.token_ids, s.logprobs))
        labels.append(tags)
    after = adapter_state(policy)
    new = learner_logprobs(policy, samples)
    load_adapter_state(policy, before)
    old = learner_logprobs(policy, samples)
    load_adapter_state(policy, after)
    versions = sorted({t for tags in labels for t in tags if t}, key=int)
    newest = versions[-1]
    scored = [
        [n if tag == newest else o for tag, n, o in zip(tags, nl, ol, strict=True)]
        for tags, nl, ol in zip(labels, new, old, strict=True)
    ]
    tokens_after = sum(tag == newest for tags in labels for tag in tags)
    return {**compare(samples, scored), "versions": versions, "tokens_after": tokens_after}


def family_row(name: str, *, device: Any, rank: int = 8) -> dict[str, Any]:
    """LoRA on one family of ``fixtures.model_families`` (all-linear targets, as
    ``learner.lora_target_modules`` defaults): ✓ when the engine took the adapter and the
    generator's log-probs match the learner's (mean |Δ| < 1e-3) before, during and after an
    in-flight update; else the error, e.g. a module vLLM cannot put LoRA on."""
    from transformers import AutoTokenizer

    from fixtures.model_families import FAMILIES, build_family, default_root  # noqa: PLC0415 - looked up when called: tests replace build_family

    t0 = time.monotonic()
    row: dict[str, Any] = {"family": name, "title": FAMILIES[name].title}
    model_dir = build_family(name, default_root())
    llm = None
    try:
        policy = load_policy(model_dir, device=device, lora=LoraSettings(rank=rank, alpha=16))
        row["targets"] = sorted({n.split(".lora_")[0].rsplit(".", 1)[-1]
                                 for n, _ in adapter_params(policy)})  # fmt: skip
        llm = start_lora_engine(model_dir, max_lora_rank=rank)
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        perturb_adapter(policy, seed=1)
        res = publish_adapter(llm, policy, version=1)
        if not res["ok"]:
            return {**row, "ok": False, "error": res["error"], "seconds": time.monotonic() - t0}
        row["adapter_bytes"] = res["bytes"]
        row["before"] = parity(llm, tok, policy, version=1, seed=0)
        row["in_flight"] = in_flight_parity(llm, tok, policy, version=1, seed=2)
        row["after"] = parity(llm, tok, policy, version=2, seed=1)
        worst = max(row[k]["mean_abs"] for k in ("before", "in_flight", "after"))
        row["ok"] = worst < PARITY_MEAN_ABS
        if not row["ok"]:
            row["error"] = f"mean |Δ| {worst:.2e} over the {PARITY_MEAN_ABS:g} target"
    except Exception as exc:  # noqa: BLE001 - a family LoRA cannot serve is a result
        row.update(ok=False, error=f"{type(exc).__name__}: {exc}".strip()[:1500])
    finally:
        if llm is not None:
            stop_engine(llm)
    row["seconds"] = round(time.monotonic() - t0, 1)
    return row
