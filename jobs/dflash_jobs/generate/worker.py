"""The generation loop of one shard: its chunks of data.source -> batch file -> engine -> chat rows.

    for each chunk this shard owns that has no valid done marker:
        read its lines -> prompts (bad lines counted by reason) -> prompt lengths (over-long ones dropped)
        -> request JSONL -> engine -> response JSONL -> rows (failed, empty, truncated: by the spec)
        -> store generate/chunks/<id>.jsonl, then its done marker
    when every chunk of the plan is done: generate/manifest.json; a warning if it dropped over a
        quarter of the lines, and InputError (exit 42) if it keeps no more rows than data.holdout

A killed pod loses the chunk in flight, nothing else: a chunk without a marker does not exist.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any

from dflash_jobs.balance import balance_by_tokens
from dflash_jobs.generate import batch
from dflash_jobs.generate.engines import SERVED_MODEL, Engine
from dflash_jobs.generation import (
    EMPTY_ANSWER, ENGINE_ERROR, OVER_CONTEXT, TRUNCATED, ChunkMarker, GenerationPlan, SourceChunk, chunk_key, done_key,
    done_markers, generation_settings, settings_hash, write_manifest_if_complete,
)
from dflash_jobs.generate.progress import Progress, Summary
from dflash_jobs.generate.source import Prompt, Source, load_plan, prompts_of
from dflash_jobs.rows import TEMPLATE_ERROR, BadRow
from dflash_jobs.errors import SpecError
from dflash_jobs.spec import VLLM_IMAGE, GenerateSpec, RunSpec
from dflash_jobs.storage import Storage, storage_for

log = logging.getLogger("dflash.generate")

DETAIL_CHARS = 300
LOGGED_BAD_ROWS = 20


def assign_chunks(plan: GenerationPlan, shards: int) -> list[list[SourceChunk]]:
    """Every shard's chunks, balanced by estimated tokens (a pure function of the plan and `shards`)."""
    return balance_by_tokens(plan.chunks, shards, tokens=lambda c: c.weight, ident=lambda c: c.id)


def prompt_seed(seed: int, sample_id: int) -> int:
    """A prompt's own sampling seed: the same prompt samples the same, in whatever batch it runs."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{sample_id}".encode()).digest()[:4], "little") & 0x7FFFFFFF


def generated_row(prompt: Prompt, answer: batch.Answer) -> dict[str, Any]:
    """The chat row prepare reads: the prompt, earlier assistant turns with weight 0, the target's
    answer, and how it was generated: `generation.token_ids` is the answer as the target sampled it
    (its end token included, none when cut at the limit), which prepare trains on; the text is for
    people and older readers."""
    messages = [{**m, "weight": 0} if m["role"] == "assistant" else m for m in prompt.messages]
    reply: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if answer.reasoning:
        reply["reasoning_content"] = answer.reasoning
    if answer.tool_calls:
        reply["tool_calls"] = answer.tool_calls
    row: dict[str, Any] = {"sample_id": prompt.sample_id, "messages": [*messages, reply]}
    if prompt.tools is not None:
        row["tools"] = prompt.tools
    row["generation"] = {"finish_reason": answer.finish_reason, "prompt_tokens": answer.prompt_tokens,
                         "completion_tokens": answer.completion_tokens, "token_ids": answer.token_ids}
    return row


@dataclass(slots=True)
class ChunkOutcome:
    """What became of one chunk's lines."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    dropped: Counter = field(default_factory=Counter)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    truncated_kept: int = 0
    empty_kept: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def reject(self, sample_id: int, reason: str, detail: str) -> None:
        self.dropped[reason] += 1
        self.rejected.append({"line": sample_id + 1, "sample_id": sample_id, "reason": reason, "detail": detail[:DETAIL_CHARS]})


