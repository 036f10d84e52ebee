"""Answers per second of the generate step's two decoders side by side (issue 48 item 2), and the
fast one's tokens, its step eager and compiled, against the plain greedy loop's.

    python bench/generate/bench_generate.py --shape smollm2 --out $OUT/generate-h100.json   # one H100, about 4 minutes
    python bench/generate/bench_generate.py --shape tiny --out generate-tiny.json           # the same on a CPU, a few minutes

The target is a random-weight Llama of the shape asked (smollm2: SmolLM2-135M's, tied embeddings,
bf16 on a GPU): no checkpoint, no tokenizer, so that the machine needs nothing carried. Random
weights never end an answer, so every answer runs to --new-tokens: the longest, slowest case.
Prompts are random token ids of seeded random lengths (--min-prompt..--max-prompt, about the code
prompts' with their chat template), sorted by length and cut into batches of --batch, each padded on
the left to its longest, as the Transformers engine batches them (jobs/dflash_jobs/generate/engines.py).

Stages (--stages, default all), the JSON written after each:
1. agreement: the first batch decoded by the plain greedy loop (bench/generate/reference.py), by
   the static decoder (its step eager, then compiled) and by generate, each keeping every step's two
   best scores; where a row parts from the plain loop, the scores there class it (an exact tie,
   within one bf16 step, or other); and each decoder's greedy as the engine asks it (the static one:
   argmax in the replayed step) against its own recorded tokens, row by row; the seconds of each
   decoding (the compiled decoder's first two hold its compiles: logits out, then greedy in the step).
2. profile: where one batch's time goes in the static decoder, eager and compiled (profile_step.profile_batch).
3. throughput: each decoder warmed on one batch, then timed on its prompts in the order
   static, generate, generate, static (both orders: a later run gains nothing from an earlier one);
   answers/s = prompts / seconds of the run, tokens counted as decoded (prompts x new tokens).
4. sweep: the static decoder's knobs side by side on the same prompts (profile_step.sweep; its
   groups of variants --sweep-variants, of profile_step.SWEEP_GROUPS).

After each stage the JSON also holds `compiled_graphs`: the graphs torch.compile made of the decode
step so far and its graph breaks (one graph for greedy in the step and one for logits out are
expected whatever the windows and batch sizes: a count growing with them is a recompile).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from dflash_jobs.generate.decoding import HfGenerate, StaticDecoder, greedy
from profile_step import SWEEP_GROUPS, profile_batch, sweep, sweep_variants, synchronize
from reference import Recorder, partings, plain_greedy

SHAPES = {
    "smollm2": {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                "intermediate_size": 1536, "vocab_size": 49152, "max_position_embeddings": 8192},
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 1024},
}
STOP_ID = 2
PAD_ID = 0


def random_target(shape: str, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape], tie_word_embeddings=True, bos_token_id=1, eos_token_id=STOP_ID, pad_token_id=PAD_ID,
                         rms_norm_eps=1e-5, rope_theta=100000.0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with device:
        model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=dtype)
    return model.eval()


def random_prompts(count: int, lengths: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    """`count` prompts of random ids and seeded random lengths, sorted by length."""
    rng = random.Random(seed)
    return sorted(([rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))] for _ in range(count)), key=len)


def left_padded(prompts: list[list[int]], size: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The prompts in batches of `size`, each padded on the left to its longest: (ids, attention) each."""
    made = []
    for begin in range(0, len(prompts), size):
        part = prompts[begin : begin + size]
        longest = max(map(len, part))
        ids = torch.full((len(part), longest), PAD_ID, dtype=torch.long)
        attention = torch.zeros((len(part), longest), dtype=torch.long)
        for row, prompt in enumerate(part):
            ids[row, longest - len(prompt):] = torch.tensor(prompt)
            attention[row, longest - len(prompt):] = 1
        made.append((ids.to(device), attention.to(device)))
    return made


