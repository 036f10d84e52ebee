"""What a user of the exported drafter does, in a fresh process that cannot import this project.

    python zlab_user_process.py EXPORT_DIR TARGET_DIR INPUTS.pt OUTPUTS.pt

Loads the drafter the way z-lab's README does (`AutoModel.from_pretrained(dir, trust_remote_code=True)`,
offline, from the local directory) and the target with `AutoModelForCausalLM`, then stores:
- `logits`: the block's logits from one forward over the whole context (z-lab's forward interface);
- `drafted`: the block's drafts from the same forward, as spec_generate drafts them (`draft_tokens`:
  the argmax for DFlash, the selector's walk for DFlash2);
- `cached_logits`: the same block drafted in two steps through a cache, the way z-lab's generate
  loop drives the drafter (context K/V cached, the first block's K/V cropped off), with the cache
  z-lab's loop makes (`DynamicCache(config=draft.config)`, sliding-window layers and all);
- `generated`: `draft.spec_generate(...)` on the prompt;
- `class_name`, `module`: what `AutoModel` built.
"""

from __future__ import annotations

import sys

sys.modules["dflash_jobs"] = None  # the export must run without this project installed
sys.modules["dflashctl"] = None

import torch  # noqa: E402
from transformers import AutoModel, AutoModelForCausalLM  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402


def block_logits(draft, target, context, anchor_token, *, start, cache=None):
    """Drafts the block anchored at position context.shape[1]; feeds context[:, start:] (earlier positions are in `cache`).
    Returns its logits and drafts."""
    B, C = draft.block_size, context.shape[1]
    block = torch.full((1, B), draft.mask_token_id, dtype=torch.long)
    block[0, 0] = anchor_token
    hidden = draft(
        position_ids=torch.arange(start, C + B)[None],
        noise_embedding=target.get_input_embeddings()(block),
        target_hidden=context[:, start:],
        past_key_values=cache,
        use_cache=cache is not None,
    )
    if cache is not None:
        cache.crop(C - cache.get_seq_length())  # keep the context's K/V only
    head = target.get_output_embeddings()
    return draft.compute_logits(hidden[:, 1:], head)[0], draft.draft_tokens(hidden[0], block[0, 0], head)


def main(export_dir: str, target_dir: str, inputs_path: str, outputs_path: str) -> None:
    inputs = torch.load(inputs_path)
    draft = AutoModel.from_pretrained(export_dir, trust_remote_code=True, dtype=torch.float32, local_files_only=True).eval()
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    context, anchor, split = inputs["context"], inputs["anchor_token"], inputs["split"]
    with torch.no_grad():
        logits, drafted = block_logits(draft, target, context, anchor, start=0)
        cache = DynamicCache(config=draft.config)
        cache.activate_past_recording()
        block_logits(draft, target, context[:, :split], inputs["first_anchor_token"], start=0, cache=cache)
        cached_logits, _ = block_logits(draft, target, context, anchor, start=split, cache=cache)
    generated = draft.spec_generate(
        target=target, input_ids=inputs["prompt"][None], max_new_tokens=inputs["max_new_tokens"],
        stop_token_ids=inputs["stop_token_ids"], temperature=0.0,
    )
    torch.save({
        "logits": logits, "drafted": drafted, "cached_logits": cached_logits, "generated": generated,
        "class_name": type(draft).__name__, "module": type(draft).__module__,
    }, outputs_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
