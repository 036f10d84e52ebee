"""The scales of the quality benchmark: everything that differs between the test's run, the CPU
run, the command check and the H100/H200 run, for each task (tasks.py): sorting words for a small
target taught here (tiny, cpu, gpu) and real code prompts for a real model (code-tiny, code-cpu,
code-gpu)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from code_task import CodeTask, RandomTarget, SmolLM2Target
from package_task import PackagePromptsTask
from sorting import SortingTask
from tasks import ChatCounts, Task


@dataclass(frozen=True, slots=True)
class Size:
    """One scale of the benchmark: its task (the target and the chats), then the chain's settings, the same for every task."""

    task: Task
    capture: list[int] | None
    """Target layers the drafter reads (target.layers; None: the spec's default for the target's depth)."""
    chats: int
    """Conversations of the drafter's data set; `holdout` of them, held out at their source, are the evaluation prompts."""
    holdout: int
    max_answer_tokens: int
    """generate.max_new_tokens: the target's answers are cut here (and kept)."""
    regenerate_batch: int
    """generate.batch_prompts."""
    draft_layers: int
    block_size: int
    anchors: int
    epochs: int
    draft_lr: float
    micro_batch_tokens: int
    """train.micro_batch_tokens. Small on the CPU: its few epochs are then enough optimizer steps for the
    drafter to learn, and the dense attention mask of the CPU path is quadratic in it."""
    micro_batch_blocks: int
    chunk_tokens: int
    max_length: int
    """data.max_length: also the longest batch shape extraction warms up, so kept near the longest sample."""
    eval_new_tokens: int
    eval_prompts: int | None = None
    """eval.prompts: the first of the held-out prompts every chain decodes (None: all of them). The
    diversity figures read all `holdout` of them (the generate step answers them at little cost);
    decoding is what a CPU run spends most on, nine chains over."""
    seeds: tuple[int, ...] = (42,)
    """Drafter seeds (train.seed) of the regenerated and the source chain, as many as given (each later
    one a chain more of each, trained and evaluated on the first one's extracted states): a claim takes
    the drafter at its mean over them, and their spread stands beside it as training noise."""
    seeded: tuple[str, ...] = ("regenerated", "source")
    """The chains trained again with the later seeds."""
    data_fractions: tuple[float, ...] = ()
    """Chains on part of the regenerated rows (the held-out prompts kept): does more data help?"""
    step_epochs: tuple[int, ...] = ()
    """Chains on all the regenerated states trained for fewer epochs than `epochs`, each to the end of
    its own schedule, evaluated without trees: does training longer help (the steps curve)?"""
    fp8_chain: bool = False
    """A chain on the regenerated rows stored in float8_e4m3fn: acceptance against bf16 storage."""
    fp8_compute_chain: bool = False
    """A chain on the regenerated rows whose states the target computes with FP8 linear layers
    (extract.compute_dtype float8: a GPU with FP8 tensor cores): acceptance against bf16 compute's."""
    successors: tuple[str, ...] = ("dflash2", "dspark")
    """train.drafter of the chains beside DFlash on the regenerated chain's states (issue 30)."""
    ablations: tuple[str, ...] = ("dflash2-selector-off", "dspark-markov-rank1")
    """Successors without their own head, on the same states (chains.ABLATIONS): is a lead its head's or its anchor path's?"""
    eval_processes: int = 1
    """eval.processes: held-out prompts decoded in this many processes (a small target fits many times on a GPU)."""
    extra_tree_budgets: tuple[int, ...] = (16, 32)
    """Node budgets of the draft trees decoded beside the ones its task's goal judges (tree_budgets)."""
    goal_trees: bool = True
    """Its chains decode the draft trees its task's goal judges (goals.Goals.tree_budget); False where they cost
    too much at this size, and the goals then say the trees goal was not measured."""
    trees_on_every_chain: bool = True
    states: str = "stored"
    """train.states of every chain: "online" where the stored states would not fit the machine's disk (the
    target runs inside each training step, and a chain reading another's data shares its token chunks alone)."""
    device: str = "cpu"

    @property
    def tree_budgets(self) -> tuple[int, ...]:
        """eval.tree_budgets: the draft trees every chain (or the regenerated DFlash of each seed: trees_on_every_chain) decodes."""
        return tuple(sorted({*self.extra_tree_budgets, *((self.task.goals.tree_budget,) if self.goal_trees else ())}))

    @property
    def chat_counts(self) -> ChatCounts:
        """The chats it asks of its task: `chats` in all, the last `holdout` of them held out."""
        return ChatCounts(training=self.chats - self.holdout, held_out=self.holdout)


