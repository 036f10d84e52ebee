"""The engines that answer a batch file (dflash_jobs.generate.batch): vLLM's `vllm run-batch`, or Transformers.

Both read the same request JSONL and write the same response JSONL, so the chunk around them does
not know which one ran:

- `VllmEngine` runs vLLM's own batch runner in the vLLM image, one process per chunk (the model
  loads once per chunk: generate.chunk_prompts trades that against what a killed pod loses);
- `TransformersEngine` renders each conversation with the chat template, as vLLM does, and decodes
  prompts of similar length together with left padding (decoding.py: a static cache and CUDA graphs,
  the step compiled where generate.compile asks, where the target's attention allows, generate otherwise); it returns each answer's token ids as
  vLLM does for `return_token_ids`.

Output lines are written as answers complete, so a watcher of the output file sees progress.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path
from typing import Any, Protocol

from dflash_jobs.errors import SpecError
from dflash_jobs.generate.batch import EngineError, completion_line, error_line
from dflash_jobs.generate.decoding import Decoder, greedy, pick_decoder
from dflash_jobs.generate.sizing import batch_rows
from dflash_jobs.spec import GenerateSpec

log = logging.getLogger("dflash.generate")

SERVED_MODEL = "target"
"""The model name requests carry and `vllm run-batch --served-model-name` serves."""


class Engine(Protocol):
    name: str

    def run(self, requests: Path, outputs: Path) -> None:
        """Answers every request line of `requests` into `outputs` (one line each, any order)."""


class VllmEngine:
    """`vllm run-batch` on one chunk's batch file, with the settings the requests do not carry."""

    name = "vllm"

    def __init__(self, settings: GenerateSpec, checkpoint: Path) -> None:
        self.settings = settings
        self.checkpoint = checkpoint

    def command(self, requests: Path, outputs: Path) -> list[str]:
        return [
            "vllm", "run-batch", "-i", str(requests), "-o", str(outputs),
            "--model", str(self.checkpoint), "--served-model-name", SERVED_MODEL,
            "--tensor-parallel-size", str(self.settings.gpus_per_shard),
            "--seed", str(self.settings.seed),
            # Sampling is what the spec says, not the checkpoint's generation_config.json defaults.
            "--generation-config", "vllm",
            *self.settings.vllm_args,
        ]

    def run(self, requests: Path, outputs: Path) -> None:
        command = self.command(requests, outputs)
        # The packages staged for this job (PYTHONPATH) must not shadow vLLM's own.
        env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
        log.info("running %s", " ".join(command))
        try:
            code = subprocess.run(command, env=env, stdin=subprocess.DEVNULL).returncode  # its log is the pod's log
        except FileNotFoundError:
            raise SpecError("generate.vllm_image", self.settings.vllm_image, "an image with vLLM's `vllm` command, such as the official vllm/vllm-openai") from None
        if code != 0:
            raise EngineError(f"vllm run-batch exited with code {code}", "Its log lines above say why; the shard retries the chunk")


class SeededSampling:
    """Picks each row of a batch with its own request's seed, temperature and top_p (a decoding.Pick).

    Transformers' own sampling draws every row from one generator, so a prompt's answer would
    depend on which prompts share its batch, and generate.batch_prompts is a throughput knob,
    left out of the settings hash: with a generator per row, a prompt samples the same in any batch."""

    def __init__(self, requests: list[dict[str, Any]], device) -> None:
        import torch

        self.temperature = torch.tensor([[r["temperature"]] for r in requests], device=device)
        self.top_p = torch.tensor([[r["top_p"]] for r in requests], device=device)
        self.generators = [torch.Generator(device).manual_seed(r["seed"]) for r in requests]

    def __call__(self, logits):
        import torch

        probs = torch.softmax(logits / self.temperature, dim=-1)  # [B, V]
        ranked, order = probs.sort(dim=-1, descending=True)
        # Nucleus: the most likely tokens until their mass reaches top_p (the first always stays).
        ranked[ranked.cumsum(-1) - ranked >= self.top_p] = 0
        picks = torch.cat([torch.multinomial(row, 1, generator=g) for row, g in zip(ranked, self.generators)])  # [B]
        return order.gather(1, picks[:, None])[:, 0]  # [B]


