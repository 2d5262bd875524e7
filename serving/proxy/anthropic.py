"""Anthropic's Messages API in front of backends: `POST /v1/messages` and `/v1/messages/count_tokens`.

Backends that serve it natively (llama-server, recent vLLM: the adapters say) get the request as
is; for the others (llama-cpp-python) a request is translated to chat completions and the answer
back, streaming included (message_start, content_block_start/delta/stop, message_delta,
message_stop), with system prompts, images, tool definitions, tool_use and tool_result mapped
both ways. On these paths `x-api-key` is accepted like `Authorization: Bearer`, and errors come
in Anthropic's shape `{"type": "error", "error": {"type": ..., "message": ...}}`.
"""
from __future__ import annotations

import contextlib
import json
import time
import uuid

from serving.proxy.errors import ProxyError
from serving.proxy.upstream import UpstreamReply

MESSAGES_PATHS = ("/v1/messages", "/v1/messages/count_tokens")

# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error",
}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use",
                "content_filter": "refusal"}
BODY_MAX = 16 << 20  # a translated (non-streaming) answer read whole: far above any chat answer


def is_messages_path(path: str) -> bool:
    """Whether `path` (a proxy path, or the backend's) is one of the Messages paths."""
    return path.endswith(MESSAGES_PATHS) and (
        path in MESSAGES_PATHS or path.removeprefix("/api/inference") in MESSAGES_PATHS)


def with_api_key_auth(headers: dict[bytes, bytes]) -> dict[bytes, bytes]:
    """`x-api-key: <key>` (Anthropic's clients) read as `Authorization: Bearer <key>` when no
    Authorization header is sent."""
    key = headers.get(b"x-api-key")
    if key is None or b"authorization" in headers:
        return headers
    return {**headers, b"authorization": b"Bearer " + key.strip()}


def error_dict(status: int, message: str) -> dict:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_bytes(status: int, message: str) -> bytes:
    return json.dumps(error_dict(status, message)).encode()


def backend_error(status: int, data: bytes, content_type: str) -> bytes | None:
    """A backend's error on a Messages path in Anthropic's shape (None: it already is)."""
    message = ""
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        body = None
    if isinstance(body, dict):
        if body.get("type") == "error" and isinstance(body.get("error"), dict):
            return None
        error = body.get("error")
        if isinstance(error, dict):
            message = str(error.get("message") or "")
        elif isinstance(error, str):
            message = error
        elif body.get("detail"):
            message = str(body["detail"])
    if not message:
        message = " ".join(data[:500].decode("utf-8", "replace").split()) or f"The backend answered {status}."
    return error_bytes(status, message)


def sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


