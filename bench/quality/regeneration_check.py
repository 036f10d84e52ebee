"""Are the regenerated answers what the target decodes? The generate step's engine (batched,
left-padded `generate`) against the evaluation's reference (plain greedy, one prompt at a time, the
verify loop's cache), on the same prompts, and the answer's tokens against what prepare makes of
its text (the answer is stored as text and tokenized again inside the chat template).

    python bench/quality/regeneration_check.py --target DIR --chats chats.jsonl [--prompts 64] [--dtype float32] --out check.json

A drafter learns the rows it is given: where the engine's greedy answer is not the target's own
greedy decoding (a padding or batching bug, or rounding), or where tokenizing its text again gives
other tokens, training and serving see different text, and acceptance falls with no error
anywhere. With --dtype float32 a difference is a bug, not a tie rounding apart.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from dflash_jobs.drafter.speculative import DecodeTarget, greedy_decode
from dflash_jobs.generate.engines import TransformersEngine
from dflash_jobs.rows import ChatEncoder
from dflash_jobs.spec import GenerateSpec


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--chats", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=getattr(torch, args.dtype)).to(device).eval()
    rows = [json.loads(line) for line in args.chats.read_text().splitlines()[-args.prompts :]]
    settings = GenerateSpec(engine="transformers", temperature=0.0, max_new_tokens=args.new_tokens, batch_prompts=args.batch)
    engine = TransformersEngine(settings, model=model, tokenizer=tokenizer, device=device, max_length=model.config.max_position_embeddings)
    bodies = [{"messages": row["messages"][:-1], "model": "target", "temperature": 0.0, "max_completion_tokens": args.new_tokens} for row in rows]
    prompts = [engine.encode(body) for body in bodies]

    batched: list[list[int]] = [[] for _ in rows]
    order = sorted(range(len(rows)), key=lambda i: len(prompts[i]))  # as the engine batches them: by length
    captured = {}
    original_decode = tokenizer.decode

    def keep_ids(tokens, **kwargs):  # the engine's token ids, before they become text
        captured[len(captured)] = list(tokens)
        return original_decode(tokens, **kwargs)

    tokenizer.decode = keep_ids
    answers = {}
    with torch.inference_mode():
        for begin in range(0, len(order), args.batch):
            chunk = order[begin : begin + args.batch]
            captured.clear()
            out = engine.generate([(str(i), prompts[i], bodies[i]) for i in chunk])
            for k, i in enumerate(chunk):
                batched[i] = captured[k]
                answers[i] = out[k]["response"]["body"]["choices"][0] if out[k]["response"] else None
    tokenizer.decode = original_decode

    reference = DecodeTarget(model)
    encoder = ChatEncoder(tokenizer)
    report = {"command": " ".join(["python", *sys.argv]), "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "dtype": args.dtype, "prompts": len(rows), "new_tokens": args.new_tokens, "batch": args.batch}
    equal, differences, retokenized_equal, retokenized_differences = 0, [], 0, []
    for i, (prompt, engine_ids) in enumerate(zip(prompts, batched)):
        greedy = greedy_decode(reference, torch.tensor(prompt), max_new_tokens=args.new_tokens, stop_ids=frozenset(engine.stop_ids)).tokens
        greedy = [t for t in greedy if t not in engine.stop_ids]
        where = first_difference(engine_ids, greedy)
        equal += where is None
        if where is not None:
            differences.append(where)
        if answers.get(i) is not None:
            conversation = bodies[i]["messages"] + [{"role": "assistant", "content": answers[i]["message"]["content"]}]
            row = {"messages": conversation, "generation": {"finish_reason": answers[i]["finish_reason"]}}  # as the generate step stores it
            ids, mask = encoder.encode([encoder.render(row)])[0]
            supervised = [int(t) for t, m in zip(ids, mask) if m]
            where = first_difference(supervised[: len(engine_ids)], engine_ids)
            retokenized_equal += where is None
            if where is not None:
                retokenized_differences.append(where)
    report.update({
        "engine_equals_greedy": equal, "first_difference_positions": sorted(differences),
        "retokenized_equals_engine": retokenized_equal, "retokenized_first_difference_positions": sorted(retokenized_differences),
    })
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
