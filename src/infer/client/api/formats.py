"""The HTTP front's response formats: OpenAI's completion and chat completion objects and their stream chunks
(text, logprobs, tool calls, reasoning content), usage, best-of-n, server-sent events."""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import math
import struct
import time
import uuid
from typing import TYPE_CHECKING, Any

from infer.client.api.reasoning import ReasoningSplitter
from infer.client.api.tools import PARSERS, ToolCall, ToolCallStream, calls_of_required, new_call_id
from infer.protocol.codes import FinishReason
from infer.protocol.outputs import Completion, RequestOutput, TokenLogprobs

if TYPE_CHECKING:
    from infer.client.api.jobs import Job
    from infer.client.api.tokenization import Tokenization

log = logging.getLogger("infer.api")


class ResponseFormat:
    """How one endpoint shapes its JSON: the whole response, stream chunks, the usage chunk."""

    object_name = ""
    chunk_object_name = ""
    id_prefix = ""

    def __init__(self, body: Any, tok: Tokenization) -> None:
        self.body = body
        self.tok = tok  # the tokenization of the model the body runs on: token strings, parsers
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = body.model

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model, "choices": choices}

    def response(self, jobs: list[Job], usage_of: list[Job] | None = None) -> dict[str, Any]:
        """The whole answer with `jobs` as its choices; usage counts `usage_of` (every candidate of best_of)."""
        out = self._envelope(self.object_name, [self.choice(job) for job in jobs])
        out["usage"] = _usage(jobs if usage_of is None else usage_of)
        return out

    def usage_chunk(self, jobs: list[Job]) -> dict[str, Any]:
        out = self._envelope(self.chunk_object_name, [])
        out["usage"] = _usage(jobs)
        return out

    def opening_chunks(self, jobs: list[Job]) -> list[dict[str, Any]]:
        """The chunks that open a stream, one per job (in order), or none."""
        return []

    @staticmethod
    def with_usage(chunk: dict[str, Any], job: Job) -> dict[str, Any]:
        """stream_options.continuous_usage_stats (vLLM's): the chunk with its choice's usage so far (the prompt's
        tokens, the tokens generated up to and including this chunk)."""
        chunk["usage"] = _usage([job])
        return chunk

    def choice(self, job: Job) -> dict[str, Any]:
        raise NotImplementedError

    def chunks(self, job: Job, delta: RequestOutput) -> list[dict[str, Any]]:
        """The SSE chunks of one delta (`job` has taken it in already); none for a delta with nothing to
        show (no text, logprobs or end)."""
        if not delta.text and not delta.finished and not delta.logprobs:
            return []
        return [self._envelope(self.chunk_object_name, [self.chunk_choice(job, delta)])]

    def chunk_choice(self, job: Job, delta: RequestOutput) -> dict[str, Any]:
        raise NotImplementedError


