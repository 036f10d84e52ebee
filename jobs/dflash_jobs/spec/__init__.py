"""The run spec: one YAML file a user writes, parsed once at the edge into typed sections.

Every other part receives these objects, never raw dicts. A bad spec fails here, before anything
runs, with a `SpecError` naming the field, the bad value and what is allowed.

This package is part of the contract shared by the control plane and the data plane: it imports
neither torch nor transformers. Import from the package itself; its modules follow the spec's parts:
`sections` (target, data, storage, extract, generate, eval, local), `train` (with DFlash2's and
DSpark's sub-sections), `anchors` (each drafter's anchor layout, which gives train.block_size and
train.gamma their defaults, and which the training data, the evaluation and serving read alike),
`cluster` (placement and its Kubernetes checks), `run` (the whole run and its identity), `parse`
(YAML to types, naming the field at fault), `checks` (the value checks they share) and `depth` (the
target's depth and the layers it allows).
"""

from dflash_jobs.spec.anchors import ANCHOR_LAYOUTS, AnchorLayout, anchor_layout
from dflash_jobs.spec.checks import BINARY_QUANTITY, DNS1123_LABEL, is_s3, local_path, s3_bucket_problem, under
from dflash_jobs.spec.cluster import ClusterSpec, CpuPlacementSpec, OutputVolumeSpec, VolumeSpec
from dflash_jobs.spec.depth import default_layers, resolve_layers, rope_kind, text_config
from dflash_jobs.spec.parse import DEFAULT_SPEC_FILE, dump_spec, load_spec, parse_spec
from dflash_jobs.spec.run import OPTIONAL_SECTIONS, OUTSIDE_RUN_IDENTITY, RunSpec, run_identity
from dflash_jobs.spec.sections import (
    BASELINES, BIGRAM, CHUNK_CACHE_ENV, MAX_TREE_BUDGET, MODEL_CACHE_ENV, PROMPT_LOOKUP, VLLM_IMAGE, DataSpec, EvalSpec, ExtractSpec, GenerateSpec, LocalSpec, StorageSpec, TargetSpec,
)
from dflash_jobs.spec.train import DFlash2Spec, DSparkSpec, TrainSpec

__all__ = [
    "ANCHOR_LAYOUTS", "BASELINES", "BIGRAM", "BINARY_QUANTITY", "CHUNK_CACHE_ENV", "DEFAULT_SPEC_FILE", "DNS1123_LABEL", "MAX_TREE_BUDGET", "MODEL_CACHE_ENV", "OPTIONAL_SECTIONS",
    "OUTSIDE_RUN_IDENTITY", "PROMPT_LOOKUP", "VLLM_IMAGE",
    "AnchorLayout", "ClusterSpec", "CpuPlacementSpec", "DFlash2Spec", "DSparkSpec", "DataSpec", "EvalSpec", "ExtractSpec", "GenerateSpec",
    "LocalSpec", "OutputVolumeSpec", "RunSpec", "StorageSpec", "TargetSpec", "TrainSpec", "VolumeSpec",
    "anchor_layout", "default_layers", "dump_spec", "is_s3", "load_spec", "local_path", "parse_spec", "resolve_layers", "rope_kind",
    "run_identity", "s3_bucket_problem", "text_config", "under",
]
