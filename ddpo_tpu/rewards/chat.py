"""An OpenAI-compatible chat-completions client for VLM judges (stdlib only: urllib + json + threads).

vLLM (``vllm serve``) and sglang (``python -m sglang.launch_server``) both serve ``POST {url}/chat/completions`` with
the OpenAI body (``model``, ``messages``, sampling fields; ``logprobs`` / ``top_logprobs`` on request). The references
call it through the ``openai`` / ``aiohttp`` packages with one request per image, all of a batch at once
(yifan123/flow_grpo@ac4c86e flow_grpo/rewards.py:338-341 ``asyncio.gather``; verl-project/verl-omni@a1139ba
verl_omni/utils/reward_score/unified_reward.py:196-207; X-GenGroup/Flow-Factory@a0b2bc5
src/flow_factory/rewards/vllm_evaluate.py:245 and 272, under a semaphore of ``max_concurrent``). This client does the
same with at most ``max_concurrency`` requests in flight, on daemon threads, so the trainer needs no async runtime and
no new package.

Failure handling is rewards/remote.py's, so both remote rewards behave alike:

* connection errors, timeouts (``timeout_s`` on connecting and on each socket read) and HTTP 5xx / 429 are retried
  up to ``retries`` times, ``backoff_s * 2**k`` seconds before retry ``k``;
* any other 4xx is the server refusing the request (unknown model, a prompt past the context length, a wrong path):
  raised at once, with the server's error text and the key to fix;
* a reply that is not a chat completion (no ``choices[0].message``) is raised at once, naming ``reward.url``;
* ``should_stop`` (set by the trainer on SIGTERM) is polled every 0.2 s while requests or backoffs wait: the call
  raises RewardInterrupted within about that, not after ``timeout_s x retries`` (a blocked socket read cannot be
  interrupted, so requests run on daemon threads that are abandoned).

``api_key_env`` names an environment variable (never the key): its value is sent as ``Authorization: Bearer ...``,
so the key stays out of config.yaml and the run dir.
"""

from __future__ import annotations

import http.client
import json
import math
import re
import threading
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Callable, Sequence

from ddpo_tpu.env import secret
from ddpo_tpu.rewards.remote import (
    _STOP_POLL_S,
    RewardInterrupted,
    _describe,
    _error_text,
    _excerpt,
    _is_loopback,
    _Transient,
)
from ddpo_tpu.waits import advanced

__all__ = ["ChatClient", "ENV_NAME", "RewardInterrupted", "chat_endpoint"]

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # what api_key_env may hold: a variable's name, not a key
COMPLETIONS = "/chat/completions"


def chat_endpoint(url: str) -> str:
    """The completions endpoint under an API base (``http://HOST:PORT/v1`` -> ``.../v1/chat/completions``)."""
    return url.rstrip("/") + COMPLETIONS


