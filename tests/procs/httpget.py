"""HTTP helper shared by the test process wrappers. Not named http.py: scripts run from this
folder would shadow the standard library's http package."""

from __future__ import annotations

import urllib.error
import urllib.request


def http_get(port: int, path: str) -> tuple[int, str]:
    """(status, body) of GET http://127.0.0.1:port/path; (0, "") when nothing listens yet."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return 0, ""  # not listening (yet)
