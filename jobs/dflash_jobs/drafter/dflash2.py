"""The exported DFlash2 drafter as a Hugging Face model, loaded the way z-lab's drafters load:

    draft = AutoModel.from_pretrained(drafter_dir, trust_remote_code=True)   # a DFlash2DraftModel
    output_ids = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=256, stop_token_ids=[eos])

DFlashDraftModel (dflash.py) with DFlash2's layers and candidate selector (dflash2_model.py): the
same forward and cache convention, the same spec_generate loop (speculative.py); its drafts are the
selector's greedy walk over each slot's top-K candidates rather than the argmax. The export copies
this file with dflash2_model.py, dflash.py, model.py, masks.py and speculative.py (relative imports
only) and names it in config.json's auto_map. The codebooks are bare parameters under z-lab's names
(`candidate_selector.predecessor_codebook`, no `.weight`), so no key mapping is needed to load them.
"""

from __future__ import annotations

import torch

from .dflash import DFlashDraftModel
from .dflash2_model import DFlash2Config, DFlash2Trunk


class DFlash2DraftModel(DFlash2Trunk, DFlashDraftModel):
    _no_split_modules = ["DFlash2DecoderLayer"]
    config_type = DFlash2Config

    def draft_tokens(self, hidden: torch.Tensor, anchor_token: torch.Tensor, output_head: torch.nn.Module) -> torch.Tensor:
        """The selector's greedy walk over slots 1..Q-1 of one block's hidden states [Q, d], from the anchor."""
        return self.candidate_selector.walk(hidden[1:], self.compute_logits(hidden[1:], output_head), anchor_token)