class ChatClient:
    """Sends chat-completion requests (JSON bodies as the OpenAI API takes them) and returns the replies in order.

    Args:
        url: the API base, ``http(s)://HOST:PORT/v1`` (the client posts to ``{url}/chat/completions``).
        timeout_s, retries, backoff_s: as rewards/remote.py (see the module docstring).
        max_concurrency: requests in flight at once (one image per request, as the references send them).
        api_key_env: name of the environment variable holding the server's API key, or None for none.
        error: builds the exception raised for a failure from its one-line message (the reward's ``_error``).
        should_stop: polled while waiting; True abandons the call with RewardInterrupted.
        prefix: the dotted prefix of the keys named in messages (``reward``, ``reward.components.0``).
    """

    def __init__(self, url: str, *, timeout_s: float = 60.0, retries: int = 3, backoff_s: float = 1.0,
                 max_concurrency: int = 16, api_key_env: str | None = None,
                 error: Callable[[str], Exception] = RuntimeError,
                 should_stop: Callable[[], bool] = lambda: False, prefix: str = "reward"):
        self._make_error, self.should_stop, self.prefix = error, should_stop, prefix
        if not isinstance(url, str) or not url.strip():
            raise self._fail(f"{prefix}.url={url!r}: must be the judge's API base, e.g. http://127.0.0.1:8000/v1")
        url = url.strip()
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise self._fail(f"{prefix}.url={url}: must be an http:// or https:// URL with a host, "
                             "e.g. http://127.0.0.1:8000/v1")
        try:
            parsed.port  # noqa: B018 -- raises ValueError on a bad port
        except ValueError as exc:
            raise self._fail(f"{prefix}.url={url}: {exc}") from exc
        if parsed.path.rstrip("/").endswith(COMPLETIONS):
            raise self._fail(f"{prefix}.url={url}: give the API base (ending in /v1), not the endpoint: the client "
                             f"adds {COMPLETIONS}")
        self.url, self._parsed = url, parsed
        self.endpoint = chat_endpoint(url)
        self.timeout_s = self._number("timeout_s", timeout_s, inclusive=False)
        self.backoff_s = self._number("backoff_s", backoff_s, inclusive=True)
        self.retries = self._integer("retries", retries, 0)
        self.max_concurrency = self._integer("max_concurrency", max_concurrency, 1)
        self.headers = {"Content-Type": "application/json", "Accept": "application/json",
                        "User-Agent": "ddpo_tpu-vlm-judge/1"}
        if api_key_env is not None:
            if not isinstance(api_key_env, str) or not ENV_NAME.fullmatch(api_key_env):
                raise self._fail(f"{prefix}.api_key_env={api_key_env!r}: must be the NAME of an environment variable "
                                 "(e.g. VLM_API_KEY), never the key itself")
            key = secret(api_key_env)
            if not key:
                raise self._fail(f"{prefix}.api_key_env={api_key_env}: the environment variable is not set. Fix: "
                                 f"export {api_key_env}=<the server's --api-key>, or set {prefix}.api_key_env=null")
            self.headers["Authorization"] = f"Bearer {key}"
        self.api_key_env = api_key_env
        proxies = {} if _is_loopback(parsed.hostname) else None  # loopback: never through a proxy
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler(proxies))

    # -- validation --------------------------------------------------------------------------------------------------

    def _fail(self, message: str) -> Exception:
        return self._make_error(message)

    def _number(self, key: str, value: Any, inclusive: bool) -> float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not (ok and (value >= 0 if inclusive else value > 0)):
            raise self._fail(f"{self.prefix}.{key}={value!r}: must be a finite number {'>=' if inclusive else '>'} 0")
        return float(value)

    def _integer(self, key: str, value: Any, minimum: int) -> int:
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= minimum):
            raise self._fail(f"{self.prefix}.{key}={value!r}: must be an integer >= {minimum}")
        return int(value)

    @property
    def shown_url(self) -> str:
        """The URL for messages, without any user:password@."""
        p = self._parsed
        if p.username is None and p.password is None:
            return self.url
        netloc = p.hostname + (f":{p.port}" if p.port else "")
        return urllib.parse.urlunsplit((p.scheme, netloc, p.path, p.query, p.fragment))

    # -- requests ----------------------------------------------------------------------------------------------------

    def complete(self, requests: Sequence[dict[str, Any] | Callable[[], dict[str, Any]]]) -> list[dict[str, Any]]:
        """One reply (the parsed JSON chat completion) per request body, in order; at most ``max_concurrency`` in
        flight. A request may be a function returning its body: it is called on a worker thread, so building the
        next bodies (image encoding) overlaps the requests in flight. Raises the first failure (after its retries),
        or RewardInterrupted on a stop request."""
        bodies = list(requests)
        replies: list[Any] = [None] * len(bodies)
        if not bodies:
            return []
        lock, cancel, done = threading.Lock(), threading.Event(), threading.Event()
        state = {"next": 0, "left": len(bodies), "error": None}

        def worker():
            while not cancel.is_set():
                with lock:
                    i = state["next"]
                    if i >= len(bodies):
                        return
                    state["next"] = i + 1
                try:
                    request = bodies[i]() if callable(bodies[i]) else bodies[i]
                    body = json.dumps(request, separators=(",", ":")).encode("utf-8")
                    replies[i] = self._complete_one(body, i, cancel)
                except BaseException as exc:  # noqa: BLE001 -- handed to the caller
                    with lock:
                        state["error"] = state["error"] or exc
                    cancel.set()
                    done.set()
                    return
                with lock:
                    state["left"] -= 1
                    if state["left"] == 0:
                        done.set()

        for _ in range(min(self.max_concurrency, len(bodies))):
            threading.Thread(target=worker, name="ddpo-vlm-judge", daemon=True).start()
        while not done.wait(_STOP_POLL_S):
            if self.should_stop():
                cancel.set()
                raise RewardInterrupted(f"{self.prefix}.url={self.shown_url}: stop requested while "
                                        f"{state['left']} chat request(s) were waiting")
        if state["error"] is not None:
            raise state["error"]
        return replies

    def _complete_one(self, body: bytes, index: int, cancel: threading.Event) -> dict[str, Any] | None:
        last: _Transient | None = None
        for attempt in range(self.retries + 1):
            if attempt and cancel.wait(self.backoff_s * 2 ** (attempt - 1)):
                return None  # the call was abandoned (a stop request or another request's failure)
            try:
                payload = self._post(body)
            except _Transient as exc:
                last = exc
                continue
            advanced()  # a request answered: a rank waiting on this reward is moving (ddpo_tpu/waits.py)
            return self._check_reply(payload, index)
        assert last is not None
        raise self._fail(self._give_up_message(last))

    def _check_reply(self, payload: bytes, index: int) -> dict[str, Any]:
        where = f"{self.prefix}.url={self.shown_url}: malformed reply to request {index}"
        try:
            reply = json.loads(payload.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise self._fail(f"{where}: not JSON: {_excerpt(payload)!r}. Fix: the URL must be an OpenAI-compatible "
                             "API base (vLLM / sglang: http://HOST:PORT/v1)") from None
        choices = reply.get("choices") if isinstance(reply, dict) else None
        if not (isinstance(choices, list) and choices and isinstance(choices[0], dict)
                and isinstance(choices[0].get("message"), dict)):
            raise self._fail(f"{where}: no choices[0].message in {_excerpt(payload)!r}. Fix: the URL must be an "
                             "OpenAI-compatible API base (vLLM / sglang: http://HOST:PORT/v1)")
        return reply

    def _post(self, body: bytes) -> bytes:
        request = urllib.request.Request(self.endpoint, data=body, headers=self.headers, method="POST")
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
            raise self._fail(f"{self.prefix}.url={self.shown_url}: the server rejected the request with HTTP "
                             f"{exc.code}: {text}{self._hint(exc.code)}") from None
        except (OSError, http.client.HTTPException) as exc:  # URLError, timeouts, resets, bad status lines
            raise _Transient(*_describe(exc, self.timeout_s)) from None

    def _hint(self, code: int) -> str:
        p = self.prefix
        if code in (401, 403):
            return (f". Fix: set {p}.api_key_env to the name of an environment variable holding the server's API key"
                    + (f" (now {self.api_key_env}: is it the right key?)" if self.api_key_env else ""))
        if code == 404:
            return (f". Fix: {p}.url must be the API base (vLLM / sglang: http://HOST:PORT/v1), and {p}.model the "
                    "served model name (vLLM: --served-model-name)")
        if code == 400:
            return (f". Fix: check {p}.model (the served name), {p}.max_tokens (prompt + reply within the server's "
                    f"context length) and {p}.image_size")
        return ""

    def _give_up_message(self, last: _Transient) -> str:
        p, where, after = self.prefix, f"{self.prefix}.url={self.shown_url}", f"after {self.retries} retries"
        if last.kind == "timeout":
            return (f"{where}: no reply {after} ({last.text}). Fix: check that the judge server is up and not stuck, "
                    f"or raise {p}.timeout_s (now {self.timeout_s:g}) / lower {p}.max_concurrency "
                    f"(now {self.max_concurrency})")
        if last.kind == "server":
            return f"{where}: server error {after} ({last.text}). Fix: check the judge server's log, or raise " \
                   f"{p}.retries / {p}.backoff_s"
        return (f"{where}: unreachable {after} ({last.text}). Fix: start the judge server (vllm serve / "
                f"sglang.launch_server, docs/rewards.md 'VLM judges') or fix {p}.url")
