"""``import_peer_config``: read a peer's launch script or YAML and map it onto Tether's keys."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from tether.config_import.loss_and_sampling import map_loss_and_sampling
from tether.config_import.mapping import Mapper, why_unmapped
from tether.config_import.openrlhf import map_openrlhf
from tether.config_import.result import PEERS, ImportProblem, ImportResult
from tether.config_import.roll import map_roll
from tether.config_import.shell import read_script
from tether.config_import.slime import map_slime
from tether.config_import.sources import read_yaml
from tether.config_import.verl import map_verl

_MAPPERS = {"verl": map_verl, "openrlhf": map_openrlhf, "slime": map_slime, "roll": map_roll}


def import_peer_config(
    peer: str, path: str | Path, *, variables: Mapping[str, str] | None = None
) -> ImportResult:
    """Reads a peer's launch script or YAML config at ``path`` and maps it onto Tether's keys.

    ``variables`` are the shell/``oc.env`` variables known to the caller (the script's own
    assignments override them, as bash would). Raises ValueError for an unknown peer or an
    unreadable file; everything about the config itself is reported in the result.
    """
    if peer not in _MAPPERS:
        raise ValueError(
            f"unknown peer {peer!r} for config import; choose one of {', '.join(PEERS)}."
        )
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(
            f"cannot read {path}: {exc.strerror}; check the path given to --from {peer}."
        ) from None
    variables = dict(variables or {})
    if path.suffix in (".yaml", ".yml"):
        src = read_yaml(text, variables, path)
    else:
        src = read_script(peer, text, variables)
    result = ImportResult(peer=peer, source=str(path), unknown_variables=list(src.unknown))
    result.problems.extend(ImportProblem(p) for p in src.problems)
    if not src.problems:
        mapper = Mapper(peer, src, result)
        _MAPPERS[peer](mapper)
        map_loss_and_sampling(peer, mapper)
        mapper.finish(why_unmapped)
    return result