# ---------------------------------------------------------------- request: Messages -> chat completions
def _text_of(content) -> str:
    """A system prompt or tool result as plain text (a string, or a list of text blocks)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(b.get("text", "")) for b in content if isinstance(b, dict) and b.get("type") == "text")
    raise ValueError("content must be a string or a list of blocks")


def _image_part(block: dict) -> dict:
    source = block.get("source") or {}
    if source.get("type") == "base64":
        url = f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}"
    else:
        url = str(source.get("url", ""))
    return {"type": "image_url", "image_url": {"url": url}}


def _message(message: dict) -> list[dict]:
    """One Anthropic message as one or more chat messages (tool results become `tool` messages)."""
    role = message["role"]
    if role not in ("user", "assistant"):
        raise ValueError(f"unknown role {role!r}")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise ValueError("content must be a string or a list of blocks")
    parts: list[dict] = []
    tool_calls: list[dict] = []
    results: list[dict] = []
    for block in content:
        kind = block["type"]
        if kind == "text":
            parts.append({"type": "text", "text": str(block.get("text", ""))})
        elif kind == "image":
            parts.append(_image_part(block))
        elif kind == "tool_use":
            tool_calls.append({"id": str(block["id"]), "type": "function",
                               "function": {"name": str(block["name"]),
                                            "arguments": json.dumps(block.get("input") or {})}})
        elif kind == "tool_result":
            text = _text_of(block.get("content"))
            if block.get("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": str(block["tool_use_id"]), "content": text})
        # thinking, documents and other block kinds have no chat-completions form: left out
    out: list[dict] = list(results)
    only_text = all(p["type"] == "text" for p in parts)
    if role == "assistant":
        text = "".join(p["text"] for p in parts if p["type"] == "text")
        if text or tool_calls:
            msg: dict = {"role": "assistant", "content": text or None}
            if tool_calls:
                msg["tool_calls"] = tool_calls
            out.append(msg)
    elif parts:
        out.append({"role": "user", "content": "\n".join(p["text"] for p in parts) if only_text else parts})
    return out


def _tool_choice(choice: dict):
    kind = choice.get("type")
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": str(choice["name"])}}
    if kind == "none":
        return "none"
    return "auto"


def to_chat_request(payload: dict, *, count_only: bool = False) -> dict:
    """The chat-completions request for a Messages request; ValueError/KeyError/TypeError for a
    body that is not one."""
    messages: list[dict] = []
    system = payload.get("system")
    if system:
        messages.append({"role": "system", "content": _text_of(system)})
    for message in payload.get("messages") or []:
        messages.extend(_message(message))
    chat: dict = {"model": payload.get("model"), "messages": messages}
    if count_only:
        chat["max_tokens"] = 1  # the backend's usage.prompt_tokens is the count, template and tools included
    else:
        if payload.get("max_tokens") is not None:
            chat["max_tokens"] = int(payload["max_tokens"])
        for name in ("temperature", "top_p", "top_k"):
            if payload.get(name) is not None:
                chat[name] = payload[name]
        if payload.get("stop_sequences"):
            chat["stop"] = [str(s) for s in payload["stop_sequences"]]
        if payload.get("stream"):
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True}
        user = (payload.get("metadata") or {}).get("user_id")
        if user:
            chat["user"] = str(user)
    tools = payload.get("tools")
    if tools:
        chat["tools"] = [{"type": "function", "function": {
            "name": str(t["name"]), "description": str(t.get("description", "")),
            "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}} for t in tools]
        if payload.get("tool_choice") and not count_only:
            chat["tool_choice"] = _tool_choice(payload["tool_choice"])
    return chat


# ---------------------------------------------------------------- answer: chat completions -> Messages
def _tool_input(arguments) -> dict:
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments or "{}")
    except (ValueError, TypeError):
        return {"_raw": arguments}
    return value if isinstance(value, dict) else {"value": value}


def _message_id(chat_id) -> str:
    return "msg_" + (str(chat_id).removeprefix("chatcmpl-") if chat_id else uuid.uuid4().hex)


def from_chat_response(chat: dict, model: str) -> dict:
    """A Messages answer for a chat-completions answer."""
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    content: list[dict] = []
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        content.append({"type": "tool_use", "id": call.get("id") or "toolu_" + uuid.uuid4().hex[:24],
                        "name": function.get("name", ""), "input": _tool_input(function.get("arguments"))})
    usage = chat.get("usage") or {}
    stop = STOP_REASONS.get(choice.get("finish_reason") or "stop", "end_turn")
    if content and content[-1]["type"] == "tool_use":
        stop = "tool_use"
    return {
        "id": _message_id(chat.get("id")), "type": "message", "role": "assistant", "model": model,
        "content": content, "stop_reason": stop, "stop_sequence": None,
        "usage": {"input_tokens": int(usage.get("prompt_tokens") or 0),
                  "output_tokens": int(usage.get("completion_tokens") or 0)},
    }


class StreamTranslator:
    """Chat-completion chunks in, Messages stream events out."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.started = False
        self.index = -1
        self.open: tuple[str, int] | None = None  # ("text", -1) or ("tool", openai index)
        self.tools: dict[int, int] = {}
        self.stop_reason: str | None = None
        self.input_tokens = 0
        self.output_tokens = 0
        self.counted = 0  # chunks with content, for a backend that sends no usage
        self.finished = False

    def _start(self, chunk: dict) -> list[bytes]:
        if self.started:
            return []
        self.started = True
        return [sse("message_start", {"type": "message_start", "message": {
            "id": _message_id(chunk.get("id")), "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}})]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [sse("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def feed(self, chunk: dict) -> list[bytes]:
        out = self._start(chunk)
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.input_tokens = int(usage.get("prompt_tokens") or self.input_tokens)
            self.output_tokens = int(usage.get("completion_tokens") or self.output_tokens)
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            text = delta.get("content")
            if text:
                self.counted += 1
                if self.open != ("text", -1):
                    out += self._close()
                    self.index += 1
                    self.open = ("text", -1)
                    out.append(sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                                           "content_block": {"type": "text", "text": ""}}))
                out.append(sse("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                       "delta": {"type": "text_delta", "text": text}}))
            for call in delta.get("tool_calls") or []:
                position = int(call.get("index") or 0)
                function = call.get("function") or {}
                if position not in self.tools:
                    self.counted += 1
                    out += self._close()
                    self.index += 1
                    self.tools[position] = self.index
                    self.open = ("tool", position)
                    out.append(sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                                           "content_block": {
                                                               "type": "tool_use",
                                                               "id": call.get("id") or "toolu_" + uuid.uuid4().hex[:24],
                                                               "name": function.get("name", ""), "input": {}}}))
                arguments = function.get("arguments")
                if arguments and self.open == ("tool", position):
                    out.append(sse("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                           "delta": {"type": "input_json_delta",
                                                                     "partial_json": arguments}}))
            if choice.get("finish_reason"):
                self.stop_reason = STOP_REASONS.get(choice["finish_reason"], "end_turn")
        return out

    def finish(self) -> list[bytes]:
        if self.finished:
            return []
        self.finished = True
        out = self._start({}) + self._close()
        if self.tools and self.stop_reason in (None, "end_turn"):
            self.stop_reason = "tool_use"
        out.append(sse("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": self.stop_reason or "end_turn", "stop_sequence": None},
                                         # the input too: message_start went out before the backend said it
                                         "usage": {"input_tokens": self.input_tokens,
                                                   "output_tokens": self.output_tokens or self.counted}}))
        out.append(sse("message_stop", {"type": "message_stop"}))
        return out


