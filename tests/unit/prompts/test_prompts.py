"""Tests for the prompt sources (ddpo_tpu.prompts)."""

from __future__ import annotations

import collections
import subprocess
import sys

import numpy as np
import pytest

from ddpo_tpu.prompts import (
    PROMPT_SETS,
    PromptError,
    PromptSource,
    asset_path,
    make_prompt_source,
    with_indefinite_article,
)

pytestmark = pytest.mark.torch_free  # no torch in the test or what it starts (tests/conftest.py)


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def read_asset(name: str) -> list[str]:
    return asset_path(name).read_text(encoding="utf-8").splitlines()


# --------------------------------------------------------------------------- assets


def test_prompt_sets_constant():
    assert PROMPT_SETS == ("imagenet_animals", "simple_animals", "nouns_activities", "from_file", "dataset")


def test_imagenet_classes_asset():
    lines = read_asset("imagenet_classes.txt")
    assert len(lines) == 1000
    assert all(line and line == line.strip() for line in lines)
    # Spot checks of the standard class-index order.
    assert lines[0] == "tench, Tinca tinca"
    assert lines[151] == "Chihuahua"
    assert lines[268] == "Mexican hairless"
    assert lines[397] == "puffer, pufferfish, blowfish, globefish"
    assert lines[398] == "abacus"
    assert lines[999] == "toilet tissue, toilet paper, bathroom tissue"
    # The only repeated name in ImageNet-1k is "crane" (bird 134, machine 517).
    repeated = [k for k, v in collections.Counter(lines).items() if v > 1]
    assert repeated == ["crane"] and lines[134] == lines[517] == "crane"


def test_simple_animals_and_activities_assets():
    animals = read_asset("simple_animals.txt")
    assert len(animals) == 45 == len(set(animals))
    assert animals[:3] == ["cat", "dog", "horse"] and animals[-1] == "kangaroo"
    activities = read_asset("activities.txt")
    assert activities == ["washing dishes", "riding a bike", "playing chess"]


def test_asset_path_is_inside_package_and_rejects_unknown():
    path = asset_path("simple_animals.txt")
    assert path.is_file() and path.parent.name == "assets" and path.parent.parent.name == "prompts"
    with pytest.raises(FileNotFoundError):
        asset_path("no_such_list.txt")
    with pytest.raises(FileNotFoundError):
        asset_path("../__init__.py")


# --------------------------------------------------------------------------- sources


def test_imagenet_animals():
    src = make_prompt_source("imagenet_animals")
    assert isinstance(src, PromptSource) and src.name == "imagenet_animals"
    vocab = src.vocabulary
    assert len(vocab) == 398
    assert vocab[0] == "tench, Tinca tinca"
    assert vocab[-1] == "puffer, pufferfish, blowfish, globefish"
    assert "abacus" not in vocab
    assert set(src.sample(500, rng(1))) <= set(vocab)


def test_simple_animals():
    src = make_prompt_source("simple_animals")
    assert src.name == "simple_animals"
    assert len(src.vocabulary) == 45
    assert src.vocabulary[0] == "cat"
    assert set(src.sample(200, rng(2))) <= set(src.vocabulary)


def test_nouns_activities_defaults():
    src = make_prompt_source("nouns_activities")
    vocab = src.vocabulary
    assert len(vocab) == 45 * 3
    assert vocab[0] == "a cat washing dishes"
    assert "an ant playing chess" in vocab and "a ant playing chess" not in vocab
    assert "a kangaroo riding a bike" in vocab
    samples = src.sample(300, rng(3))
    assert set(samples) <= set(vocab)
    # Both factors vary.
    assert len({s.split(" ", 2)[1] for s in samples}) > 30
    assert {a for a in ("washing dishes", "riding a bike", "playing chess") if any(s.endswith(a) for s in samples)} == {
        "washing dishes",
        "riding a bike",
        "playing chess",
    }


def test_nouns_activities_user_files(tmp_path):
    nouns = tmp_path / "nouns.txt"
    nouns.write_text("owl\nrobot\n\n  elephant  \n", encoding="utf-8")
    acts = tmp_path / "acts.txt"
    acts.write_text("reading a book\n", encoding="utf-8")
    src = make_prompt_source("nouns_activities", nouns_file=str(nouns), activities_file=str(acts))
    assert src.vocabulary == ["an owl reading a book", "a robot reading a book", "an elephant reading a book"]
    # Only the nouns overridden: activities stay the shipped ones.
    src2 = make_prompt_source("nouns_activities", nouns_file=str(nouns))
    assert len(src2.vocabulary) == 3 * 3
    # Like the reference, a bare name of a shipped list is accepted.
    src3 = make_prompt_source("nouns_activities", nouns_file="simple_animals.txt", activities_file="activities.txt")
    assert src3.vocabulary == make_prompt_source("nouns_activities").vocabulary


