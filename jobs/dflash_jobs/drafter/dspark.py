"""The exported DSpark drafter as a Hugging Face model, in DeepSpec's flat layout:

    draft = AutoModel.from_pretrained(drafter_dir, trust_remote_code=True)   # a Qwen3DSparkModel
    output_ids = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=256, stop_token_ids=[eos])

The export copies this file with dspark_model.py, dflash.py, model.py, masks.py and speculative.py
(relative imports only) and names it in config.json's auto_map. The forward and compute_logits are
DFlashDraftModel's (dflash.py: the same backbone, z-lab's call convention), returning the hidden
states of all B slots; the heads (dspark_model.py) then draft the block left to right:

    hidden = draft(position_ids=..., noise_embedding=..., target_hidden=..., past_key_values=cache, use_cache=True)
    drafts, embedded = draft.markov_draft(draft.compute_logits(hidden[0], target.get_output_embeddings()), anchor)
    survival = draft.survival(hidden[0], embedded)      # the confidence head's c_k, None without one

Slot k of the block [anchor, mask x (B-1)] drafts the token at anchor + k + 1: B drafts a block.
"""

from __future__ import annotations

import torch
from transformers import Qwen3Config

from .dflash import CachedDrafter, DFlashDraftModel
from .dspark_model import DSparkConfig, DSparkHeads


class Qwen3DSparkModel(DSparkHeads, DFlashDraftModel):
    config_class = Qwen3Config
    base_model_prefix = "dspark"

    def __init__(self, config: Qwen3Config) -> None:
        # PreTrainedModel's initialiser (skipping DFlashDraftModel's, which reads a z-lab config).
        super(DFlashDraftModel, self).__init__(config)
        self.drafter_config = DSparkConfig.from_deepspec(config.to_dict())
        self.build_trunk(self.drafter_config)
        self.build_heads(self.drafter_config)
        self.target_layer_ids = list(self.drafter_config.target_layer_ids)
        self.block_size = self.drafter_config.block_size
        self.mask_token_id = self.drafter_config.mask_token_id
        self.post_init()

    def cached_drafter(self, target: torch.nn.Module) -> CachedDrafter:
        return CachedDSparkDrafter(self, target)


class CachedDSparkDrafter(CachedDrafter):
    """A Qwen3DSparkModel as speculative_decode's drafter: the context's K/V cached as for DFlash,
    the block's B slots all drafted, left to right through the Markov head."""

    def __init__(self, model: Qwen3DSparkModel, target: torch.nn.Module) -> None:
        super().__init__(model, target)
        self.drafts = model.block_size

    def propose(self, tokens: torch.Tensor, context: torch.Tensor | None) -> torch.Tensor:
        hidden = self.block_hidden(tokens, context)  # [B, d]
        return self.model.markov_draft(self.model.compute_logits(hidden, self.head), tokens[-1])[0]