def _events(data: bytes) -> list[str]:
    """The `data:` payloads of whole SSE events."""
    out = []
    for event in data.replace(b"\r\n", b"\n").split(b"\n\n"):
        lines = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
        if lines:
            out.append(b"\n".join(lines).decode("utf-8", "replace"))
    return out


# ---------------------------------------------------------------- one translated exchange
class Translation:
    """A Messages request sent to a backend as chat completions, and its answer sent back."""

    def __init__(self, payload: dict, *, count_only: bool = False) -> None:
        self.payload = payload
        self.count_only = count_only
        self.model = str(payload.get("model") or "")
        self.stream = bool(payload.get("stream")) and not count_only
        try:
            self.chat = to_chat_request(payload, count_only=count_only)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ProxyError(400, f"The request is not a valid Messages request: {exc.__class__.__name__}: {exc}",
                             code="invalid_request") from None

    def chat_body(self) -> bytes:
        return json.dumps(self.chat).encode()

    async def _read(self, reply: UpstreamReply) -> bytes:
        parts, size = [], 0
        async with contextlib.aclosing(reply.chunks()) as stream:
            async for chunk in stream:
                parts.append(chunk)
                size += len(chunk)
                if size > BODY_MAX:
                    raise ProxyError(502, "The backend's answer is too large to translate.", code="upstream_error")
        return b"".join(parts)

    async def _json(self, send, status: int, body: bytes, headers: list) -> None:
        out = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
        await send({"type": "http.response.start", "status": status, "headers": out})
        await send({"type": "http.response.body", "body": body})

    async def relay(self, reply: UpstreamReply, send, timing) -> None:
        """Answer the client in the Messages shape from the backend's chat-completions answer."""
        request_id = [(b"x-request-id", reply.answer_request_id.encode())]
        if reply.ctx is not None:  # a limited key's x-ratelimit-* (and a cold start's) as on every answer
            request_id += [*reply.ctx.rate_headers, *reply.ctx.extra_headers]
        if reply.status >= 400 or not (self.stream and reply.is_sse):
            read_from = time.perf_counter()
            data = await self._read(reply)
            headers = [*request_id, timing(time.perf_counter() - read_from)]
            if reply.status >= 400:
                await self._json(send, reply.status, backend_error(reply.status, data, "") or data, headers)
                return
            try:
                chat = json.loads(data)
                if not isinstance(chat, dict):
                    raise ValueError("not an object")
            except (ValueError, UnicodeDecodeError, RecursionError):
                await self._json(send, 502, error_bytes(502, "The backend's answer is not JSON."), headers)
                return
            if self.count_only:
                count = int((chat.get("usage") or {}).get("prompt_tokens") or 0)
                answer = {"input_tokens": count}
            else:
                answer = from_chat_response(chat, self.model)
            await self._json(send, 200, json.dumps(answer).encode(), headers)
            return
        translator = StreamTranslator(self.model)
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), *request_id, timing(0.0)]})
        async with contextlib.aclosing(reply.chunks()) as stream:
            async for chunk in stream:
                out: list[bytes] = []
                for payload in _events(chunk):
                    if payload == "[DONE]":
                        out += translator.finish()
                        continue
                    try:
                        event = json.loads(payload)
                    except ValueError:
                        continue
                    if isinstance(event, dict) and "error" in event and "choices" not in event:
                        error = event["error"] if isinstance(event["error"], dict) else {"message": str(event["error"])}
                        out.append(sse("error", error_dict(502, str(error.get("message", "backend error")))))
                        translator.finished = True
                        continue
                    if isinstance(event, dict):
                        out += translator.feed(event)
                if out:
                    await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
        await send({"type": "http.response.body", "body": b"".join(translator.finish()), "more_body": False})
