"""Every Redis name Tether uses: streams, consumer groups and keys, all under the run's
namespace ``<run>:`` (``Bus.key`` adds it)::

    prompts  --(group "generators")-->  generator  --> groups
    groups   --(group "scorers")----->  scorer     --> scored
    scored   --(group "learner")----->  learner    (dispatches prompts, publishes weights)
    dead     dead letters from every consumer group, with the reason

Keys: ``version:learner`` (policy version = optimizer steps done), ``version:generator:<id>``,
``weights:addr`` (host:port of the learner's weight store), ``weights:publishing`` (the version
the learner is sending: generators watch it instead of the store), ``weights:epoch`` (the
weight chain's membership epoch after the last publish: it moves whenever a generator joined, left
or was dropped; the learner's weight store holds the chain itself, which the process groups need
for their rendezvous), ``status`` (a hash with one
field ``<service>:<id>`` per replica: phase seconds, counters, heartbeat; read by ``tether
status``), ``done:<group>`` (a consumer group's dedupe ids, scored by commit time),
``inhand:<stream>:<group>`` / ``strikes:<stream>:<group>`` (which consumer holds an entry it is
working on, and how often a consumer failed while holding it: ``common.bus.strikes``) and
``run:finished`` (written by the learner when the run is over: every service then stops,
``common.service.run_end``).
"""

from __future__ import annotations

PROMPTS, GROUPS, SCORED, DEAD = "prompts", "groups", "scored", "dead"
GENERATORS, SCORERS, LEARNER = "generators", "scorers", "learner"
PAYLOAD_FIELD = b"m"  # the one field of a stream entry: the encoded message
PIPELINE = ((PROMPTS, GENERATORS), (GROUPS, SCORERS), (SCORED, LEARNER))  # stream, its group
LEARNER_CONSUMER = "learner-0"  # rank 0's name in the learner's group (one learner per run)

LEARNER_VERSION = "version:learner"
# the highest training cycle any learner process of the run dispatched (``learner/dispatch.py``):
# a run ended early after a restart trains up to it, not only to what the new process dispatched
DISPATCHED_THROUGH = "learner:dispatched_through"
WEIGHTS_ADDR = "weights:addr"
WEIGHTS_PUBLISHING = "weights:publishing"
WEIGHTS_EPOCH = "weights:epoch"
STATUS = "status"
# Hash: generator id -> groups it has published over the run (all its processes): the status
# accounting's "generated", which must not restart at 0 when a generator restarts. Held-out
# groups are counted apart, under "<id>:eval" (``generated_field``): a round whose learner died
# is never recorded in metrics.jsonl, and its groups must not read as training data.
GENERATED_GROUPS = "generated:groups"
EVAL_SUFFIX = ":eval"


def generated_field(sid: str, split: str) -> str:
    """The ``generated:groups`` field that counts generator ``sid``'s groups of ``split``."""
    return sid + EVAL_SUFFIX if split == "eval" else sid


# JSON {num_cycles, version, at[, ended_early_at_cycle]}: the learner finished the run
# (``common.service.run_end``).
RUN_FINISHED = "run:finished"
# JSON {at}: an operator asked the run to end early (`tether finish`): the learner dispatches no
# new cycle, trains those it dispatched, then finishes (``common.service.run_end``).
RUN_FINISH_REQUEST = "run:finish_request"


def generator_version(sid: str) -> str:
    """The key holding the policy version generator ``sid`` runs."""
    return f"version:generator:{sid}"


def done_set(group: str) -> str:
    """The sorted set of dedupe ids ``group`` has committed (score: commit time)."""
    return f"done:{group}"


def in_hand(stream: str, group: str) -> str:
    """The hash of entries of ``stream`` a consumer of ``group`` is working on (id -> consumer)."""
    return f"inhand:{stream}:{group}"


def strikes(stream: str, group: str) -> str:
    """The hash of strikes (id -> times a consumer failed while holding the entry)."""
    return f"strikes:{stream}:{group}"
