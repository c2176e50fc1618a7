"""torchrun entry for tests/services/test_sharded_loading.py: sharded start-up against
``from_pretrained`` on every model directory given, on real gloo ranks.

    torchrun --nproc_per_node N tests/procs/sharded_load_worker.py --out DIR MODEL_DIR...

For each directory every rank loads the policy (``load_policy``, FSDP2) and the reference
(``load_reference``) through the sharded start-up, and the current path's model
(``from_pretrained``, whole, in fp32), and compares: each parameter's local shard with the same
rows of the whole model's tensor (exact), every buffer (exact), whether a tied ``lm_head`` is
still the embedding, the logits of one forward (a collective), and how many elements this rank
holds. Rank R writes ``DIR/rank<R>.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common.service import process_exit
from services.learner.model import attention_kwargs, load_policy, load_reference, setup_distributed


def _local_mismatches(model, whole) -> tuple[list[str], int]:
    """Names whose local shard (or buffer) differs from ``whole``'s rows; elements held here."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    expected = whole.state_dict()
    bad, held = [], 0
    for name, t in model.state_dict().items():
        ref = expected[name]
        if isinstance(t, DTensor):
            local = t.to_local()
            _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            ref = ref[offset[0] : offset[0] + local.shape[0]]
            t = local
        held += t.numel()
        if t.shape != ref.shape or t.dtype != ref.dtype or not torch.equal(t, ref):
            bad.append(name)
    for name, buf in whole.named_buffers():
        if not torch.equal(model.get_buffer(name), buf):
            bad.append(f"buffer {name}")
    return bad, held


def _fsdp_params(model) -> int:
    """Parameters FSDP manages: one per model parameter (a tied pair counted twice would keep
    two shards of one weight that drift apart after an optimizer step)."""
    from torch.distributed.fsdp import FSDPModule

    groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules()
              if isinstance(m, FSDPModule)]  # fmt: skip
    return sum(len(g.fsdp_params) for g in groups if g is not None)


def check(model_dir: Path, device) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    whole = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, **attention_kwargs(model_dir)
    )
    policy = load_policy(model_dir, device=device)
    reference = load_reference(model_dir, device=device)
    tied = bool(getattr(whole.config, "tie_word_embeddings", False))
    # one parameter for both (read before a forward: FSDP's root keeps gathered copies after one)
    still_tied = policy.lm_head.weight is policy.model.embed_tokens.weight if tied else None
    bad, held = _local_mismatches(policy, whole)
    ref_bad, _ = _local_mismatches(reference, whole)
    ids = torch.arange(3, 40).reshape(1, -1) % int(whole.config.vocab_size)
    with torch.no_grad():
        want = whole(input_ids=ids).logits
        got = policy(input_ids=ids).logits
    return {
        "mismatched": bad,
        "reference_mismatched": ref_bad,
        "reference_trainable": sum(p.requires_grad for p in reference.parameters()),
        "tied_still_tied": still_tied,
        "max_logit_diff": float((want - got).abs().max()),
        "held_elements": held,
        "fsdp_params": _fsdp_params(policy),
        "parameters": len(list(policy.parameters())),
        "total_elements": sum(t.numel() for t in whole.state_dict().values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("models", nargs="+")
    args = parser.parse_args()

    rank, _, device = setup_distributed()
    result = {str(m): check(Path(m), device) for m in args.models}
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    process_exit.skip_finalization("gloo process groups")  # see process_exit's docstring
    main()
    process_exit.end(0)
