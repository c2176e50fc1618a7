"""Versioned, bounded, elastic weight sync: learner (rank 0) -> generators.

Modules: ``layout`` (an update's header: offsets, units, dtypes), ``buckets`` (packing tensors
into the units sent), ``checksum``, ``group`` (the pairwise process group, its collectives and
deadline), ``transfer`` (one update on the wire, both sides), ``publisher`` (learner side:
membership, concurrent sends) and ``receiver`` (generator side).

Membership
    The learner hosts a ``torch.distributed.TCPStore`` (``is_master``). A generator joins by
    bumping ``wsync/epoch/<member>`` (its epoch: 1 on the first join, +1 on every rejoin) and
    appending ``<member>:<epoch>`` to a join list. The publisher's acceptor thread (or
    ``publish_to_new_members()``) picks joins up within ``accept_interval_s`` and both sides build
    a 2-process group (``ProcessGroupGloo``, or ``ProcessGroupNCCL`` with ``backend="nccl"``:
    same code) over ``PrefixStore("wsync/<member>/<epoch>/", store)`` with ``timeout_s``. The
    publisher writes its backend to the store and a receiver (``backend="auto"``) follows it, so
    both sides always agree; with NCCL the buffers live on each side's current GPU, and every
    collective is polled against the deadline (``finish``): NCCL's ``wait()`` does not block,
    and a stuck transfer aborts only that member's group. The NCCL pair has not been run here
    (one GPU at most; NCCL refuses two ranks on one device); gloo is the default.

Why one group per member and not one per membership epoch
    A shared group makes every member wait for the slowest one and a peer that dies mid-broadcast
    poisons the collective for all. Pairwise groups isolate failures: a dead or hung generator only
    breaks its own group; it is dropped and the others finish. The cost is that the learner sends
    the bytes once per member (N x the traffic of a tree broadcast), which is fine for a handful of
    generators on one node; very large fleets would want a relay tree (not built).

One update on the wire (per member; every step is a broadcast from rank 0 = learner)
    1. ``int64[3]`` = (magic, version, header length)
    2. ``uint8[header length]`` = JSON header: version, tensor names (sorted), dtypes, shapes,
       byte offsets in a flat staging buffer (64-byte aligned), the units and the total bytes.
    3. the units: runs of consecutive tensors of at most ``bucket_bytes``; a tensor at least as big
       as a bucket goes alone and is sent from its own memory (no copy); small tensors are packed
       once per publish into shared buffers.
    4. ``uint8[16]`` = checksum (sent last so sending overlaps the sender's hashing).
    Before step 1 the learner sets ``pending`` = version in the member's store prefix, so a
    generator can poll cheaply (``WeightReceiver.poll()``) and only enter the collective when an
    update is really on its way.

Checksum
    xxh3-128 over, for every tensor in name order, ``"<name>|<dtype>|<shape>\\n"`` followed by its
    raw bytes (``tensors_checksum``). Exact (any flipped byte, missing tensor or reordering
    changes it) and fast (~5 GB/s), but not a defence against a malicious sender.

Guarantees
    * ``publish`` returns within ``timeout_s`` (+ thread hand-off slack) whatever the members do;
      each member gets "ok", "timeout" or "error: ..."; failed members are dropped and may rejoin
      (new epoch). A member that (re)joins is sent the latest version promptly by the acceptor.
    * Versions are strictly increasing ints (learner optimizer steps); each member receives them in
      order.
    * The receiver gets everything into a staging buffer and verifies the checksum before handing
      tensors out: a failed, partial or corrupted update raises ``WeightSyncError`` and leaves
      the caller on its previous complete version. After a failure the receiver must ``join()``
      again (its group is in an unknown state).
    * The publisher keeps references to the tensors of the latest publish to serve late joiners:
      do not modify them in place afterwards (a mismatch would be caught by the checksum).
"""
