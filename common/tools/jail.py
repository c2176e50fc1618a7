"""Closing a sandbox worker's jail: what a tool call can see and touch (Linux).

Run by the worker (``common.tools.worker``) after it imported its tools and before it serves a
call, inside the namespaces ``common.tools.sandbox`` starts it in
(``unshare --net --pid --mount --ipc --uts --fork``, as root):

- **network**: a new network namespace with no interface up, not even loopback: every
  ``connect`` fails with "Network is unreachable", so no Redis, no metadata endpoint, no
  internet, no other service on this host;
- **files**: a private mount namespace whose root is a small tmpfs holding read-only binds of
  ``/usr`` (with the ``/lib``, ``/lib64``, ``/bin`` links) and the Python installation, the
  devices ``null``, ``zero``, ``urandom``, and ``/work``, the only writable directory (the tmpfs
  bounds its size; it is emptied after every call). ``/etc``, ``/home``, ``/root``, ``/proc``,
  the run directory and the repository are not there;
- **processes**: a PID namespace whose init is the worker (it kills and reaps every process a
  call leaves behind), and a user id of its own per pool slot (``uid``), without capabilities
  and with ``no_new_privs``, so ``RLIMIT_NPROC`` bounds a fork bomb to that slot;
- **environment**: emptied (only ``HOME``, ``PATH``, ``LC_ALL``), so no secret in the
  generator's environment reaches a tool.

What stays visible: ``/usr`` and the Python installation (read-only), the kernel (system calls
are not filtered: there is no seccomp filter), and CPU time and memory up to the per-call limits
(``common.tools.worker``).
"""

from __future__ import annotations

import ctypes
import os
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_NO_NEW_PRIVS = 38
PR_SET_DUMPABLE = 4
DEVICES = ("null", "zero", "urandom", "random")
WORK = "/work"


class JailError(RuntimeError):
    """The jail could not be closed (no privilege, no namespaces): the worker says so."""


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    libc = _libc()
    rc = libc.mount(
        source.encode() if source else None,
        target.encode(),
        fstype.encode() if fstype else None,
        ctypes.c_ulong(flags),
        data.encode() if data else None,
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise JailError(f"mount {source} on {target}: {os.strerror(err)}")


def _bind_readonly(source: str, target: str) -> None:
    os.makedirs(target, exist_ok=True)
    _mount(source, target, None, MS_BIND | MS_REC)
    _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _covered(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def readonly_roots(python: str) -> list[str]:
    """The host directories bound read-only: ``/usr``, the Python installation, and the
    interpreter's own directory when it lies elsewhere."""
    roots = ["/usr"]
    for extra in (sys.base_prefix, os.path.dirname(python)):
        real = os.path.realpath(extra)
        if not _covered(real, roots):
            roots.append(real)
    return roots


def close_jail(*, uid: int, work_mb: int, python: str) -> None:
    """Enter the jail described in the module docstring; the caller runs as root in fresh
    mount, PID and network namespaces. Afterwards the process is ``uid`` in ``/work``."""
    if os.geteuid() != 0:
        raise JailError("closing the jail needs root (euid 0) in the worker's namespaces")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    # /tmp of this private mount namespace becomes the jail: the host's /tmp is untouched
    base = "/tmp"
    _mount("tmpfs", base, "tmpfs", MS_NOSUID | MS_NODEV, f"size={work_mb}m,mode=755")
    root = os.path.join(base, "root")
    os.makedirs(root)
    for path in readonly_roots(python):
        _bind_readonly(path, root + path)
    for link in ("/lib", "/lib64", "/bin", "/sbin"):
        if os.path.islink(link):
            os.symlink(os.readlink(link), root + link)
        elif os.path.isdir(link) and not _covered(link, readonly_roots(python)):
            _bind_readonly(link, root + link)
    os.makedirs(root + "/dev")
    for dev in DEVICES:
        if os.path.exists(f"/dev/{dev}"):
            open(f"{root}/dev/{dev}", "w").close()
            _mount(f"/dev/{dev}", f"{root}/dev/{dev}", None, MS_BIND)
    os.makedirs(root + WORK, mode=0o700)
    os.chown(root + WORK, uid, uid)
    os.chroot(root)
    os.chdir(WORK)
    drop_privileges(uid)


def drop_privileges(uid: int) -> None:
    """Become ``uid``/``uid`` with no supplementary groups and ``no_new_privs`` (no setuid
    binary can give privileges back)."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if _libc().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise JailError(f"prctl(no_new_privs): {os.strerror(ctypes.get_errno())}")


def clean_environment(home: str) -> None:
    """Forget the environment the worker was started with (secrets included)."""
    os.environ.clear()
    os.environ.update({"HOME": home, "PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"})


def make_undumpable() -> None:
    """Make this process (the generator) non-dumpable: its ``/proc/<pid>/environ``, ``mem``,
    ``maps`` and ``fd`` become root's, so a process of the same uid (a tool in ``rlimits``
    mode) cannot read them, nor ptrace it. Side effects: no core dumps, and ``py-spy`` needs
    root to attach. Exec'd children (the tool workers) are dumpable again."""
    if _libc().prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise JailError(f"prctl(PR_SET_DUMPABLE, 0): {os.strerror(ctypes.get_errno())}")
