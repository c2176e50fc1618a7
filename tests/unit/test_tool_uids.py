"""Every slot of every tool sandbox in one process runs under a uid of its own
(``common.tools.sandbox``): the demo agent's sandbox beside the generator's shared its uids,
and with them RLIMIT_NPROC and the right to signal the other's tools."""

from common.tools.registry import resolve_tools
from common.tools.sandbox import ToolSandbox


def test_two_sandboxes_in_one_process_share_no_uid():
    specs = resolve_tools(["calculator"])
    a, b = ToolSandbox(specs, workers=2), ToolSandbox(specs, workers=3)
    uids = [s.uid for s in (*a._slots, *b._slots)]
    assert len(set(uids)) == 5 and all(u >= 2_000_000 for u in uids)
