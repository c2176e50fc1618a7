"""A real full disk for tests: a size-limited tmpfs mounted by the test (``mount -t tmpfs -o
size=…``). Mounting needs root, which CI has; elsewhere the test is skipped with that reason."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_tmpfs(path: Path, size_kb: int) -> Iterator[Path]:
    """``path`` as a tmpfs of ``size_kb`` KiB for the duration (unmounted after)."""
    if os.geteuid() != 0:
        pytest.skip("a size-limited tmpfs needs root to mount (CI runs as root)")
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(path)],
                   check=True)  # fmt: skip
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def resize(path: Path, size_kb: int) -> None:
    """Give the tmpfs at ``path`` ``size_kb`` KiB (what "freeing space" does for the test)."""
    subprocess.run(["mount", "-o", f"remount,size={size_kb}k", str(path)], check=True)


def used_kb(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize // 1024
