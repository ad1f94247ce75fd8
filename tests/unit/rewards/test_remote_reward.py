"""Remote (HTTP) and weighted rewards, against scripts/reward_server.py started as a subprocess.

Every server binds 127.0.0.1 on an ephemeral port, carries --idle-timeout as a safety net, and is terminated in a
finally block; every client uses small timeouts and bounded retries.
"""

from __future__ import annotations

import contextlib
import json
import selectors
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Iterator

import numpy as np
import pytest

import ddpo_tpu.rewards.remote  # noqa: F401  (registers "remote")
import ddpo_tpu.rewards.weighted  # noqa: F401  (registers "weighted")
from ddpo_tpu.rewards import REWARDS, RewardError, make_reward
from ddpo_tpu.rewards.remote import RemoteReward, decode_image, encode_image, encode_reply, parse_reply
from ddpo_tpu.rewards.weighted import WeightedReward

from tests.helpers import REPO, clean_env
from tests.helpers.reward_server import recording_server

pytestmark = pytest.mark.torch_free  # no torch in the test or what it starts (tests/conftest.py)

SCRIPT = REPO / "scripts" / "reward_server.py"
PROMPTS7 = [f"prompt {i}" for i in range(7)]


def _images(n: int = 7, size: int = 24, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, size, size, 3), dtype=np.uint8)


class Server:
    def __init__(self, proc: subprocess.Popen, port: int):
        self.proc, self.port = proc, port
        self.url = f"http://127.0.0.1:{port}/score"

    def wait_output(self, timeout: float = 20) -> str:
        """Wait for the server to stop by itself; its remaining stdout."""
        out, _ = self.proc.communicate(timeout=timeout)
        assert self.proc.returncode == 0, out
        return out


@contextlib.contextmanager
def reward_server(*args: str, idle_timeout: float = 60) -> Iterator[Server]:
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--host", "127.0.0.1", "--port", "0", "--idle-timeout", str(idle_timeout),
         *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=clean_env(), cwd=REPO,
    )
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            assert sel.select(timeout=30), "reward server did not start within 30 s"
        line = proc.stdout.readline()
        assert line.startswith("listening on 127.0.0.1:"), line + (proc.stdout.read() if proc.poll() else "")
        yield Server(proc, int(line.strip().rsplit(":", 1)[1]))
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if proc.stdout:
            proc.stdout.close()


@contextlib.contextmanager
def canned_server(status: int, body: bytes) -> Iterator[tuple[str, list[dict]]]:
    """In-process server answering every POST with (status, body); yields (url, the requests)."""
    with recording_server(lambda request, index: body, status) as served:
        yield served


def _closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- registry and construction -------------------------------------------------------------------------------------


def test_registry_knows_remote_and_weighted():
    assert REWARDS["remote"] is RemoteReward and REWARDS["weighted"] is WeightedReward
    reward = make_reward("remote", url="http://127.0.0.1:8000/score")
    assert isinstance(reward, RemoteReward)
    assert (reward.timeout_s, reward.retries, reward.backoff_s, reward.batch_size) == (30.0, 3, 0.5, 16)


@pytest.mark.parametrize("kwargs, key", [
    ({"url": "ftp://127.0.0.1/score"}, "reward.url="),
    ({"url": ""}, "reward.url="),
    ({"url": "http://127.0.0.1:8000/score", "batch_size": 0}, "reward.batch_size=0"),
    ({"url": "http://127.0.0.1:8000/score", "timeout_s": 0}, "reward.timeout_s=0"),
    ({"url": "http://127.0.0.1:8000/score", "retries": -1}, "reward.retries=-1"),
    ({"url": "http://127.0.0.1:8000/score", "image_format": "jpeg"}, "reward.image_format="),
])
def test_remote_rejects_bad_settings(kwargs, key):
    with pytest.raises(RewardError, match=key):
        make_reward("remote", **kwargs)


@pytest.mark.parametrize("image_format", ["png", "raw"])
def test_image_encoding_round_trips(image_format):
    image = _images(1, size=5)[0]
    assert np.array_equal(decode_image(json.loads(json.dumps(encode_image(image, image_format)))), image)


# --- against the reference server ----------------------------------------------------------------------------------


@pytest.mark.parametrize("image_format", ["png", "raw"])
def test_remote_equals_local_jpeg_compressibility(image_format):
    images = _images(5)
    prompts = PROMPTS7[:5]
    expected = make_reward("jpeg_compressibility")(images, prompts)
    with reward_server("--kind", "jpeg") as server:
        got = make_reward("remote", url=server.url, timeout_s=10, retries=0, image_format=image_format)(images, prompts)
    assert got.dtype == np.float32 and got.shape == (5,)
    np.testing.assert_array_equal(got, expected)


