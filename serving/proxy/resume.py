"""Streams that survive a replica (issue 25 #3).

A streamed chat or completions request (`n` 1) whose replica dies or breaks off after the answer's
first byte goes on on another READY replica of the model: the proxy sends the request again with
the text streamed so far as the start of the answer (chat: the final assistant message, which
llama-server continues by default and vLLM with `continue_final_message`; completions: appended
to the prompt), `max_tokens` less the tokens already streamed. The client sees one stream: a
comment line `: resumed ...`, then the new replica's events under the first stream's id, without
the role-only chunk that opens every stream, one `data: [DONE]`, and a usage chunk that counts the
prompt once (the engine's count of the original request) and every completion token of both parts.

Only what can be continued exactly is resumed: plain text deltas (a stream that carried tool calls
or reasoning is not), on llama-server and vLLM (llama-cpp-python renders a final assistant message
as a closed turn). At most XGEN_STREAM_RESUME_MAX times per request; `X-XGEN-Resume: off` turns it
off for one. The request log's `resumes` field and `xgen_stream_resumes` count them.

What the first stream carried is kept as it passed (bounded by KEEP_MAX) and read only when it
breaks: a stream that does not break costs a list append per chunk.
"""
from __future__ import annotations

import json
import logging

from django.conf import settings

from serving.proxy import metrics
from serving.proxy.usage_reader import sse_payloads

log = logging.getLogger("xgen.proxy")

# How each engine continues a final assistant message: llama-server by default (its
# --no-prefill-assistant turns that off), and its answer repeats that message first (stripped
# here); vLLM when asked, with only the new text.
ENGINES: dict[str, dict] = {"llama-server": {}, "vllm": {"continue_final_message": True, "add_generation_prompt": False}}
ECHOES = frozenset({"llama-server"})
SHAPES = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
HEADER = b"x-xgen-resume"
OFF = frozenset({b"off", b"0", b"false", b"no"})
KEEP_MAX = 2 << 20  # bytes of a stream's events kept for a resume (~14,000 tokens of chat chunks); past it, not resumed
LIMIT_KEYS = ("max_tokens", "max_completion_tokens", "n_predict")


