"""`tether report`: ``data`` (what a run directory holds), ``plots`` and ``page`` (the HTML)."""
