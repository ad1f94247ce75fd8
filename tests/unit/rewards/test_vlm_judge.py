"""reward=vlm_judge and the VLM OCR transcriber against a loopback stub of an OpenAI-compatible chat server.

The stub binds 127.0.0.1 on an ephemeral port, answers a bounded number of requests (then, or after a deadline, it
stops by itself) and records every request, so each test checks what the client sent (model, messages, the image's
data URL, the templated question, sampling fields, logprobs) as well as what it made of the canned replies.

What the references send and how they score is written from their code, not from ours:
* UnifiedReward 1.5: yifan123/flow_grpo@ac4c86e flow_grpo/rewards.py:284-357 (question at :315, "Final Score" pattern
  at :300, /5 at :355, 512 x 512 resize at :350, "data:image;base64," PNG at :291-296, temperature=0 at :334);
* UnifiedReward 2.0: verl-project/verl-omni@a1139ba verl_omni/utils/reward_score/unified_reward.py:30-165;
* Yes/No logprobs: X-GenGroup/Flow-Factory@a0b2bc5 src/flow_factory/rewards/vllm_evaluate.py:63-108, 144-157, 268-282
  (the data URL: src/flow_factory/utils/image.py:668-688, JPEG at PIL's default quality);
* VLM OCR: verl-omni@a1139ba verl_omni/utils/reward_score/genrm_ocr.py:34-38, 174-195.
The questions are pinned by the SHA-256 of the text each reference builds for PROMPT, computed from the reference
files at those commits (flow_grpo: line 315's f-string evaluated; verl-omni: `_build_unified_reward_prompt(PROMPT)`;
Flow-Factory: `VLMEvaluateRewardModel.EVALUATE_PROMPT`; GenRM-OCR: `DEFAULT_GRM_PROMPT`).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import math
import os
import signal
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator

import numpy as np
import pytest
from PIL import Image

from ddpo_tpu.problems import ConfigError
from ddpo_tpu.rewards import REWARDS, RewardError
from ddpo_tpu.rewards.chat import RewardInterrupted
from ddpo_tpu.rewards.vlm_judge import (
    VlmJudge,
    VlmTranscriber,
    parse_final_score,
    parse_unified_reward_v2,
    score_unified_reward_v2,
    yes_probability,
)

pytestmark = pytest.mark.torch_free  # no torch in the test or what it starts (tests/conftest.py)

PROMPT = 'a sign that says "Hello"'
REF_SHA256 = {
    "unifiedreward_v1_5": "e67161ec3a43294cf61c28e93c816cdacde4f69636ad2f5074039943772557f9",
    "unifiedreward_v2": "c5ce88353f9703c202770ff1cf579a375b06640b0a8f8044837456c58dbc1209",
    "yes_no": "64a0a112b120f4261d13b6860303e51fa9dfce2975ac3ded3e1415a0381e4afe",
    "ocr": "d233c642a829efc98a07a680100aca6e9594264d2d9005854220d43aa61f3ada",
}


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _images(n: int, size: int = 32, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, size, size, 3), dtype=np.uint8)


def _completion(content: str | None, logprobs: Any = None) -> dict[str, Any]:
    """A chat completion as vLLM returns one."""
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                         "logprobs": logprobs, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


def _top(pairs: list[tuple[str, float]]) -> dict[str, Any]:
    """vLLM's logprobs object for a one-token reply whose top alternatives are `pairs`."""
    return {"content": [{"token": pairs[0][0], "logprob": pairs[0][1], "bytes": None,
                         "top_logprobs": [{"token": t, "logprob": lp, "bytes": None} for t, lp in pairs]}]}


class Stub:
    def __init__(self, url: str):
        self.url = url
        self.requests: list[dict[str, Any]] = []  # {"path", "headers", "body"}
        self.in_flight = self.most_in_flight = 0