class CompletionFormat(ResponseFormat):
    object_name = "text_completion"
    chunk_object_name = "text_completion"
    id_prefix = "cmpl"

    def choice(self, job: Job) -> dict[str, Any]:
        logprobs = None
        if self.body.logprobs is not None:
            logprobs = self._logprobs(job.token_ids, job.logprobs, len(job.echo))
            if self.body.echo:
                logprobs = self._with_prompt(job, logprobs)
        out = {
            "index": job.index,
            "text": job.echo + job.text,
            "finish_reason": job.finish_reason,
            "logprobs": logprobs,
        }
        if self.body.prompt_logprobs is not None:
            out["prompt_logprobs"] = prompt_logprobs_json(self.tok, job, self.body.prompt_logprobs)
        return out

    def _with_prompt(self, job: Job, completion: dict[str, Any]) -> dict[str, Any]:
        """echo with logprobs: the prompt's tokens first (the first with no logprob), then the completion's."""
        rows = job.prompt_logprobs or []
        ids = job.prompt_token_ids
        head = self._logprobs(ids[1:], rows, 0)
        first = self.tok.token_text(ids[0])
        offsets = [0] + [o + len(first) for o in head["text_offset"]]
        return {
            "tokens": [first, *head["tokens"], *completion["tokens"]],
            "token_logprobs": [None, *head["token_logprobs"], *completion["token_logprobs"]],
            "top_logprobs": [None, *head["top_logprobs"], *completion["top_logprobs"]],
            "text_offset": [*offsets, *completion["text_offset"]],
        }

    def chunk_choice(self, job: Job, delta: RequestOutput) -> dict[str, Any]:
        logprobs = None
        if self.body.logprobs is not None and delta.logprobs:
            start = len(job.text) - len(delta.text)
            logprobs = self._logprobs(delta.token_ids, delta.logprobs, start)
        text, job.echo = job.echo + delta.text, ""  # the prompt's text goes out once, before the first text
        return {"index": job.index, "text": text, "logprobs": logprobs, "finish_reason": delta.finish_reason}

    def _logprobs(self, token_ids: list[int], rows: list[TokenLogprobs], offset: int) -> dict[str, Any]:
        text = self.tok.token_text
        n = self.body.logprobs or 0
        tokens, token_lps, tops, offsets = [], [], [], []
        for token_id, row in zip(token_ids, rows):
            piece = text(token_id)
            tokens.append(piece)
            token_lps.append(_finite(row.get(token_id)))
            tops.append({text(t): _finite(lp) for t, lp in _top(row, n)})
            offsets.append(offset)
            offset += len(piece)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


