"""The DSpark drafter's exports (reference/dflash2-dspark.md 4.7), one training, two layouts:

    train/drafter/               DeepSpec's config keys and tensor names, architectures ["Qwen3DSparkModel"]:
                                 vLLM's `method: dspark` serves it (V2 model runner), and
                                 `AutoModel.from_pretrained(dir, trust_remote_code=True)` through
                                 dspark.py (auto_map) runs the code it was trained with
        config.json  model.safetensors  dspark.py dspark_model.py dflash.py model.py masks.py speculative.py
    train/drafter-speculators/   speculators' format (speculators_model_type dspark), which vLLM
                                 translates into the same model from the release that reads
                                 sample_from_anchor there (>= 0.28.0; earlier ones serve it in the
                                 fill-in layout: under 1% acceptance)
        config.json  model.safetensors

The weights are the same in both, under DeepSpec's names: fc, hidden_norm, layers.*, norm,
markov_head.markov_w1.weight and markov_w2.weight [V, r], confidence_head.proj.weight [1, d + r] and
.bias [1] (none without a confidence head, which vLLM's loader accepts). Not DeepSpec's whole
checkpoint: no embed_tokens or lm_head. vLLM shares the target's when the drafter's vocabulary is the
target's (load_dspark_model), as speculators' own full-vocabulary exports leave them out, and
spec_generate uses the target's too; DeepSpec's own Qwen3DSparkModel.from_pretrained would fill them
with random values (docs/drafters.md: what writing them would cost, 5.09 GB at the 27B shape).
Layer ids: z-lab's in the native config (target_layer_ids), one higher in speculators'
(aux_hidden_state_layer_ids). The speculators directory is written first: the native config.json,
written last, says that both are complete.
"""

from __future__ import annotations

from typing import Any

from dflash_jobs.drafter.dspark_model import DSparkConfig, DSparkDrafter
from dflash_jobs.drafter.export import DRAFTER_PREFIX, MODELING_FILES, write_export
from dflash_jobs.formats import SPECULATORS_DRAFTER_DIR
from dflash_jobs.speculators import aux_layer_ids
from dflash_jobs.storage import Storage

SPECULATORS_PREFIX = f"{SPECULATORS_DRAFTER_DIR}/"
DSPARK_MODELING_FILES = ("dspark.py", "dspark_model.py", *MODELING_FILES)
"""dspark.py (named in auto_map) and what it imports, relatively."""
SPECULATORS_FORMAT_VERSION = "0.9.0"
"""The speculators release whose DSpark config these keys follow (DSparkSpeculatorConfig)."""
NOT_LAYER_KEYS = ("architectures", "auto_map", "block_size", "dflash_config", "num_target_layers")
"""Keys of the z-lab config that are the drafter's, not its decoder layers' (speculators' transformer_layer_config)."""


def export_dspark(drafter: DSparkDrafter, storage: Storage, prefix: str = DRAFTER_PREFIX, speculators_prefix: str = SPECULATORS_PREFIX) -> None:
    """Both layouts of the drafter, the native one under `prefix` last."""
    weights = drafter.state_dict()
    write_export(storage, speculators_prefix, weights, (), speculators_config(drafter.config))
    write_export(storage, prefix, weights, DSPARK_MODELING_FILES, drafter.config.to_deepspec())


def speculators_config(config: DSparkConfig) -> dict[str, Any]:
    """The config.json of speculators' DSpark format (reference/dflash2-dspark.md 4.7b). Its verifier
    is left unnamed: the serve command names the target."""
    layers = {key: value for key, value in config.to_zlab().items() if key not in NOT_LAYER_KEYS}
    return {
        "architectures": ["DSparkSpeculator"],
        "speculators_model_type": "dspark",
        "speculators_version": SPECULATORS_FORMAT_VERSION,
        "speculators_config": {
            "algorithm": "dspark",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": config.block_size, "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": None, "architectures": []},
        },
        "transformer_layer_config": layers,
        "draft_vocab_size": config.vocab_size,
        "block_size": config.block_size,
        "aux_hidden_state_layer_ids": aux_layer_ids(list(config.target_layer_ids)),
        "mask_token_id": config.mask_token_id,
        "markov_rank": config.markov_rank,
        "markov_head_type": "vanilla",
        "enable_confidence_head": config.enable_confidence_head,
        "confidence_head_with_markov": True,
        "sample_from_anchor": True,
        # speculators' flag for its sliding layers; ours are causal inside the block, as vLLM serves them.
        "sliding_window_non_causal": False,
    }