@contextlib.contextmanager
def stub_server(reply: Callable[[dict[str, Any], int], tuple[int, Any]], max_requests: int = 32,
                deadline_s: float = 30.0) -> Iterator[Stub]:
    """A chat server on 127.0.0.1:<ephemeral>: `reply(body, n)` (n: the request's 0-based number) gives (status,
    JSON-able body or bytes). It handles at most `max_requests` requests or runs `deadline_s`, then stops itself."""
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):  # quiet
            pass

        def do_POST(self):  # noqa: N802
            raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            body = json.loads(raw)
            with lock:
                n = len(stub.requests)
                stub.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                stub.in_flight += 1
                stub.most_in_flight = max(stub.most_in_flight, stub.in_flight)
            try:
                status, out = reply(body, n)
            finally:
                with lock:
                    stub.in_flight -= 1
            data = out if isinstance(out, bytes) else json.dumps(out).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.timeout = 0.1
    stub = Stub(f"http://127.0.0.1:{server.server_address[1]}/v1")
    end = time.monotonic() + deadline_s

    def serve():
        while len(stub.requests) < max_requests and time.monotonic() < end:
            server.handle_request()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield stub
    finally:
        end = 0.0
        thread.join(timeout=10)
        server.server_close()


def _by_prompt(replies: dict[str, Any]) -> Callable[[dict[str, Any], int], tuple[int, Any]]:
    """Answer each request with the canned completion of the caption its question carries."""
    def reply(body, n):
        text = body["messages"][-1]["content"][1]["text"]
        for caption, completion in replies.items():
            if text.endswith(f"[{caption}]") or caption == "*":
                return 200, completion
        return 400, {"error": f"unexpected question {text[-60:]!r}"}
    return reply


def _decode(url: str, prefix: str) -> Image.Image:
    assert url.startswith(prefix), url[:40]
    return Image.open(io.BytesIO(base64.b64decode(url[len(prefix):])))


def _user(body: dict[str, Any]) -> tuple[str, str]:
    """(image URL, question) of a request's user message, checking the message's shape."""
    message = body["messages"][-1]
    assert message["role"] == "user" and [c["type"] for c in message["content"]] == ["image_url", "text"]
    return message["content"][0]["image_url"]["url"], message["content"][1]["text"]


# --- the presets' requests and scores ---------------------------------------------------------------------------------


def test_unifiedreward_v1_5_request_and_final_score_over_5():
    images = _images(4)
    prompts = [PROMPT, "b", "c", "d"]
    replies = {PROMPT: _completion("The image matches the caption well.\nFinal Score: 4"),
               "b": _completion("Alignment is partial... Final Score: 3.5 overall"),
               "c": _completion("I cannot judge this image."),  # no score: the reference's 0.0
               "d": _completion("Final Score: 10")}  # the reference's [1-5] reads the 1: 1/5
    with stub_server(_by_prompt(replies)) as stub:
        reward = VlmJudge(stub.url, preset="unifiedreward_v1_5", timeout_s=10, retries=0)
        scored = reward.score(images, prompts)
    np.testing.assert_allclose(scored.values, [4 / 5, 3.5 / 5, 0.0, 1 / 5], rtol=0, atol=1e-7)
    assert scored.values.dtype == np.float32
    np.testing.assert_array_equal(scored.extras["unparsed"], [0, 0, 1, 0])
    np.testing.assert_array_equal(scored.extras["raw_score"], [4, 3.5, np.nan, 1])
    assert len(stub.requests) == 4
    first = next(r for r in stub.requests if _user(r["body"])[1].endswith(f"[{PROMPT}]"))
    assert first["path"] == "/v1/chat/completions" and "Authorization" not in first["headers"]
    body = first["body"]
    assert set(body) == {"model", "messages", "temperature"}  # no token limit, no logprobs
    assert body["model"] == "UnifiedReward-7b-v1.5" and body["temperature"] == 0 and len(body["messages"]) == 1
    url, question = _user(body)
    assert _sha(question) == REF_SHA256["unifiedreward_v1_5"]
    assert question.startswith("<image>\nYou are given a text caption") and "after 'Final Score:'" in question
    sent = _decode(url, "data:image;base64,")
    assert sent.format == "PNG" and sent.size == (512, 512)
    expected = Image.fromarray(images[0]).resize((512, 512))  # the reference's call, PIL's default filter
    np.testing.assert_array_equal(np.asarray(sent.convert("RGB")), np.asarray(expected))


