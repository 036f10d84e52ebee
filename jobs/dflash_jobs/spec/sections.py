"""The typed sections of a run besides train and cluster: target, data, storage, extract, generate,
eval and local, each validating its own fields."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from dflash_jobs.errors import SpecError
from dflash_jobs.spec.checks import _check_location, _positive

MODEL_CACHE_ENV = "DFLASH_MODEL_CACHE"
"""Where a pod keeps its copy of an s3:// target.model (the renderer points it at cluster.model_cache)."""
CHUNK_CACHE_ENV = "DFLASH_CACHE_DIR"
"""Where a training pod keeps its resident hidden-state chunks (the renderer points it at the cache volume)."""
MAX_TREE_BUDGET = 1024
"""The largest draft tree the evaluation verifies: its verify forward holds budget + 1 tokens with a
dense ancestor mask; the DDTree authors sweep budgets up to 1,024, and at that size one verify costs
what a prefill chunk of as many tokens costs, far past the budgets where their speed-ups peak."""
PROMPT_LOOKUP = "prompt_lookup"
BIGRAM = "bigram"
BASELINES = (PROMPT_LOOKUP, BIGRAM)
"""The drafters without training an evaluation can decode beside the trained one (evaluate/baselines.py),
under these names in its report."""


@dataclass(kw_only=True, slots=True)
class TargetSpec:
    model: str
    """HF checkpoint directory (a PVC mount in pods) or an s3:// prefix holding one."""
    layers: list[int] | None = None
    """Decoder layers to capture, 0-based and ascending: layer i is the output of decoder layer i before the final norm
    (z-lab's target_layer_ids; HF output_hidden_states[i + 1], except for the last layer, whose HF entry is after the
    final norm). Default: 5 evenly spaced over 1..n-3."""
    attn_implementation: str = "sdpa"
    """Attention kernel for the target's full-attention layers: sdpa, eager or flash_attention_2."""

    def __post_init__(self) -> None:
        _check_location("target.model", self.model, what="the target checkpoint")
        if self.layers is not None:
            if not self.layers:
                raise SpecError("target.layers", self.layers, "a non-empty list of 0-based layer indices, or null for the default")
            if any(layer < 0 for layer in self.layers):
                raise SpecError("target.layers", self.layers, "layer indices >= 0")
            if len(set(self.layers)) != len(self.layers):
                raise SpecError("target.layers", self.layers, "distinct layer indices")
            if self.layers != sorted(self.layers):
                # vLLM concatenates the captured layers in ascending order: a drafter trained on
                # another order would read them shuffled when served, silently.
                raise SpecError(
                    "target.layers", self.layers,
                    f"layer indices in ascending order, {sorted(self.layers)}: vLLM feeds the drafter the layers in ascending order",
                )
        allowed = ("sdpa", "eager", "flash_attention_2")
        if self.attn_implementation not in allowed:
            raise SpecError("target.attn_implementation", self.attn_implementation, " | ".join(allowed))


@dataclass(kw_only=True, slots=True)
class DataSpec:
    source: str
    """Chat JSONL ({"messages": [...]}) or pre-tokenized JSONL ({"input_ids", "loss_mask"}): s3:// or a path."""
    max_length: int = 4096
    """Samples longer than this are truncated (and counted in tokens/dataset.json)."""
    chunk_tokens: int = 65536
    """Target size of one work unit (a token chunk and its hidden-state chunk)."""
    holdout: int = 64
    """Samples held back from training, used as evaluation prompts."""

    def __post_init__(self) -> None:
        _check_location("data.source", self.source, what="the JSONL data set")
        _positive("data.max_length", self.max_length, minimum=2)
        _positive("data.chunk_tokens", self.chunk_tokens, minimum=1)
        if self.chunk_tokens < self.max_length:
            raise SpecError("data.chunk_tokens", self.chunk_tokens, f">= data.max_length ({self.max_length}) so that every sample fits a chunk")
        _positive("data.holdout", self.holdout, minimum=0)


