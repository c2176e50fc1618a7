"""The trajectory bus: durable, acknowledged Redis Streams carrying ``common.protocol.wire``
messages. ``settings`` (connection and delivery settings, from the config), ``client`` (``Bus``:
publish, commit, back-pressure, trimming, small keys), ``consumer`` (a consumer-group member:
own pending first, then claims, then new entries; dead letters), ``metrics``, ``inspect``
(``tether bus inspect``) and ``server`` (the embedded Redis-protocol server)."""
