"""CPU per answer of the proxy's usage reader (serving/proxy/usage_reader.py) against the 0.2
scan it replaced (a regex over the last 4 KiB of a whole answer; a regex per stream chunk), on
answers shaped as llama-server sends them: a chat answer, one with `"verbose": true`, an
embeddings answer of 1 MiB, and a stream's events (a token's chunk, the usage chunk).

    python bench/usage_reader.py [--rounds N]
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from serving.proxy.usage_reader import StreamReader, read_body  # noqa: E402

OLD_USAGE_RE = re.compile(rb'"(prompt_tokens|completion_tokens)"\s*:\s*(\d+)')
OLD_TEXT_RE = re.compile(rb'"(?:content|text)"\s*:\s*"(?!")')


def old_whole(body: bytes) -> dict:
    return {k: int(v) for k, v in OLD_USAGE_RE.findall(body[-4096:])}


def old_chunk(data: bytes) -> tuple[int, bytes]:
    return len(OLD_TEXT_RE.findall(data)), data[-4096:]


def chat(verbose: bool = False) -> bytes:
    answer = {"choices": [{"finish_reason": "length", "index": 0, "message": {"role": "assistant",
                                                                          "content": "word " * 60}}],
              "created": 1796301829, "model": "tiny", "object": "chat.completion",
              "usage": {"completion_tokens": 64, "prompt_tokens": 30, "total_tokens": 94},
              "id": "chatcmpl-9lXZYBCFqPkhtuubWaFWmARG5diq2wET", "timings": {"prompt_n": 30, "predicted_n": 64}}
    if verbose:
        answer["__verbose"] = {"prompt": "x" * 8000, "generation_settings": {"stop": ["y" * 3000]}}
    return json.dumps(answer).encode()


def embeddings() -> bytes:
    return json.dumps({"object": "list", "data": [{"embedding": [0.0123456789] * 1024, "index": i}
                                                  for i in range(64)],
                       "model": "e", "usage": {"prompt_tokens": 512, "total_tokens": 512}}).encode()


def event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


TOKEN = event({"choices": [{"finish_reason": None, "index": 0, "delta": {"content": " she"}}], "created": 1796301829,
               "id": "chatcmpl-pnty2HR11O0uZMtMbkokA1cPpDujyW3R", "model": "tiny", "object": "chat.completion.chunk"})
LAST = event({"choices": [], "created": 1796301829, "id": "chatcmpl-pn", "model": "tiny",
              "object": "chat.completion.chunk", "usage": {"completion_tokens": 3, "prompt_tokens": 30,
                                                           "total_tokens": 33}}) + b"data: [DONE]\n\n"


def per_call_us(fn, arg, rounds: int) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.process_time()
        for _ in range(rounds):
            fn(arg)
        best = min(best, (time.process_time() - t0) / rounds * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()
    reader = StreamReader("chat")
    cases = [("chat answer", chat(), read_body, old_whole, args.rounds),
             ("verbose chat answer", chat(verbose=True), read_body, old_whole, args.rounds),
             ("embeddings answer", embeddings(), read_body, old_whole, max(20, args.rounds // 100)),
             ("stream: a token's chunk", TOKEN, reader.feed, old_chunk, args.rounds * 5),
             ("stream: usage chunk + [DONE]", LAST, reader.feed, old_chunk, args.rounds)]
    print(f"{'case':32} {'bytes':>9} {'reader us':>10} {'0.2 scan us':>12}  usage read (0.2 scan)")
    for name, data, new, old, rounds in cases:
        got = new(data) if new is read_body else None
        found = old(data) if old is old_whole else None
        print(f"{name:32} {len(data):9d} {per_call_us(new, data, rounds):10.2f} {per_call_us(old, data, rounds):12.2f}"
              f"  {got if got is not None else ''} {f'({found})' if found is not None else ''}")


if __name__ == "__main__":
    main()