@dataclass(kw_only=True, slots=True)
class StorageSpec:
    endpoint_url: str | None = None
    """S3 endpoint for MinIO and other S3-compatible stores; AWS_ENDPOINT_URL overrides it."""
    region: str | None = None
    """S3 region; AWS_REGION / AWS_DEFAULT_REGION override it."""


@dataclass(kw_only=True, slots=True)
class ExtractSpec:
    shards: int = 8
    """Number of extraction pods (one GPU each). Chunks are balanced across shards by tokens."""
    token_budget: int = 32768
    """Padded tokens per forward batch."""
    dtype: Literal["bfloat16", "float8_e4m3fn"] = "bfloat16"
    """Storage dtype of hidden states; float8_e4m3fn stores a float32 scale per token and layer."""
    compute_dtype: Literal["bfloat16", "float8"] = "bfloat16"
    """The target's linear layers: bfloat16, or float8 (row-wise scaled FP8 matmuls, for targets served
    in FP8; needs FP8 tensor cores: Ada, Hopper, Blackwell). On an H200 at the 27B shape, in one run,
    the forward runs 1.28x the bf16 one eager, and 1.64x it compiled (16,801 tokens/s:
    bench/results/extract-fp8-compile-h200.json)."""
    compile: bool | None = None
    """torch.compile the target's norms and MLPs (capture/fusion.py): fused elementwise work, the
    same states up to rounding. Unset: on a GPU (an H200 at the 27B shape runs 1.17x faster in bf16,
    1.28x with FP8 compute: bench/results/extract-compile-h200.json, extract-fp8-compile-h200.json),
    off on a CPU (where compiling takes longer than a small run's whole extraction). Its graphs land
    in the kernel cache with Triton's, so a node's later pods load them."""
    backoff_limit_per_index: int = 3
    """Retries of one shard before it is marked failed."""
    pad_multiple: int = 256
    """Padded batch lengths are multiples of this, so only a few shapes need Triton warm-up."""
    sort_window: int = 4
    """Chunks sorted together by length to cut padding (bounded host memory)."""
    final_hidden: bool | None = None
    """Also store the target's final hidden state at every token (the last decoder layer's output,
    before the final norm, [T, d], in extract.dtype): DSpark's objective reads the target's
    next-token distribution from it. null: stored when the drafter needs it (train.drafter: dspark).
    It costs d x 2 bytes a token in bf16: +10,240 B, +20% at the 27B shape."""

    def __post_init__(self) -> None:
        _positive("extract.shards", self.shards, minimum=1)
        _positive("extract.token_budget", self.token_budget, minimum=1)
        _positive("extract.backoff_limit_per_index", self.backoff_limit_per_index, minimum=0)
        _positive("extract.pad_multiple", self.pad_multiple, minimum=1)
        _positive("extract.sort_window", self.sort_window, minimum=1)

    def compiled_on(self, device_type: str) -> bool:
        """Whether a pod on this device type ("cuda", "cpu") compiles the target's norms and MLPs."""
        return _compiled_on(self.compile, device_type)


def _compiled_on(compile: bool | None, device_type: str) -> bool:
    """An unset `compile` means on a GPU: torch.compile pays there, and on a CPU costs more to build than it saves."""
    return compile if compile is not None else device_type == "cuda"


VLLM_IMAGE = "vllm/vllm-openai:v0.21.0"
"""The official vLLM image; from v0.20.0 its unsuffixed tags are CUDA 13 builds."""
VLLM_OWN_ARGS = ("-i", "--input-file", "-o", "--output-file", "--model", "--served-model-name", "--tensor-parallel-size", "-tp",
                 "--seed", "--generation-config")
"""`vllm run-batch` arguments the generation job sets itself (from the spec), so generate.vllm_args may not."""


