"""The managed reward process: one reward, built from its config, served on loopback with the remote wire format.

The trainer starts it (ddpo_tpu/rewards/managed.py) with the Python of ``reward.process.python`` when a reward needs
packages that do not install beside the trainer's (GenEval's mmdet 2.x, PaddleOCR)::

    PYTHON -m ddpo_tpu.rewards.serve --port 0 --parent-pid PID --cache-dir DIR [--device cuda:1] < config.json

stdin: the reward's config as JSON (the run's `reward` section, ddpo_tpu/config/schema.py), validated with the
same schema and built with the same code as in the trainer (rewards/from_config.py, so `tiny` stand-ins and the
catalog's modules work here too). It serves ``POST /score`` (requests and replies as ddpo_tpu/rewards/remote.py
documents: metadata in, extras out) and ``GET /health`` on 127.0.0.1 only. Scoring is serialised (one request at a
time): a reward model is not assumed to be thread-safe.

stdout carries exactly one line, ``READY_PREFIX<port>``, once the reward is built and the socket listens; everything
else the process prints (its own lines, the libraries' warnings, a traceback) goes to stderr, which the trainer
points at the run dir's ``reward_process.log``.

It ends on SIGTERM (exit 0), and by itself as soon as its parent is gone (exit 3), checked every 0.25 s: the trainer
killed with SIGKILL leaves no scorer behind. Decision: polling the parent pid rather than prctl(PR_SET_PDEATHSIG),
because a death signal fires when the *thread* that started the process ends, and the trainer restarts a dead
scorer from whichever reward thread saw it die.

The environment needs ddpo_tpu importable (the trainer puts the package's parent directory first on PYTHONPATH, so
no install is needed) and what ddpo_tpu's reward path imports: numpy, pillow, pydantic, plus the reward's own
packages (torch and transformers for the model rewards).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ddpo_tpu.rewards.managed import READY_PREFIX  # the line the managing side waits for
EXIT_ORPHANED = 3  # the trainer that started it is gone
_PARENT_POLL_S = 0.25


class _Device:
    """The device a reward is built for, as rewards/from_config.py reads one (`.type`, `str()`), without importing
    torch for rewards that do not use it."""

    def __init__(self, name: str):
        self.name, self.type = name, name.split(":", 1)[0]

    def __str__(self) -> str:
        return self.name


def build_reward(config: dict[str, Any], cache_dir: str, device: str | None):
    """The reward a `reward` config (a plain mapping) describes, validated by the run's schema."""
    from pydantic import TypeAdapter

    from ddpo_tpu.config.schema import RewardConfig
    from ddpo_tpu.rewards.from_config import reward_from_config

    cfg = TypeAdapter(RewardConfig).validate_python(config)
    if cfg.process.python is not None:  # the trainer sends the config with its process block cleared
        raise ValueError("reward.process.python is set in the served config: a reward process does not start another")
    return reward_from_config(cfg, model_cache_dir=cache_dir, device=_Device(device or "cpu"))


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            print(f"the trainer (pid {parent_pid}) is gone: exiting", file=sys.stderr, flush=True)
            os._exit(EXIT_ORPHANED)
        time.sleep(_PARENT_POLL_S)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int, reward):
        self.reward = reward
        self.score_lock = threading.Lock()
        self.served = 0
        super().__init__(("127.0.0.1", port), _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.0"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 -- the log keeps failures only
        pass

    def _send(self, status: int, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        print(f"{self.command} {self.path} -> {status}: {message}", file=sys.stderr, flush=True)
        self._send(status, json.dumps({"error": message}).encode("utf-8"))

    def do_GET(self) -> None:  # noqa: N802
        if self.path != "/health":
            self._error(404, f"no such path {self.path}; POST images to /score")
            return
        self._send(200, json.dumps({"ok": True, "reward": self.server.reward.name, "pid": os.getpid(),
                                    "served": self.server.served}).encode("utf-8"))

    def do_POST(self) -> None:  # noqa: N802
        from ddpo_tpu.rewards.remote import decode_request, encode_reply

        if self.path != "/score":
            self._error(404, f"no such path {self.path}; POST images to /score")
            return
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self._error(411, "a Content-Length header is required")
            return
        try:
            images, prompts, metadata = decode_request(self.rfile.read(int(length)))
        except ValueError as exc:
            self._error(400, str(exc))
            return
        try:
            with self.server.score_lock:
                scored = score_images(self.server.reward, images, prompts, metadata)
                self.server.served += 1
        except Exception as exc:  # the reward failed: the trainer names the process and this log
            import traceback

            traceback.print_exc()
            self._error(500, f"{type(exc).__name__}: {exc}")
            return
        self._send(200, encode_reply(scored.values, scored.extras))


def score_images(reward, images: list, prompts: list[str], metadata: list[dict] | None):
    """RewardScores of decoded images: one call on the stacked images when they share a shape, else one call per
    image (extras joined, NaN where an image's call lacks one). Shared with scripts/reward_server.py."""
    import numpy as np

    from ddpo_tpu.rewards.base import RewardScores

    if not images:
        return RewardScores(np.empty(0, dtype=np.float32))
    if all(im.shape == images[0].shape for im in images):
        return reward.score(np.stack(images), prompts, metadata=metadata)
    parts = [reward.score(im[None], [p], metadata=None if metadata is None else [metadata[i]])
             for i, (im, p) in enumerate(zip(images, prompts))]
    names = sorted({k for part in parts for k in part.extras})
    extras = {k: np.asarray([part.extras[k][0] if k in part.extras else np.nan for part in parts], np.float32)
              for k in names}
    return RewardScores(np.concatenate([part.values for part in parts]).astype(np.float32), extras)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0: a free one)")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is no longer the parent")
    parser.add_argument("--cache-dir", default="~/.cache/ddpo_tpu", help="model cache (tiny stand-ins are built here)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cpu)")
    parser.add_argument("--import", dest="imports", action="append", default=[],
                        help="a module to import first (registers rewards defined outside ddpo_tpu)")
    args = parser.parse_args(argv)

    # stdout is the trainer's pipe for the one ready line; every other write goes to stderr (the log)
    ready = os.dup(1)
    os.dup2(2, 1)
    if args.parent_pid is not None:
        threading.Thread(target=_watch_parent, args=(args.parent_pid,), name="parent-watch", daemon=True).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer decides when this process ends

    import importlib

    for module in args.imports:
        importlib.import_module(module)
    config = json.loads(sys.stdin.read())
    start = time.monotonic()
    reward = build_reward(config, os.path.expanduser(args.cache_dir), args.device)
    server = _Server(args.port, reward)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="serve", daemon=True).start()
    port = server.server_address[1]
    print(f"reward {reward!r} built in {time.monotonic() - start:.1f}s on {args.device or 'cpu'}; "
          f"serving 127.0.0.1:{port} (pid {os.getpid()})", flush=True)
    os.write(ready, f"{READY_PREFIX}{port}\n".encode())
    os.close(ready)
    stop.wait()
    print(f"SIGTERM: stopping after {server.served} requests", flush=True)
    server.shutdown()
    server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
