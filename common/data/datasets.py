"""Prompts from files: JSONL, Parquet and verl-style Parquet; a file or a directory of files.

``load_prompts`` validates every row before anything expensive starts. A bad row (missing
column, wrong type, empty prompt) or a prompt longer than ``max_prompt_tokens`` gets the
configured policy: ``error`` raises ``DatasetError`` naming the file, the row and the fix;
``drop`` skips it, counts it in ``PromptSet.dropped`` and logs once with up to 3 examples.
Rows are named ``row N (0-based; line N+1)`` in a JSONL file and ``row N (0-based)`` in Parquet.

Prompt tokens are counted with ``common.data.prompts.encode_prompt``, the one encoding the
generator also builds what vLLM receives with, so the length check and the generated prompt
cannot differ.

Order is deterministic: ``PromptSet.order(seed, epoch)`` is a permutation of the records, so a
sampler position ``(epoch, offset)`` names the next prompt exactly (resume stores just that).
``prompt_id`` is stable across runs and machines: a hash of the file's name and the row number.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from common.data.prompts import encode_prompt

logger = logging.getLogger(__name__)

Format = Literal["auto", "jsonl", "parquet", "verl"]
OverlongPolicy = Literal["error", "drop"]
VERL_ANSWER_KEY = "reward_model.ground_truth"
_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
EMPTY_TRAIN_PATH = (
    "data.train_path is empty: set it to your prompts, a JSONL/Parquet file or a directory of them "
    "(--set data.train_path=FILE); `tether demo` runs the built-in synthetic arithmetic task."
)
_FIX_HINT = 'fix the row, or set data.overlong_prompt_policy = "drop" to skip bad and overlong rows'


class DatasetError(ValueError):
    """A dataset file or row Tether cannot use; the message names the file, row and fix."""


@dataclass
class PromptRecord:
    prompt_id: str  # stable: hash of file name + row
    source: str  # file name relative to the dataset path
    row: int  # 0-based row in that file
    text: str | None  # the prompt when it is plain text
    messages: list[dict] | None  # the prompt when it is a chat list [{role, content}]
    ground_truth: str | None
    metadata: dict[str, Any] = field(default_factory=dict)
    prompt_token_ids: list[int] | None = None


@dataclass
class PromptSet(Sequence):
    """An indexable sequence of ``PromptRecord`` with a deterministic, resumable order."""

    records: list[PromptRecord]
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> rows skipped

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i):  # type: ignore[override]
        return self.records[i]

    def order(self, seed: int, epoch: int) -> list[int]:
        """The permutation of record indices used in ``epoch``; the same for the same inputs."""
        perm = list(range(len(self.records)))
        random.Random(f"tether-order-{seed}-{epoch}").shuffle(perm)
        return perm

    def iter_from(
        self, seed: int, epoch: int = 0, offset: int = 0
    ) -> Iterator[tuple[int, int, PromptRecord]]:
        """Yield ``(epoch, offset, record)`` forever, starting at a saved position."""
        if not 0 <= offset <= len(self.records):
            raise ValueError(f"offset={offset} outside 0..{len(self.records)}")
        while True:
            perm = self.order(seed, epoch)
            for pos in range(offset, len(perm)):
                yield epoch, pos, self.records[perm[pos]]
            epoch, offset = epoch + 1, 0


def _lookup(row: dict, dotted: str) -> Any:
    """``row["a"]["b"]`` for ``"a.b"``; a literal key with dots wins. KeyError if absent."""
    if dotted in row:
        return row[dotted]
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(dotted)
        value = value[part]
    return value


def _list_files(path: Path, split: str, setting: str) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DatasetError(f"dataset path {path} does not exist; check {setting}.")
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _SUFFIXES)
    if not files:
        raise DatasetError(f"no .jsonl/.json/.parquet files under {path}; check {setting}.")

    def in_split(p: Path) -> bool:
        rel = p.relative_to(path)
        return split in rel.parts[:-1] or rel.stem == split or rel.stem.startswith(split + "-")

    chosen = [p for p in files if in_split(p)]
    if chosen:
        return chosen
    if split == "train":  # a directory of unnamed shards is the training set
        return files
    raise DatasetError(
        f"no file for split {split!r} under {path} (expected e.g. {split}.parquet or "
        f"{split}/...); point {setting} at the right file."
    )


class _Unparsable:
    """A JSONL line that is not JSON: a bad row, handled by the policy like any other."""

    def __init__(self, error: str) -> None:
        self.error = error


def _read_rows(path: Path, fmt: str) -> list[tuple[int, Any]]:
    """``(row number, row)``; for JSONL the row number is the 0-based line (blank lines skipped)."""
    if fmt == "jsonl":
        rows: list[tuple[int, Any]] = []
        with path.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f):
                if not line.strip():
                    continue
                try:
                    rows.append((line_no, json.loads(line)))
                except json.JSONDecodeError as e:
                    rows.append((line_no, _Unparsable(str(e))))
        return rows
    import pyarrow.parquet as pq

    try:
        return list(enumerate(pq.read_table(path).to_pylist()))
    except Exception as e:  # noqa: BLE001 - any reader failure is a bad file
        raise DatasetError(f"{path}: cannot read as Parquet ({e}); check data.path.") from e


@dataclass(frozen=True, kw_only=True)
class _Spec:
    fmt: Format
    prompt_key: str
    answer_key: str | None
    metadata_keys: tuple[str, ...]
    tokenizer: Any
    apply_chat_template: bool
    max_prompt_tokens: int | None
    tools: list[dict[str, Any]] | None = None


def _file_format(path: Path, spec: _Spec) -> str:
    if spec.fmt != "auto":
        return "jsonl" if spec.fmt == "jsonl" else "parquet"
    return _SUFFIXES.get(path.suffix, "jsonl")


def _answer_key(spec: _Spec, row: dict) -> str | None:
    if spec.fmt == "verl" and spec.answer_key == "answer":
        return VERL_ANSWER_KEY  # verl keeps the answer nested; "answer" is only our default
    if spec.fmt == "auto" and spec.answer_key == "answer" and "answer" not in row:
        if "reward_model" in row:
            return VERL_ANSWER_KEY
    return spec.answer_key


def _parse_row(row: Any, spec: _Spec) -> tuple[str | None, list[dict] | None, str | None, dict]:
    """(text, messages, ground_truth, metadata); raises ValueError saying what is wrong."""
    if isinstance(row, _Unparsable):
        raise ValueError(f"not valid JSON ({row.error})")
    if not isinstance(row, dict):
        raise ValueError(f"row is a {type(row).__name__}, expected an object")
    try:
        prompt = _lookup(row, spec.prompt_key)
    except KeyError:
        raise ValueError(f"missing prompt column {spec.prompt_key!r}") from None
    text, messages = None, None
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("empty prompt")
        text = prompt
    elif isinstance(prompt, list):
        ok = all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in prompt
        )
        if not prompt or not ok:
            raise ValueError("chat prompt must be a non-empty list of {role, content} strings")
        if not any(m["content"].strip() for m in prompt):
            raise ValueError("empty prompt (every message is blank)")
        messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
    else:
        raise ValueError(
            f"prompt {spec.prompt_key!r} is a {type(prompt).__name__}, "
            "expected a string or a chat list"
        )
    truth = None
    answer_key = _answer_key(spec, row)
    if answer_key is not None:
        try:
            value = _lookup(row, answer_key)
        except KeyError:
            raise ValueError(f"missing answer column {answer_key!r}") from None
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ValueError(f"answer {answer_key!r} is a {type(value).__name__}, expected text")
        truth = str(value)
        if not truth.strip():  # the scorer would dead-letter its every group as unscorable
            raise ValueError(f"empty answer in column {answer_key!r}")
    metadata = {}
    for key in spec.metadata_keys:
        try:
            metadata[key] = _lookup(row, key)
        except KeyError:
            raise ValueError(f"missing metadata column {key!r}") from None
    return text, messages, truth, metadata


def _prompt_id(source: str, row: int) -> str:
    return hashlib.sha1(f"{source}#{row}".encode()).hexdigest()[:16]


def load_prompts(
    path: str | Path,
    *,
    format: Format = "auto",
    prompt_key: str = "prompt",
    answer_key: str | None = "answer",
    metadata_keys: Sequence[str] = (),
    tokenizer: Any = None,
    apply_chat_template: bool = True,
    max_prompt_tokens: int | None = None,
    overlong_policy: OverlongPolicy = "error",
    split: str = "train",
    setting: str = "the dataset path",
    tools: list[dict[str, Any]] | None = None,
) -> PromptSet:
    """Load and validate every prompt under ``path`` (file or directory). See module docstring.

    ``answer_key`` and ``metadata_keys`` may be dotted paths into nested columns
    (``reward_model.ground_truth``). With a ``tokenizer`` each record gets ``prompt_token_ids``
    (``encode_prompt``; with the episode's ``tools`` rendered in). ``setting`` names where
    ``path`` came from in messages (data.train_path).
    """
    if format not in ("auto", "jsonl", "parquet", "verl"):
        raise ValueError(f"format={format!r}: use auto, jsonl, parquet or verl.")
    if overlong_policy not in ("error", "drop"):
        raise ValueError(f"overlong_policy={overlong_policy!r}: use 'error' or 'drop'.")
    if max_prompt_tokens is not None and tokenizer is None:
        raise ValueError("max_prompt_tokens needs a tokenizer to count prompt tokens.")
    if (
        tokenizer is not None
        and apply_chat_template
        and not getattr(tokenizer, "chat_template", None)
    ):
        raise DatasetError(
            "data.apply_chat_template is true but the tokenizer has no chat template; set "
            "data.apply_chat_template = false to feed raw text, or use a tokenizer that has one."
        )
    spec = _Spec(
        fmt=format,
        prompt_key=prompt_key,
        answer_key=answer_key,
        metadata_keys=tuple(metadata_keys),
        tokenizer=tokenizer,
        apply_chat_template=apply_chat_template,
        max_prompt_tokens=max_prompt_tokens,
        tools=tools,
    )
    root = Path(path)
    records: list[PromptRecord] = []
    problems: dict[str, list[str]] = {}
    for file in _list_files(root, split, setting):
        source = file.name if root.is_file() else str(file.relative_to(root))
        fmt = _file_format(file, spec)
        for i, row in _read_rows(file, fmt):
            where = f"{file}: row {i} (0-based{f'; line {i + 1}' if fmt == 'jsonl' else ''})"
            try:
                records.append(_make_record(row, spec, source, i))
            except _Overlong as e:
                if overlong_policy == "error":
                    raise DatasetError(
                        f"{where}: prompt has {e.num_tokens} tokens, over run.max_prompt_tokens"
                        f" = {max_prompt_tokens}; raise run.max_prompt_tokens or set "
                        'data.overlong_prompt_policy = "drop" to skip such prompts.'
                    ) from None
                problems.setdefault("overlong", []).append(f"{where} ({e.num_tokens} tokens)")
            except ValueError as e:
                if overlong_policy == "error":
                    raise DatasetError(f"{where}: {e}; {_FIX_HINT}.") from None
                problems.setdefault("bad_row", []).append(f"{where}: {e}")
    for reason, examples in problems.items():
        logger.warning(
            "dropped %d %s prompt(s) from %s, e.g. %s",
            len(examples),
            reason,
            root,
            "; ".join(examples[:3]),
        )
    if not records:
        raise DatasetError(f"no usable prompts in {root} (dropped: {_counts(problems)}).")
    return PromptSet(records=records, dropped=_counts(problems))


def _counts(problems: dict[str, list[str]]) -> dict[str, int]:
    return {reason: len(v) for reason, v in problems.items()}


class _Overlong(Exception):
    def __init__(self, num_tokens: int) -> None:
        super().__init__(num_tokens)
        self.num_tokens = num_tokens


def _make_record(row: Any, spec: _Spec, source: str, index: int) -> PromptRecord:
    text, messages, truth, metadata = _parse_row(row, spec)
    token_ids = None
    if spec.tokenizer is not None:
        prompt: str | list[dict] = messages if messages is not None else text  # type: ignore[assignment]
        token_ids = encode_prompt(
            spec.tokenizer, prompt, apply_chat_template=spec.apply_chat_template, tools=spec.tools
        )
        if spec.max_prompt_tokens is not None and len(token_ids) > spec.max_prompt_tokens:
            raise _Overlong(len(token_ids))
    return PromptRecord(
        prompt_id=_prompt_id(source, index),
        source=source,
        row=index,
        text=text,
        messages=messages,
        ground_truth=truth,
        metadata=metadata,
        prompt_token_ids=token_ids,
    )
