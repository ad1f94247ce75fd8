"""Remote reward: score images with an HTTP reward server (stdlib only: urllib + json + base64).

Use it when the reward model does not belong in the training process (a large VLM, another machine, another
framework)::

    reward = make_reward("remote", url="http://127.0.0.1:8000/score")
    rewards = reward(images_uint8_bhwc, prompts)          # float32 (B,)

``scripts/reward_server.py`` is a reference server (JPEG compressibility by default).

Wire format (version 1) -- the contract for your own server
-----------------------------------------------------------
The client sends one ``POST`` to ``url`` per chunk of at most ``batch_size`` images, with
``Content-Type: application/json`` and the body::

    {
      "version": 1,
      "images": [IMAGE, ...],          # one per sample, in order
      "prompts": ["a cat", ...],       # same length as "images"
      "metadata": [{...}, ...]         # optional: one JSON object per image (see below)
    }

``metadata`` (optional, still version 1) is sent only when the prompts carry metadata (a prompt dataset's rows:
GenEval's ``tag``/``include``/``exclude``, an OCR target; ddpo_tpu/rewards/base.py): one object per image, in the
order of ``images``, ``{}`` for a prompt without any.  A server that does not know the field ignores it.

where each IMAGE is an object, by ``image_format``:

* ``"png"`` (default)::

      {"format": "png", "data": "<base64 of a PNG file>"}

  an 8-bit RGB PNG, lossless (decode with any PNG reader: PIL ``Image.open(BytesIO(b64decode(data)))``).
* ``"raw"``::

      {"format": "raw", "dtype": "uint8", "shape": [H, W, 3], "data": "<base64 of the H*W*3 bytes>"}

  the pixels in row-major (C) order, RGB, channels last
  (``np.frombuffer(b64decode(data), np.uint8).reshape(shape)``).  Bigger, but no encoding cost.

A successful reply is HTTP 2xx with a JSON object holding one number per image, in the same order::

    {"rewards": [0.25, -1.5, ...]}

Each reward must be a JSON number (``true``/``false``, strings and ``null`` are rejected); Python's
``NaN``/``Infinity`` literals are accepted and reach the trainer as non-finite rewards (handled by
``on_nonfinite_reward``).  A reply may also carry optional per-image values to log beside the reward::

    {"rewards": [0.25, -1.5], "extras": {"strict_accuracy": [1, null], "counting": [null, 0.5]}}

each a list of one number or ``null`` per image (``null``: the value does not apply to that image; it becomes NaN),
returned by ``RemoteReward.score()`` as the ``extras`` of its RewardScores.  Other keys are ignored, so an old
server (no extras) and an old client (extras ignored) keep working.

Errors: reply 4xx for a request the server will never accept (bad input); the body should be
``{"error": "what is wrong"}`` (plain text also works) and the client raises at once with that text, except 429
(too many requests), which is retried like a 5xx.  Reply 5xx for a transient failure (overloaded, model
loading): the client retries.

Retries: connection errors (refused, reset, DNS), timeouts (``timeout_s`` applies to connecting and to each
socket read) and HTTP 5xx/429 are retried up to ``retries`` times, waiting ``backoff_s * 2**k`` seconds before
retry ``k`` (0, 1, ...).  Malformed replies and other 4xx are not retried.  So one chunk takes at most about
``(retries + 1) * timeout_s + backoff_s * (2**retries - 1)`` seconds before a RewardError.

Every error names the setting to fix (``reward.url=...``, ``reward.timeout_s=...``).

Proxies: a loopback ``url`` (localhost, 127.x, ::1) is always contacted directly; any other goes through
urllib's default proxy handling.  Requests are independent (no shared state), so the reward can be called from
several threads (``reward.host_workers``).
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import math
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Mapping

import numpy as np

from ddpo_tpu.rewards.base import Metadata, Reward, RewardScores, register_reward
from ddpo_tpu.rewards.wire import (IMAGE_FORMATS, WIRE_VERSION, _TEXT_LIMIT, _excerpt, decode_image,  # noqa: F401
                                   decode_request, encode_image, encode_reply, encode_request, parse_reply,
                                   parse_rewards)
from ddpo_tpu.waits import advanced

__all__ = [
    "WIRE_VERSION",
    "IMAGE_FORMATS",
    "RemoteReward",
    "encode_image",
    "decode_image",
    "encode_request",
    "decode_request",
    "encode_reply",
    "parse_reply",
    "parse_rewards",
]

_NAME = "remote"


def _error_text(payload: bytes) -> str:
    """The server's error message: the "error" field of a JSON body, else the body's text."""
    try:
        reply = json.loads(payload.decode("utf-8"))
        if isinstance(reply, dict) and "error" in reply:
            return _excerpt(str(reply["error"]))
    except (UnicodeDecodeError, json.JSONDecodeError):
        pass
    return _excerpt(payload) or "(empty body)"


def _is_loopback(host: str | None) -> bool:
    if not host:
        return False
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _describe(exc: BaseException, timeout_s: float) -> tuple[str, str]:
    """(kind, text) of a transient failure; kind is 'timeout' or 'connection'."""
    reason: Any = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    if isinstance(reason, (TimeoutError, socket.timeout)):
        return "timeout", f"timed out after {timeout_s:g}s"
    if isinstance(reason, ConnectionRefusedError):
        return "connection", "connection refused"
    if isinstance(reason, socket.gaierror):
        return "connection", f"cannot resolve the host: {reason}"
    if isinstance(reason, (ConnectionResetError, http.client.RemoteDisconnected)):
        return "connection", f"connection closed by the server ({type(reason).__name__})"
    if isinstance(reason, BaseException):
        return "connection", f"{type(reason).__name__}: {reason}"
    return "connection", str(reason)


# ---------------------------------------------------------------------------
# The reward
# ---------------------------------------------------------------------------


class _Transient(Exception):
    def __init__(self, kind: str, text: str):
        super().__init__(text)
        self.kind = kind  # 'connection', 'timeout' or 'server'
        self.text = text


class RewardInterrupted(Exception):
    """The trainer asked to stop (SIGTERM) while a request was waiting: the epoch's rewards are abandoned."""


