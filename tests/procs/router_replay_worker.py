"""torchrun entry for tests/services/test_router_replay_engine.py: routing replay on the learner's
own FSDP2 model, on real gloo ranks.

    torchrun --nproc_per_node N tests/procs/router_replay_worker.py --out DIR MODEL_DIR

Every rank loads the MoE policy sharded (``load_policy``, packing on), installs the replay and
scores the same two sequences: with no routing, replaying its own recorded routing (must be
equal), and replaying other experts (must differ, and a backward must reach the router's
shard). Rank R writes ``DIR/rank<R>.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common.service import process_exit
from services.learner import batching, packing
from services.learner.model import load_policy, setup_distributed, token_logprobs_and_entropy


def check(model_dir: str, device) -> dict:
    import torch

    from services.learner.router_replay import RouterReplay  # noqa: PLC0415 - loads torch

    model = load_policy(model_dir, device=device, pack_sequences=True)
    model.router_replay = replay = RouterReplay(model)
    samples = [{"prompt_ids": [5, 6, 7, 8], "response_ids": [9, 10, 11, 12, 13]},
               {"prompt_ids": [14, 15], "response_ids": [16, 17, 18]}]  # fmt: skip
    mb = packing.add_packed(batching.collate(samples, [0, 1], pad_id=0), pad_id=0)
    ids, mask = mb["input_ids"], mb["attention_mask"]
    resp = mb["loss_mask"].long()

    def score(routing=None):
        return token_logprobs_and_entropy(model, ids, mask, resp, position_ids=mb["position_ids"],
                                          packed=packing.packed_of(mb), routing=routing)[0]  # fmt: skip

    with torch.no_grad():
        plain = score()
        with replay.recording() as per_layer:  # the padded forward's own routing, per position
            model(input_ids=ids, attention_mask=mask, position_ids=mb["position_ids"],
                  use_cache=False)  # fmt: skip
        own = torch.stack(per_layer, dim=1).reshape(*ids.shape, replay.layers, replay.top_k)
        same = score(own)
        other = (own + 1) % replay.num_experts
        moved = score(other)
    model.train()
    score(other).sum().backward()
    router = next(m for m in model.modules() if type(m).__name__.endswith("TopKRouter"))
    grad = router.weight.grad
    grad = grad.to_local() if hasattr(grad, "to_local") else grad
    counts = replay.take_counts()
    return {
        "own_replay_max_diff": float((plain - same).abs().max()),
        "other_replay_max_diff": float((plain - moved).abs().max()),
        "router_grad_abs_sum": float(grad.abs().sum()),
        "replayed_tokens": counts.replayed_tokens,
        "fallback_tokens": counts.fallback_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("model")
    args = parser.parse_args()

    rank, _, device = setup_distributed()
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(check(args.model, device)))


if __name__ == "__main__":
    process_exit.skip_finalization("gloo process groups")  # see process_exit's docstring
    main()
    process_exit.end(0)