def test_batching_sends_ceil_b_over_batch_size_requests_in_order():
    images = _images(7)
    expected = make_reward("jpeg_compressibility")(images, PROMPTS7)
    with reward_server("--kind", "jpeg", "--max-requests", "3") as server:
        got = RemoteReward(server.url, timeout_s=10, retries=0, batch_size=3)(images, PROMPTS7)
        out = server.wait_output()  # stops by itself after exactly 3 requests
    np.testing.assert_array_equal(got, expected)  # chunks reassembled in order
    lines = out.splitlines()
    assert [ln for ln in lines if ln.startswith("POST")] == [
        "POST /score -> 200 (3 images)", "POST /score -> 200 (3 images)", "POST /score -> 200 (1 images)"]
    assert lines[-1] == "served 3 requests"


def test_empty_batch_sends_nothing():
    reward = RemoteReward(f"http://127.0.0.1:{_closed_port()}/score", retries=0)
    assert reward(np.zeros((0, 8, 8, 3), np.uint8), []).shape == (0,)


def test_retries_succeed_against_flaky_server():
    images = _images(4)
    expected = make_reward("jpeg_compressibility")(images, PROMPTS7[:4])
    with reward_server("--kind", "flaky") as server:
        reward = RemoteReward(server.url, timeout_s=10, retries=3, backoff_s=0.01, batch_size=2)
        np.testing.assert_array_equal(reward(images, PROMPTS7[:4]), expected)  # each chunk: 503 then 200
        with pytest.raises(RewardError) as info:  # without retries the 503 is fatal
            RemoteReward(server.url, timeout_s=10, retries=0)(images, PROMPTS7[:4])
    message = str(info.value)
    assert f"reward.url={server.url}" in message and "server error after 0 retries" in message
    assert "HTTP 503" in message and "flaky server" in message


def test_unreachable_url_raises_naming_reward_url_quickly():
    url = f"http://127.0.0.1:{_closed_port()}/score"
    reward = RemoteReward(url, timeout_s=1, retries=2, backoff_s=0.01)
    t0 = time.monotonic()
    with pytest.raises(RewardError) as info:
        reward(_images(2), PROMPTS7[:2])
    assert time.monotonic() - t0 < 10
    message = str(info.value)
    assert f"reward.url={url}: unreachable after 2 retries (connection refused)" in message
    assert "python scripts/reward_server.py --port" in message and "fix reward.url" in message


def test_timeout_is_retried_then_raises():
    with reward_server("--kind", "slow", "--delay", "2") as server:
        reward = RemoteReward(server.url, timeout_s=0.3, retries=1, backoff_s=0.01)
        t0 = time.monotonic()
        with pytest.raises(RewardError, match=r"no reply after 1 retries \(timed out after 0.3s\).*reward.timeout_s"):
            reward(_images(1), PROMPTS7[:1])
        assert time.monotonic() - t0 < 10


