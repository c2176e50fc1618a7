"""Where the tests find the clone and their fixtures, wherever a test module sits."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
PROCS = REPO / "tests" / "procs"
