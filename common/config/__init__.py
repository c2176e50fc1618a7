"""Tether's one typed configuration: the schema (``schema.TetherConfig``; sections in ``shared``
for run, data, bus and weights, and one module per service: ``generator``, ``scorer``,
``learner``), the cross-field rules (``rules``), the sources and their precedence (``load``),
``tether config explain|show`` (``explain``, ``toml``) and the README's reference table
(``reference``). The importers of the peers' configs are the application's
(``tether.config_import``)."""