@dataclass(eq=False)
class GenerateWorker:
    """Generates the answers of one shard's chunks."""

    spec: RunSpec
    _: KW_ONLY
    storage: Storage
    source: Source
    plan: GenerationPlan
    tokenizer: Any
    engine: Engine
    summary: Summary
    workdir: Path
    log_interval: float = 10.0
    settings: GenerateSpec = field(init=False)
    settings_hash: str = field(init=False)
    logged_bad: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        assert self.spec.generate is not None
        self.settings = self.spec.generate
        self.settings_hash = settings_hash(generation_settings(self.spec))

    def run(self) -> Summary:
        summary = self.summary
        mine = assign_chunks(self.plan, summary.shards)[summary.shard]
        done = done_markers(self.storage, mine, self.settings_hash)
        pending = [chunk for chunk in mine if chunk.id not in done]
        summary.engine = self.engine.name
        summary.chunks_total, summary.chunks_skipped = len(mine), len(mine) - len(pending)
        prompts = sum(c.lines for c in pending)
        log.info("shard %d/%d: %d chunks, %d already done, %d to generate (%s prompts) with %s",
                 summary.shard, summary.shards, len(mine), summary.chunks_skipped, len(pending), f"{prompts:,}", self.engine.name)
        for chunk in pending:
            # A marker of other settings, or without its object: it must not stand for the chunk redone here.
            self.storage.delete(done_key(chunk.id))
        shutil.rmtree(self.workdir, ignore_errors=True)  # files of a killed predecessor
        progress = Progress(summary, pending_prompts=prompts, pending_chunks=len(pending), interval=self.log_interval)
        for chunk in pending:
            progress.committed(self.generate_chunk(chunk, progress))
            progress.log()
        manifest = write_manifest_if_complete(self.storage, self.spec)
        summary.manifest = manifest is not None
        if manifest is not None:
            log.info("every chunk is done: generate/manifest.json lists %d rows of %d lines; dropped %s; truncated kept %d",
                     manifest.rows, manifest.lines, manifest.dropped or "none", manifest.truncated_kept)
            warning = manifest.drop_warning()
            if warning:
                log.warning("%s", warning)
            too_few = manifest.too_few_rows(self.spec.data.holdout)
            if too_few is not None:
                raise too_few
        else:
            log.info("shard %d/%d done; other shards still have chunks to generate", summary.shard, summary.shards)
        return summary

    def generate_chunk(self, chunk: SourceChunk, progress: Progress) -> ChunkMarker:
        started = time.monotonic()
        outcome = ChunkOutcome()
        prompts = self.prompts(chunk, outcome)
        directory = self.workdir / f"{chunk.id:06d}"
        directory.mkdir(parents=True, exist_ok=True)
        requests, outputs = directory / "requests.jsonl", directory / "outputs.jsonl"
        with open(requests, "w") as f:
            for prompt, max_tokens in prompts:
                line = batch.request(
                    prompt.sample_id, prompt.messages, tools=prompt.tools, model=SERVED_MODEL, settings=self.settings,
                    max_tokens=max_tokens, seed=prompt_seed(self.settings.seed, prompt.sample_id),
                )
                f.write(json.dumps(line) + "\n")
        answers: dict[int, batch.Answer | batch.Failure] = {}
        if prompts:
            with progress.watching(chunk.id, len(prompts), outputs):
                self.engine.run(requests, outputs)
            with open(outputs, "rb") as f:
                for line in f:
                    if line.strip():
                        result = batch.parse_output(line)
                        if isinstance(result, batch.Answer) and result.token_ids is None:
                            raise self.without_token_ids()
                        answers[result.sample_id] = result
        for prompt, _ in prompts:
            self.keep(prompt, answers.get(prompt.sample_id), outcome)
        body = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in outcome.rows).encode()
        stored = self.storage.put_bytes(chunk_key(chunk.id), body)
        marker = ChunkMarker(
            chunk=chunk.id, first_line=chunk.first_line, lines=chunk.lines, rows=len(outcome.rows), bytes=stored.size,
            sha256=stored.sha256, etag=stored.etag, settings=self.settings_hash, dropped=dict(sorted(outcome.dropped.items())),
            rejected=outcome.rejected, truncated_kept=outcome.truncated_kept, empty_kept=outcome.empty_kept,
            prompt_tokens=outcome.prompt_tokens, completion_tokens=outcome.completion_tokens,
            seconds=round(time.monotonic() - started, 2), shard=self.summary.shard, engine=self.engine.name,
        )
        self.storage.put_bytes(done_key(chunk.id), marker.to_json().encode())  # last: the chunk now exists
        shutil.rmtree(directory, ignore_errors=True)
        return marker

    def without_token_ids(self) -> SpecError:
        """An answer came back as text alone: training on it would learn the tokenizer's split of
        the text, not the target's (and <|im_end|> where it stopped on another end token). Only a
        vLLM that ignores the request's return_token_ids does that (the transformers engine always
        returns them); every chunk would fail alike, so the spec is refused, not retried."""
        return SpecError(
            "generate.vllm_image", self.settings.vllm_image,
            "an image whose vLLM returns the answers' token ids (the request's return_token_ids, vLLM 0.10.2 or later, such "
            f"as {VLLM_IMAGE}): this one answered with text alone, and the drafter must learn the tokens the target produced",
        )

    def prompts(self, chunk: SourceChunk, outcome: ChunkOutcome) -> list[tuple[Prompt, int]]:
        """The chunk's prompts with each one's token limit; lines that cannot be asked go to `outcome`."""
        parsed = []
        for sample_id, item in prompts_of(self.source.lines(chunk)):
            if isinstance(item, BadRow):
                self.reject(outcome, sample_id, item.reason, item.detail)
            else:
                parsed.append(item)
        texts = []
        for prompt in parsed:
            try:
                texts.append(self.render(prompt))
            except Exception as exc:  # noqa: BLE001 - jinja raises anything: the row's message says what
                texts.append(BadRow(TEMPLATE_ERROR, f"the chat template failed: {type(exc).__name__}: {exc}"))
        rendered = [text for text in texts if isinstance(text, str)]
        lengths = iter(len(e.ids) for e in self.tokenizer.backend_tokenizer.encode_batch(rendered, add_special_tokens=False))
        asked = []
        max_length = self.spec.data.max_length
        for prompt, text in zip(parsed, texts):
            if isinstance(text, BadRow):
                self.reject(outcome, prompt.sample_id, text.reason, text.detail)
                continue
            length = next(lengths)
            room = max_length - length
            if room < 1:
                self.reject(outcome, prompt.sample_id, OVER_CONTEXT,
                            f"the prompt has {length} tokens: no room for an answer within data.max_length = {max_length}")
                continue
            asked.append((prompt, min(self.settings.max_new_tokens, room)))
        return asked

    def render(self, prompt: Prompt) -> str:
        kwargs = {} if self.settings.thinking is None else {"enable_thinking": self.settings.thinking}
        messages = batch.engine_messages(prompt.messages)
        return self.tokenizer.apply_chat_template(messages, tools=prompt.tools, tokenize=False, add_generation_prompt=True, **kwargs)

    def keep(self, prompt: Prompt, answer: batch.Answer | batch.Failure | None, outcome: ChunkOutcome) -> None:
        """Adds the prompt's row to the outcome, or counts why not (generate.empty and .truncated decide)."""
        if answer is None:
            self.reject(outcome, prompt.sample_id, ENGINE_ERROR, "the engine's output holds no answer to this prompt")
            return
        if isinstance(answer, batch.Failure):
            status = f"status {answer.status}: " if answer.status else ""
            self.reject(outcome, prompt.sample_id, ENGINE_ERROR, f"{status}{answer.message}")
            return
        outcome.prompt_tokens += answer.prompt_tokens
        outcome.completion_tokens += answer.completion_tokens
        if answer.empty:
            if self.settings.empty == "drop":
                self.reject(outcome, prompt.sample_id, EMPTY_ANSWER, f"the answer has no text (finish_reason {answer.finish_reason})")
                return
            outcome.empty_kept += 1
        elif answer.truncated:
            if self.settings.truncated == "drop":
                self.reject(outcome, prompt.sample_id, TRUNCATED, f"the answer was cut at {answer.completion_tokens} tokens (finish_reason length)")
                return
            outcome.truncated_kept += 1
        outcome.rows.append(generated_row(prompt, answer))

    def reject(self, outcome: ChunkOutcome, sample_id: int, reason: str, detail: str) -> None:
        outcome.reject(sample_id, reason, detail)
        self.logged_bad += 1
        if self.logged_bad <= LOGGED_BAD_ROWS:
            log.warning("line %d dropped (%s): %s", sample_id + 1, reason, detail[:DETAIL_CHARS])
            if self.logged_bad == LOGGED_BAD_ROWS:
                log.warning("not logging further dropped lines: counts in each chunk's done marker and generate/manifest.json, "
                            "every one in generate/rejected.jsonl")



