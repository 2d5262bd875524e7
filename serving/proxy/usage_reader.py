"""The one reader of the usage an engine reports, in every shape the engines answer in.

- OpenAI chat completions, completions and embeddings: `usage.prompt_tokens` / `completion_tokens`
  (a stream's last chunk when `stream_options.include_usage` was asked).
- Anthropic Messages (llama-server serves it natively): `usage.input_tokens`, `output_tokens`,
  `cache_read_input_tokens`, `cache_creation_input_tokens` (the prompt is their sum: Anthropic
  counts cached input apart); a stream's `message_start` carries the input, `message_delta` the output.
- OpenAI Responses: `usage.input_tokens` / `output_tokens` (cached input is inside input_tokens);
  a stream's `response.completed` event carries it under `response`.
- llama-server's native `/completion` and `/infill`: `tokens_evaluated` / `tokens_predicted` at
  the top level (every streamed event has the running figures; the last says `"stop": true`).

Only the answer's own top level counts (a Responses answer echoes the caller's tools, a
`"verbose": true` answer appends `__verbose` with the generation settings after `usage`: a
member named usage in either is the caller's, not the engine's). Pure parsing, no I/O; the
proxy's hot path calls it once per answer and once per SSE chunk that can carry usage.
"""
from __future__ import annotations

import json
import re

SHAPES = ("chat", "completions", "messages", "responses", "native", "other")
PATH_SHAPES = {
    "/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/messages": "messages",
    "/v1/responses": "responses", "/completion": "native", "/completions": "native", "/infill": "native",
}
# Shapes whose prompt the console can ask the engine to count (a generation with one token).
GENERATION_SHAPES = frozenset({"chat", "completions", "messages", "responses", "native"})
FULL_PARSE_MAX = 64 << 20  # a body without a top-level usage member is parsed whole up to this size

_decoder = json.JSONDecoder()
USAGE_KEY = b'"usage"'
_AFTER_KEY = re.compile(rb"\s*:\s*")
# An SSE chunk worth parsing: a usage object, or a native event's last (`"stop": true`).
_HINT = re.compile(rb'"usage"\s*:\s*\{|"stop"\s*:\s*true')
# A stream's last event: `data: [DONE]` on a line of its own, or a typed last event. Two patterns
# that each start with a literal, so the engine skips ahead to it: as one alternation led by `^`
# the search tried every byte (a 100-event chunk took 579 us, each of these 17-19 us).
_DONE_LINE = re.compile(rb'data:[ \t]*\[DONE\][ \t]*\r?$', re.MULTILINE)
_DONE_START = re.compile(rb'data:[ \t]*\[DONE\]')
_DONE_TYPE = re.compile(rb'"type"\s*:\s*"(?:message_stop|response\.completed)"')
# Events that carry generated text (a token each on llama.cpp's engines), per shape: the count of
# a stream's tokens so far where the engine has not said (a client that left, a stream without usage).
# llama.cpp's engines send an event per token even where its text is empty (a character split
# across tokens); a completion's last event (with its finish_reason) has text and no token.
_TEXT = {
    "chat": re.compile(rb'"(?:content|reasoning_content|arguments)"\s*:\s*"'),
    "completions": re.compile(rb'"text"\s*:\s*"'),
    "messages": re.compile(rb'"type"\s*:\s*"content_block_delta"'),
    "responses": re.compile(rb'"type"\s*:\s*"response\.[a-z_]+\.delta"'),
    "native": re.compile(rb'"content"\s*:\s*"(?!")'),
    "other": re.compile(rb'"(?:content|text)"\s*:\s*"(?!")'),
}
_FINISHED = re.compile(rb'"finish_reason"\s*:\s*"')
_NATIVE_PROMPT = re.compile(rb'"tokens_evaluated"\s*:\s*(\d+)')
_NATIVE_DONE = re.compile(rb'"tokens_predicted"\s*:\s*(\d+)')
_ID = re.compile(rb'"id"\s*:\s*"([A-Za-z0-9_.:\-]{1,128})"')


def shape_of(upstream_path: str) -> str:
    """The answer shape of a backend path (`other`: no usage expected beyond OpenAI's)."""
    return PATH_SHAPES.get(upstream_path, "other")