class ChatFormat(ResponseFormat):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, body: Any, tok: Tokenization) -> None:
        super().__init__(body, tok)
        self.tool_mode = body.tool_mode
        self.reasoning = tok.reasoning_parser
        self.parse_tools = PARSERS[tok.tool_call_parser]
        self._splitters: dict[int, ReasoningSplitter] = {}
        self._tool_streams: dict[int, ToolCallStream] = {}

    def choice(self, job: Job) -> dict[str, Any]:
        message, finish_reason = self._message(job)
        out = {
            "index": job.index,
            "message": message,
            "logprobs": self._logprobs(job.token_ids, job.logprobs) if job.params.logprobs is not None else None,
            "finish_reason": finish_reason,
        }
        if self.body.prompt_logprobs is not None:
            out["prompt_logprobs"] = prompt_logprobs_json(self.tok, job, self.body.prompt_logprobs)
        return out

    def _message(self, job: Job) -> tuple[dict[str, Any], str | None]:
        """A finished job's assistant message (reasoning split off, tool calls parsed) and its finish_reason
        ("tool_calls" when it called tools)."""
        reasoning, content = ReasoningSplitter(self.reasoning).split(job.text) if self.reasoning else (None, job.text)
        calls: list[ToolCall] = []
        if self.tool_mode is not None and content:
            content, calls = self._tool_calls(job, content)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
        return message, "tool_calls" if calls and job.finish_reason == FinishReason.STOP else job.finish_reason

    def _tool_calls(self, job: Job, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.tool_mode == "named":
            try:
                arguments = json.loads(text)
            except ValueError:
                return text, []  # cut short by max_tokens: the text as it is
            name = self.body.tool_choice.function.name
            return None, [ToolCall(name, json.dumps(arguments, ensure_ascii=False), new_call_id())]
        if self.tool_mode == "required":  # cut at max_tokens: the complete calls it holds
            calls = calls_of_required(text, truncated=job.finish_reason == FinishReason.LENGTH)
            return (text, []) if calls is None else (None, calls)
        return self.parse_tools(text)

    def chunks(self, job: Job, delta: RequestOutput) -> list[dict[str, Any]]:
        if self.tool_mode is not None:
            return self._tool_chunks(job, delta)
        if self.reasoning:
            return self._reasoning_chunks(job, delta)
        return super().chunks(job, delta)

    def _tool_chunks(self, job: Job, delta: RequestOutput) -> list[dict[str, Any]]:
        """With tools, content streams as it comes and each call once it is complete (tools.ToolCallStream), in
        OpenAI's shape: a call's chunk has its index, id, name and arguments (a named function's arguments
        follow its opening chunk in pieces); the finish reason is "tool_calls" when the output called tools."""
        stream = self._tool_streams.get(job.index)
        if stream is None:
            named = self.body.tool_choice.function.name if self.tool_mode == "named" else None
            stream = self._tool_streams[job.index] = ToolCallStream(self.tool_mode, self.tok.tool_call_parser, named)
        reasoning, text = self._split_reasoning(job, delta)
        content, events = stream.feed(text)
        if delta.finished:
            more, last = stream.finish()
            content, events = content + more, events + last
        out = [self._chunk_of(job, {"reasoning_content": reasoning}, None)] if reasoning else []
        if content:
            out.append(self._chunk_of(job, {"content": content}, None))
        calls = stream.calls - sum(isinstance(e, ToolCall) for e in events)  # index of the next call
        for event in events:
            if isinstance(event, ToolCall):
                call = {
                    "index": calls,
                    "id": event.id,
                    "type": "function",
                    "function": {"name": event.name, "arguments": event.arguments},
                }
                calls += 1
            else:  # a piece of the named function's arguments
                call = {"index": 0, "function": {"arguments": event}}
            out.append(self._chunk_of(job, {"tool_calls": [call]}, None))
        if delta.finished:
            reason = "tool_calls" if stream.calls and delta.finish_reason == FinishReason.STOP else delta.finish_reason
            out.append(self._chunk_of(job, {}, reason))
        return out

    def _split_reasoning(self, job: Job, delta: RequestOutput) -> tuple[str, str]:
        """(reasoning, content) of a delta's text: all content without a reasoning parser."""
        if not self.reasoning:
            return "", delta.text
        splitter = self._splitters.setdefault(job.index, ReasoningSplitter(self.reasoning))
        reasoning, content = splitter.feed(delta.text)
        if delta.finished:
            rest = splitter.finish()
            reasoning, content = reasoning + rest[0], content + rest[1]
        return reasoning, content

    def _reasoning_chunks(self, job: Job, delta: RequestOutput) -> list[dict[str, Any]]:
        reasoning, content = self._split_reasoning(job, delta)
        fields = {k: v for k, v in (("reasoning_content", reasoning), ("content", content)) if v}
        if not fields and not delta.finished:
            return []
        return [self._chunk_of(job, fields, delta.finish_reason)]

    def _chunk_of(self, job: Job, fields: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        return self._envelope(
            self.chunk_object_name,
            [{"index": job.index, "delta": fields, "logprobs": None, "finish_reason": finish_reason}],
        )

    def opening_chunks(self, jobs: list[Job]) -> list[dict[str, Any]]:
        return [
            self._envelope(
                self.chunk_object_name,
                [
                    {
                        "index": job.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            )
            for job in jobs
        ]

    def chunk_choice(self, job: Job, delta: RequestOutput) -> dict[str, Any]:
        logprobs = None
        if job.params.logprobs is not None and delta.logprobs:
            logprobs = self._logprobs(delta.token_ids, delta.logprobs)
        content = {"content": delta.text} if delta.text or not delta.finished else {}
        return {"index": job.index, "delta": content, "logprobs": logprobs, "finish_reason": delta.finish_reason}

    def _logprobs(self, token_ids: list[int], rows: list[TokenLogprobs]) -> dict[str, Any]:
        text = self.tok.token_text
        n = self.body.top_logprobs or 0
        content = []
        for token_id, row in zip(token_ids, rows):
            piece = text(token_id)
            top = [
                {"token": text(t), "logprob": _finite(lp), "bytes": list(text(t).encode())} for t, lp in _top(row, n)
            ]
            content.append(
                {
                    "token": piece,
                    "logprob": _finite(row.get(token_id)),
                    "bytes": list(piece.encode()),
                    "top_logprobs": top,
                }
            )
        return {"content": content}


def prompt_logprobs_json(tok: Tokenization, job: Job, n: int) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per token {id: {logprob,
    decoded_token}} for the token itself and the top n."""
    out: list[dict[str, Any] | None] = [None]
    for token_id, row in zip(job.prompt_token_ids[1:], job.prompt_logprobs or []):
        keep: dict[int, float | None] = dict(_top(row, n))
        keep[token_id] = row.get(token_id)  # None (reported as -9999) where the row lacks the token
        out.append({str(t): {"logprob": _finite(lp), "decoded_token": tok.token_text(t)} for t, lp in keep.items()})
    return out


def num_candidates(body: Any) -> int:
    """Engine requests per prompt: completions' best_of (>= n) when given, else n; 1 for a beam search (its beams
    run in one engine request)."""
    if body.use_beam_search:
        return 1
    return getattr(body, "best_of", None) or body.n


def beam_choices(jobs: list[Job], n: int) -> list[Job]:
    """Each beam-search job (one per prompt) as the n choices of its prompt: its best n beams, best first."""
    choices = []
    for job in jobs:
        for rank, beam in enumerate(job.beams or ()):
            choice = dataclasses.replace(job, index=job.prompt_index * n + rank)
            choice.completion = Completion(
                job.request_id,
                job.prompt_token_ids,
                token_ids=list(beam.token_ids),
                text=beam.text,
                finish_reason=beam.finish_reason,
                prompt_logprobs=job.completion.prompt_logprobs,
            )
            choices.append(choice)
    return choices


def best_of(jobs: list[Job], n: int) -> list[Job]:
    """Per prompt, the n candidates with the highest sum of sampled-token logprobs (OpenAI's best_of),
    renumbered as choices 0..n-1 of their prompt; all of them when there are no more than n."""
    by_prompt: dict[int, list[Job]] = {}
    for job in jobs:
        by_prompt.setdefault(job.prompt_index, []).append(job)
    if all(len(group) <= n for group in by_prompt.values()):
        return jobs
    chosen = []
    for p, group in sorted(by_prompt.items()):
        ranked = sorted(group, key=lambda job: -sum(_finite(row.get(t)) for t, row in zip(job.token_ids, job.logprobs)))
        for rank, job in enumerate(ranked[:n]):
            job.index = p * n + rank
            chosen.append(job)
    return chosen


def _top(row: TokenLogprobs, n: int) -> list[tuple[int, float]]:
    """The n most likely tokens of a logprobs row (the row holds the top n plus the sampled token)."""
    return sorted(row.items(), key=lambda kv: -kv[1])[:n]


def _finite(value: float | None) -> float:
    """JSON has no -inf: a token the sampler could not pick (masked) reports OpenAI's floor, -9999."""
    if value is None or value != value or value == float("-inf"):
        return -9999.0
    return value


def _usage(jobs: list[Job]) -> dict[str, int]:
    per_prompt = {job.prompt_index: job.num_prompt_tokens or len(job.prompt_token_ids) for job in jobs}
    prompt = sum(per_prompt.values())
    completion = sum(len(job.token_ids) for job in jobs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def embedding_json(vector: list[float], dimensions: int | None, normalize: bool, encoding: str) -> list[float] | str:
    """An embedding as OpenAI sends it: floats, or base64 of little-endian float32 (what the openai client asks for
    and decodes). `dimensions`: the first that many, normalized again when the vector was (Matryoshka)."""
    if dimensions is not None and dimensions < len(vector):
        vector = vector[:dimensions]
        if normalize:
            norm = math.sqrt(sum(v * v for v in vector)) or 1.0
            vector = [v / norm for v in vector]
    if encoding == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def sse_event(payload: dict[str, Any]) -> str:
    """One SSE event; text that is not valid Unicode (it cannot be sent as UTF-8) goes \\u-escaped."""
    text = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(payload, separators=(",", ":"))
    return f"data: {text}\n\n"
