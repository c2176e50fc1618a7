"""The mapping core every peer's mapper is built on: ``Mapper`` reads peer keys (marking them
used) and records Tether values with where they came from; helpers translate the batch knobs
(with a problem when the peer's steps are unequal), the schedules, the KL term and the reasons a
key is left unmapped."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, get_args

from common.config.learner import LossAgg
from tether.config_import.result import ImportProblem, ImportResult, MappedKey
from tether.config_import.sources import Source, coerce


class Skip(Exception):
    """Raised by a value converter: the peer value has no Tether equivalent (message: why)."""


_NOT_SET = object()


class Mapper:
    """Reads peer keys (marking them used) and records Tether values with where they came from."""

    def __init__(self, peer: str, src: Source, result: ImportResult) -> None:
        self.peer, self.src, self.res = peer, src, result
        self.used: set[str] = set()
        self.dropped: set[str] = set()

    def name(self, key: str) -> str:
        if key in self.src.flat:
            return self.src.flat[key][0]
        if self.peer == "slime":
            return "--" + key.replace("_", "-")
        return "--" + key if self.peer == "openrlhf" else key

    def given(self, key: str) -> bool:
        """Set in the peer config to a value we can read (``null`` means the peer's default)."""
        if key not in self.src.flat:
            return False
        raw = self.src.flat[key][1]
        return not self._unresolved(raw) and coerce(raw) is not None

    def _unresolved(self, value: Any) -> bool:
        text = json.dumps(value, default=str) if not isinstance(value, str) else value
        return any(lit in text for lit in self.src.unresolved)

    def get(self, key: str, default: Any = None) -> Any:
        """The peer's value (typed), or ``default`` when absent or unresolvable."""
        if key not in self.src.flat:
            return default
        if key not in self.used:
            self.used.add(key)
            raw = self.src.flat[key][1]
            if self._unresolved(raw):
                names = [n for n in self.src.unknown if n in str(raw)] or self.src.unknown
                why = f"depends on unknown variable(s) {', '.join(names)}; give their values to map it"
                self.res.unmapped.append((self.name(key), raw, why))
        raw = self.src.flat[key][1]
        value = None if self._unresolved(raw) else coerce(raw)
        return default if value is None else value

    def put(self, tether_key: str, value: Any, keys: str | tuple[str, ...], note: str = "") -> None:
        keys = (keys,) if isinstance(keys, str) else keys
        shown = [self.get(k, _NOT_SET) for k in keys]
        shown = ["(not set)" if v is _NOT_SET else v for v in shown]
        section, key = tether_key.split(".")
        self.res.tether.setdefault(section, {})[key] = value
        peer_value = shown[0] if len(shown) == 1 else tuple(shown)
        peer_key = " + ".join(self.name(k) for k in keys)
        self.res.mapping.append(MappedKey(peer_key, peer_value, tether_key, value, note))

    def drop(self, key: str, why: str) -> None:
        """Lists a peer key as not mapped, with the reason (once; absent keys are ignored)."""
        if key not in self.src.flat or key in self.dropped:
            return
        self.get(key)
        self.dropped.add(key)
        if not self._unresolved(self.src.flat[key][1]):
            self.res.unmapped.append((self.name(key), self.src.flat[key][1], why))

    def problem(self, message: str) -> None:
        self.res.problems.append(ImportProblem(message))

    def simple(self, table: list[tuple[Any, ...]]) -> None:
        """Maps ``(peer key, tether key[, converter[, note]])`` rows whose peer key is set."""
        for peer_key, tether_key, *rest in table:
            convert: Callable[[Any], Any] | None = rest[0] if rest else None
            note = rest[1] if len(rest) > 1 else ""
            if not self.given(peer_key) or peer_key in self.dropped:
                self.get(peer_key)
                continue
            value = self.get(peer_key)
            try:
                value = convert(value) if convert else value
            except Skip as why:
                self.drop(peer_key, str(why))
                continue
            self.put(tether_key, value, peer_key, note)

    def finish(self, why: Callable[[str], str]) -> None:
        for key in self.src.flat:
            if key not in self.used and self.src.flat[key][1] is not None:
                self.drop(key, why(key))  # null keys only restate the peer's default

    def check_division(
        self,
        *,
        prompts: int,
        n: int,
        step: int,
        passes: int,
        cycle_text: str,
        step_text: str,
        behaviour: str,
        knob: Callable[[int], str],
    ) -> int | None:
        """Optimizer steps per cycle, or None (and a problem) when the peer's steps are unequal."""
        cycle = prompts * n
        if step > 0 and cycle % step == 0:
            return cycle // step * passes
        fixes = _fixes(prompts, n, step, passes, knob)
        listed = "; ".join(f"({chr(97 + i)}) {f}" for i, f in enumerate(fixes))
        self.problem(
            f"{self.peer}'s batch sizes do not divide evenly: {cycle_text} = {cycle} responses per cycle, "
            f"but one optimizer step takes {step_text} = {step} responses, and {cycle} is not a multiple "
            f"of {step}. {behaviour} Tether needs equal steps: prompts_per_cycle × responses_per_prompt "
            f"× passes_per_cycle = train_batch_size × train_steps_per_cycle. Valid settings: {listed}."
        )
        return None

    def put_per_cycle(self, key: str, tether_key: str, steps: int | None, unit: str) -> None:
        """Maps a peer "every N cycles" setting onto Tether's optimizer-step count."""
        if not self.given(key):
            return
        value = self.get(key)
        if not isinstance(value, int) or value <= 0:
            self.drop(key, "disabled in the peer config; Tether's default applies")
        elif steps is None:
            self.drop(
                key,
                f"counts {unit}; needs the optimizer steps per cycle, which could not be derived",
            )
        else:
            self.put(
                tether_key,
                value * steps,
                key,
                f"the peer counts {unit}; × {steps} optimizer steps per cycle",
            )

    def peer_estimator(self, key: str, table: dict[str, str], default: str) -> str | None:
        value = self.get(key, default)
        if value in table:
            return table[value]
        origin = (
            f"{self.name(key)}={value}"
            if self.given(key)
            else f"{self.name(key)} is not set and defaults to {value}"
        )
        if value in ("gae", "ppo"):
            self.problem(
                f"{origin}: PPO with a learned critic (GAE). Tether has no critic; choose a "
                f"critic-free estimator ({', '.join(sorted(set(table.values())))}) in the peer "
                "config or set learner.advantage_estimator."
            )
        else:
            self.problem(
                f"{origin}: Tether has no such advantage estimator; choose one of "
                f"{', '.join(sorted(set(table.values())))}."
            )
        return None

    def batch_knob(self, key: str, default: Any) -> Any:
        """A batch knob: its value, the peer's default when absent, None when unresolvable."""
        if key in self.src.flat and self._unresolved(self.src.flat[key][1]):
            self.get(key)
            return None
        return self.get(key, default)

    def default_note(self, key: str, default: Any, note: str = "") -> str:
        return note if self.given(key) else f"not set; {self.peer}'s default is {default}"

    def put_staleness(self, steps: int, keys: tuple[str, ...], why: str) -> None:
        self.put(
            "run.max_staleness",
            max(steps - 1, 0),
            keys,
            f"{why}: a cycle's last step trains on data {max(steps - 1, 0)} steps old; the smallest "
            "value Tether accepts. Raise it to let generation overlap training",
        )

    def put_kl(
        self,
        *,
        coef: str,
        kind: str | None,
        in_reward: bool,
        coef_default: float,
        kind_default: str,
        keys: tuple[str, ...],
        k3_clamp: float | None = None,
        reward_note: str = "",
    ) -> None:
        """Puts Tether's single KL term (coefficient, estimator, loss or reward). ``k3_clamp``: the
        bound the peer clamps its k3 estimate to (Tether's is unclamped unless kl_clamp is set)."""
        value = self.get(coef, coef_default)
        self.put("learner.kl_coef", value, (coef, *keys), self.default_note(coef, coef_default))
        self.put("learner.kl_in_reward", in_reward, keys, reward_note if in_reward else "")
        if kind:
            try:
                kl_type = to_kl_type(self.get(kind, kind_default))
                self.put("learner.kl_type", kl_type, kind, self.default_note(kind, kind_default))
            except Skip as why:
                self.drop(kind, str(why))
                return
            if kl_type == "k3" and k3_clamp is not None:
                self.put(
                    "learner.kl_clamp",
                    k3_clamp,
                    kind,
                    f"{self.peer} clamps its k3 (low_var_kl) estimate to [−{k3_clamp:g}, {k3_clamp:g}]",
                )

    def put_kl_loss(self, *, kind: str, kind_default: str) -> None:
        """slime's and ROLL's ``use_kl_loss``: the KL as a loss term weighted by
        ``kl_loss_coef`` (0 unless set), its estimator named by ``kind``."""
        self.put_kl(
            coef="kl_loss_coef",
            kind=kind,
            in_reward=False,
            coef_default=0.0,
            kind_default=kind_default,
            keys=("use_kl_loss",),
        )


_WHY = [
    (
        r"(^|\.)ref\.|^reference\.|^ref_",
        "reference-model placement; Tether's learner holds the frozen reference",
    ),
    (
        r"^actor_infer\.|(^|\.)rollout\.|^vllm_|^sglang_|^rollout_",
        "the peer's inference-engine settings; Tether's generator configures vLLM itself",
    ),
    (
        r"fsdp|megatron|strategy|zero_stage|offload|sequence_parallel|ulysses|_parallel_size$|"
        r"ring_attn|flash_attn|bf16|deepspeed|liger|remove_padding|fused",
        "the peer trainer's sharding/kernel settings; Tether's learner uses FSDP2 with its own",
    ),
    (
        r"(^|\.)ref\.|^reference\.|^ref_",
        "reference-model placement; Tether's learner holds the frozen reference",
    ),
    (r"critic|value_", "Tether has no critic (value model)"),
    (
        r"log_prob_|logprob",
        "log-prob recomputation batching; Tether's learner sizes it from its micro-batches",
    ),
    (
        r"logger|wandb|tensorboard|project_name|swanlab|tracker|log_",
        "experiment tracking; Tether exports Prometheus metrics",
    ),
    (
        r"reward_model|custom_reward|reward_fn|remote_rm|reward_pretrain|rm_",
        "reward set-up; choose Tether's [scorer] mode (rule or solver) instead",
    ),
    (
        r"ray|colocate|num_cpus|placement|vllm_sync|vllm_enable_sleep|hybrid_engine|sleep",
        "process placement of the peer; Tether runs generators, scorer and learner as separate services",
    ),
    (
        r"^defaults$|^hydra|config_(path|name)$",
        "Hydra composition: base configs are not read; import the composed YAML",
    ),
    (
        r"(^|_)save|ckpt|checkpoint|load_|resume|default_local_dir|output_dir",
        "checkpoint paths; set Tether's paths yourself",
    ),
]


def why_unmapped(key: str) -> str:
    for pattern, why in _WHY:
        if re.search(pattern, key):
            return why
    return "no Tether equivalent"


def _fixes(prompts: int, n: int, step: int, passes: int, knob: Callable[[int], str]) -> list[str]:
    """Valid Tether settings near the peer's: a step size dividing the cycle, or a matching cycle."""
    cycle = prompts * n
    sizes = [d for d in range(n, cycle + 1, n) if cycle % d == 0]  # whole prompt groups per step
    out = []
    for d in (
        min((d for d in sizes if d > step), default=None),
        max((d for d in sizes if d < step), default=None),
    ):
        if d:
            steps = cycle // d * passes
            out.append(
                f"train_batch_size = {d} with train_steps_per_cycle = {steps}, "
                f"prompts_per_cycle = {prompts} ({knob(d)})"
            )
    if step % n == 0:
        per_step = step // n
        low = prompts // per_step * per_step
        keep = [
            f"{k} ({k // per_step * passes} step{'s' if k // per_step * passes > 1 else ''})"
            for k in (low, low + per_step)
            if k
        ]
        out.append(
            f"keep train_batch_size = {step} and set prompts_per_cycle = " + " or ".join(keep)
        )
    return out


def to_lr_schedule(value: Any) -> str:
    if value in ("constant", "cosine"):
        return value
    if value in ("cosine_with_min_lr", "cosine_with_warmup"):
        return "cosine"
    if value in ("constant_with_warmup",):
        return "constant"
    raise Skip(f"Tether's lr_schedule is constant or cosine; {value!r} has no equivalent")


_KL = {
    "kl": "k1",
    "k1": "k1",
    "abs": "abs",
    "mse": "k2",
    "k2": "k2",
    "low_var_kl": "k3",
    "k3": "k3",
}


def to_kl_type(value: Any) -> str:
    if value not in _KL:
        raise Skip(f"Tether's kl_type is k1, k2, k3 or abs; {value!r} has no equivalent")
    return _KL[value]


def to_loss_agg(value: Any) -> str:
    if value in get_args(LossAgg):
        return value
    raise Skip(f"Tether's loss_agg is {', '.join(get_args(LossAgg))}; {value!r} has no equivalent")


def to_one_path(value: Any) -> str:
    if isinstance(value, list):
        if len(value) != 1:
            raise Skip("Tether reads one data file per split; merge the files first")
        value = value[0]
    return str(value)


R2_NOTE = (
    "R2 replays the routing the learner's own old policy computed; Tether replays the routing "
    'the generator sampled with (R3, learner.router_replay = "r3") or none'
)


def to_router_replay(value: Any) -> str:
    """verl's ``router_replay.mode`` (disabled, R2, R3) as ``learner.router_replay``."""
    mode = str(value).strip().upper()
    if mode in ("DISABLED", "NONE", "OFF", "FALSE", ""):
        return "off"
    if mode == "R3":
        return "r3"
    raise Skip(R2_NOTE if mode == "R2" else f"unknown router replay mode {value!r}")
