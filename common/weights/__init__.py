"""Versioned, bounded, elastic weight sync: learner (rank 0) -> generators.

Modules: ``layout`` (an update's header: offsets, units, pieces, dtypes), ``buckets`` (packing
tensors into the units sent), ``checksum``, ``group`` (a pairwise process group, its broadcast and
the deadline every collective is held to), ``transfer`` (one update over one link, both sides),
``stream`` (an update produced unit by unit while it is sent: the learner never holds the whole
model), ``chain`` (routes, links, the member's relay, the learner's failure rule), ``publisher``
(learner side: the store and the publishes, with its parts ``acceptor`` (joins), ``roster`` (the
members), ``pairwise`` (a sender per member) and ``chain_sender`` (chain rounds and their
retry)), ``receiver`` (generator side) and ``store_calls`` (its calls to the learner's store,
each answered within a limit: across a partition a store client waits with none).

Membership
    The learner hosts a ``torch.distributed.TCPStore`` (``is_master``). A generator joins by
    bumping ``wsync/epoch/<member>`` (its join epoch: 1 on the first join, +1 on every rejoin)
    and appending ``<member>:<join epoch>:<version it holds>`` to a join list. The publisher's
    acceptor thread (or ``publish_to_new_members()``) picks joins up within
    ``accept_interval_s`` and both sides build a 2-process group (``ProcessGroupGloo``, or
    ``ProcessGroupNCCL`` with ``backend="nccl"``: same code) over
    ``PrefixStore("wsync/<member>/<epoch>/", store)`` with ``timeout_s``: the join path. Over it
    the acceptor sends a new member the latest version at once (unless it holds it already), so a
    restarted generator has the current weights before it generates anything. The publisher
    writes its backend to the store and a receiver (``backend="auto"``) follows it, so both sides
    always agree; with NCCL the buffers live on each side's current GPU, and every collective is
    waited on in slices against the deadline (``finish``): NCCL's ``wait()`` does not block, and
    a stuck transfer aborts only that link. The NCCL links have not been run here (one GPU at
    most; NCCL refuses two ranks on one device); gloo is the default.

One copy out of the learner: a chain (``fanout = "chain"``, the default)
    Measured first (``tether bench weights``): gloo's own broadcast over one group of the
    learner and N members is a binomial tree; its root sends ceil(log2(N + 1)) copies (1, 2 and
    3 copies for N = 1, 2, 4; ``wchar`` of the root's ``/proc/self/io`` and the loopback
    counter agree). So a publish goes down a chain instead: learner -> m1 -> ... -> mN, in
    pieces of ``chunk_bytes``; each member passes every piece to the next (``Forwarder``, its
    own thread) while it receives the next one, so the learner sends each byte once and every
    extra member adds one piece of delay. Every link is a pairwise group over
    ``wsync/chain/<chain epoch>/link/<position>/``, built once per chain epoch; the chain epoch
    moves when the members change or a round failed, and the learner mirrors it to Redis
    (``weights:epoch``). NCCL's own broadcast is a pipelined ring with the same one-copy
    property, but one collective over all members is what lets one dead member hang them all:
    the chain keeps each link separate on both backends, with the same code.

Failures in a chain (``ChainRound``)
    Each member reports ``progress`` and ``result`` in its store prefix; the learner watches
    them. The chain breaks at its first member without the version: that member is blamed when it
    reports an error, when it makes no progress for ``timeout_s / 4`` (dead, SIGSTOPped, hung),
    or when anything below it failed and it stayed quiet for a moment. It is dropped (it rejoins
    through the join path) and the members below it get the version at once down a new chain,
    within the same deadline; members waiting on a link that was called off notice within
    ``CANCEL_CHECK_S``. A relay that fails never fails its own member, so the one to blame is
    the member that did not get the version, not the one above it. Measured with three members
    (``tests/services/test_weight_chain.py``): the middle one SIGKILLed mid-publish costs about
    0.6 s, SIGSTOPped about 2 s with an 8 s deadline.

Slow links (``slow_link_fraction``, ``roster``)
    A publish lasts until every member has the version, and every member below a slow one in a
    chain gets it at that member's rate. Each whole chain round reports when each member had
    the version; one that had it over 1 / ``slow_link_fraction`` times later than the member
    above it is slow (updates of ``MEASURE_MIN_BYTES`` or more). The chain is ordered with the
    members whose link was shown fine first, so a first member is judged the round after (and
    again if it turns late). A slow member is left out of the rounds and sent the latest
    version in the background from a copy the learner holds (a streamed update is then kept in
    host memory); those sends measure its link, and it returns once it keeps up. Measured on
    emulated hosts: ``tether bench weights --hosts-mbit 200 --slow-link 10``.

One update on the wire (per link; every step is a broadcast from rank 0 = the sender)
    1. ``int64[3]`` = (magic, version, header length)
    2. ``uint8[header length]`` = JSON header: version, tensor names (sorted), dtypes, shapes,
       byte offsets in a flat staging buffer (64-byte aligned), the units and the total bytes.
    3. the units: a tensor of at least 1 MiB alone, sent from its own memory (no copy), or a run
       of consecutive smaller ones of at most ``bucket_bytes``, packed once per publish. Each
       unit goes in pieces of at most the header's ``chunk`` bytes, which a relay passes on as
       they come, followed by ``uint8[16]`` = the running checksum through that unit.
    Both sides keep ``transfer.WINDOW_OPS`` collectives in flight. The header also names the
    checksum (``checksum.py``) and the update's deadline (``deadline_s`` = ``timeout_s`` + its
    bytes at ``min_gb_per_s``), which the receiver holds itself to as well.
    Before step 1 the learner sets ``route`` (which link to listen on: pairwise or a place in a
    chain), ``pending`` = version and ``announce/<n>`` in the member's store prefix, so a
    generator can poll cheaply (``WeightReceiver.poll()``), or block on the next announcement,
    and only enter the collective when an update is really on its way.

Checksum
    ``checksum.py``: xxh3-128 over every tensor's name, dtype, shape and bytes on the host; on a
    GPU a weighted sum of the bytes computed on the device. A running checksum: the receiver
    verifies each unit before it hands the unit out.

Guarantees
    * ``publish`` returns within its deadline (``timeout_s`` + bytes / ``min_gb_per_s``, + thread
      hand-off slack) whatever the members do;
      each member gets "ok", "timeout", "stalled: ...", "broke the chain (...)" or "error: ...";
      failed members are dropped and may rejoin (new join epoch). A member that (re)joins is sent
      the latest version promptly by the acceptor unless it holds it.
    * Versions are strictly increasing ints (learner optimizer steps); each member receives them in
      order.
    * The receiver stages one unit at a time and verifies it before handing it out: a failed,
      partial or corrupted update raises ``WeightSyncError`` and the receiver's ``version`` stays
      the previous complete one; a caller that loaded units before the failure knows its copy
      mixes versions (the generator then stays paused until a whole version loads,
      ``services.generator.update_stream``). After a failure the receiver must ``join()`` again
      (its group is in an unknown state).
    * ``publish(named, version)`` keeps references to the tensors of the latest publish to serve
      late joiners: do not modify them in place afterwards (a mismatch would be caught by the
      checksum). A streamed publish (``begin``, the learner's: ``stream.py``) keeps nothing:
      its late joiners are sent the version by ``begin_catch_up`` when the learner next can.
"""
