"""What the proxy reads of a request before routing it: the body (size and time limits), its
media type (an allowlist), the JSON object or a multipart form's `model` field, and the request ids.
Shared by the proxy app and the guard in front of Django (xgenconsole/body_guard.py)."""
from __future__ import annotations

import asyncio
import json
import os
import re
import time

from serving.proxy.errors import ProxyError
from serving.proxy.upstream import multipart_boundary

REQUEST_ID_RE = re.compile(rb"[\x21-\x7e](?:[\x20-\x7e]{0,126}[\x21-\x7e])?")  # a caller's X-Request-ID


async def read_body(receive, headers: dict[bytes, bytes], *, limit: int, timeout_s: float) -> bytes | None:
    """The request body, refused past `limit` bytes (declared or counted as it arrives) and past
    `timeout_s` seconds in all (a client that trickles its body holds a connection no longer);
    None when the client left. Shared by the proxy and the guard in front of Django."""
    declared = headers.get(b"content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise ProxyError(400, "Invalid Content-Length.", code="invalid_request") from None
        if size > limit:
            raise ProxyError(413, f"The request body exceeds {limit} bytes.", code="request_too_large")
    parts: list[bytes] = []
    total = 0
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                chunk = message.get("body", b"")
                if chunk:
                    total += len(chunk)
                    if total > limit:
                        raise ProxyError(413, f"The request body exceeds {limit} bytes.", code="request_too_large")
                    parts.append(chunk)
                if not message.get("more_body", False):
                    break
    except TimeoutError:
        raise ProxyError(408, f"The request body did not arrive within {timeout_s:g} s.",
                         code="request_timeout", headers=[(b"connection", b"close")]) from None
    return parts[0] if len(parts) == 1 else b"".join(parts)



def parse_body(body: bytes) -> dict:
    """The request body as a JSON object; ProxyError 400 otherwise."""
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise ProxyError(400, "The request body is not valid JSON.", code="invalid_json") from None
    except RecursionError:
        raise ProxyError(400, "The request body nests too deeply.", code="invalid_json") from None
    if not isinstance(payload, dict):
        raise ProxyError(400, "The request body must be a JSON object.", code="invalid_request")
    return payload



# The media types a body may come as (an allowlist, matched lower-cased: llama-server matches
# case-sensitively and read a JSON body sent as `Multipart/form-data` as JSON while the proxy took
# it for a form). All but a form are read as JSON and sent on as application/json
# (upstream.forwarded_content_type), so the console and the engine read one body alike.
JSON_MEDIA_TYPES = frozenset({
    b"",  # none given: JSON, as the OpenAI SDKs send
    b"application/json",
    b"application/x-www-form-urlencoded",  # what `curl -d` labels the JSON it sends
})
MULTIPART_PATHS = frozenset({"/v1/audio/transcriptions", "/v1/audio/translations"})  # the routes taking a form
# A Content-Disposition parameter, its value a quoted string (one holding `;name=` is not read as two) or a token.
DISPOSITION_PARAM_RE = re.compile(rb';\s*([!#$%&\'*+.^_`|~0-9A-Za-z-]+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^;\s]*))')


def media_type(headers: dict[bytes, bytes]) -> tuple[bytes, bytes]:
    """(the lower-cased media type, its parameters) of the request's Content-Type."""
    media, _, params = headers.get(b"content-type", b"").partition(b";")
    return media.strip().lower(), params


def request_payload(body: bytes, headers: dict[bytes, bytes], *, path: str = "") -> tuple[dict, bytes | None]:
    """What routing reads of a body: (the JSON object, None), or (the `model` field of a multipart
    form, the form's Content-Type parameters) on the routes that take one (`path`, the backend's);
    415 for a media type the proxy does not read (or a form elsewhere), 400 for a body that is not
    what its type says. The media type is read here once."""
    media, params = media_type(headers)
    if media == b"multipart/form-data":
        if path not in MULTIPART_PATHS:
            raise ProxyError(415, f"{path or 'This route'} takes a JSON body (Content-Type: application/json), "
                                  "not a multipart form.", code="unsupported_media_type")
        return multipart_model(body, params), params
    if media not in JSON_MEDIA_TYPES or _param(params, b"charset") not in (None, b"utf-8", b"utf8"):
        forms = " or a multipart form" if path in MULTIPART_PATHS else ""
        raise ProxyError(415, f"Content-Type {headers.get(b'content-type', b'').decode('latin-1')[:100]!r} is not "
                              f"accepted; send JSON (application/json, UTF-8){forms}.", code="unsupported_media_type")
    if json.detect_encoding(body) not in ("utf-8", "utf-8-sig"):
        raise ProxyError(400, "The request body is JSON in another encoding than UTF-8.", code="invalid_json")
    try:
        return parse_body(body), None
    except ProxyError:
        if media == b"application/x-www-form-urlencoded":
            raise ProxyError(415, "The body is labelled a form (application/x-www-form-urlencoded) and is not "
                                  "a JSON object; send JSON with Content-Type: application/json.",
                             code="unsupported_media_type") from None
        raise


def _param(params: bytes, name: bytes) -> bytes | None:
    """A Content-Type parameter's value, lower-cased and unquoted; None when absent."""
    for param in params.split(b";"):
        key, sep, value = param.partition(b"=")
        if sep and key.strip().lower() == name:
            return value.strip().strip(b'"').lower()
    return None


def _form_name(disposition: bytes) -> bytes | None:
    """The `name` parameter of a part's Content-Disposition (`form-data; name="model"`)."""
    for param in DISPOSITION_PARAM_RE.finditer(disposition):
        if param.group(1).lower() == b"name":
            return re.sub(rb"\\(.)", rb"\1", param.group(2)) if param.group(2) is not None else param.group(3)
    return None


def multipart_model(body: bytes, params: bytes) -> dict:
    """The `model` field of a multipart form (form_model_span): {"model": ...}, or {} without one."""
    span = form_model_span(body, params)
    if span is None:
        return {}
    try:
        return {"model": body[span[0]:span[1]].decode("utf-8")}
    except UnicodeDecodeError:
        raise ProxyError(400, "The form's `model` field is not UTF-8.", code="invalid_request") from None


def form_model_span(body: bytes, params: bytes) -> tuple[int, int] | None:
    """Where the `model` field's value sits in a multipart form, found as a form parser finds it:
    parts between the boundary lines that the Content-Type names, a part's headers up to its blank
    line; 400 for a body that is not such a form, or names `model` twice."""
    boundary = multipart_boundary(params)
    if boundary is None:
        raise ProxyError(400, "A multipart Content-Type needs a valid boundary parameter.", code="invalid_request")
    delimiter = b"--" + boundary
    if not body.startswith(delimiter + b"\r\n"):
        raise ProxyError(400, "The body is not the multipart form its Content-Type says (it does not start with "
                              "its boundary line).", code="invalid_request")
    found: list[tuple[int, int]] = []
    pos = len(delimiter) + 2
    separator = b"\r\n" + delimiter
    while True:
        end = body.find(separator, pos)
        if end < 0:
            raise ProxyError(400, "The multipart form ends without its closing boundary.", code="invalid_request")
        head_end = body.find(b"\r\n\r\n", pos, end)
        head = body[pos:head_end] if head_end >= 0 else b""
        for line in head.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-disposition" and _form_name(value) == b"model":
                found.append((head_end + 4, end))
        after = body[end + len(separator):end + len(separator) + 2]
        if after == b"--":
            break
        if after != b"\r\n":
            raise ProxyError(400, "The multipart form has a malformed boundary line.", code="invalid_request")
        pos = end + len(separator) + 2
    if len(found) > 1:
        raise ProxyError(400, "The form names `model` more than once.", code="invalid_request")
    return found[0] if found else None



def client_request_id(headers: dict[bytes, bytes]) -> str:
    """The caller's own X-Request-ID ('' when it sent none): kept in the request log and echoed
    back, never sent to a backend (the console's own id goes there: llama-cpp-python answers 400
    to an id that is not a UUID). ProxyError 400 for one that is not 1-128 printable ASCII characters."""
    sent = headers.get(b"x-request-id")
    if not sent:  # none, or an empty one (as before: some gateways send the header empty)
        return ""
    if not REQUEST_ID_RE.fullmatch(sent):
        raise ProxyError(400, "X-Request-ID must be 1 to 128 printable ASCII characters (no spaces at its ends).",
                         code="invalid_request_id")
    return sent.decode("ascii")


def new_request_id() -> str:
    """A UUIDv7 (RFC 9562) in 32 hex digits: unique, and ordered by time (milliseconds), so the
    request log's request_id index grows at its end. Random ids (uuid4) land anywhere in it: at
    250,000 rows an insert cost 28.5 us against 10.2 us for ordered ones (SQLite), and worse as
    the log grows."""
    rand = int.from_bytes(os.urandom(10), "big")
    value = ((time.time_ns() // 1_000_000) & 0xFFFF_FFFF_FFFF) << 80 | 0x7 << 76 | (rand >> 68) << 64 \
        | 0b10 << 62 | (rand & ((1 << 62) - 1))
    return f"{value:032x}"

