"""`tether demo` and what it is built from: a synthetic arithmetic task (``tasks``), a tiny
Qwen2-architecture model (``tiny_model``), the supervised warm-up (``warmup``), the demo's config
(``demo.toml``) and the run itself (``run``); plus the copy solver the tests and benchmarks use
as a real solver LLM whose right answers are known (``solver_fixture``), and tiny random models
in the structure of real model families, with their own tokenizers and chat templates
(``model_families``, ``family_tokenizers``, ``family_templates``), for tests and benchmarks."""