SIZES = {
    # Measured in bench/results/quality-cpu.json (its seconds per stage). The target is taught to sort
    # 4-8 of 64 words (1,200 steps, about 10 minutes); the drafter, two layers as wide as the target,
    # trains on 4,096 chats for one epoch (159 steps of 1,024 tokens, 8 anchors a sample, about 4 minutes
    # of one core: 16 anchors for 4 epochs took 3 s a step, 33 minutes a chain, past the hour for eleven).
    # Three seeds: the third adds a regenerated and a source chain, trained and evaluated on the first
    # seed's states (the second seed's took 149.5 and 147.2 s of one core, two stages at a time: about
    # 2.5 minutes more of wall time, to some 28-32 minutes).
    "cpu": Size(
        task=SortingTask(target_layers=4, target_hidden=128, target_heads=4, target_head_dim=32, vocab_size=2048, corpus_files=48,
                         document_chars=2500, vocabulary_size=64, min_words=4, max_words=8,
                         target_chats=20000, train_steps=1200, train_seconds=10800.0, train_batch=16, train_length=128, lr=1e-2),
        capture=[1, 3], chats=4160, holdout=64, max_answer_tokens=32, regenerate_batch=64,
        draft_layers=2, block_size=8, anchors=8, epochs=1, draft_lr=3e-3, micro_batch_tokens=1024, micro_batch_blocks=2048, chunk_tokens=16384,
        max_length=64, eval_new_tokens=24, seeds=(42, 43, 44), data_fractions=(0.25, 0.5), fp8_chain=True, eval_processes=2,
    ),
    # The test's size, every chain of the others, on a CPU in minutes: a check of the code path (and of
    # the GPU size's command before device time is spent). Its target, trained for seconds, answers
    # almost every prompt alike, and its report says so (diversity.verdict "degenerate").
    "tiny": Size(
        task=SortingTask(target_layers=4, target_hidden=64, target_heads=4, target_head_dim=16, vocab_size=1024, corpus_files=30,
                         document_chars=None, vocabulary_size=32, min_words=3, max_words=5,
                         target_chats=400, train_steps=30, train_seconds=30.0, train_batch=16, train_length=64, lr=1e-2),
        capture=[1, 3], chats=64, holdout=4, max_answer_tokens=12, regenerate_batch=32,
        draft_layers=1, block_size=8, anchors=16, epochs=1, draft_lr=3e-3, micro_batch_tokens=512, micro_batch_blocks=2048, chunk_tokens=2048,
        max_length=64, eval_new_tokens=12, eval_prompts=3, seeds=(42, 43, 44), data_fractions=(0.25, 0.5), fp8_chain=True,
    ),
    # The H200 run, in two device calls of under 10 minutes with the same --workdir (the second goes
    # on after the stages the first finished). Its target: 8 layers of hidden 384, taught to sort
    # 6-12 of 128 words (up to 150 s); the drafter, three layers as wide, on 16,384 chats for 3
    # epochs. It decides the claims on DFlash alone (seeds, source, the data curve): the successors,
    # their ablations and the fp8 chain are the CPU size's, so that the run fits the device time a
    # session has. Measured on an H200 (bench/results/quality-gpu-h200-partial.json and .log): target
    # 194 s, generation 80 s, then the six chains side by side, each extracted in 20-61 s and trained
    # in 34-101 s; their evaluations were still running when the first call ended at 500 s. Two seeds:
    # a third would add two chains (training 78-94 s each beside the others, evaluation not yet
    # measured at this size) to a run that has yet to finish within a session's device time.
    "gpu": Size(
        task=SortingTask(target_layers=8, target_hidden=384, target_heads=6, target_head_dim=64, vocab_size=4096, corpus_files=None,
                         document_chars=2500, vocabulary_size=128, min_words=6, max_words=12,
                         target_chats=100000, train_steps=2500, train_seconds=150.0, train_batch=32, train_length=256, lr=3e-3),
        capture=[1, 3, 5, 7], chats=16448, holdout=64, max_answer_tokens=48, regenerate_batch=512,
        draft_layers=3, block_size=16, anchors=32, epochs=3, draft_lr=1e-3, micro_batch_tokens=8192, micro_batch_blocks=8192, chunk_tokens=65536,
        max_length=96, eval_new_tokens=48, seeds=(42, 43), data_fractions=(0.25, 0.5), fp8_chain=False, successors=(), ablations=(),
        eval_processes=4, device="cuda",
    ),
    # The code task's test size: every chain of code-gpu, on a tiny random target (its answers are
    # noise: diversity "degenerate") in a few minutes on a CPU (tests/test_quality_code.py), as a
    # check of the GPU size's command before device time is spent.
    "code-tiny": Size(
        task=CodeTask(RandomTarget(layers=4, hidden=64, heads=4, head_dim=16, vocab_size=1024, corpus_files=30),
                      max_prompt_tokens=160, max_source_answer_tokens=96),
        capture=[1, 3], chats=48, holdout=6, max_answer_tokens=12, regenerate_batch=16,
        draft_layers=1, block_size=8, anchors=8, epochs=4, draft_lr=3e-3, micro_batch_tokens=1024, micro_batch_blocks=2048, chunk_tokens=4096,
        max_length=288, eval_new_tokens=12, eval_prompts=3, seeds=(42, 43), seeded=("regenerated",), data_fractions=(0.25, 0.5),
        step_epochs=(1, 2), successors=("dflash2", "dspark"), ablations=(), extra_tree_budgets=(16,), goal_trees=False, trees_on_every_chain=False,
    ),
    # SmolLM2-135M-Instruct (4-bit Q4_1 weights, dequantized: a slightly degraded SmolLM2) on real
    # code prompts, on 2 CPU cores in under an hour. Sized from CPU-seconds measured per stage on this
    # machine while it was loaded (one thread a step, fp32; bench/README.md): generation 0.57 s a
    # prompt of 32 answer tokens, extraction 560 tokens/s, training 0.9 s a step of 1,024 tokens (the
    # 49,152-row head is most of it), evaluation 16.6 s a prompt of 32 tokens (greedy, DFlash,
    # prompt lookup, bigram: about 130 target forwards of 0.13 s). Short prompts (<= 96 tokens),
    # short answers (source <= 64, the target's cut at 32), 616 training chats, 24 held-out prompts
    # (8 a kind), four chains: about 3,800 CPU-seconds, 35-45 min on 2 idle cores.
    "code-cpu": Size(
        task=CodeTask(SmolLM2Target(), max_prompt_tokens=96, max_source_answer_tokens=64),
        capture=None, chats=640, holdout=24, max_answer_tokens=32, regenerate_batch=25,
        draft_layers=2, block_size=8, anchors=8, epochs=4, draft_lr=3e-3, micro_batch_tokens=1024, micro_batch_blocks=2048, chunk_tokens=16384,
        max_length=192, eval_new_tokens=32, seeds=(42, 43), successors=(), ablations=(),
        # One budget: a tree decoding costs about a chain's decoding again on a CPU.
        extra_tree_budgets=(16,), goal_trees=False, trees_on_every_chain=False,
    ),
    # The same on an H100 in two device calls of at most 9 minutes with the same --workdir, from the
    # GGUF file on the machine (bench/README.md gives the calls and the arithmetic). The standard
    # library's and torch's functions (about 10,000 chats of prompts <= 256 tokens; the held-out ones
    # from standard-library modules only), 8,128 training chats answered again by the target (cut at
    # 128 tokens), 64 held-out prompts decoded for 48 tokens. A 3-layer DFlash at block 16 for 4
    # epochs of 4,096-token micro-batches (about 1,900 steps); beside it a second seed, the source,
    # DFlash2 and DSpark on the same states, a quarter and a half of the rows (the data curve) and 1
    # and 2 epochs (the steps curve): ten chains, side by side.
    "code-gpu": Size(
        task=CodeTask(SmolLM2Target(), max_prompt_tokens=256, max_source_answer_tokens=256, packages=("torch",)),
        capture=None, chats=8192, holdout=64, max_answer_tokens=128, regenerate_batch=1024,
        draft_layers=3, block_size=16, anchors=32, epochs=4, draft_lr=1e-3, micro_batch_tokens=4096, micro_batch_blocks=8192, chunk_tokens=65536,
        max_length=544, eval_new_tokens=48, seeds=(42, 43), seeded=("regenerated",), data_fractions=(0.25, 0.5), step_epochs=(1, 2),
        successors=("dflash2", "dspark"), ablations=(), eval_processes=2,
        trees_on_every_chain=False, device="cuda",
    ),
    # Issue 48: SmolLM2 on the packages' prompts (package_prompts.py), answered again by the target, in
    # at most three device calls of under 10 minutes on one GPU with the same --workdir (bench/README.md
    # gives the calls and the arithmetic). Its states are online: 65,536 chats of about 280 tokens at
    # SmolLM2's five captured layers would take some 100 GB stored, more than the machine's disk. As
    # many rows as the session's device time held once the machine's starts had spent a third of it
    # (bench/README.md), two epochs, the data curve at 1/8 and 1/2 of them (8,192 and 32,768 rows);
    # 128 held-out prompts from four packages no training prompt comes from, the kinds in turn.
    # Four evaluation processes: batch-1 decoding of a 135M target is bound by its kernel launches, not the GPU.
    "code-scale": Size(
        task=PackagePromptsTask(SmolLM2Target(), max_prompt_tokens=256),
        capture=None, chats=65_664, holdout=128, max_answer_tokens=128, regenerate_batch=1024,
        draft_layers=3, block_size=16, anchors=32, epochs=2, draft_lr=1e-3, micro_batch_tokens=16384, micro_batch_blocks=8192,
        chunk_tokens=262_144, max_length=448, eval_new_tokens=48, seeds=(42,), seeded=(), data_fractions=(0.125, 0.5),
        successors=(), ablations=(), eval_processes=4, trees_on_every_chain=False, states="online",
        device="cuda",
    ),
    # code-scale's every chain on a tiny random target and a prompts file the test writes: its command
    # on a CPU in minutes (tests/test_quality_scale.py) before device time is spent.
    "code-scale-tiny": Size(
        task=PackagePromptsTask(RandomTarget(layers=4, hidden=64, heads=4, head_dim=16, vocab_size=1024, corpus_files=30), max_prompt_tokens=160),
        capture=[1, 3], chats=40, holdout=5, max_answer_tokens=12, regenerate_batch=16,
        draft_layers=1, block_size=8, anchors=8, epochs=2, draft_lr=3e-3, micro_batch_tokens=1024, micro_batch_blocks=2048, chunk_tokens=4096,
        max_length=224, eval_new_tokens=12, eval_prompts=5, seeds=(42,), seeded=(), data_fractions=(0.25,),
        successors=("dflash2", "dspark"), ablations=(), extra_tree_budgets=(16,), goal_trees=False, trees_on_every_chain=False, states="online",
    ),
}
# code-scale's full chain alone, without the data curve's two chains beside it: for a session whose
# device time, after refused machine starts, holds one chain's training and evaluation, not three.
SIZES["code-scale-full"] = replace(SIZES["code-scale"], data_fractions=())
# The data curve's next point after code-scale's (8,192 / 32,768 / 65,536 chats: 1.47 / 2.49 / 2.97 on the
# same 128 held-out prompts, still rising): twice its chats, one chain, the same recipe. About 260 s of
# generation and 510 s of training at code-scale's measured rates, in two calls after the setup call
# (the prompts a part of 140,000 training prompts: some 3% are over 256 tokens).
SIZES["code-scale-131k"] = replace(SIZES["code-scale-full"], chats=131_072 + 128)
# Issue 50's FP8 parity on the real model: the DFlash drafter trained online on states the target
# computes with FP8 linear layers beside the one trained on bf16's, on code-scale's first 32,768 chats
# (its data curve's middle point, 2.49) and held-out prompts. One call after the setup call: about 65 s
# of generation and two 32,768-chat trainings and evaluations side by side.
SIZES["code-scale-fp8"] = replace(SIZES["code-scale-full"], chats=32_768 + 128, fp8_compute_chain=True)
# The successors beside DFlash on code-scale's chats, each trained online on the regenerated chain's
# token chunks (the target in every step; DSpark's its final hidden state too): the issue's "best of
# DFlash, DFlash2 and DSpark by its interval". Three trainings of 2,150 steps side by side, three
# calls after the setup call.
SIZES["code-scale-successors"] = replace(SIZES["code-scale-full"], successors=("dflash2", "dspark"))
