"""Prefix-aware routing among a model's replicas (issue 25 #2).

A request's *routing key* is the start of what the engine will read first: the system prompt and
the first turns of a chat (OpenAI `messages`, Anthropic `system` + `messages`), or the start of a
completion's `prompt`, cut at XGEN_ROUTING_PREFIX_CHARS characters. Requests with the same key go
to the same replica, where the engine's prompt cache (llama-server's slots, vLLM's prefix cache)
already holds that prefix, so only the rest of the prompt is computed.

The replica is chosen by rendezvous hashing (highest random weight): each replica's score is a hash
of (key, instance id) and the highest wins. It is a consistent hash without a ring's virtual nodes:
every web process computes the same choice from the routing table they share, and a replica that
comes or goes moves only the keys that were (or become) its own. Bounded load: a replica that holds
ceil((1 + XGEN_ROUTING_PREFIX_EPS_PCT/100) x the mean requests in flight) or more (this process's
counts, this request included) is passed over for the next by score, so a hot prefix spills over
instead of queueing on one replica (with 2 replicas and the default 50 %, a replica takes up to 2
requests of its keys while the other is idle, 3 once that one has 1). No key (embeddings, an empty prompt): least in flight, as XGEN_ROUTING=least_inflight.

XGEN_ROUTING=least_inflight is the default: bench/prefix_routing.py (2 llama-server replicas x 2
slots, 4 system prompts of ~1,500 tokens) measured prefix routing's TTFT p50 at 1.15x least in
flight's (SmolLM2-135M; 1.08x on the tiny model): llama-server keeps prompts it evicts from a slot in
its host-memory prompt cache (--cache-ram), so least in flight reuses nearly as much (54,120 of
60,850 tokens per round), and prefix routing loses more by leaving a replica idle while its keys'
replica computes.
"""
from __future__ import annotations

import hashlib
import math
from typing import Any

MAX_PARTS = 256  # messages (or content parts) read for a key: a key never costs more than this


def _text(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list (other parts by type)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content[:MAX_PARTS]:
            if isinstance(part, dict):
                text = part.get("text")
                out.append(text if isinstance(text, str) else f"<{str(part.get('type', ''))[:40]}>")
            elif isinstance(part, str):
                out.append(part)
        return "".join(out)
    return ""


def routing_key(payload: dict[str, Any], chars: int) -> bytes | None:
    """The request's routing key (its first `chars` characters, as UTF-8), or None: none to route by."""
    if chars <= 0 or not isinstance(payload, dict):
        return None
    pieces: list[str] = []
    size = 0

    def add(piece: str) -> bool:
        nonlocal size
        pieces.append(piece)
        size += len(piece)
        return size >= chars

    done = False
    system = payload.get("system")  # Anthropic messages
    if system is not None:
        done = add("system\x1f" + _text(system) + "\x1e")
    messages = payload.get("messages")
    if isinstance(messages, list):
        for message in messages[:MAX_PARTS]:
            if done:
                break
            if isinstance(message, dict):
                role = message.get("role")
                done = add(f"{role if isinstance(role, str) else ''}\x1f{_text(message.get('content'))}\x1e")
    elif not done:
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch routes by its first prompt
        if isinstance(prompt, str):
            add(prompt)
        elif isinstance(prompt, list):  # token ids
            add(",".join(str(t) for t in prompt[:chars] if isinstance(t, int)))
    text = "".join(pieces)[:chars]
    return text.encode("utf-8", "surrogatepass") if text.strip("\x1e\x1f") else None


def score(key: bytes, instance_id: int) -> int:
    """The replica's rendezvous weight for `key` (the highest wins; the same in every process)."""
    digest = hashlib.blake2b(key, digest_size=8, person=instance_id.to_bytes(8, "big", signed=True)).digest()
    return int.from_bytes(digest, "big")


def load_cap(in_flight: list[int], eps: float) -> int:
    """The most requests in flight a replica may hold to be chosen for a new one (bounded load):
    ceil((1 + eps) x the mean, counting the new request), at least 1."""
    total = sum(in_flight) + 1
    return max(1, math.ceil((1 + eps) * total / len(in_flight)))