def test_unifiedreward_v2_request_and_three_axes():
    images = _images(5)
    prompts = [PROMPT, "b", "c", "d", "e"]
    replies = {
        PROMPT: _completion("Alignment Score (1-5): 4\nCoherence Score (1-5): 3\nStyle Score (1-5): 5"),
        "b": _completion("alignment score: 2.5\ncoherence score (1-5): 2\nSTYLE SCORE: 3\nAlignment Score: 5"),
        "c": _completion("Alignment: 4, Coherence: 4, Style: 1"),  # no axis named: the first three numbers
        "d": _completion("Alignment Score (1-5): 7\nCoherence Score (1-5): 6\nStyle Score (1-5): 5"),  # mean clipped
        "e": _completion("The image is fine."),
    }
    with stub_server(_by_prompt(replies)) as stub:
        scored = VlmJudge(stub.url, preset="unifiedreward_v2", timeout_s=10, retries=0).score(images, prompts)
    # (clip(mean, 1, 5) - 1) / 4; "b": the last Alignment (5) wins, (5 + 2 + 3) / 3
    np.testing.assert_allclose(scored.values, [(4 - 1) / 4, (10 / 3 - 1) / 4, (3 - 1) / 4, 1.0, 0.0], atol=1e-7)
    np.testing.assert_array_equal(scored.extras["alignment"], [4, 5, 4, 7, np.nan])
    np.testing.assert_array_equal(scored.extras["style"], [5, 3, 1, 5, np.nan])
    np.testing.assert_array_equal(scored.extras["unparsed"], [0, 0, 0, 0, 1])
    body = next(r["body"] for r in stub.requests if _user(r["body"])[1].endswith(f"[{PROMPT}]"))
    assert body["model"] == "CodeGoat24/UnifiedReward-2.0-qwen3vl-2b"
    assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0.0, 1.0, 512) and "logprobs" not in body
    url, question = _user(body)
    assert _sha(question) == REF_SHA256["unifiedreward_v2"]
    sent = _decode(url, "data:image/png;base64,")
    np.testing.assert_array_equal(np.asarray(sent.convert("RGB")), images[0])  # lossless, not resized


def test_yes_no_judge_reads_the_first_tokens_logprobs():
    images = _images(5)
    prompts = ["a", "b", "c", "d", "e"]
    canned = [_completion("Yes", _top([("Yes", -0.1), ("No", -2.4), ("yes", -3.0)])),
              _completion("No", _top([("No", -0.05), ("Maybe", -3.0)])),     # Yes absent: logprob -inf, P = 0
              _completion("Sure", _top([("Sure", -0.2), ("OK", -1.0)])),     # neither: unparsed
              _completion("Yes", None),                                       # a server without logprobs: unparsed
              _completion("Yes", _top([("Yes", -0.5), (" yes", -1.5), ("NO", -2.0), ("No", -3.0)]))]
    with stub_server(lambda body, n: (200, canned[prompts.index(_prompt_of[_user(body)[0]])])) as stub:
        _prompt_of = {}
        reward = VlmJudge(stub.url, preset="yes_no", timeout_s=10, retries=0, max_concurrency=1)
        for image, prompt in zip(images, prompts):  # one at a time: the reply follows the image sent
            _prompt_of[reward.request(image, prompt)["messages"][0]["content"][0]["image_url"]["url"]] = prompt
        scored = reward.score(images, prompts)
    sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731 -- the reference's torch.sigmoid(yes - no) in float64
    np.testing.assert_allclose(scored.values, [sigmoid(-0.1 + 2.4), 0.0, 0.0, 0.0, sigmoid(-0.5 + 3.0)], atol=1e-7)
    np.testing.assert_array_equal(scored.extras["unparsed"], [0, 0, 1, 1, 0])
    body = stub.requests[0]["body"]
    assert body["model"] == "Qwen3-VL" and body["logprobs"] is True and body["top_logprobs"] == 20
    assert body["max_completion_tokens"] == 1 and body["temperature"] == 0.0 and "max_tokens" not in body
    url, question = _user(body)
    assert _sha(question) == REF_SHA256["yes_no"] and question.endswith("Answer Yes or No.")
    assert _decode(url, "data:image/jpeg;base64,").format == "JPEG"
    # canonicalize: every case / space variant summed (Flow-Factory vllm_evaluate.py:94-108)
    last = canned[4]
    p = (math.exp(-0.5) + math.exp(-1.5)) / (math.exp(-0.5) + math.exp(-1.5) + math.exp(-2.0) + math.exp(-3.0))
    assert yes_probability(last, canonicalize=True) == pytest.approx(p, abs=1e-12)
    assert yes_probability(canned[2], canonicalize=True) is None