def _count(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def from_usage(usage) -> tuple[int | None, int | None]:
    """(prompt, completion) of one usage object in any of the shapes; None where it says nothing."""
    if not isinstance(usage, dict):
        return None, None
    prompt = _count(usage.get("prompt_tokens"))
    completion = _count(usage.get("completion_tokens"))
    if prompt is None:
        prompt = _count(usage.get("input_tokens"))
        if prompt is not None:  # Anthropic counts cache reads and writes outside input_tokens
            prompt += (_count(usage.get("cache_read_input_tokens")) or 0) + \
                (_count(usage.get("cache_creation_input_tokens")) or 0)
    if completion is None:
        completion = _count(usage.get("output_tokens"))
    return prompt, completion


def from_object(answer) -> tuple[int | None, int | None]:
    """(prompt, completion) an answer object or stream event states at its own top level (or in
    `message` of message_start, `response` of a Responses event, llama-server's native fields)."""
    if not isinstance(answer, dict):
        return None, None
    prompt, completion = from_usage(answer.get("usage"))
    if prompt is None and completion is None:
        kind = answer.get("type")
        if kind == "message_start":
            prompt, completion = from_usage((answer.get("message") or {}).get("usage"))
        elif isinstance(kind, str) and kind.startswith("response."):
            prompt, completion = from_usage((answer.get("response") or {}).get("usage"))
    if prompt is None:
        prompt = _count(answer.get("tokens_evaluated"))
    if completion is None:
        completion = _count(answer.get("tokens_predicted"))
    return prompt, completion


def read_body(body: bytes) -> tuple[int | None, int | None]:
    """(prompt, completion) of a whole JSON answer.

    Cheap where usage is its last top-level member but one or two (OpenAI's answers, embeddings
    of any size): only the bytes from the last `"usage"` key on are parsed, and they are taken
    when what follows the value closes the answer itself (`{"_":0` + the rest is one object).
    Anything else (a usage nested in an echo, llama-server's native fields) parses the body whole.
    """
    at = len(body)
    while True:
        at = body.rfind(USAGE_KEY, 0, at)
        if at < 0:
            break
        colon = _AFTER_KEY.match(body, at + len(USAGE_KEY))
        if colon is None:
            continue  # a string "usage", not a key
        try:
            rest = body[colon.end():].decode("utf-8")
            value, end = _decoder.raw_decode(rest)
            json.loads('{"_":0' + rest[end:])
        except (ValueError, UnicodeDecodeError, RecursionError):
            break  # not the top level (or not JSON): parse it whole
        return from_usage(value)
    if len(body) > FULL_PARSE_MAX:
        return None, None
    try:
        return from_object(json.loads(body))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None, None


def sse_payloads(data: bytes) -> list[bytes]:
    """The `data:` payloads of the whole SSE events in `data`."""
    out = []
    for event in data.replace(b"\r\n", b"\n").split(b"\n\n"):
        lines = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
        if lines:
            out.append(b"\n".join(lines))
    return out


class StreamReader:
    """What an SSE stream has told about its usage so far, fed whole events as they pass.

    `prompt` / `completion`: the engine's own figures once an event stated them (None until
    then); `streamed`: events with generated text so far; `done`: the stream's last event passed
    (`data: [DONE]`, message_stop, response.completed, a native event with `"stop": true`).
    """

    __slots__ = ("shape", "prompt", "completion", "streamed", "done", "first_id", "counted_by_console", "started",
                 "_text")

    def __init__(self, shape: str) -> None:
        self.shape = shape
        self.prompt: int | None = None
        self.completion: int | None = None
        self.streamed = 0
        self.done = False
        self.first_id = ""
        self.counted_by_console = False  # the prompt figure is the console's count (the engine sent none)
        self.started = False  # a Messages stream's message_start passed
        self._text = _TEXT.get(shape, _TEXT["other"])

    def feed(self, data: bytes) -> None:
        """Read whole SSE events (one or more)."""
        if not self.first_id:
            found = _ID.search(data)
            if found:
                self.first_id = found.group(1).decode()
        self.streamed += len(self._text.findall(data))
        if self.shape == "completions":
            self.streamed -= len(_FINISHED.findall(data))
        if self.shape == "native":  # every native event has the running figures
            counts = _NATIVE_PROMPT.findall(data)
            if counts:
                self.prompt = int(counts[-1])
            counts = _NATIVE_DONE.findall(data)
            if counts:
                self.completion = int(counts[-1])
        tail = _from_hint(data)
        if tail and _HINT.search(tail):
            for payload in sse_payloads(tail):
                if not _HINT.search(payload):
                    continue
                try:
                    event = json.loads(payload)
                except (ValueError, UnicodeDecodeError, RecursionError):
                    continue
                prompt, completion = from_object(event)
                if prompt is not None:
                    self.prompt = prompt
                if completion is not None:
                    self.completion = completion
                if not isinstance(event, dict):
                    continue
                if event.get("stop") is True and self.shape == "native":
                    self.done = True
                elif event.get("type") == "message_start":
                    self.started = True
        if not self.done and (b"[DONE]" in data and _at_line_start(_DONE_LINE, data) >= 0
                              or (b"message_stop" in data or b"response.completed" in data) and _DONE_TYPE.search(data)):
            self.done = True

    @property
    def known(self) -> bool:
        """Whether the engine stated both figures."""
        return self.prompt is not None and self.completion is not None


def _from_hint(data: bytes) -> bytes:
    """`data` from the start of the event where `"usage"` or `"stop"` first appears (b"": neither
    does). A payload matching _HINT holds one of them, as raw bytes too (a payload's lines are the
    raw lines less their `data:`), so the events before cannot match: they are not split and
    scanned (a 100-event chunk whose last event has the usage)."""
    usage, stop = data.find(USAGE_KEY), data.find(b'"stop"')
    if usage < 0 and stop < 0:
        return b""
    cut = last_boundary(data, usage if stop < 0 else stop if usage < 0 else min(usage, stop))
    return data[cut:] if cut else data


def last_boundary(data: bytes, end: int, start: int = 0) -> int:
    """Where the last SSE event boundary (`\\n\\n` or `\\r\\n\\r\\n`) at or before `end` ends; `start`
    (itself a boundary, or 0) when none lies after it. A boundary may overlap the one at `start`:
    `\\n\\n\\n` has one after each of its last two newlines."""
    lf, crlf = data.rfind(b"\n\n", max(0, start - 1), end), data.rfind(b"\r\n\r\n", max(0, start - 3), end)
    return max(start, lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


def _at_line_start(pattern: re.Pattern[bytes], data: bytes) -> int:
    """Where the first match of `pattern` that starts a line starts (-1: none), as `(?m)^` +
    `pattern` would find it, without trying `^` at every byte. A match found mid-line is passed
    over; the search goes on from its end, which no match at a line's start can precede."""
    for found in pattern.finditer(data):
        at = found.start()
        if at == 0 or data[at - 1] == 0x0A:
            return at
    return -1


def done_at(data: bytes) -> int:
    """Where the `data: [DONE]` event starts in `data` (-1: not in it)."""
    return _at_line_start(_DONE_START, data)


def count_request(engine: str, upstream_path: str, body: bytes) -> tuple[str, bytes] | None:
    """The request that has the engine count the prompt of `body` as it processed it (its own
    tokenizer and chat template, tools and images included), as (path, body); None when the
    body is not a JSON object or its path generates nothing.

    llama-server counts without generating (`/v1/chat/completions/input_tokens`,
    `/v1/responses/input_tokens`, `/v1/messages/count_tokens`, `/tokenize` for a plain prompt);
    llama-cpp-python counts a plain prompt (`/extras/tokenize/count`) and has no route for a chat
    prompt: there, and on other engines, the same request is sent unstreamed for one token (the
    engine reuses the prompt it has just processed) and its usage read."""
    shape = shape_of(upstream_path)
    payload = _json_object(body) if shape in GENERATION_SHAPES else None
    if payload is None:
        return None
    prompt = payload.get("prompt")
    if engine == "llama-server":
        route = {"chat": "/v1/chat/completions/input_tokens", "responses": "/v1/responses/input_tokens",
                 "messages": "/v1/messages/count_tokens"}.get(shape)
        if route is not None:
            return route, body
        if shape != "native" or upstream_path != "/infill":
            if isinstance(prompt, str):
                return "/tokenize", json.dumps({"content": prompt, "add_special": True,
                                                "parse_special": True}).encode()
    elif engine == "llama-cpp-python" and shape == "completions" and isinstance(prompt, str):
        return "/extras/tokenize/count", json.dumps({"input": prompt}).encode()
    payload.pop("stream_options", None)
    payload["stream"] = False
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens", "n_predict"):
        payload.pop(name, None)
    if shape == "responses":
        payload["max_output_tokens"] = 16  # the Responses API's least
    elif shape == "native":
        payload["n_predict"] = 1
    else:
        payload["max_tokens"] = 1
    return upstream_path, json.dumps(payload).encode()


def counted(answer: bytes) -> int | None:
    """The prompt tokens in the answer to count_request's request."""
    value = _json_object(answer)
    if value is None:
        return None
    for name in ("input_tokens", "count"):
        if _count(value.get(name)) is not None:
            return value[name]
    if isinstance(value.get("tokens"), list):
        return len(value["tokens"])
    return from_object(value)[0]


def _json_object(data: bytes) -> dict | None:
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return value if isinstance(value, dict) else None
