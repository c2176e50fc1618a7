"""`tether plan --memory` (``tether.runs.memory_plan``): the shapes' parameter counts, the terms,
and the defaults checked against the Kubernetes learner manifest they describe."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.paths import REPO
from tether.cli.main import build_parser, main
from tether.runs.memory_plan import MODELS, GiB, memory_plan, phase_peaks, rank_memory


@pytest.mark.parametrize(
    ("name", "billions"),
    [("qwen2.5-0.5b", 0.494), ("qwen2.5-7b", 7.62), ("qwen3-32b", 32.8), ("qwen3-30b-a3b", 30.5)],
)
def test_parameter_counts_are_the_published_ones(name: str, billions: float) -> None:
    assert MODELS[name].params / 1e9 == pytest.approx(billions, rel=0.01)


def test_offload_moves_the_model_states_to_host_memory() -> None:
    m = MODELS["qwen3-32b"]
    on_gpu = rank_memory(m, ranks=8, offload=False)
    offloaded = rank_memory(m, ranks=8, offload=True)
    states = 16 * m.params // 8  # fp32 weights + fp32 gradients + two AdamW moments
    # a save's state dict: the weights and the moments, on the GPU without offload
    assert on_gpu["gpu_phases"]["checkpoint"] == 12 * m.params // 8
    assert offloaded["gpu_phases"]["checkpoint"] == 0
    assert offloaded["gpu_phases"]["optimizer"] == 0  # the step runs in host memory
    assert offloaded["host_terms"]["offloaded_states"] == states
    # sharding: twice the ranks, half the states
    assert (
        rank_memory(m, ranks=16, offload=False)["gpu_phases"]["checkpoint"] == 12 * m.params // 16
    )


def test_the_optimizer_step_goes_tensor_by_tensor_when_its_temporary_is_large() -> None:
    """AdamW's multi-tensor step holds a temporary of 4P/R bytes: 15.3 GiB at 32B on 8 ranks,
    so there the step goes parameter by parameter (services.learner.optim)."""
    small, big = MODELS["qwen2.5-0.5b"], MODELS["qwen3-32b"]
    states = 16 * small.params // 8
    assert phase_peaks(small, ranks=8, offload=False)["optimizer"] == states + 4 * small.params // 8
    peak = phase_peaks(big, ranks=8, offload=False)["optimizer"]
    assert 16 * big.params // 8 < peak < 16 * big.params // 8 + 1 * GiB


def test_what_fits_on_8_gpus_of_80_gb() -> None:
    rows = {(r["model"], r["offload"]): r for r in memory_plan(
        ["qwen2.5-7b", "qwen3-32b", "qwen3-30b-a3b"], ranks=8, gpu_gib=79.0, ranks_per_node=1,
        host_limit_gib=128.0, reference=False, tokens_per_micro_batch=4096)}  # fmt: skip
    assert rows["qwen2.5-7b", False]["fits_gpu"]
    assert not rows["qwen3-32b", False]["fits_gpu"] and rows["qwen3-32b", True]["fits_gpu"]
    assert all(r["fits_host"] for r in rows.values())  # one rank per pod, 128 GiB


def test_defaults_are_the_learner_manifests() -> None:
    """--ranks-per-node 1 and --host-limit-gib 128 describe deploy/k8s/learner.yaml: one GPU
    per pod and its memory limit; if the manifest changes, the plan's defaults must too."""
    docs = list(yaml.safe_load_all((REPO / "deploy" / "k8s" / "learner.yaml").read_text()))
    job = next(d for d in docs if d and d.get("kind") == "Job")
    (learner,) = [
        c for c in job["spec"]["template"]["spec"]["containers"] if c["name"] == "learner"
    ]
    limits = learner["resources"]["limits"]
    args = build_parser().parse_args(["plan", "--memory"])
    assert int(limits["nvidia.com/gpu"]) == args.ranks_per_node
    assert limits["memory"] == f"{args.host_limit_gib:g}Gi"


def test_a_bad_layout_is_refused() -> None:
    with pytest.raises(ValueError, match="must divide"):
        memory_plan(["qwen2.5-7b"], ranks=8, gpu_gib=79, ranks_per_node=3, host_limit_gib=128,
                    reference=False, tokens_per_micro_batch=4096)  # fmt: skip
    with pytest.raises(ValueError, match="unknown model"):
        memory_plan(["llama-9b"], ranks=8, gpu_gib=79, ranks_per_node=1, host_limit_gib=128,
                    reference=False, tokens_per_micro_batch=4096)  # fmt: skip
    assert GiB == 1 << 30


@pytest.mark.parametrize(
    ("marker", "flags"),
    [("one-per-pod", []), ("eight-per-pod", ["--ranks-per-node", "8", "--reference"])],
)
def test_deploy_readme_tables_are_the_plans(marker: str, flags: list[str], capsys) -> None:
    """deploy/README.md's "What fits" tables are `tether plan --memory`'s output."""
    assert main(["plan", "--memory", *flags]) == 0
    table = capsys.readouterr().out.strip().split("\n", 1)[1]
    text = (REPO / "deploy" / "README.md").read_text()
    begin = text.index(f"<!-- memory-plan:{marker} -->") + len(f"<!-- memory-plan:{marker} -->")
    assert text[begin : text.index("<!-- memory-plan:end -->", begin)].strip() == table, (
        f"regenerate with: tether plan --memory {' '.join(flags)}"
    )


def test_the_plan_is_within_tolerance_of_the_committed_measurement() -> None:
    """Each phase's planned GPU bytes against bench/results/memory_scale.json: the learner's own
    step at 32B and 30B-A3B on 8 (fake) ranks, measured under fake tensors (`tether bench memory
    --size scale`). Changing the plan, or the code the measurement ran, means rerunning it."""
    from bench.memory_scale import within  # noqa: PLC0415 - loads torch

    result = json.loads((REPO / "bench" / "results" / "memory_scale.json").read_text())
    assert {m["model"] for m in result["runs"]} == {"qwen3-32b", "qwen3-30b-a3b"}
    for m in result["runs"]:
        plan = phase_peaks(MODELS[m["model"]], ranks=m["world_size"], offload=m["offload"],
                           tokens_per_micro_batch=m["tokens_per_micro_batch"])  # fmt: skip
        for phase, measured in m["device_bytes"].items():
            assert within(plan[phase], measured), (
                f"{m['model']} offload={m['offload']} {phase}: plan {plan[phase] / GiB:.2f} GiB, "
                f"measured {measured / GiB:.2f} GiB"
            )