def test_reference_server_rejects_bad_requests_with_400():
    with reward_server("--kind", "constant") as server:
        request = urllib.request.Request(server.url, data=json.dumps({"images": [], "prompts": ["x"]}).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with pytest.raises(urllib.error.HTTPError) as info:
            opener.open(request, timeout=10)
        assert info.value.code == 400
        assert "0 images but 1 prompts" in json.loads(info.value.read())["error"]
        info.value.close()
        with opener.open(server.url.replace("/score", "/health"), timeout=10) as reply:
            assert json.loads(reply.read())["ok"] is True


# --- malformed replies and 4xx (in-process canned server) ----------------------------------------------------------


@pytest.mark.parametrize("body, match", [
    (b'{"rewards": [1.0]}', r'"rewards" has 1 values for 2 images'),
    (b'{"rewards": [1.0, "x"]}', r'rewards\[1\] is \'x\''),
    (b'{"rewards": [1.0, true]}', r"rewards\[1\] is True"),
    (b'{"rewards": [1.0, null]}', r"rewards\[1\] is None"),
    (b'{"scores": [1.0, 2.0]}', r'must be a JSON object with a "rewards" list'),
    (b"<html>oops</html>", r"the reply is not JSON"),
])
def test_malformed_reply_raises_without_retry(body, match):
    with canned_server(200, body) as (url, requests):
        with pytest.raises(RewardError, match=match) as info:
            RemoteReward(url, timeout_s=5, retries=3, backoff_s=0.01)(_images(2), PROMPTS7[:2])
    assert f"reward.url={url}: malformed reply" in str(info.value)
    assert len(requests) == 1


def test_nan_reward_passes_through():
    with canned_server(200, b'{"rewards": [NaN, 2.5]}') as (url, _):
        got = RemoteReward(url, timeout_s=5, retries=0)(_images(2), PROMPTS7[:2])
    assert np.isnan(got[0]) and got[1] == 2.5


def test_4xx_raises_at_once_with_the_servers_text():
    with canned_server(422, b'{"error": "images must be 512x512"}') as (url, requests):
        with pytest.raises(RewardError) as info:
            RemoteReward(url, timeout_s=5, retries=3, backoff_s=0.01)(_images(2), PROMPTS7[:2])
    assert len(requests) == 1  # not retried
    message = str(info.value)
    assert f"reward.url={url}" in message and "HTTP 422" in message and "images must be 512x512" in message


def test_5xx_is_retried_then_raises():
    with canned_server(500, b"internal trouble") as (url, requests):
        with pytest.raises(RewardError, match=r"server error after 2 retries \(HTTP 500: internal trouble\)"):
            RemoteReward(url, timeout_s=5, retries=2, backoff_s=0.01)(_images(1), PROMPTS7[:1])
    assert len(requests) == 3


# --- metadata in, extras out (wire version 1's optional fields) ----------------------------------------------------


def _metadata_reply(request: dict, index: int) -> dict:
    """rewards: each prompt's length; extras (with metadata only): its row's "n" (null without one), and "first"
    in the first request's reply only."""
    reply = {"rewards": [float(len(p)) for p in request["prompts"]]}
    if "metadata" in request:
        reply["extras"] = {"n": [m.get("n") for m in request["metadata"]]}
        if index == 0:
            reply["extras"]["first"] = [1] * len(request["prompts"])
    return reply


def test_metadata_is_sent_only_when_given_and_extras_come_back():
    prompts = ["a", "bb", "ccc"]
    metadata = [{"n": 2, "tag": "counting", "include": [{"class": "cat", "count": 2}]}, {"tag": "colors"}, {"n": 0.5}]
    with recording_server(_metadata_reply) as (url, seen):
        reward = RemoteReward(url, timeout_s=5, retries=0, batch_size=2)
        plain = reward.score(_images(3), prompts)
        assert [set(r) for r in seen] == [{"version", "images", "prompts"}] * 2  # no metadata key at all
        assert plain.extras == {} and plain.values.tolist() == [1, 2, 3]
        seen.clear()
        scored = reward.score(_images(3), prompts, metadata=metadata)
    assert [r["version"] for r in seen] == [1, 1]
    assert [r["metadata"] for r in seen] == [metadata[:2], metadata[2:]]  # each chunk its own rows, in order
    assert scored.values.tolist() == [1, 2, 3]
    np.testing.assert_array_equal(scored.extras["n"], np.asarray([2, np.nan, 0.5], np.float32))  # null -> NaN
    np.testing.assert_array_equal(scored.extras["first"], np.asarray([1, 1, np.nan], np.float32))  # absent -> NaN
    assert all(v.dtype == np.float32 and v.shape == (3,) for v in scored.extras.values())


def test_an_old_server_reply_without_extras_still_scores():
    with canned_server(200, b'{"rewards": [1.5, 2.5], "other": 1}') as (url, _):
        scored = RemoteReward(url, timeout_s=5, retries=0).score(_images(2), PROMPTS7[:2], metadata=[{}, {"a": 1}])
    assert scored.values.tolist() == [1.5, 2.5] and scored.extras == {}


@pytest.mark.parametrize("extras, match", [
    ('{"n": [1]}', r'"extras.n" must be a list of 2 numbers or nulls'),
    ('{"n": [1, "x"]}', r'"extras.n" must hold numbers or nulls'),
    ('{"n": [1, true]}', r'"extras.n" must hold numbers or nulls'),
    ('[1, 2]', r'"extras" must be an object of lists'),
])
def test_malformed_extras_raise_without_retry(extras, match):
    with canned_server(200, f'{{"rewards": [1, 2], "extras": {extras}}}'.encode()) as (url, requests):
        with pytest.raises(RewardError, match=match):
            RemoteReward(url, timeout_s=5, retries=3, backoff_s=0.01).score(_images(2), PROMPTS7[:2])
    assert len(requests) == 1


def test_metadata_that_is_not_json_is_refused_before_sending():
    reward = RemoteReward(f"http://127.0.0.1:{_closed_port()}/score", retries=0)
    with pytest.raises(RewardError, match=r"could not encode images 0..1: .*metadata must be JSON"):
        reward(_images(2), PROMPTS7[:2], metadata=[{"x": object()}, {}])
    with pytest.raises(RewardError, match=r"got 1 metadata rows for 2 prompts"):
        reward(_images(2), PROMPTS7[:2], metadata=[{}])


def test_reply_encoding_round_trips_nan_as_null():
    body = encode_reply(np.asarray([1.0, np.nan], np.float32), {"x": np.asarray([np.nan, 3.0])})
    assert json.loads(body.replace(b"NaN", b"null"))["extras"] == {"x": [None, 3.0]}
    scored = parse_reply(body, 2)
    assert scored.values[0] == 1 and np.isnan(scored.values[1])  # a non-finite reward reaches the trainer as NaN
    assert np.isnan(scored.extras["x"][0]) and scored.extras["x"][1] == 3


def test_reference_server_accepts_metadata():
    images, prompts = _images(3), PROMPTS7[:3]
    expected = make_reward("jpeg_compressibility")(images, prompts)
    with reward_server("--kind", "jpeg") as server:
        scored = RemoteReward(server.url, timeout_s=10, retries=0).score(images, prompts,
                                                                          metadata=[{"tag": "ocr"}, {}, {"n": 1}])
        np.testing.assert_array_equal(scored.values, expected)
        assert scored.extras == {}
        body = json.dumps({"images": [], "prompts": [], "metadata": {"tag": "x"}}).encode()
        request = urllib.request.Request(server.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=10)
        assert info.value.code == 400
        assert json.loads(info.value.read())["error"] == '"metadata" must be a list of JSON objects, one per image'
        info.value.close()


# --- weighted ------------------------------------------------------------------------------------------------------


def test_weighted_sum_of_local_and_remote():
    images = _images(7)
    jpeg = make_reward("jpeg_compressibility")(images, PROMPTS7)
    with reward_server("--kind", "jpeg") as server:
        reward = make_reward("weighted", components=[
            {"name": "jpeg_compressibility", "weight": 0.5},
            {"name": "remote", "weight": 2.0, "url": server.url, "timeout_s": 10, "retries": 0, "batch_size": 3},
        ])
        total = reward(images, PROMPTS7)
    assert total.dtype == np.float32 and total.shape == (7,)
    by_hand = (0.5 * jpeg.astype(np.float64) + 2.0 * jpeg.astype(np.float64)).astype(np.float32)
    np.testing.assert_array_equal(total, by_hand)
    assert set(reward.last_components) == {"jpeg_compressibility", "remote"}
    np.testing.assert_array_equal(reward.last_components["jpeg_compressibility"], jpeg)
    np.testing.assert_array_equal(reward.last_components["remote"], jpeg)


def test_weighted_duplicate_names_get_indexed_keys():
    reward = make_reward("weighted", components=[
        {"name": "jpeg_compressibility", "weight": 1.0},
        {"name": "jpeg_compressibility", "weight": -1.0, "quality": 50},
        {"name": "jpeg_incompressibility"},  # weight defaults to 1.0
    ])
    images = _images(2, size=8)
    total = reward(images, PROMPTS7[:2])
    assert reward.component_keys == ("jpeg_compressibility#0", "jpeg_compressibility#1", "jpeg_incompressibility")
    parts = reward.last_components
    expected = sum(w * parts[k].astype(np.float64) for k, w in zip(reward.component_keys, (1.0, -1.0, 1.0)))
    np.testing.assert_array_equal(total, expected.astype(np.float32))


@pytest.mark.parametrize("components, match", [
    ([], r"reward.components=\[\]"),
    ({"name": "jpeg_compressibility"}, r"reward.components="),
    (["jpeg_compressibility"], r"reward.components.0="),
    ([{"weight": 1.0}], r"reward.components.0.name=None"),
    ([{"name": "jpeg_compressibility", "weight": "x"}], r"reward.components.0.weight='x'"),
    ([{"name": "jpeg_compressibility", "weight": 1}, {"name": "nope", "weight": 1}],
     r"reward.components.1 \(nope\): .*unknown reward"),
    ([{"name": "remote", "weight": 1.0}], r"reward.components.0 \(remote\): .*url"),
])
def test_weighted_errors_name_the_component(components, match):
    with pytest.raises(RewardError, match=match):
        make_reward("weighted", components=components)


def test_weighted_call_error_names_component_and_url():
    url = f"http://127.0.0.1:{_closed_port()}/score"
    reward = make_reward("weighted", components=[
        {"name": "jpeg_compressibility", "weight": 1.0},
        {"name": "remote", "weight": 1.0, "url": url, "timeout_s": 1, "retries": 0},
    ])
    with pytest.raises(RewardError) as info:
        reward(_images(1), PROMPTS7[:1])
    message = str(info.value)
    assert "reward.components.1 (remote)" in message and f"reward.url={url}: unreachable" in message