def test_from_file(tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("a red apple\n\n   \n  a blue car  \na green frog\r\n", encoding="utf-8")
    src = make_prompt_source("from_file", file=str(f))
    assert src.name == "from_file"
    assert src.vocabulary == ["a red apple", "a blue car", "a green frog"]
    samples = src.sample(100, rng(4))
    assert set(samples) == set(src.vocabulary)


def test_from_file_accepts_pathlike_and_unicode(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("un café au lait\n", encoding="utf-8")
    assert make_prompt_source("from_file", file=f).vocabulary == ["un café au lait"]


# --------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("name", ["imagenet_animals", "simple_animals", "nouns_activities"])
def test_sampling_is_deterministic(name):
    src = make_prompt_source(name)
    a = src.sample(64, rng(123))
    b = src.sample(64, rng(123))
    c = src.sample(64, rng(124))
    assert a == b
    assert a != c
    assert len(a) == 64 and all(isinstance(p, str) and p for p in a)
    # Same generator consumed in two halves gives the same stream as one draw of
    # each half from a generator in the same state.
    g1, g2 = rng(7), rng(7)
    assert src.sample(10, g1) + src.sample(10, g1) == src.sample(10, g2) + src.sample(10, g2)
    # Independent of the source object: a new source gives the same prompts.
    assert make_prompt_source(name).sample(64, rng(123)) == a


def test_sampling_covers_many_prompts_roughly_uniformly():
    src = make_prompt_source("imagenet_animals")
    samples = src.sample(20000, rng(5))
    counts = collections.Counter(samples)
    assert len(counts) == 398  # every class appears (expected ~50 each)
    mean = 20000 / 398
    assert min(counts.values()) > 0.4 * mean and max(counts.values()) < 1.8 * mean

    animals = make_prompt_source("simple_animals").sample(9000, rng(6))
    counts = collections.Counter(animals)
    assert len(counts) == 45
    assert max(counts.values()) < 1.4 * min(counts.values()) + 60


def test_sample_edge_cases():
    src = make_prompt_source("simple_animals")
    assert src.sample(0, rng()) == []
    assert len(src.sample(np.int64(3), rng())) == 3
    with pytest.raises(ValueError):
        src.sample(-1, rng())
    with pytest.raises(ValueError):
        src.sample(2.5, rng())
    with pytest.raises(TypeError):
        src.sample(2, 42)


# --------------------------------------------------------------------------- errors


def test_unknown_name_lists_valid_ones():
    with pytest.raises(PromptError) as e:
        make_prompt_source("imagenet_dogs")
    msg = str(e.value)
    assert "prompts.name" in msg and "imagenet_dogs" in msg
    for name in PROMPT_SETS:
        assert name in msg
    assert e.value.key == "prompts.name"
    assert isinstance(e.value, ValueError)


def test_from_file_errors_name_the_key(tmp_path):
    with pytest.raises(PromptError, match=r"prompts\.file") as e:
        make_prompt_source("from_file")
    assert e.value.key == "prompts.file"

    missing = tmp_path / "nope.txt"
    with pytest.raises(PromptError) as e:
        make_prompt_source("from_file", file=str(missing))
    msg = str(e.value)
    assert msg.startswith(f"prompts.file={missing}: file not found") and "fix:" in msg

    empty = tmp_path / "empty.txt"
    empty.write_text("\n   \n\n", encoding="utf-8")
    with pytest.raises(PromptError, match=r"prompts\.file=.*empty"):
        make_prompt_source("from_file", file=str(empty))

    with pytest.raises(PromptError, match=r"prompts\.file=.*not a regular file"):
        make_prompt_source("from_file", file=str(tmp_path))

    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(PromptError, match=r"prompts\.file=.*UTF-8"):
        make_prompt_source("from_file", file=str(binary))


def test_nouns_activities_errors_name_the_key(tmp_path):
    with pytest.raises(PromptError, match=r"^prompts\.nouns_file=.*file not found") as e:
        make_prompt_source("nouns_activities", nouns_file=str(tmp_path / "x.txt"))
    assert e.value.key == "prompts.nouns_file"
    empty = tmp_path / "empty.txt"
    empty.write_text("", encoding="utf-8")
    with pytest.raises(PromptError, match=r"^prompts\.activities_file=.*empty") as e:
        make_prompt_source("nouns_activities", activities_file=str(empty))
    assert e.value.key == "prompts.activities_file"


def test_options_the_source_does_not_use_are_rejected(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("x\n", encoding="utf-8")
    with pytest.raises(PromptError, match=r"prompts\.file=.*only used with prompts\.name=from_file"):
        make_prompt_source("simple_animals", file=str(f))
    with pytest.raises(PromptError, match=r"prompts\.nouns_file"):
        make_prompt_source("from_file", file=str(f), nouns_file=str(f))
    with pytest.raises(PromptError, match=r"prompts\.activities_file"):
        make_prompt_source("imagenet_animals", activities_file=str(f))


# --------------------------------------------------------------------------- misc


@pytest.mark.parametrize(
    "noun, expected",
    [
        ("cat", "a cat"),
        ("ant", "an ant"),
        ("owl", "an owl"),
        ("elephant", "an elephant"),
        ("unicorn", "a unicorn"),
        ("hour-old chick", "an hour-old chick"),
        ("European robin", "a European robin"),
        ("one-eyed cat", "a one-eyed cat"),
        ("the cat", "the cat"),
        ("an otter", "an otter"),
    ],
)
def test_indefinite_article(noun, expected):
    assert with_indefinite_article(noun) == expected


def test_import_is_light():
    code = (
        "import sys, ddpo_tpu.prompts as p; "
        "p.make_prompt_source('nouns_activities').sample(4, __import__('numpy').random.default_rng(0)); "
        "bad = [m for m in ('torch', 'torch_xla', 'transformers', 'diffusers', 'PIL') "
        "if sys.modules.get(m) is not None]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
