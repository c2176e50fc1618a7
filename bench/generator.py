"""Generator benchmark: the `tether generator` service against bare vLLM, and its weight updates
against a bare gloo broadcast. ``python -m bench.generator``.

Throughput, same model, prompts and sampling settings (``ignore_eos``: every response is exactly
``max_tokens`` long, so both sides generate the same number of tokens), in the same run:

- bare:    one ``GenerationEngine`` in this process, every prompt's ``generate_group`` submitted
           at once (continuous batching; the best vLLM can do with these prompts);
- service: a `tether generator` subprocess; the clock runs from the XADD of the prompts to
           ``<run>:prompts`` until the last ``TrajectoryGroup`` is in ``<run>:groups``, so it
           includes Redis, msgpack, the staleness gate, tokenisation and the exactly-once commit.

Both engines stay up and the rounds alternate (bare, service, bare, service, ...): on a shared
machine the load changes by the minute, and alternating rounds see the same load. Each side's
figure is its best round, after one warm-up round each.

Weight updates: this process hosts the learner's ``WeightPublisher`` and publishes the model's
state dict to the running generator while it is idle (best of ``update_repeats``) and once while
it generates. Reported: the publisher's time (transfer + checksum) and the generator's own update
time (pause, receive, verify, load, resume: its ``tether_generator_weight_update_seconds``), as
GB/s of the bytes moved, against a bare gloo broadcast of the same size
(``bench.weights.run_weights_bench``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from bench.weights import run_weights_bench
from common.bus.client import Bus
from common.bus.server import EmbeddedRedis
from common.bus.settings import BusSettings
from common.engine import EngineSettings, GenerationEngine, SamplingSettings
from common.protocol import streams, wire
from common.service import process_exit
from common.weights.publisher import WeightPublisher
from tether.demo.tiny_model import build_tiny_model

log = logging.getLogger(__name__)
MAX_PROMPT_TOKENS = 256  # the config default; the bare engine's max_model_len matches the service's
CACHE = Path("bench/work/cache")  # inside the clone (git-ignored), like every bench's work_dir


def _prompt_texts(count: int, *, offset: int = 0) -> list[str]:
    return [
        f"Question {i}: what is {i} + {2 * i}? Think step by step."
        for i in range(offset, offset + count)
    ]


def _bare_engine(model: str, max_tokens: int):
    return GenerationEngine(
        EngineSettings(model=model, dtype="float32", max_model_len=MAX_PROMPT_TOKENS + max_tokens,
                       gpu_memory_utilization=0.2, kv_cache_gib=1, max_num_seqs=256, seed=0)
    )  # fmt: skip


async def _bare_round(
    engine: Any, tokenizer: Any, texts: list[str], *, n: int, max_tokens: int
) -> dict:
    sampling = SamplingSettings(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [_encode(tokenizer, t) for t in texts]
    start = time.perf_counter()
    outs = await asyncio.gather(
        *(engine.generate_group(p, sampling, request_id=f"bare-{uuid.uuid4().hex}") for p in ids)
    )
    seconds = time.perf_counter() - start
    tokens = sum(len(s.token_ids) for group in outs for s in group)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}


def _encode(tokenizer: Any, text: str) -> list[int]:
    """As the service does with data.apply_chat_template = true."""
    chat = [{"role": "user", "content": text}]
    rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(rendered, add_special_tokens=False).input_ids)


class _Service:
    """A `tether generator` subprocess on its own run namespace, and this side's bus."""

    def __init__(self, url: str, model: str, *, n: int, max_tokens: int, log_path: Path) -> None:
        self.run = f"bench-gen-{uuid.uuid4().hex[:8]}"
        self.bus = Bus(
            BusSettings(url=url, run=self.run, block_ms=200, socket_timeout_s=10), service="bench"
        )
        sets = [f"run.name={self.run}", f"run.model={model}", f"run.responses_per_prompt={n}",
                f"run.max_response_tokens={max_tokens}", "generator.ignore_eos=true",
                "generator.kv_cache_gib=1", "generator.gpu_memory_utilization=0.2",
                "bus.block_ms=200"]  # fmt: skip
        args = [sys.executable, "-m", "tether.cli", "generator", "--id", "bench-0"]
        for s in sets:
            args += ["--set", s]
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TETHER_RUN__REDIS_URL": url}
        self.proc = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def wait(self, pred, timeout_s: float, what: str) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = pred()
            if value:
                return value
            if self.proc.poll() is not None:
                raise RuntimeError(f"the generator exited while {what}; log: {self.log_path}")
            time.sleep(0.02)
        raise RuntimeError(
            f"timed out after {timeout_s} s waiting for {what}; log: {self.log_path}"
        )

    def round(self, texts: list[str], tag: str) -> dict:
        msgs = [
            wire.PromptMsg(prompt_id=f"{tag}-{i}", cycle=0, index=i, text=t)
            for i, t in enumerate(texts)
        ]
        key = self.bus.key(streams.GROUPS)
        before = self.bus.redis.xlen(key)
        start = time.perf_counter()
        pipe = self.bus.redis.pipeline(transaction=True)
        for m in msgs:
            pipe.xadd(self.bus.key(streams.PROMPTS), {streams.PAYLOAD_FIELD: wire.encode(m)})
        pipe.execute()
        self.wait(lambda: self.bus.redis.xlen(key) >= before + len(msgs), 1800, f"round {tag}")
        seconds = time.perf_counter() - start
        entries = self.bus.redis.xrange(key)[before:]
        groups: list[Any] = [wire.decode(f[streams.PAYLOAD_FIELD]) for _, f in entries]
        tokens = sum(len(s.response_token_ids) for g in groups for s in g.samples)
        return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}

    def metric(self, port: int, name: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.rsplit(" ", 1)[1])
        return 0.0

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, 9)
        except ProcessLookupError:
            pass
        self.proc.wait(30)
        self._log.close()


