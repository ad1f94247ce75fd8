"""An in-process reward=remote server for tests: answers each POST with what the test's function returns."""

from __future__ import annotations

import contextlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator


@contextlib.contextmanager
def recording_server(reply, status: int = 200) -> Iterator[tuple[str, list[dict]]]:
    """In-process server answering each POST with `status` and reply(request_json, index): a JSON-able object, or
    bytes sent as they are (a malformed reply); yields (url, the decoded requests)."""
    seen: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):  # quiet
            pass

        def do_POST(self):  # noqa: N802
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(request)
            data = reply(request, len(seen) - 1)
            if not isinstance(data, bytes):
                data = json.dumps(data).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/score", seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
