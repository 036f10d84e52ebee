"""The demo's inputs: `python -m dflash_jobs.architectures.tiny.demo DIR` writes what `dflashctl
init --demo DIR` needs: DIR/target, the tiny Qwen3.5 target taught the demo's kind of conversation,
and DIR/chats.jsonl. The controller runs it as a subprocess because it never imports torch itself.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dflash_jobs.architectures.tiny import write_tiny_target
from dflash_jobs.architectures.tiny.chats import tiny_chat_dataset, tiny_chat_rows
from dflash_jobs.architectures.tiny.teach import teach_tiny_target

DEMO_LAYERS = 4
DEMO_CONVERSATIONS = 1200
DEMO_TEACHING_STEPS = 300


def write_demo_inputs(directory: str | Path, *, conversations: int = DEMO_CONVERSATIONS,
                      teaching_steps: int = DEMO_TEACHING_STEPS) -> dict[str, Any]:
    """DIR/target, taught on other conversations of the same kinds, and DIR/chats.jsonl."""
    import torch
    from transformers import AutoTokenizer

    directory = Path(directory)
    torch.manual_seed(0)
    target = write_tiny_target(directory / "target", num_layers=DEMO_LAYERS)
    taught = None
    if teaching_steps:
        tokenizer = AutoTokenizer.from_pretrained(target)
        # Other conversations than the data set's (seed 7): the target generalises, it does not recite.
        texts = [tokenizer.apply_chat_template(row["messages"], tokenize=False) for row in tiny_chat_rows(4000, seed=7)]
        taught = teach_tiny_target(target, texts, steps=teaching_steps, batch=16, length=128, lr=3e-3)
    chats = tiny_chat_dataset(directory / "chats.jsonl", conversations)
    return {"target": str(target), "chats": str(chats), "conversations": conversations, "teaching": taught}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the demo's tiny target and chat data set into DIR.")
    parser.add_argument("directory", type=Path)
    parser.add_argument("--conversations", type=int, default=DEMO_CONVERSATIONS)
    parser.add_argument("--teaching-steps", type=int, default=DEMO_TEACHING_STEPS,
                        help="training steps of the target on the demo's kind of text (0: random weights)")
    args = parser.parse_args(argv)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # one bar per saved shard is noise under the demo's progress
    print(json.dumps(write_demo_inputs(args.directory, conversations=args.conversations, teaching_steps=args.teaching_steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
