"""The exported drafter as a Hugging Face model, the way z-lab's drafters load:

    draft = AutoModel.from_pretrained(drafter_dir, trust_remote_code=True)   # a DFlashDraftModel
    output_ids = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=256, stop_token_ids=[eos])

The export copies this file with model.py, masks.py and speculative.py (relative imports only) and
names it in config.json's auto_map, so the served drafter runs the code it was trained and
evaluated with. The class name, attributes (target_layer_ids, block_size, mask_token_id),
forward signature and compute_logits are those z-lab's generate loop calls:

    hidden = draft(position_ids=..., noise_embedding=..., target_hidden=..., past_key_values=cache, use_cache=True)

target_hidden [b, C, L*d]: the target's captured layers for the C new context positions, each the
output of decoder layer i (target_layer_ids, ascending) before the final norm. Transformers'
output_hidden_states[i + 1] is that for every layer but the last, whose entry is after the final
norm: spec_generate captures with forward hooks instead, as extraction does.
noise_embedding [b, Q, d]: the target's embedding of [anchor, mask x (Q - 1)].
position_ids [b, C + Q]: the context's positions, then the block's (rows equal).
past_key_values: a transformers Cache holding the K/V of earlier context, which must sit at the
positions right before the new ones; the new K/V are appended to it, and the caller crops the
block's K/V off afterwards. Returns the final-normed hidden states of the block [b, Q, d].
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, Qwen3Config
from transformers.cache_utils import Cache, DynamicCache

from .masks import AttentionFn, one_block_attention
from .model import DraftTrunk, DrafterConfig
from .speculative import DecodeTarget, speculative_decode


class DFlashDraftModel(DraftTrunk, PreTrainedModel):
    config_class = Qwen3Config
    base_model_prefix = "dflash"
    _no_split_modules = ["DecoderLayer"]
    config_type = DrafterConfig
    """How this class reads its config.json (a variant's entry point names its own)."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        self.drafter_config = self.config_type.from_zlab(config.to_dict())
        self.build_trunk(self.drafter_config)
        self.target_layer_ids = list(self.drafter_config.target_layer_ids)
        self.block_size = self.drafter_config.block_size
        self.mask_token_id = self.drafter_config.mask_token_id
        self.post_init()

    def forward(
        self,
        position_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        noise_embedding: torch.Tensor | None = None,
        target_hidden: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool = False,
        **kwargs,
    ) -> torch.Tensor:
        """The block's final-normed hidden states [b, Q, d] (see the module docstring)."""
        if attention_mask is not None:
            raise ValueError(f"{type(self).__name__} builds its masks from the layer types and is_causal (blockwise): pass attention_mask=None")
        if (position_ids != position_ids[:1]).any():
            raise ValueError("every row of position_ids must be the same: a batch drafts at one position")
        positions = position_ids[0]
        block_size = noise_embedding.shape[1]

        def attention(index: int, kind: str) -> AttentionFn:
            window = self.drafter_config.window(kind)

            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                if past_key_values is not None:
                    k, v = past_key_values.update(k, v, index)
                # The cache may keep only a window of the past: count what came back, right before the new keys.
                kept = k.shape[-2] - len(positions)
                first = positions[0]
                key_positions = torch.cat([torch.arange(first - kept, first, device=positions.device), positions])
                return one_block_attention(key_positions, block_size, window, self.drafter_config.is_causal)(q, k, v)

            return attend

        return self.run_trunk(target_hidden, noise_embedding, positions, attention)

    def compute_logits(self, hidden: torch.Tensor, output_head: torch.nn.Module) -> torch.Tensor:
        """Logits through the target's LM head (the drafter has none of its own)."""
        return output_head(hidden.to(output_head.weight.dtype))

    def draft_tokens(self, hidden: torch.Tensor, anchor_token: torch.Tensor, output_head: torch.nn.Module) -> torch.Tensor:
        """The greedy drafts of one block from its hidden states [Q, d]: the argmax of slots 1..Q-1."""
        return self.compute_logits(hidden[1:], output_head).argmax(-1)

    @torch.inference_mode()
    def spec_generate(
        self,
        target: torch.nn.Module,
        input_ids: torch.LongTensor,
        max_new_tokens: int,
        stop_token_ids: list[int] | None = None,
        temperature: float = 0.0,
    ) -> torch.LongTensor:
        """Greedy speculative decoding of one prompt (input_ids [1, n]) with `target`, a Transformers
        causal LM (hybrid Gated DeltaNet models included: rejected drafts are rolled back exactly).
        Returns [1, n + generated]: the prompt, then what plain greedy decoding would generate,
        stopped after the first stop token or at max_new_tokens."""
        if temperature != 0.0:
            raise ValueError(f"temperature {temperature}: spec_generate decodes greedily; pass temperature=0.0")
        if input_ids.shape[0] != 1:
            raise ValueError(f"input_ids {tuple(input_ids.shape)}: spec_generate decodes one prompt, [1, n]")
        self.eval()
        prompt = input_ids[0]
        verifier = DecodeTarget(target, self.target_layer_ids)
        try:
            decoded = speculative_decode(
                verifier, self.cached_drafter(target), prompt,
                max_new_tokens=max_new_tokens, stop_ids=frozenset(stop_token_ids or ()),
            )
        finally:
            verifier.close()
        return torch.cat([prompt, torch.tensor(decoded.tokens, dtype=prompt.dtype, device=prompt.device)])[None]

    def cached_drafter(self, target: torch.nn.Module) -> CachedDrafter:
        """This model as spec_generate's drafter."""
        return CachedDrafter(self, target)


class CachedDrafter:
    """A DFlashDraftModel as speculative_decode's drafter, driven the way z-lab's loop drives it: the
    context's K/V stay in a cache, each call feeds only the newly committed context and crops the
    block's K/V off again."""

    def __init__(self, model: DFlashDraftModel, target: torch.nn.Module) -> None:
        self.model = model
        self.block_size = model.block_size
        self.drafts = model.block_size - 1
        self.target_layers = list(model.target_layer_ids)
        self.embed = target.get_input_embeddings()
        self.head = target.get_output_embeddings()
        self.cache = DynamicCache()
        self.cached = 0  # context positions whose K/V are in the cache

    def propose(self, tokens: torch.Tensor, context: torch.Tensor | None) -> torch.Tensor:
        return self.model.draft_tokens(self.block_hidden(tokens, context), tokens[-1], self.head)

    def block_hidden(self, tokens: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """The hidden states [B, d] of the block anchored at tokens[-1], after the newly committed
        context (context[self.cached:]) went into the cache."""
        anchor = len(tokens) - 1  # context covers positions 0..anchor-1
        device = self.model.fc.weight.device
        block = torch.full((1, self.block_size), self.model.mask_token_id, dtype=torch.long, device=self.embed.weight.device)
        block[0, 0] = tokens[-1]
        hidden = self.model(
            position_ids=torch.arange(self.cached, anchor + self.block_size, device=device)[None],
            noise_embedding=self.embed(block).to(device),
            target_hidden=context[self.cached :][None].to(device),
            past_key_values=self.cache,
            use_cache=True,
        )
        self.cache.crop(anchor - self.cache.get_seq_length())  # keep the context's K/V, drop the block's
        self.cached = anchor
        return hidden[0]