def test_parsers_on_real_looking_and_malformed_replies():
    assert parse_final_score("**Final Score:** 4") is None  # markdown between: the reference's pattern misses it
    assert parse_final_score("Final Score:\n 2.75") == 2.75
    assert parse_final_score("Final Score: 0") is None and parse_final_score("") is None
    assert parse_final_score("Final Score: 5.\nDone") == 5.0  # "5." has no decimal digits: the 5 alone
    assert parse_unified_reward_v2("Coherence Score (1-5): 3.5") == {"coherence": 3.5}
    assert score_unified_reward_v2({"coherence": 3.5}) == pytest.approx((3.5 - 1) / 4)
    assert parse_unified_reward_v2("scores 1 and 2") == {} and score_unified_reward_v2({}) is None
    assert score_unified_reward_v2({"alignment": 0.0, "coherence": 0.5, "style": 1.0}) == 0.0  # clipped at 1
    # "(1-5)" without "Score": the fallback's first three numbers are 1, -5 and the 4 (verl-omni's regex)
    assert parse_unified_reward_v2("Alignment (1-5) 4") == {"alignment": 1.0, "coherence": -5.0, "style": 4.0}


def test_unparsed_nan_hands_the_reply_to_on_nonfinite_reward():
    with stub_server(lambda body, n: (200, _completion("no score here"))) as stub:
        values = VlmJudge(stub.url, timeout_s=10, retries=0, unparsed="nan")(_images(2), ["a", "b"])
    assert np.isnan(values).all()


def test_key_overrides_reach_the_request():
    with stub_server(lambda body, n: (200, _completion("Final Score: 5"))) as stub:
        reward = VlmJudge(stub.url, model="ur-qwen", temperature=0.3, max_tokens=256, image_format="jpeg",
                          image_size=64, prompt_template="Rate {prompt}. Final Score:", timeout_s=10, retries=0)
        assert reward(_images(1), [PROMPT])[0] == 1.0
    body = stub.requests[0]["body"]
    assert (body["model"], body["temperature"], body["max_tokens"]) == ("ur-qwen", 0.3, 256)
    url, question = _user(body)
    assert question == f"Rate {PROMPT}. Final Score:"
    assert _decode(url, "data:image/jpeg;base64,").size == (64, 64)


# --- the client: transcriber, concurrency, retries, errors, keys, interruption -------------------------------------


def test_ocr_transcriber_asks_as_genrm_ocr_and_returns_the_texts_in_order():
    texts = {0: "HELLO", 1: None, 2: "Open 24h"}
    with stub_server(lambda body, n: (200, _completion(texts[_seed_of(body)]))) as stub:
        ocr = VlmTranscriber(stub.url, timeout_s=10, retries=0)
        out = ocr([_images(1, seed=s)[0] for s in range(3)])
    assert out == ["HELLO", "", "Open 24h"]
    body = stub.requests[0]["body"]
    assert body["model"] == "Qwen/Qwen2.5-VL-7B-Instruct"
    assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0.7, 0.8, 4096)
    assert body["messages"][0] == {"role": "system", "content": "You are a helpful assistant."}
    url, question = _user(body)
    assert _sha(question) == REF_SHA256["ocr"] and url.startswith("data:image/png;base64,")