# ---- wiring -------------------------------------------------------------------------------------


def build_worker(spec: RunSpec, shard: int, *, summary: Summary) -> GenerateWorker:
    """Everything shard `shard` needs: the plan, the tokenizer, the engine, the output storage."""
    from dflash_jobs.capture.checkpoint import local_checkpoint  # torch: the pods have it (the vLLM image too)
    from dflash_jobs.generate.engines import TransformersEngine, VllmEngine
    from dflash_jobs.rows import ChatEncoder, load_tokenizer

    settings = spec.generate
    assert settings is not None
    storage = storage_for(spec)
    source = Source(spec)
    plan = load_plan(storage, spec, source)
    checkpoint = local_checkpoint(spec)
    tokenizer = load_tokenizer(str(checkpoint))
    ChatEncoder(tokenizer)  # refuses a tokenizer without a chat template, or not a fast one, naming the fix
    if settings.thinking is not None and "enable_thinking" not in tokenizer.chat_template:
        raise SpecError("generate.thinking", settings.thinking, f"null: the chat template of {spec.target.model} has no enable_thinking switch")
    engine: Engine
    if settings.engine == "vllm":
        engine = VllmEngine(settings, checkpoint)
    else:
        from dflash_jobs.devices import pick_device

        engine = TransformersEngine.load(settings, checkpoint, tokenizer=tokenizer, device=pick_device(spec),
                                         attn_implementation=spec.target.attn_implementation, max_length=spec.data.max_length)
    return GenerateWorker(
        spec, storage=storage, source=source, plan=plan, tokenizer=tokenizer, engine=engine, summary=summary,
        workdir=Path(tempfile.gettempdir()) / "dflash-generate" / f"{spec.name}-shard-{shard}",
    )
