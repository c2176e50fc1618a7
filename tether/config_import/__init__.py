"""`tether config import`: translate a peer framework's run configuration into Tether's.

``translate.import_peer_config`` reads the source (``shell`` for launch scripts, ``sources`` for
YAML), runs the peer's mapper (``verl``, ``openrlhf``, ``slime``, ``roll``, each built on the
shared ``mapping`` helpers) and returns an ``ImportResult`` (``result``) that ``render`` turns
into a Tether TOML and a mapping table. Nothing is guessed: a key we cannot translate goes to
``unmapped`` with the reason, a ``$VAR`` we cannot resolve goes to ``unknown_variables``, and a
peer configuration that Tether cannot reproduce (uneven batch division, a critic-based
estimator) goes to ``problems``, which the CLI turns into exit status 2.
"""