@dataclass(kw_only=True, slots=True)
class GenerateSpec:
    engine: Literal["vllm", "transformers"] = "vllm"
    """vllm: `vllm run-batch` in the vLLM image (real runs); transformers: batched generate in the dflash image (demo, tests, small runs)."""
    temperature: float = 0.7
    """Sampling temperature; 0 decodes greedily."""
    top_p: float = 0.8
    """Nucleus sampling: the smallest set of tokens holding this much probability."""
    max_new_tokens: int = 2048
    """Longest answer in tokens; each prompt's is also capped so that prompt and answer fit data.max_length."""
    thinking: bool | None = None
    """The chat template's enable_thinking switch: true or false as you will serve the target; null keeps the template's default. A template without the switch refuses true or false."""
    seed: int = 42
    """Every prompt samples with a seed derived from this and its line, so a chunk generated again gives the same answers, in whatever batch a prompt lands (both engines)."""
    truncated: Literal["drop", "keep"] = "drop"
    """An answer cut at its token limit (finish_reason length): dropped, or kept as it is. Counted either way."""
    empty: Literal["drop", "keep"] = "drop"
    """An answer with no text: dropped, or kept. Counted either way."""
    shards: int = 8
    """Generation pods; each owns a token-balanced set of chunks."""
    gpus_per_shard: int = 1
    """GPUs of one generation pod (vllm's tensor parallelism; transformers: 1)."""
    chunk_prompts: int = 1024
    """Prompts per work unit: what a killed pod loses at most, and (vllm) one model load per chunk."""
    batch_prompts: int | Literal["auto"] = "auto"
    """Prompts decoded together by the transformers engine (vllm schedules its own batches): a number,
    or auto: on a GPU as many as fit the memory the target's weights leave free (each row's KV cache for
    a prompt of data.max_length - 1 tokens and max_new_tokens more, its prompt forward and logits; 80%
    of the free memory, at most 4,096 rows), on a CPU 64. A small target's decode step costs about the
    same at any batch, so its answers a second grow with the rows. A chunk's prompts are decoded
    shortest first, so a batch holds prompts of like length. The pod's log says the batch and why."""
    compile: bool | None = False
    """The transformers engine's decode step through torch.compile (generate/decoding.py: fused norms,
    rotary, residuals and SwiGLU, inside the step's CUDA graph) for a target of full attention; a
    hybrid one decodes with generate either way. A greedy answer can part from eager decoding's only
    where two tokens' scores are as close as the fused kernels' roundings (bench/generate/bench_generate.py
    counts and classes where it does against the plain greedy loop). Off by default: on an H100 at
    SmolLM2's shape the compiled step decoded 0.55x the eager one's answers a second (its dynamic
    shapes serve every window and batch size, and lose to the kernels eager selects per window:
    bench/results/generate-compiled-h100.json). null: on a GPU, off on a CPU (where compiling takes
    longer than a small run's decoding). The first batch pays the compile."""
    backoff_limit_per_index: int = 3
    """Retries of one shard before it is marked failed."""
    vllm_image: str = VLLM_IMAGE
    """The image of the vllm engine's pods: the official vLLM image (CUDA 13), or one built on it."""
    vllm_args: list[str] = field(default_factory=list)
    """More `vllm run-batch` arguments, e.g. [--gpu-memory-utilization, "0.92", --max-num-seqs, "256"].
    No reasoning parser: the answer is stored as the target wrote it (its token ids), which a parser
    would only split into reasoning and content."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise SpecError("generate.temperature", self.temperature, "a number >= 0 (0 decodes greedily)")
        if not 0 < self.top_p <= 1:
            raise SpecError("generate.top_p", self.top_p, "a number in (0, 1]")
        _positive("generate.max_new_tokens", self.max_new_tokens, minimum=1)
        _positive("generate.seed", self.seed, minimum=0)
        _positive("generate.shards", self.shards, minimum=1)
        _positive("generate.gpus_per_shard", self.gpus_per_shard, minimum=1)
        _positive("generate.chunk_prompts", self.chunk_prompts, minimum=1)
        rows = self.batch_prompts
        if rows != "auto" and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
            raise SpecError("generate.batch_prompts", rows, "an integer >= 1, or auto (sized for the target and the device)")
        _positive("generate.backoff_limit_per_index", self.backoff_limit_per_index, minimum=0)
        if self.engine == "transformers" and self.gpus_per_shard != 1:
            raise SpecError("generate.gpus_per_shard", self.gpus_per_shard, "1 with engine transformers (engine vllm splits a model over several GPUs)")
        if not self.vllm_image or any(c.isspace() for c in self.vllm_image):
            raise SpecError("generate.vllm_image", self.vllm_image, f"an image reference such as {VLLM_IMAGE}")
        own = [arg for arg in self.vllm_args if arg.split("=", 1)[0] in VLLM_OWN_ARGS]
        if own:
            raise SpecError(
                "generate.vllm_args", self.vllm_args,
                f"arguments other than {', '.join(VLLM_OWN_ARGS)}: the job sets those from target.model and the generate section ({own[0]})",
            )
        # A reasoning parser returns the answer's text in two parts, </think> cut out: rejoined, it is
        # what the target wrote only approximately, and not at all for an answer cut before </think>.
        parsing = [arg for arg in self.vllm_args
                   if "reasoning-parser" in arg.replace("_", "-") or arg.replace("_", "-").split("=", 1)[0] == "--enable-reasoning"]
        if parsing:
            raise SpecError(
                "generate.vllm_args", self.vllm_args,
                f"no reasoning parser (remove {parsing[0]}): generation keeps the target's answer whole, as the token ids it "
                "sampled, and trains on those; the parser would only split its text into reasoning and content",
            )

    def compiled_on(self, device_type: str) -> bool:
        """Whether the transformers engine on this device type ("cuda", "cpu") compiles its decode step."""
        return _compiled_on(self.compile, device_type)


PROMPT_SET_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")
"""An eval.prompt_sets name: a key of the report and of the kept results."""


@dataclass(kw_only=True, slots=True)
class EvalSpec:
    prompts: int = 32
    """Held-out prompts decoded with and without the drafter."""
    max_new_tokens: int = 256
    """Tokens generated per prompt. Keep it several blocks long: the train/serve check compares only
    verify steps that drafted a whole block, and says "not compared" with too few of them."""
    processes: int = 1
    """Worker processes decoding prompts at once on the evaluation's device, each with its own copy of
    the target and drafter: a small target is bound by Python and kernel launches and fits many
    times on one GPU; a 27B one fits once, so keep 1 there. Only the figures come from them: the
    speeds come from eval.timed_prompts, decoded in one process before the workers start decoding."""
    timed_prompts: int = 16
    """Held-out prompts (the first ones) that greedy and every drafter decode one after another, alone
    on the device after a warm-up, before the other prompts: the tokens/s and speed-ups of the report
    come from them (greedy's and the chain's decodings give their figures too)."""
    tree_budgets: list[int] = field(default_factory=lambda: [16, 32, 64])
    """Node budgets of the draft trees (DDTree) the trained drafter is also evaluated with, beside the
    chain's own budget (as many nodes as it drafts), which is always added: each tree decodes every
    prompt for real (one verify forward of budget + 1 tokens a step) and its acceptance is computed
    exactly at every verify step of the chain. [] evaluates the chain alone."""
    prompt_sets: dict[str, str] = field(default_factory=dict)
    """Named prompt sets evaluated beside the held-out prompts, a table each (tau with its interval,
    acceptance per position, speed-up): name -> a chat JSONL file or s3:// object ({"messages": [...]}
    rows, as MT-Bench, HumanEval or GSM8K are given), each row's prompt its conversation through its
    last user turn; up to eval.prompts prompts a set, rows without a user turn or too long counted.
    `dflashctl eval --prompt-set NAME=FILE` adds one."""
    reference_cache: str | None = None
    """Where greedy's decodings of the prompts are kept for every evaluation on the same target, prompts
    and settings (evaluate/reference.py): a local path or s3:// prefix several runs share (the quality
    benchmark's chains, `dflashctl eval` of several drafters); null: the run's own output."""
    cuda_graphs: bool = True
    """On a GPU, for a target of full attention only (a dense one, such as Llama): greedy, the verify
    loops and the trees on a static KV cache, each token's, verify block's and tree's forward one
    replayed CUDA graph (drafter/static_target.py), and the served drafter's block and a tree's
    growth too (drafter/replayed_drafter.py), where eager forwards at batch size 1 wait on the host's
    kernel launches: on an H100 at SmolLM2's shape greedy 5.4x and the DFlash chain 6.4x the eager
    tokens/s (bench/results/eval-loops-graphed-h100.json). Their logits differ from the dynamic
    cache's by roundings, which the lossless check's tie tolerance measures on the same target.
    false: the dynamic cache, eager. A hybrid target decodes on the dynamic cache either way."""
    baselines: list[str] = field(default_factory=lambda: list(BASELINES))
    """The untrained drafters decoded beside the trained one on the same prompts: prompt_lookup and bigram
    (a table fitted on the run's training rows). Each decodes every prompt again, about a greedy decoding's
    worth of target forwards: [] when the figures are had elsewhere (several drafters trained on one data
    set decode the same prompt lookup)."""

    def __post_init__(self) -> None:
        _positive("eval.prompts", self.prompts, minimum=1)
        _positive("eval.max_new_tokens", self.max_new_tokens, minimum=1)
        _positive("eval.processes", self.processes, minimum=1)
        _positive("eval.timed_prompts", self.timed_prompts, minimum=1)
        if not isinstance(self.tree_budgets, list):
            raise SpecError("eval.tree_budgets", self.tree_budgets, "a list of node budgets such as [16, 32, 64], or [] for none")
        for budget in self.tree_budgets:
            if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= MAX_TREE_BUDGET:
                raise SpecError("eval.tree_budgets", self.tree_budgets,
                                f"node budgets from 1 to {MAX_TREE_BUDGET} (the tokens one verify forward holds besides the anchor)")
        if len(set(self.tree_budgets)) != len(self.tree_budgets):
            raise SpecError("eval.tree_budgets", self.tree_budgets, "distinct node budgets")
        if not isinstance(self.prompt_sets, dict):
            raise SpecError("eval.prompt_sets", self.prompt_sets, "a mapping of set names to chat JSONL files, e.g. {mt_bench: s3://bucket/mt_bench.jsonl}")
        for name, source in self.prompt_sets.items():
            if not isinstance(name, str) or not PROMPT_SET_NAME.fullmatch(name):
                raise SpecError("eval.prompt_sets", name, "set names of letters, digits, '_' and '-', starting with a letter (report keys)")
            _check_location(f"eval.prompt_sets.{name}", source, what="a chat JSONL file")
        if not isinstance(self.cuda_graphs, bool):
            raise SpecError("eval.cuda_graphs", self.cuda_graphs, "true or false")
        if self.reference_cache is not None:
            _check_location("eval.reference_cache", self.reference_cache, what="where greedy's decodings are shared")
        if (not isinstance(self.baselines, list) or not all(isinstance(name, str) and name in BASELINES for name in self.baselines)
                or len(set(self.baselines)) != len(self.baselines)):
            raise SpecError("eval.baselines", self.baselines, f"a list of distinct baselines from {list(BASELINES)}, or [] for none")


@dataclass(kw_only=True, slots=True)
class LocalSpec:
    workdir: str = ".dflash"
    """Where the local backend keeps pod logs, mapped volumes and state."""
    parallelism: int | None = None
    """Processes at once per Job; default: the Job's own parallelism."""
    cores: int | None = None
    """CPU cores a Job's parallel pods share: each runs OMP_NUM_THREADS = cores / parallelism, whatever the
    environment says. Training's figures change with its thread count (float sums in another order), so
    a fixed value gives the same figures on any machine of one kind. Default: this machine's cores, or
    OMP_NUM_THREADS where the environment sets it."""
    device: str = "cpu"
    """torch device for local pods: cpu, or cuda on a workstation."""

    def __post_init__(self) -> None:
        if self.cores is not None:
            _positive("local.cores", self.cores, minimum=1)