def plan(payload: dict, upstream_path: str, headers: list[tuple[bytes, bytes]], candidates: list) -> Resume | None:
    """A Resume for a request whose stream may go on on another replica; None when it may not."""
    shape = SHAPES.get(upstream_path)
    if (shape is None or settings.STREAM_RESUME_MAX <= 0 or payload.get("stream") is not True
            or payload.get("n", 1) not in (1, None) or len(candidates) < 2):
        return None
    if any(name == HEADER and value.strip().lower() in OFF for name, value in headers):
        return None
    if any(c.backend not in ENGINES for c in candidates):
        return None
    if shape == "completions" and not isinstance(payload.get("prompt"), str):
        return None
    if shape == "chat":
        messages = payload.get("messages")
        if not isinstance(messages, list) or not messages or (
                isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant"):
            return None  # the client's own prefill: the engines differ in what they repeat of it
    return Resume(shape)


class Resume:
    """One request's resumes: the events its current stream carried, and how the next stream's
    events are rewritten to read as the first's."""

    __slots__ = ("shape", "kept", "kept_size", "resumes", "first_id", "opened", "carried", "done_text", "ttft_s",
                 "echo")

    def __init__(self, shape: str) -> None:
        self.shape = shape
        self.kept: list[bytes] = []  # whole events of the stream now relayed, as they passed
        self.kept_size = 0
        self.resumes = 0
        self.first_id: str | None = None  # the first stream's id, which every resumed event carries
        self.opened = False  # the resumed stream's role-only opening chunk has passed (dropped)
        self.carried = 0  # completion tokens the broken streams streamed (one per text event)
        self.done_text = ""  # the text they streamed
        self.ttft_s: float | None = None  # the first stream's first token, from the request's start
        self.echo = ""  # what the resumed stream repeats before its new text (llama-server), still to strip

    def keep(self, events: bytes) -> None:
        """Note whole events of the current stream (what a resume reads)."""
        if self.kept_size <= KEEP_MAX:
            self.kept.append(events)
            self.kept_size += len(events)

    def text_so_far(self) -> tuple[str, int] | None:
        """The text the current stream carried and its text events (tokens), or None when what it
        carried cannot be continued exactly (tool calls, reasoning, more choices, too much kept)."""
        if self.kept_size > KEEP_MAX:
            return None
        parts: list[str] = []
        events = 0
        for payload in sse_payloads(b"".join(self.kept)):
            if payload == b"[DONE]":
                return None
            try:
                event = json.loads(payload)
            except (ValueError, UnicodeDecodeError, RecursionError):
                return None
            if not isinstance(event, dict) or "error" in event:
                return None
            if self.first_id is None and isinstance(event.get("id"), str):
                self.first_id = event["id"]
            choices = event.get("choices")
            if not isinstance(choices, list):
                return None
            for choice in choices:
                if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                    return None
                if choice.get("finish_reason"):
                    return None  # it had ended: nothing to go on with
                if self.shape == "chat":
                    delta = choice.get("delta")
                    if not isinstance(delta, dict):
                        return None
                    if delta.get("tool_calls") or delta.get("reasoning_content") or delta.get("function_call"):
                        return None
                    text = delta.get("content")
                else:
                    text = choice.get("text")
                if text is None:
                    continue
                if not isinstance(text, str):
                    return None
                if text:
                    parts.append(text)
                    events += 1
        return "".join(parts), events

    def next_body(self, body: bytes, engine: str, text: str, tokens: int) -> bytes | None:
        """The request again, going on from `text` (`tokens` streamed); None when nothing is left to
        generate or the body cannot carry it."""
        try:
            payload = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return None
        for key in LIMIT_KEYS:
            limit = payload.get(key)
            if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
                if limit - tokens <= 0:
                    return None
                payload[key] = limit - tokens
        if text:
            if self.shape == "chat":
                payload["messages"] = [*payload["messages"], {"role": "assistant", "content": text}]
                payload.update(ENGINES.get(engine, {}))
            else:
                payload["prompt"] = payload["prompt"] + text
        return json.dumps(payload).encode()

    def begin_resume(self, text: str, tokens: int, engine: str) -> None:
        """A new stream on `engine` takes over: what the broken one streamed is carried, its events
        forgotten."""
        self.resumes += 1
        self.carried += tokens
        self.done_text += text
        self.kept, self.kept_size = [], 0
        self.opened = False
        self.echo = self.done_text if self.shape == "chat" and engine in ECHOES else ""

    def rewrite(self, events: bytes, *, billed_prompt: int | None) -> bytes:
        """A resumed stream's whole events as the client's one stream shows them: the role-only
        opening chunk dropped, the first stream's id, usage counting the prompt once (the original
        request's, `billed_prompt`) and the completion of every part."""
        out: list[bytes] = []
        for raw in events.replace(b"\r\n", b"\n").split(b"\n\n"):
            if not raw.strip():
                continue
            lines = [line[5:].strip() for line in raw.split(b"\n") if line.startswith(b"data:")]
            payload = b"\n".join(lines)
            if not lines or payload == b"[DONE]":
                out.append(raw + b"\n\n")
                continue
            try:
                event = json.loads(payload)
            except (ValueError, UnicodeDecodeError, RecursionError):
                out.append(raw + b"\n\n")
                continue
            if not isinstance(event, dict):
                out.append(raw + b"\n\n")
                continue
            if not self.opened and self._opening(event):
                self.opened = True
                continue
            self.opened = True
            if self.echo and not self._strip_echo(event):
                continue
            if self.first_id is not None and isinstance(event.get("id"), str):
                event["id"] = self.first_id
            usage = event.get("usage")
            if isinstance(usage, dict):
                completion = usage.get("completion_tokens")
                if isinstance(completion, int):
                    usage["completion_tokens"] = completion + self.carried
                if billed_prompt is not None:
                    usage["prompt_tokens"] = billed_prompt
                if isinstance(usage.get("prompt_tokens"), int) and isinstance(usage.get("completion_tokens"), int):
                    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            out.append(b"data: " + json.dumps(event).encode() + b"\n\n")
        return b"".join(out)

    def _strip_echo(self, event: dict) -> bool:
        """Take what the engine repeats of the prefill out of `event`'s text; False when nothing
        of the event is left to send."""
        choices = event.get("choices")
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            return True
        delta = choices[0].get("delta")
        content = delta.get("content") if isinstance(delta, dict) else None
        if not isinstance(delta, dict) or not isinstance(content, str) or not content:
            return True
        if content.startswith(self.echo):
            delta["content"], self.echo = content[len(self.echo):], ""
        elif self.echo.startswith(content):
            delta["content"], self.echo = "", self.echo[len(content):]
        else:
            log.warning("a resumed stream did not repeat its prefill as expected (%r...); sent as it came",
                        content[:40])
            self.echo = ""
            return True
        return bool(delta["content"]) or bool(choices[0].get("finish_reason")) or event.get("usage") is not None

    def _opening(self, event: dict) -> bool:
        """Whether `event` is a stream's opening chunk that carries no text (a role, an empty content)."""
        choices = event.get("choices")
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            return False
        choice = choices[0]
        if choice.get("finish_reason"):
            return False
        if self.shape == "chat":
            delta = choice.get("delta")
            return isinstance(delta, dict) and not delta.get("content") and not delta.get("tool_calls") and (
                set(delta) <= {"role", "content"})
        return not choice.get("text")


def count(model: str, outcome: str) -> None:
    metrics.STREAM_RESUMES.labels(model, outcome).inc()
