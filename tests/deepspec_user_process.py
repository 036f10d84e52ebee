"""What a user of the exported DSpark drafter does, in a fresh process that cannot import this project.

    python deepspec_user_process.py EXPORT_DIR TARGET_DIR INPUTS.pt OUTPUTS.pt

Loads the drafter with `AutoModel.from_pretrained(dir, trust_remote_code=True)` (offline, from the
local directory) and the target with `AutoModelForCausalLM`, then stores:
- `hidden`, `drafts`, `survival`: the block's hidden states from one forward over the whole
  context, its B drafts through the Markov head (left to right) and the confidence head's survival
  probabilities;
- `cached_drafts`: the same block drafted through the drafter spec_generate uses, the context fed in
  two steps through its cache (a first block anchored earlier, then this one);
- `generated`: `draft.spec_generate(...)` on the prompt;
- `class_name`, `module`, `drafts_per_block`: what `AutoModel` built.
"""

from __future__ import annotations

import sys

sys.modules["dflash_jobs"] = None  # the export must run without this project installed
sys.modules["dflashctl"] = None

import torch  # noqa: E402
from transformers import AutoModel, AutoModelForCausalLM  # noqa: E402


def main(export_dir: str, target_dir: str, inputs_path: str, outputs_path: str) -> None:
    inputs = torch.load(inputs_path)
    draft = AutoModel.from_pretrained(export_dir, trust_remote_code=True, dtype=torch.float32, local_files_only=True).eval()
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    context, anchor, split = inputs["context"], inputs["anchor_token"], inputs["split"]
    B, C = draft.block_size, context.shape[1]
    with torch.no_grad():
        block = torch.full((1, B), draft.mask_token_id, dtype=torch.long)
        block[0, 0] = anchor
        hidden = draft(
            position_ids=torch.arange(C + B)[None], noise_embedding=target.get_input_embeddings()(block), target_hidden=context,
        )[0]
        drafts, embedded = draft.markov_draft(draft.compute_logits(hidden, target.get_output_embeddings()), anchor)
        survival = draft.survival(hidden, embedded)
        cached = draft.cached_drafter(target)
        first_tokens = torch.cat([torch.zeros(split, dtype=torch.long), torch.tensor([inputs["first_anchor_token"]])])
        cached.propose(first_tokens, context[0, :split])
        tokens = torch.cat([torch.zeros(C, dtype=torch.long), torch.tensor([anchor])])
        cached_drafts = cached.propose(tokens, context[0])
    generated = draft.spec_generate(
        target=target, input_ids=inputs["prompt"][None], max_new_tokens=inputs["max_new_tokens"],
        stop_token_ids=inputs["stop_token_ids"], temperature=0.0,
    )
    torch.save({
        "hidden": hidden, "drafts": drafts, "survival": survival, "cached_drafts": cached_drafts, "generated": generated,
        "class_name": type(draft).__name__, "module": type(draft).__module__, "drafts_per_block": cached.drafts,
    }, outputs_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
