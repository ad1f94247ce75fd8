#!/usr/bin/env python
"""Reference reward server for ``reward=remote`` (wire format: ddpo_tpu/rewards/remote.py).

Serves ``POST /score`` (and ``GET /health``) with the stdlib ``http.server``; one thread per request.

    python scripts/reward_server.py --port 8000                     # JPEG compressibility
    python scripts/reward_server.py --port 8000 --reward aesthetic  # any registered reward (its defaults)
    python scripts/reward_server.py --port 0 --max-requests 3       # ephemeral port, stop after 3 requests

Kinds (``--kind``):
  jpeg      score with ``--reward`` (default jpeg_compressibility)           [default]
  constant  every image gets ``--value``
  slow      like jpeg, after sleeping ``--delay`` seconds                    (timeout tests)
  flaky     like jpeg, but every other POST /score (the 1st, 3rd, ...) gets HTTP 503   (retry tests)

Stdout (flushed): ``listening on HOST:PORT`` once bound (``--port 0`` picks a free port), then one line per
request (``POST /score -> 200 (3 images)``), and ``served N requests`` when it stops.  It stops after
``--max-requests N`` requests, after ``--idle-timeout S`` seconds without a request, or on SIGINT/SIGTERM.

Requests may carry the optional ``"metadata"`` list (one object per image); it is passed to the reward
(``reward.score(images, prompts, metadata=...)``). Replies: 200 ``{"rewards": [...]}``, with ``"extras"`` when the
reward reports any; 400/404/405/411/413 ``{"error": "..."}`` for bad requests; 503 (flaky) and
500 (the reward raised) for server-side failures.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from ddpo_tpu.rewards import make_reward  # noqa: E402  (registers jpeg_* and aesthetic)
from ddpo_tpu.rewards.base import RewardScores  # noqa: E402
from ddpo_tpu.rewards.remote import decode_request, encode_reply  # noqa: E402
from ddpo_tpu.rewards.serve import score_images  # noqa: E402

KINDS = ("jpeg", "constant", "slow", "flaky")


def say(line: str) -> None:
    print(line, flush=True)


class _Reject(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def parse_request(body: bytes) -> tuple[list[np.ndarray], list[str], list[dict] | None]:
    """Decode a wire-format request into images, prompts and metadata (None when the client sent none); raises
    _Reject(400) when malformed."""
    try:
        return decode_request(body)
    except ValueError as exc:
        raise _Reject(400, str(exc)) from None


Scorer = Callable[[list[np.ndarray], list[str], "list[dict] | None"], RewardScores]


def make_scorer(kind: str, reward_name: str, value: float) -> Scorer:
    """(images, prompts, metadata) -> RewardScores: the reward's values and extras; metadata is passed on."""
    if kind == "constant":
        return lambda images, prompts, metadata: RewardScores(np.full(len(images), value, dtype=np.float32))
    reward = make_reward(reward_name)
    return lambda images, prompts, metadata: score_images(reward, images, prompts, metadata)


class RewardServer(ThreadingHTTPServer):
    daemon_threads = False  # server_close() waits for requests in flight
    block_on_close = True

    def __init__(self, address: tuple[str, int], args: argparse.Namespace):
        self.args = args
        self.scorer = make_scorer(args.kind, args.reward, args.value)
        self.lock = threading.Lock()
        self.accepted = 0  # connections accepted (one request each: HTTP/1.0, no keep-alive)
        self.score_posts = 0  # POST /score seen (for --kind flaky)
        self.in_flight = 0
        self.last_activity = time.monotonic()
        super().__init__(address, Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.lock:
            self.accepted += 1
            self.in_flight += 1
            self.last_activity = time.monotonic()
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.lock:
                self.in_flight -= 1
                self.last_activity = time.monotonic()

    def next_score_post(self) -> int:
        with self.lock:
            self.score_posts += 1
            return self.score_posts


class Handler(BaseHTTPRequestHandler):
    server: RewardServer
    protocol_version = "HTTP/1.0"
    timeout = 60  # seconds per socket read: a stuck client cannot hold a thread forever

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 -- we log our own line
        pass

    def _reply(self, status: int, obj: dict, note: str = "") -> None:
        self._send(status, json.dumps(obj).encode("utf-8"), note)

    def _send(self, status: int, data: bytes, note: str = "") -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        say(f"{self.command} {self.path} -> {status}{f' ({note})' if note else ''}")

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/health":
            self._reply(200, {"ok": True, "kind": self.server.args.kind})
        else:
            self._reply(404, {"error": f"no such path {self.path}; POST images to /score"})

    def do_POST(self) -> None:  # noqa: N802
        args = self.server.args
        if self.path != "/score":
            self._reply(404, {"error": f"no such path {self.path}; POST images to /score"})
            return
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self._reply(411, {"error": "a Content-Length header is required"})
            return
        if int(length) > args.max_body_mb * 1_000_000:
            self._reply(413, {"error": f"body of {length} bytes exceeds --max-body-mb {args.max_body_mb}"})
            return
        body = self.rfile.read(int(length))
        if args.kind == "flaky" and self.server.next_score_post() % 2 == 1:
            self._reply(503, {"error": "flaky server: failing every other request, try again"})
            return
        try:
            images, prompts, metadata = parse_request(body)
        except _Reject as exc:
            self._reply(exc.status, {"error": exc.message})
            return
        if args.kind == "slow":
            time.sleep(args.delay)
        try:
            scored = self.server.scorer(images, prompts, metadata)
        except Exception as exc:  # the reward failed: a server-side error
            self._reply(500, {"error": f"{type(exc).__name__}: {exc}"})
            return
        self._send(200, encode_reply(scored.values, scored.extras), note=f"{len(images)} images")


def serve(args: argparse.Namespace) -> int:
    server = RewardServer((args.host, args.port), args)
    host, port = server.server_address[:2]
    say(f"listening on {host}:{port}")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.is_set():
            if args.max_requests and server.accepted >= args.max_requests:
                break
            poll = 0.5  # wake up now and then to notice SIGTERM
            if args.idle_timeout:
                with server.lock:
                    idle = 0.0 if server.in_flight else time.monotonic() - server.last_activity
                remaining = args.idle_timeout - idle
                if remaining <= 0:
                    say(f"idle for {args.idle_timeout:g}s: stopping")
                    break
                poll = min(poll, remaining)
            server.timeout = poll
            server.handle_request()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()  # waits for the requests in flight
        say(f"served {server.accepted} requests")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port; 0 picks a free one (default 8000)")
    parser.add_argument("--kind", choices=KINDS, default="jpeg")
    parser.add_argument("--reward", default="jpeg_compressibility",
                        help="registered reward used by the jpeg/slow/flaky kinds (default jpeg_compressibility)")
    parser.add_argument("--value", type=float, default=1.0, help="reward of --kind constant")
    parser.add_argument("--delay", type=float, default=2.0, help="seconds --kind slow sleeps per request")
    parser.add_argument("--max-requests", type=int, default=0, help="stop after N requests (0: no limit)")
    parser.add_argument("--idle-timeout", type=float, default=0.0,
                        help="stop after S seconds without requests (0: never)")
    parser.add_argument("--max-body-mb", type=float, default=512.0, help="largest request body accepted (MB)")
    args = parser.parse_args(argv)
    if args.max_requests < 0 or args.idle_timeout < 0 or args.delay < 0:
        parser.error("--max-requests, --idle-timeout and --delay must be >= 0")
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
