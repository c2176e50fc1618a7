"""LoRA settings of verl and OpenRLHF in Tether's ``learner.lora_*``.

The numbers mean the same in all three: a rank of 0 trains every weight, a LoRA layer's output is
scaled by ``alpha / rank``, and ``all-linear`` is peft's (every linear layer but the output
head); all three build the adapter with peft. What differs is how the adapter reaches vLLM, which
the notes say.
"""

from __future__ import annotations

from typing import Any

from tether.config_import.mapping import Mapper

VERL_MODEL = "actor_rollout_ref.model."
_LR_NOTE = (
    "LoRA RL wants a learning rate about 10× full fine-tuning's; this import keeps the peer's value"
)


def _targets(value: Any) -> list[str]:
    """A peer's target modules (a string, a comma list, or a list) as Tether's list."""
    if isinstance(value, str):
        value = [v for v in value.replace(",", " ").split() if v]
    return [str(v) for v in value] if isinstance(value, list | tuple) else [str(value)]


def _put_lora(m: Mapper, *, rank: str, alpha: str, targets: str, dropout: str | None,
              sync_note: str) -> None:  # fmt: skip
    """Map one peer's four keys; ``rank`` 0 (their default) means no LoRA and drops the rest."""
    given = [k for k in (rank, alpha, targets, dropout) if k and m.given(k)]
    if not given:
        return
    r = int(m.get(rank, 0) or 0)
    if r <= 0:
        for key in given:
            if key != rank:
                m.drop(key, f"{m.name(rank)} is 0: the peer trains every weight, no adapter")
        if m.given(rank):
            m.put("learner.lora_rank", 0, rank, "0 = full fine-tuning in both")
        return
    m.put("learner.lora_rank", r, rank, f"{sync_note}; {_LR_NOTE}")
    m.put("learner.lora_alpha", float(m.get(alpha, 16)), alpha,
          m.default_note(alpha, 16, "output scaled by alpha / rank in both"))  # fmt: skip
    mods = _targets(m.get(targets, "all-linear"))
    m.put("learner.lora_target_modules", mods, targets,
          m.default_note(targets, "all-linear", "peft's target_modules"))  # fmt: skip
    if dropout and m.given(dropout):
        m.put("learner.lora_dropout", float(m.get(dropout)), dropout)


def map_verl_lora(m: Mapper) -> None:
    """``actor_rollout_ref.model.lora_rank`` / ``lora_alpha`` / ``target_modules``."""
    _put_lora(
        m,
        rank=VERL_MODEL + "lora_rank",
        alpha=VERL_MODEL + "lora_alpha",
        targets=VERL_MODEL + "target_modules",
        dropout=None,
        sync_note="verl and Tether both send vLLM only the adapter (verl through vLLM's "
        "in-memory LoRA loader, as Tether does)",
    )
    excluded = VERL_MODEL + "exclude_modules"
    if m.given(excluded):
        m.drop(excluded, "Tether has no exclude list: name the modules to adapt in "
                         "learner.lora_target_modules instead")  # fmt: skip
    for key, why in (
        (VERL_MODEL + "use_shm", "a loading speed-up of verl's (model files in /dev/shm)"),
        ("actor_rollout_ref.rollout.layered_summon", "verl's per-layer FSDP gather of the "
         "adapter; Tether gathers only the adapter's tensors anyway"),
        ("actor_rollout_ref.rollout.load_format", "verl needs safetensors to load the base "
         "model in vLLM under LoRA; Tether's generators load the model directory as it is"),
        (VERL_MODEL + "lora_adapter_path", "a pretrained adapter to start from: Tether starts "
         "LoRA from a fresh adapter (merge yours into the model with `tether export`-style "
         "merging, or start without it)"),
    ):  # fmt: skip
        m.drop(key, why)


def map_openrlhf_lora(m: Mapper) -> None:
    """``--lora_rank``, ``--lora_alpha``, ``--target_modules``, ``--lora_dropout``."""
    _put_lora(
        m,
        rank="lora_rank",
        alpha="lora_alpha",
        targets="target_modules",
        dropout="lora_dropout",
        sync_note="OpenRLHF's LoRA does not reach its vLLM engines (OpenRLHF #1081: peft's "
        "names do not match vLLM's and the weight broadcast fails; PR #869, open, would merge "
        "the adapter first); Tether sends vLLM only the adapter",
    )
