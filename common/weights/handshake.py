"""Who may join the learner's weight group: the run's shared secret.

The learner's weight store is a ``torch.distributed.TCPStore``, which has no authentication: a
process that reaches its port could append a join and be sent every version of the policy. With
a secret (``TETHER_WEIGHTS_SECRET``, the same value in the learner and every generator: a
Kubernetes Secret, compose's ``.env``; ``tether train`` makes one per run) a join carries a
proof, HMAC-SHA256 over the publisher's instance id (random per learner process: the challenge),
the member id, its join epoch and the version it holds. The learner builds a process group only
for a join whose proof checks, and refuses every other one in the member's store prefix
(``refused``), where the joining side reads it and fails at once with the reason. A join is
accepted once: the same entry appended again (a replay) is refused.

What it does not do: the store's keys stay readable and writable by whoever reaches the port
(TCPStore has no access control), so the network policy that admits only the run's pods to it
stays the barrier against an active attacker in the cluster; the secret keeps everything else
out of the weight group itself — a pod without it, a stale generator of another deployment
pointed at the wrong learner. Without a secret the learner accepts any join, as before, and says
so at start.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass

SECRET_ENV = "TETHER_WEIGHTS_SECRET"
REFUSED_KEY = "refused"  # in the member's prefix: why the learner refused this join


def secret_from_env() -> bytes | None:
    """The shared secret from ``TETHER_WEIGHTS_SECRET``, or None when unset or empty."""
    value = os.environ.get(SECRET_ENV, "")
    return value.encode() if value else None


def proof(secret: bytes, *, instance: str, member: str, epoch: int, has: int) -> str:
    """The join's proof of the secret, bound to this learner process and this join."""
    msg = f"tether-weights-join\0{instance}\0{member}\0{epoch}\0{has}".encode()
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Join:
    """One entry of the store's ``wsync/joins`` list."""

    member: str
    epoch: int
    has: int  # the version it holds from this publisher, -1 for none
    proof: str = ""

    def entry(self) -> str:
        return f"{self.member}:{self.epoch}:{self.has}:{self.proof};"

    @classmethod
    def parse(cls, entry: str) -> Join:
        """``member:epoch:has[:proof]`` (a receiver without a secret leaves the proof empty)."""
        member, epoch, has, *rest = entry.split(":")
        return cls(member, int(epoch), int(has), rest[0] if rest else "")


def signed(secret: bytes | None, *, instance: str, member: str, epoch: int, has: int) -> Join:
    """The join a receiver appends: with a proof when it has a secret."""
    p = proof(secret, instance=instance, member=member, epoch=epoch, has=has) if secret else ""
    return Join(member, epoch, has, p)


def refusal(secret: bytes | None, join: Join, *, instance: str) -> str:
    """Why the learner refuses ``join`` ('' = accept it)."""
    if secret is None:
        return ""
    if not join.proof:
        return (
            f"{join.member} joined without the weights secret; set {SECRET_ENV} to the learner's "
            "value in every generator"
        )
    want = proof(secret, instance=instance, member=join.member, epoch=join.epoch, has=join.has)
    if not hmac.compare_digest(want, join.proof):
        return (
            f"{join.member}'s weights secret does not match the learner's; set the same "
            f"{SECRET_ENV} in the learner and every generator"
        )
    return ""