class TransformersEngine:
    """A Transformers causal LM answering batches of `rows` prompts (generate.batch_prompts, `auto` sized
    for the target, the device and prompts up to `max_length` tokens: sizing.py), each chunk's prompts
    sorted by length (shortest first: a batch pads little, and reuses the static decoder's cache and
    graphs), left-padded, each batch decoded by `decoder` (default: the fastest that fits the target,
    decoding.pick_decoder, its step compiled as generate.compile says for the device)."""

    name = "transformers"

    def __init__(self, settings: GenerateSpec, *, model, tokenizer, device, max_length: int, decoder: Decoder | None = None) -> None:
        self.settings = settings
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        eos = getattr(model.generation_config, "eos_token_id", None)
        eos = model.config.eos_token_id if eos is None else eos
        self.stop_ids = set([eos] if isinstance(eos, int) else eos or ()) | ({tokenizer.eos_token_id} - {None})
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.stop_ids)
        self.decoder = decoder or pick_decoder(model, stop_ids=self.stop_ids, pad_id=self.pad_id, compile=settings.compiled_on(device.type))
        self.rows, why = batch_rows(settings, model, device, max_length=max_length)
        log.info("transformers engine: decoding with %s, %d prompts a batch (%s)", self.decoder.name, self.rows, why)

    @classmethod
    def load(cls, settings: GenerateSpec, checkpoint: Path, *, tokenizer, device, attn_implementation: str, max_length: int) -> TransformersEngine:
        import torch
        from transformers import AutoModelForCausalLM

        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, attn_implementation=attn_implementation)
        return cls(settings, model=model.to(device).eval(), tokenizer=tokenizer, device=device, max_length=max_length)

    def run(self, requests: Path, outputs: Path) -> None:
        import torch

        pending: list[tuple[str, list[int], dict[str, Any]]] = []
        with open(requests) as source, open(outputs, "w") as sink:
            for line in source:
                record = json.loads(line)
                try:
                    ids = self.encode(record["body"])
                except Exception as exc:  # noqa: BLE001 - jinja raises anything; vLLM answers such a request 400
                    self.write(sink, error_line(record["custom_id"], status=400, message=f"chat template: {type(exc).__name__}: {exc}"))
                    continue
                pending.append((record["custom_id"], ids, record["body"]))
            pending.sort(key=lambda item: len(item[1]))  # stable: prompts of one length keep their order
            size = self.rows
            for begin in range(0, len(pending), size):
                with torch.inference_mode():
                    for answer in self.generate(pending[begin : begin + size]):
                        self.write(sink, answer)

    def encode(self, body: dict[str, Any]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            body["messages"], tools=body.get("tools"), tokenize=False, add_generation_prompt=True, **body.get("chat_template_kwargs", {}),
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def generate(self, batch: list[tuple[str, list[int], dict[str, Any]]]) -> list[dict[str, Any]]:
        import torch

        longest = max(len(ids) for _, ids, _ in batch)
        input_ids = torch.full((len(batch), longest), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, (_, ids, _) in enumerate(batch):
            input_ids[row, longest - len(ids):] = torch.tensor(ids)
            attention[row, longest - len(ids):] = 1
        requests = [body for _, _, body in batch]
        limit = max(body["max_completion_tokens"] for body in requests)
        pick = SeededSampling(requests, self.device) if requests[0]["temperature"] > 0 else greedy
        output = self.decoder(input_ids.to(self.device), attention.to(self.device), limit, pick).tolist()
        answers = []
        for row, (request_id, ids, request) in enumerate(batch):
            generated = output[row]
            stop = next((i for i, token in enumerate(generated) if token in self.stop_ids), None)
            own_limit = request["max_completion_tokens"]
            # As vLLM answers: the ids end with the end token the target stopped on, the text leaves it out.
            if stop is not None and stop < own_limit:
                tokens, reason = generated[: stop + 1], "stop"
            else:
                tokens, reason = generated[:own_limit], "length"
            said = tokens[:-1] if reason == "stop" else tokens
            answers.append(completion_line(
                request_id, model=request["model"], content=self.tokenizer.decode(said, skip_special_tokens=True),
                finish_reason=reason, prompt_ids=ids, token_ids=tokens if request.get("return_token_ids") else None,
                completion_tokens=len(tokens),
            ))
        return answers

    @staticmethod
    def write(sink, record: dict[str, Any]) -> None:
        sink.write(json.dumps(record) + "\n")
        sink.flush()