def batches(count: int, size: int, lengths: tuple[int, int], vocab: int, seed: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return left_padded(random_prompts(count, lengths, vocab, seed), size, device)


@torch.inference_mode()
def timed(decoder, work, new_tokens: int, device: torch.device) -> dict:
    synchronize(device)
    started = time.perf_counter()
    decoded = sum(decoder(ids, attention, new_tokens, greedy).numel() for ids, attention in work)
    synchronize(device)
    seconds = time.perf_counter() - started
    prompts = sum(ids.shape[0] for ids, _ in work)
    return {"decoder": decoder.name, "prompts": prompts, "seconds": round(seconds, 3), "answers_per_s": round(prompts / seconds, 1),
            "tokens_per_s": round(decoded / seconds, 1)}


def progress(line: str) -> None:
    """A line on stderr as each decoding ends: a run cut by its call's timeout still says how far it got."""
    print(line, file=sys.stderr, flush=True)


@torch.inference_mode()
def agreement(model, decoders, work, new_tokens: int) -> dict:
    ids, attention = work[0]
    plain = Recorder()
    started = time.perf_counter()
    reference = plain_greedy(model, ids, attention, new_tokens, plain)
    progress(f"agreement: the plain greedy loop decoded {ids.shape[0]} prompts in {time.perf_counter() - started:.1f} s")
    found, greedy_rows_equal, seconds = {}, {}, {}
    for decoder in decoders:
        recorder = Recorder()
        started = time.perf_counter()
        tokens = decoder(ids, attention, new_tokens, recorder)
        recorded_at = time.perf_counter()
        found[decoder.name] = asdict(partings(reference, plain, tokens, recorder))
        # greedy as the engine asks it (the static decoder: argmax in the replayed step, on bf16 logits)
        greedy_tokens = decoder(ids, attention, new_tokens, greedy)
        greedy_rows_equal[decoder.name] = int((greedy_tokens == tokens).all(dim=1).sum())
        seconds[decoder.name] = {"recorded": round(recorded_at - started, 2), "greedy": round(time.perf_counter() - recorded_at, 2)}
        progress(f"agreement: {decoder.name} {seconds[decoder.name]}")
    return {"prompts": ids.shape[0], "new_tokens": new_tokens, "against_plain_greedy": found,
            "greedy_rows_equal_to_recorded": greedy_rows_equal, "seconds": seconds}


def compiled_graphs() -> dict:
    """The graphs torch.compile made so far in this process, and its graph breaks."""
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values())}