def _update(svc: _Service, pub: Any, named: list, version: int, port: int) -> dict:
    """Publish ``version``; time the publisher and the generator's own pause-load-resume."""
    s0 = svc.metric(port, "tether_generator_weight_update_seconds_sum")
    start = time.perf_counter()
    svc.bus.set(streams.WEIGHTS_PUBLISHING, version)  # announce first, as the learner does
    report = pub.publish(named, version)
    if report.per_member != {"bench-0": "ok"}:
        raise RuntimeError(f"weight update {version} failed: {report.per_member}")
    svc.wait(
        lambda: svc.bus.get(streams.generator_version("bench-0")) == str(version),
        300,
        f"version {version}",
    )
    wall = time.perf_counter() - start
    svc.wait(
        lambda: svc.metric(port, "tether_generator_weight_update_seconds_sum") > s0, 30, "metric"
    )
    gen_s = svc.metric(port, "tether_generator_weight_update_seconds_sum") - s0
    return {"publish_seconds": report.seconds, "generator_update_seconds": gen_s, "wall_seconds": wall,
            "bytes": report.bytes}  # fmt: skip


def _weights_part(
    svc: _Service, pub: Any, named: list, port: int, *, repeats: int, texts: list[str]
) -> dict:
    idle = [_update(svc, pub, named, v, port) for v in range(1, repeats + 1)]
    box: dict = {}
    runner = threading.Thread(target=lambda: box.update(svc.round(texts, "inflight")))
    runner.start()
    time.sleep(1.0)  # mid-generation
    busy = _update(svc, pub, named, repeats + 1, port)
    runner.join()
    nbytes = idle[0]["bytes"]
    best = min(idle, key=lambda r: r["generator_update_seconds"])

    bare = run_weights_bench(
        total_mb=max(1, math.ceil(nbytes / 2**20)), num_tensors=len(named), repeats=repeats
    )
    return {
        "bytes": nbytes,
        "num_tensors": len(named),
        "idle_updates": idle,
        "in_flight_update": busy,
        "publish_gb_per_s": nbytes / min(r["publish_seconds"] for r in idle) / 1e9,
        "generator_update_gb_per_s": nbytes / best["generator_update_seconds"] / 1e9,
        "in_flight_update_gb_per_s": nbytes / busy["generator_update_seconds"] / 1e9,
        "bare_gloo_bytes": bare["bytes"],
        "bare_gloo_seconds": bare["bare_broadcast_seconds"],
        "bare_gloo_gb_per_s": bare["bare_broadcast_gb_per_s"],
        "generator_update_vs_bare_gloo": bare["bare_broadcast_seconds"]
        / best["generator_update_seconds"]
        * nbytes
        / bare["bytes"],
    }