def _seed_of(body: dict[str, Any]) -> int:
    """Which of _images(1, seed=s) a request carries (its decoded pixels)."""
    pixels = np.asarray(_decode(_user(body)[0], "data:image/png;base64,").convert("RGB"))
    return next(s for s in range(8) if np.array_equal(pixels, _images(1, seed=s)[0]))


def test_concurrency_is_bounded_and_replies_keep_their_order():
    prompts = [f"p{i}" for i in range(6)]

    def reply(body, n):
        i = int(_user(body)[1].rsplit("[p", 1)[1].rstrip("]"))
        time.sleep(0.05 * (6 - i))  # later images answer first
        return 200, _completion(f"Final Score: {1 + i % 5}")

    with stub_server(reply) as stub:
        values = VlmJudge(stub.url, max_concurrency=2, timeout_s=10, retries=0)(_images(6), prompts)
    np.testing.assert_allclose(values, [(1 + i % 5) / 5 for i in range(6)], atol=1e-7)
    assert stub.most_in_flight == 2 and len(stub.requests) == 6


def test_5xx_is_retried_then_raises_naming_the_url():
    def flaky(body, n):
        return (503, {"error": "model loading"}) if n % 2 == 0 else (200, _completion("Final Score: 2"))

    with stub_server(flaky) as stub:
        values = VlmJudge(stub.url, max_concurrency=1, timeout_s=10, retries=2, backoff_s=0.01)(_images(2), ["a", "b"])
        assert len(stub.requests) == 4  # each image: 503, then 200
    np.testing.assert_allclose(values, [0.4, 0.4], atol=1e-7)
    with stub_server(lambda body, n: (500, b"Internal Server Error")) as stub:
        with pytest.raises(RewardError) as info:
            VlmJudge(stub.url, max_concurrency=1, timeout_s=10, retries=1, backoff_s=0.01)(_images(1), ["a"])
        assert len(stub.requests) == 2
    message = str(info.value)
    assert f"reward.url={stub.url}: server error after 1 retries (HTTP 500: Internal Server Error)" in message
    assert "reward.retries" in message


@pytest.mark.parametrize("status, body, key", [
    (404, {"error": {"message": "The model `UnifiedReward-7b-v1.5` does not exist.", "type": "NotFoundError"}},
     "reward.model"),
    (400, {"object": "error", "message": "This model's maximum context length is 4096 tokens."}, "reward.max_tokens"),
    (401, {"error": "Unauthorized"}, "reward.api_key_env"),
])
def test_4xx_raises_at_once_naming_the_key(status, body, key):
    with stub_server(lambda b, n: (status, body)) as stub:
        with pytest.raises(RewardError) as info:
            VlmJudge(stub.url, max_concurrency=1, timeout_s=10, retries=3, backoff_s=0.01)(_images(3), ["a", "b", "c"])
        assert len(stub.requests) == 1  # not retried, and the other images are not sent
    message = str(info.value)
    assert f"reward.url={stub.url}: the server rejected the request with HTTP {status}" in message
    assert key in message and "\n" not in message


@pytest.mark.parametrize("payload, match", [
    (b"<html>It works!</html>", "not JSON"),
    (b'{"rewards": [1.0]}', r"no choices\[0\]\.message"),
])
def test_a_reply_that_is_not_a_chat_completion_raises_without_retry(payload, match):
    with stub_server(lambda b, n: (200, payload)) as stub:
        with pytest.raises(RewardError, match=match) as info:
            VlmJudge(stub.url, max_concurrency=1, timeout_s=10, retries=3)(_images(1), ["a"])
        assert len(stub.requests) == 1
    assert f"reward.url={stub.url}" in str(info.value)


def test_api_key_comes_from_the_named_environment_variable(monkeypatch):
    monkeypatch.setenv("DDPO_TEST_VLM_KEY", "secret-123")
    with stub_server(lambda b, n: (200, _completion("Final Score: 3"))) as stub:
        VlmJudge(stub.url, api_key_env="DDPO_TEST_VLM_KEY", timeout_s=10, retries=0)(_images(1), ["a"])
    assert stub.requests[0]["headers"]["Authorization"] == "Bearer secret-123"
    monkeypatch.delenv("DDPO_TEST_VLM_KEY")
    with pytest.raises(RewardError, match="reward.api_key_env=DDPO_TEST_VLM_KEY: the environment variable is not set"):
        VlmJudge(stub.url, api_key_env="DDPO_TEST_VLM_KEY")
    with pytest.raises(RewardError, match="must be the NAME of an environment variable") as info:
        VlmJudge(stub.url, api_key_env="sk-live-abc")
    assert "sk-live-abc" in str(info.value)  # the constructor echoes; the compose-time check hides it (below)