STAGES = ("agreement", "profile", "throughput", "sweep")
"""In this order: a sweep variant that upsets the GPU (an SDPA backend, the last of them) comes after the rest."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {', '.join(STAGES)}")
    parser.add_argument("--batch", type=int, default=None, help="prompts a batch (default: 1024 on a GPU, 16 on a CPU)")
    parser.add_argument("--static-prompts", type=int, default=None, help="prompts the static decoder is timed on (default 8 batches)")
    parser.add_argument("--generate-prompts", type=int, default=None, help="prompts generate is timed on (default 1 batch)")
    parser.add_argument("--sweep-prompts", type=int, default=None,
                        help="prompts each sweep variant decodes (default 8 batches: batches of 4x still sorted by length)")
    parser.add_argument("--sweep-batches", default=None, help="batch sizes of the sweep (default: 1, 2 and 4 batches)")
    parser.add_argument("--sdpa-backends", default=None,
                        help="SDPA backends of the sweep besides the default one (default: MATH,CUDNN_ATTENTION on a GPU, MATH on a CPU; '' none)")
    parser.add_argument("--sweep-variants", default=",".join(SWEEP_GROUPS), help=f"comma-separated groups of the sweep, of {', '.join(SWEEP_GROUPS)}")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--min-prompt", type=int, default=48)
    parser.add_argument("--max-prompt", type=int, default=288)
    args = parser.parse_args(argv)
    stages = args.stages.split(",")
    if set(stages) - set(STAGES):
        parser.error(f"--stages: {args.stages!r}, not of {', '.join(STAGES)}")
    groups = args.sweep_variants.split(",")
    if set(groups) - set(SWEEP_GROUPS):
        parser.error(f"--sweep-variants: {args.sweep_variants!r}, not of {', '.join(SWEEP_GROUPS)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    size = args.batch or (1024 if device.type == "cuda" else 16)
    model = random_target(args.shape, device)
    lengths = (args.min_prompt, args.max_prompt)
    vocab = SHAPES[args.shape]["vocab_size"]
    static = StaticDecoder(model, stop_ids={STOP_ID}, pad_id=PAD_ID)
    compiled = StaticDecoder(model, stop_ids={STOP_ID}, pad_id=PAD_ID, compile=True)
    generate = HfGenerate(model, stop_ids={STOP_ID}, pad_id=PAD_ID)
    report = {"shape": args.shape, "config": SHAPES[args.shape], "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "dtype": str(model.dtype), "torch": torch.__version__, "transformers": transformers_version(), "batch": size,
              "new_tokens": args.new_tokens, "prompt_lengths": list(lengths), "stop": "random weights: no answer stops before new_tokens"}

    def write(stage: str, value) -> None:
        report[stage] = value
        report["compiled_graphs"] = {**report.get("compiled_graphs", {}), stage: compiled_graphs()}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")

    if "agreement" in stages:
        write("agreement", agreement(model, [static, compiled, generate], batches(size, size, lengths, vocab, 1, device), args.new_tokens))
    if "profile" in stages:
        work = batches(size, size, lengths, vocab, 2, device)[0]
        profiled = {}
        for decoder in (static, compiled):
            profiled[decoder.name] = profile_batch(decoder, *work, args.new_tokens)
            decoder.run = None  # its cache freed for the next
            write("profile", profiled)
    if "throughput" in stages:
        write("throughput", throughput(static, generate, args, size, lengths, vocab, device))
    if "sweep" in stages:
        backends = args.sdpa_backends if args.sdpa_backends is not None else ("MATH,CUDNN_ATTENTION" if device.type == "cuda" else "MATH")
        sizes = [int(n) for n in args.sweep_batches.split(",")] if args.sweep_batches else [size, 2 * size, 4 * size]
        static.run = compiled.run = None  # their caches freed for the sweep's bigger batches
        variants = sweep_variants(groups, batch=size, batches=sizes, backends=[name for name in backends.split(",") if name],
                                  stop_ids={STOP_ID}, pad_id=PAD_ID)
        def swept(rows: list[dict]) -> None:
            write("sweep", rows)
            row = rows[-1]
            outcome = row["error"] if "error" in row else f"{row['answers_per_s']} answers/s ({row['prompts']} prompts, batches of {row['batch']})"
            progress(f"sweep: {row['label']}: {outcome}")

        write("sweep", [])
        sweep(model, random_prompts(args.sweep_prompts or 8 * size, lengths, vocab, 5), args.new_tokens,
              lambda prompts, n: left_padded(prompts, n, device), device, variants, on_row=swept)
    print(json.dumps(report, indent=2))
    return 0


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def throughput(static, generate, args, size: int, lengths: tuple[int, int], vocab: int, device) -> dict:
    static_work = batches(args.static_prompts or 8 * size, size, lengths, vocab, 2, device)
    generate_work = batches(args.generate_prompts or size, size, lengths, vocab, 3, device)
    for decoder in (static, generate):
        timed(decoder, batches(size, size, lengths, vocab, 4, device)[:1], args.new_tokens, device)  # warm-up
    runs = [timed(decoder, work, args.new_tokens, device)
            for decoder, work in ((static, static_work), (generate, generate_work), (generate, generate_work), (static, static_work))]
    best = {name: max(run["answers_per_s"] for run in runs if run["decoder"] == name) for name in ("static", "generate")}
    return {"runs": runs, "best_answers_per_s": best, "speedup": round(best["static"] / best["generate"], 2)}


if __name__ == "__main__":
    sys.exit(main())
