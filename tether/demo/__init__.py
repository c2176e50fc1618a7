"""`tether demo` and what it is built from: a synthetic arithmetic task (``tasks``), a tiny
Qwen2-architecture model (``tiny_model``), the supervised warm-up (``warmup``), the demo's config
(``demo.toml``) and the run itself (``run``). Test and benchmark fixtures live in ``fixtures/``,
outside the wheel."""