def test_unreachable_server_is_retried_then_names_the_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    t0 = time.monotonic()
    with pytest.raises(RewardError, match=r"unreachable after 2 retries \(connection refused\).*reward.url"):
        VlmJudge(url, timeout_s=1, retries=2, backoff_s=0.01)(_images(2), ["a", "b"])
    assert time.monotonic() - t0 < 10


def test_sigterm_ends_a_hanging_judge_within_a_second():
    """The trainer's SIGTERM handler flips its stop flag; the reward polls it (should_stop) while requests hang."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)  # accepts connections, never answers
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    try:
        reward = VlmJudge(f"http://127.0.0.1:{server.getsockname()[1]}/v1", timeout_s=30, retries=3)
        reward.should_stop = stop.is_set
        timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(RewardInterrupted, match="reward.url=.*stop requested while 2 chat request"):
            reward(_images(2), ["a", "b"])
        assert time.monotonic() - t0 < 10  # was timeout_s x (retries + 1) = 120 s; ~0.7 s quiet
        timer.join()
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.close()


# --- config: the catalog, compose-time refusals, building from the typed config ------------------------------------


def test_compose_builds_the_judge_with_the_trainers_stop_flag():
    from ddpo_tpu.config.compose import compose_and_validate
    from ddpo_tpu.rewards.from_config import reward_from_config

    v = compose_and_validate(["reward=vlm_judge", "reward.preset=yes_no", "reward.max_concurrency=4",
                              "reward.url=http://10.0.0.7:30000/v1"])
    flag = lambda: True  # noqa: E731
    reward = reward_from_config(v.cfg.reward, model_cache_dir="/nonexistent", device="cpu", should_stop=flag)
    assert REWARDS["vlm_judge"] is VlmJudge and isinstance(reward, VlmJudge)
    assert reward.preset_name == "yes_no" and reward.client.max_concurrency == 4
    assert reward.client.endpoint == "http://10.0.0.7:30000/v1/chat/completions" and reward.should_stop is flag
    weighted = compose_and_validate(["reward=weighted", "reward.components=[{name: vlm_judge, weight: 2.0, "
                                     "url: 'http://127.0.0.1:8000/v1', preset: unifiedreward_v2}]"])
    assert weighted.cfg.reward.components[0].preset == "unifiedreward_v2"


@pytest.mark.parametrize("overrides, key, fragment", [
    (["reward.url=http://127.0.0.1:8000/v1/chat/completions"], "reward.url", "reward.url=http://127.0.0.1:8000/v1"),
    (["reward.url=ftp://127.0.0.1/v1"], "reward.url", "http://HOST:PORT/v1"),
    (["reward.url=http://127.0.0.1:99999/v1"], "reward.url", "Port"),
    (["reward.api_key_env=sk-live-abc"], "reward.api_key_env", "NAME of an environment variable"),
    (["reward.preset=unifiedreward_v2", "reward.max_tokens=8"], "reward.max_tokens", "reward.max_tokens=null"),
    (["reward.preset=unifiedreward_v3"], "reward.preset", "unifiedreward_v2"),
    (["reward.top_logprobs=50"], "reward.top_logprobs", "20"),
])
def test_bad_keys_are_refused_at_compose_time(overrides, key, fragment):
    from ddpo_tpu.config.compose import compose_and_validate

    with pytest.raises(ConfigError) as info:
        compose_and_validate(["reward=vlm_judge", *overrides])
    found = [p for p in info.value.problems if p.key == key]
    assert found, str(info.value)
    line = str(found[0])
    assert fragment in line and "\n" not in line and "sk-live-abc" not in line