_STOP_POLL_S = 0.2


@register_reward(_NAME)
class RemoteReward(Reward):
    """Rewards computed by an HTTP server (see the module docstring for the wire format).

    Args:
        url: the server's scoring endpoint, ``http://`` or ``https://`` (e.g. ``http://127.0.0.1:8000/score``).
        timeout_s: socket timeout of each request, in seconds (connect and each read).
        retries: how many times a failed request (connection error, timeout, HTTP 5xx/429) is retried.
        backoff_s: wait before the first retry; doubled for each further retry.
        batch_size: at most this many images per request.
        image_format: ``"png"`` (default, lossless, smaller) or ``"raw"`` (uint8 pixels + shape).
        headers: extra HTTP headers sent with every request (e.g. ``{"Authorization": "Bearer ..."}``).
    """

    name = _NAME

    def __init__(
        self,
        url: str,
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        batch_size: int = 16,
        image_format: str = "png",
        headers: Mapping[str, str] | None = None,
    ):
        if not isinstance(url, str) or not url.strip():
            raise self._error(
                f"reward.url={url!r}: must be the reward server's URL, e.g. http://127.0.0.1:8000/score"
            )
        url = url.strip()
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise self._error(
                f"reward.url={url}: must be an http:// or https:// URL with a host, "
                "e.g. http://127.0.0.1:8000/score"
            )
        try:
            parsed.port  # noqa: B018 -- raises ValueError on a bad port
        except ValueError as exc:
            raise self._error(f"reward.url={url}: {exc}") from exc
        self.url = url
        self._parsed = parsed
        self.timeout_s = self._number("timeout_s", timeout_s, minimum=0.0, inclusive=False)
        self.backoff_s = self._number("backoff_s", backoff_s, minimum=0.0, inclusive=True)
        self.retries = self._integer("retries", retries, minimum=0)
        self.batch_size = self._integer("batch_size", batch_size, minimum=1)
        if image_format not in IMAGE_FORMATS:
            raise self._error(f"reward.image_format={image_format!r}: must be one of {list(IMAGE_FORMATS)}")
        self.image_format = image_format
        if headers is not None and not (
            isinstance(headers, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items())
        ):
            raise self._error("reward.headers: must map header names to string values")
        self.headers = {
            "Content-Type": "application/json",
            "Accept": "application/json",
            "User-Agent": "ddpo_tpu-remote-reward/1",
            **dict(headers or {}),
        }
        if _is_loopback(parsed.hostname):
            self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        else:
            self._opener = urllib.request.build_opener()

    # -- validation helpers ---------------------------------------------------

    def _number(self, key: str, value: Any, minimum: float, inclusive: bool) -> float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        ok = ok and (value >= minimum if inclusive else value > minimum)
        if not ok:
            bound = f">= {minimum:g}" if inclusive else f"> {minimum:g}"
            raise self._error(f"reward.{key}={value!r}: must be a finite number {bound}")
        return float(value)

    def _integer(self, key: str, value: Any, minimum: int) -> int:
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= minimum):
            raise self._error(f"reward.{key}={value!r}: must be an integer >= {minimum}")
        return int(value)

    @property
    def _shown_url(self) -> str:
        """The URL for messages, without any user:password@."""
        p = self._parsed
        if p.username is None and p.password is None:
            return self.url
        netloc = p.hostname + (f":{p.port}" if p.port else "")
        return urllib.parse.urlunsplit((p.scheme, netloc, p.path, p.query, p.fragment))

    # -- scoring ---------------------------------------------------------------

    def __call__(self, images: np.ndarray, prompts: list[str], metadata: Metadata = None) -> np.ndarray:
        return self.score(images, prompts, metadata=metadata).values

    def score(self, images: np.ndarray, prompts: list[str], metadata: Metadata = None) -> RewardScores:
        """The server's rewards and extras, one request per chunk of ``batch_size`` images; an extra that one chunk's
        reply lacks is NaN for that chunk's images."""
        images = self._check_host_images(images, prompts)
        prompts = list(prompts)
        if metadata is not None and len(metadata) != len(prompts):
            raise self._error(f"got {len(metadata)} metadata rows for {len(prompts)} prompts")
        n = images.shape[0]
        out = np.empty(n, dtype=np.float32)
        extras: dict[str, np.ndarray] = {}
        for start in range(0, n, self.batch_size):
            stop = min(start + self.batch_size, n)
            try:
                body = encode_request(images[start:stop], prompts[start:stop], self.image_format,
                                      None if metadata is None else list(metadata[start:stop]))
            except Exception as exc:
                raise self._error(
                    f"reward.url={self._shown_url}: could not encode images {start}..{stop - 1}: "
                    f"{type(exc).__name__}: {exc}"
                    + (" (metadata must be JSON: strings, numbers, lists, objects)" if metadata is not None else "")
                ) from exc
            chunk = self._score_chunk(body, stop - start, start)
            advanced()  # a request answered: a rank waiting on this reward is moving (ddpo_tpu/waits.py)
            out[start:stop] = chunk.values
            for name, column in chunk.extras.items():
                extras.setdefault(name, np.full(n, np.nan, dtype=np.float32))[start:stop] = column
        return RewardScores(out, extras)

    # set by the trainer: a request (or a backoff) that is waiting gives up within ~0.2 s once this returns True,
    # so a SIGTERM during a hanging server stops the run in seconds, not after timeouts x retries
    should_stop = staticmethod(lambda: False)

    def _wait(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self.should_stop():
                raise RewardInterrupted(f"reward.url={self._shown_url}: stop requested while waiting to retry")
            time.sleep(min(left, _STOP_POLL_S))

    def _post_interruptible(self, body: bytes) -> bytes:
        """_post in a daemon thread, watched for a stop request (a blocked socket read cannot be interrupted)."""
        import threading

        done, box = threading.Event(), {}

        def work():
            try:
                box["payload"] = self._post(body)
            except BaseException as exc:  # noqa: BLE001 -- handed to the caller
                box["error"] = exc
            finally:
                done.set()

        threading.Thread(target=work, name="ddpo-remote-reward", daemon=True).start()
        while not done.wait(_STOP_POLL_S):
            if self.should_stop():
                raise RewardInterrupted(f"reward.url={self._shown_url}: stop requested while a request was waiting")
        if "error" in box:
            raise box["error"]
        return box["payload"]

    def _score_chunk(self, body: bytes, count: int, start: int) -> RewardScores:
        last: _Transient | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                self._wait(self.backoff_s * 2 ** (attempt - 1))
            try:
                payload = self._post_interruptible(body)
            except _Transient as exc:
                last = exc
                continue
            try:
                return parse_reply(payload, count)
            except ValueError as exc:
                raise self._error(
                    f"reward.url={self._shown_url}: malformed reply for images {start}..{start + count - 1}: "
                    f"{exc}. Fix: the server must answer {{\"rewards\": [one number per image]}} "
                    "(wire format: ddpo_tpu/rewards/remote.py)"
                ) from None
        assert last is not None
        raise self._error(self._give_up_message(last))

    def _post(self, body: bytes) -> bytes:
        request = urllib.request.Request(self.url, data=body, headers=self.headers, method="POST")
        try:
            with self._opener.open(request, timeout=self.timeout_s) as response:
                return response.read()
        except urllib.error.HTTPError as exc:
            try:
                text = _error_text(exc.read())
            except Exception:  # body unreadable (connection dropped)
                text = exc.reason if isinstance(exc.reason, str) else "(no body)"
            finally:
                exc.close()
            if exc.code >= 500 or exc.code == 429:
                raise _Transient("server", f"HTTP {exc.code}: {text}") from None
            raise self._error(
                f"reward.url={self._shown_url}: the server rejected the request with HTTP {exc.code}: {text}"
                + (". Fix: check reward.url (path)" if exc.code in (404, 405) else "")
            ) from None
        except (OSError, http.client.HTTPException) as exc:  # URLError, timeouts, resets, bad status lines
            kind, text = _describe(exc, self.timeout_s)
            raise _Transient(kind, text) from None

    def _give_up_message(self, last: _Transient) -> str:
        where = f"reward.url={self._shown_url}"
        after = f"after {self.retries} retries"
        if last.kind == "timeout":
            return (
                f"{where}: no reply {after} ({last.text}). Fix: check that the reward server is up and not stuck, "
                f"or raise reward.timeout_s (now {self.timeout_s:g}) / lower reward.batch_size (now {self.batch_size})"
            )
        if last.kind == "server":
            return (
                f"{where}: server error {after} ({last.text}). Fix: check the reward server's log, "
                "or raise reward.retries / reward.backoff_s"
            )
        port = self._parsed.port or (443 if self._parsed.scheme == "https" else 80)
        return (
            f"{where}: unreachable {after} ({last.text}). Fix: start the reward server "
            f"(python scripts/reward_server.py --port {port}) or fix reward.url"
        )

    def __repr__(self) -> str:
        return (
            f"RemoteReward(url={self._shown_url!r}, timeout_s={self.timeout_s:g}, retries={self.retries}, "
            f"backoff_s={self.backoff_s:g}, batch_size={self.batch_size}, image_format={self.image_format!r})"
        )
