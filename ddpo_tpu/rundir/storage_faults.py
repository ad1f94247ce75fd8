"""Faults of the bucket client, as one-line errors: what an exception means (unreachable, permission denied,
anything else), retries with a deadline (`storage_timeout_s`), and gcsfs's own log kept off the console. No gcsfs,
aiohttp or torch import: exceptions are judged by their type names."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

UNREACHABLE, DENIED, FAILED = "unreachable", "denied", "failed"
DENIED_FIX = ("grant this machine's account roles/storage.objectAdmin on the bucket, or run `gcloud auth "
              "application-default login` / set GOOGLE_APPLICATION_CREDENTIALS")


DEFAULT_TIMEOUT_S = 300.0  # storage_timeout_s's default (config/schema.py reads it here: one copy)


def default_timeout_s() -> float:
    return DEFAULT_TIMEOUT_S


def gcsfs_missing() -> bool:
    import importlib.util

    return importlib.util.find_spec("gcsfs") is None


def endpoint() -> str:
    """Where the bucket client sends its requests: Cloud Storage, or the emulator STORAGE_EMULATOR_HOST names."""
    from ddpo_tpu.env import storage_emulator_host

    host = storage_emulator_host() or "https://storage.googleapis.com"
    return host if "://" in host else f"http://{host}"


def unresolvable() -> tuple[str, str] | None:
    """(reason, fix) when this machine's DNS cannot resolve the endpoint's host (a definite answer, so no retries)."""
    import socket
    import urllib.parse

    parts = urllib.parse.urlsplit(endpoint())
    try:
        socket.getaddrinfo(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
    except socket.gaierror as e:
        return (f"Cloud Storage is unreachable from this machine: its DNS cannot resolve {parts.hostname} "
                f"({e.strerror})", "check this machine's network and DNS (e.g. /etc/resolv.conf), then run the same "
                "command again")
    except (OSError, UnicodeError):
        return None  # anything else: the requests themselves will say
    return None


class StorageError(RuntimeError):
    """The bucket refused or lost a request a resume needs: `reason` and `fix`, `kind` one of UNREACHABLE (DNS,
    connection, timeouts, 5xx: retried up to the deadline), DENIED (permission, credentials) or FAILED."""

    def __init__(self, reason: str, fix: str = "", kind: str = FAILED):
        self.reason, self.fix, self.kind = reason, fix, kind
        super().__init__(f"{reason} ({fix})" if fix else reason)


# --- faults: gcsfs's log, what an exception means, retries with a deadline ---------------------------------------

class _GcsfsLog(logging.Handler):
    """Takes gcsfs's own log (it logs each retry, and a traceback when it gives up) off the console; keeps the last
    retry's cause, which our error line names when a request timed out without an exception of its own."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.last = ""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 -- a broken record only loses its text
            return
        if "exception" in message:
            self.last = message.split("exception:", 1)[-1].strip().splitlines()[0][:200] if message else ""


_gcsfs_log = _GcsfsLog()


def quiet_gcsfs() -> None:
    log = logging.getLogger("gcsfs")
    if _gcsfs_log not in log.handlers:
        log.addHandler(_gcsfs_log)
        log.setLevel(logging.DEBUG)
        log.propagate = False


_UNREACHABLE_TYPES = {"ClientConnectorError", "ClientConnectorDNSError", "ClientOSError", "ServerDisconnectedError",
                      "ServerTimeoutError", "ClientPayloadError", "ConnectionError", "TimeoutError", "gaierror",
                      "ProxyError", "ChunkedEncodingError", "ReadTimeout", "FSTimeoutError"}


def classify(e: BaseException) -> str:
    """UNREACHABLE, DENIED or FAILED, by the exception's type names (no import of aiohttp or google-auth here)."""
    names = {c.__name__ for c in type(e).__mro__}
    code = getattr(e, "code", None)
    if "GoogleAuthError" in names or code in (401, 403) or str(e).startswith("Forbidden"):
        return DENIED
    if names & _UNREACHABLE_TYPES or (isinstance(code, int) and (code >= 500 or code in (408, 429))):
        return UNREACHABLE
    return FAILED


def _detail(e: BaseException) -> str:
    text = " ".join(str(e).split())[:200]
    if isinstance(e, TimeoutError) and not text:
        return f"no answer in time; last: {_gcsfs_log.last}" if _gcsfs_log.last else "no answer in time"
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _error(what: str, e: BaseException, waited: float) -> StorageError:
    kind = classify(e)
    if kind == UNREACHABLE:
        return StorageError(f"{what}: Cloud Storage ({endpoint()}) is unreachable from this machine ({_detail(e)}; "
                            f"retried for {waited:.0f} s)",
                            "check this machine's network and DNS, and the Cloud Storage status; storage_timeout_s="
                            "SECONDS sets how long an outage is waited out", UNREACHABLE)
    if kind == DENIED:
        return StorageError(f"{what}: permission denied ({_detail(e)})", DENIED_FIX, DENIED)
    return StorageError(f"{what}: {_detail(e)}", "check the bucket, then run the same command again", FAILED)


def retry(what: str, fn: Callable[[float], Any], timeout_s: float, sleep: Callable[[float], None] = time.sleep,
           clock: Callable[[], float] = time.monotonic) -> Any:
    """fn(seconds left) until it succeeds; an unreachable bucket is retried until `timeout_s` from the first try,
    anything else fails at once (FileNotFoundError is an answer, raised as it is)."""
    start, pause = clock(), 1.0
    while True:
        left = timeout_s - (clock() - start)
        try:
            return fn(max(left, 0.5))
        except FileNotFoundError:
            raise
        except Exception as e:  # noqa: BLE001 -- gcsfs raises OSError, aiohttp, google-auth and fsspec errors
            waited = clock() - start
            if classify(e) != UNREACHABLE or waited + pause >= timeout_s:
                raise _error(what, e, waited) from e
            sleep(pause)
            pause = min(pause * 2, 30.0)