def run_generator_bench(
    *, prompts: int = 30, n: int = 4, max_tokens: int = 128, rounds: int = 2,
    update_repeats: int = 3, hidden_size: int = 256, num_layers: int = 4,
    out_path: str | None = None,
) -> dict:  # fmt: skip
    """Measure (see the module docstring); print a summary; write JSON to ``out_path``."""
    if min(prompts, n, max_tokens, rounds, update_repeats) < 1:
        raise ValueError("prompts, n, max_tokens, rounds and update_repeats must all be >= 1")
    from transformers import AutoTokenizer

    model = str(
        build_tiny_model(
            CACHE / f"gen_h{hidden_size}_l{num_layers}",
            hidden_size=hidden_size,
            num_layers=num_layers,
        )
    )
    work = Path(tempfile.mkdtemp(prefix="tether-bench-gen-"))
    server = EmbeddedRedis(work / "redis")
    server.start()
    pub = WeightPublisher("127.0.0.1", 0, timeout_s=300.0)
    svc = _Service(server.url, model, n=n, max_tokens=max_tokens, log_path=work / "generator.log")
    loop = asyncio.new_event_loop()
    engine = _bare_engine(model, max_tokens)
    try:
        svc.bus.set(streams.WEIGHTS_ADDR, f"127.0.0.1:{pub.port}")
        loop.run_until_complete(engine.start())
        tokenizer = AutoTokenizer.from_pretrained(model)
        svc.wait(lambda: "bench-0" in pub.members(), 900, "the generator to join")
        named = _state_dict(model)
        pub.publish(named, 0)
        svc.wait(lambda: svc.bus.get(streams.generator_version("bench-0")) == "0", 300, "version 0")
        port = json.loads(svc.bus.read_statuses()["generator:bench-0"])["metrics_port"]
        texts = _prompt_texts(prompts)
        warm = _prompt_texts(4, offset=10_000)
        loop.run_until_complete(_bare_round(engine, tokenizer, warm, n=n, max_tokens=max_tokens))
        svc.round(warm, "warm")
        bare, service = [], []
        for r in range(rounds):
            bare.append(
                loop.run_until_complete(
                    _bare_round(engine, tokenizer, texts, n=n, max_tokens=max_tokens)
                )
            )
            service.append(svc.round(texts, f"r{r}"))
        engine.shutdown()
        weights = _weights_part(svc, pub, named, port, repeats=update_repeats, texts=texts)
    finally:
        engine.shutdown()
        pending = asyncio.all_tasks(loop)  # the engine's output handler: end it before closing
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.close()
        svc.stop()
        pub.close()
        server.stop()
    best_bare = max(b["tokens_per_s"] for b in bare)
    best_svc = max(s["tokens_per_s"] for s in service)
    result = {
        "settings": {"prompts": prompts, "n": n, "max_tokens": max_tokens, "rounds": rounds,
                     "hidden_size": hidden_size, "num_layers": num_layers, "ignore_eos": True},
        "bare_tokens_per_s": best_bare,
        "service_tokens_per_s": best_svc,
        "service_vs_bare_ratio": best_svc / best_bare,
        "bare_rounds": bare,
        "service_rounds": service,
        "weights": weights,
        "load_average": os.getloadavg(),
        "cpus": len(os.sched_getaffinity(0)),
    }  # fmt: skip
    _print(result)
    if out_path:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(result, indent=2))
    return result


def _state_dict(model_dir: str) -> list:
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return [(k, v.contiguous()) for k, v in m.state_dict().items() if k != "lm_head.weight"]


def _print(r: dict) -> None:
    w = r["weights"]
    print(f"generator service {r['service_tokens_per_s']:.0f} tok/s vs bare vLLM {r['bare_tokens_per_s']:.0f} tok/s: "
          f"ratio {r['service_vs_bare_ratio']:.2f} (target >= 0.9)")  # fmt: skip
    print(f"weight update of {w['bytes'] / 1e6:.1f} MB: generator pause-receive-load-resume "
          f"{w['generator_update_gb_per_s']:.3f} GB/s idle, {w['in_flight_update_gb_per_s']:.3f} GB/s "
          f"in flight; publisher {w['publish_gb_per_s']:.3f} GB/s; bare gloo broadcast "
          f"{w['bare_gloo_gb_per_s']:.3f} GB/s")  # fmt: skip
    print(f"load average {r['load_average']} on {r['cpus']} CPUs")


if __name__ == "__main__":
    process_exit.skip_finalization("gloo process groups")  # see process_exit's docstring
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    run_generator_bench(out_path="bench/results/generator.json")
    process_exit.end(0)
