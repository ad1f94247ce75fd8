"""GRPO's zero-advantage filter compiles nothing new on XLA: the train batch keeps its shape whatever is dropped (a loss
weight of 0, not a smaller batch), so over epochs where zero-std groups come and go (none, half the epoch, none, all)
XLA CPU compiles nothing after epoch 0. The rewards come from an in-process HTTP server (reward=remote) that answers
some sampling batches with one reward per prompt."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from tests.helpers import FAST_XLA_CPU, read_metrics, run_train

pytestmark = [pytest.mark.slow, pytest.mark.xla]

# per sampling batch (2 an epoch, one request each): True = one reward per prompt, so all its groups have std 0
EQUAL = {2: True, 6: True, 7: True}  # epoch 1 batch 0; epoch 3 both batches


@contextlib.contextmanager
def scheduled_reward_server():
    count = [0]

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            r = count[0]
            count[0] += 1
            if EQUAL.get(r):
                rewards = [int(hashlib.sha256(p.encode()).hexdigest()[:4], 16) / 65536 for p in body["prompts"]]
            else:  # a different value per image
                rewards = [int(hashlib.sha256(base64.b64decode(im["data"])).hexdigest()[:6], 16) / 2**24
                           for im in body["images"]]
            out = json.dumps({"rewards": rewards}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/score"
    finally:
        server.shutdown()
        server.server_close()


def test_zero_advantage_groups_coming_and_going_compile_nothing_after_epoch_0(tmp_path, model_cache):
    with scheduled_reward_server() as url:
        proc = run_train(["+experiment=flow_grpo_smoke", "tpu_topology=cpu", "num_epochs=4", "save_freq=4",
                          "reward=remote", f"reward.url={url}", "reward.host_workers=0", "reward.retries=0",
                          "sample.batch_size=8", "sample.num_batches_per_epoch=2", "train.batch_size=8",
                          "train.gradient_accumulation_steps=1", f"model.cache_dir={model_cache}", FAST_XLA_CPU],
                         tmp_path, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    epochs = read_metrics(tmp_path / "outputs" / "flow_grpo_smoke", "epoch")
    kept = [e["kept_fraction"] for e in epochs]
    zero_std = [e["zero_std_ratio"] for e in epochs]
    print("kept", kept, "zero_std", zero_std, "compilations", [e["new_compilations"] for e in epochs])
    assert kept[0] == 1.0 and kept[2] == 1.0 and zero_std[0] == zero_std[2] == 0.0
    assert 0 < kept[1] < 1 and zero_std[1] > 0   # half the epoch's groups had equal rewards
    assert kept[3] == 0.0 and zero_std[3] == 1.0  # every group: nothing trained, the same graphs run
    assert epochs[0]["new_compilations"] > 0
    for e in epochs[1:]:
        assert e["new_compilations"] == 0, (e["epoch"], e["phases"])
    assert np.isfinite([e["loss"] for e in epochs]).all()
