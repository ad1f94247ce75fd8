"""Prompt sources: where the text prompts of each sampling batch come from (the package re-exports this module).

The prompt sets follow the reference DDPO implementation (kvablack/ddpo-pytorch,
``ddpo_pytorch/prompts.py`` and its ``assets`` folder):

``imagenet_animals``
    One of the first 398 ImageNet-1k class names (the animal classes, "tench,
    Tinca tinca" ... "puffer, pufferfish, blowfish, globefish"), used verbatim,
    synonyms and Latin names included, exactly as the reference does.
``simple_animals``
    One of 45 common animals ("cat", "dog", ...).
``nouns_activities``
    ``"<a|an> <noun> <activity>"``, e.g. "a cat riding a bike", "an ant playing
    chess".  Like the reference (which calls ``inflect.engine().a(noun)``) the
    noun gets an indefinite article.  The nouns default to the shipped simple
    animals and the activities to the shipped activities list (the three the
    DDPO prompt-alignment experiment used); ``prompts.nouns_file`` and
    ``prompts.activities_file`` override them.
``from_file``
    One prompt per non-empty line of ``prompts.file``.
``dataset``
    flow_grpo's / DiffusionNFT's ``dataset/<name>/`` folders (``prompts.path``, ``prompts.split``), each prompt
    with its row's metadata (``datasets.py``).

Sampling is uniform with replacement and driven only by the
``numpy.random.Generator`` passed in, so it is reproducible from a seed.

This module imports only the standard library and numpy, so configuration
validation can import it cheaply.
"""

from __future__ import annotations

import atexit
import contextlib
import pathlib
from importlib import resources

from ddpo_tpu.prompts.base import PromptError, PromptSource  # noqa: F401 (re-exported)

__all__ = [
    "PROMPT_SETS",
    "PromptError",
    "PromptSource",
    "make_prompt_source",
    "source_from_config",
    "asset_path",
    "with_indefinite_article",
]

PROMPT_SETS: tuple[str, ...] = ("imagenet_animals", "simple_animals", "nouns_activities", "from_file", "dataset")

# Shipped word lists (ddpo_tpu/prompts/assets).
IMAGENET_CLASSES_FILE = "imagenet_classes.txt"
SIMPLE_ANIMALS_FILE = "simple_animals.txt"
ACTIVITIES_FILE = "activities.txt"
# The reference takes the ImageNet classes [0, 398) as "animals".
NUM_IMAGENET_ANIMALS = 398


# --------------------------------------------------------------------------- assets

_ASSET_FILES = contextlib.ExitStack()
atexit.register(_ASSET_FILES.close)


def asset_path(filename: str) -> pathlib.Path:
    """Filesystem path of a shipped asset (``ddpo_tpu/prompts/assets/<filename>``).

    Found through ``importlib.resources`` so it also works from an installed
    wheel; if the package lives in a zip archive, the file is extracted to a
    temporary location that lives until the interpreter exits.

    Raises ``FileNotFoundError`` when no such asset is shipped.
    """
    name = pathlib.PurePath(filename).name
    if not filename or name != filename:
        raise FileNotFoundError(f"not a shipped prompt asset name: {filename!r}")
    traversable = resources.files(__package__).joinpath("assets").joinpath(filename)
    if not traversable.is_file():
        raise FileNotFoundError(
            f"no shipped prompt asset {filename!r} (shipped: {', '.join(shipped_assets())})"
        )
    if isinstance(traversable, pathlib.Path):
        return traversable
    return pathlib.Path(_ASSET_FILES.enter_context(resources.as_file(traversable)))


def shipped_assets() -> list[str]:
    """Names of the shipped ``.txt`` word lists."""
    folder = resources.files(__package__).joinpath("assets")
    try:
        return sorted(p.name for p in folder.iterdir() if p.name.endswith(".txt"))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _read_lines(path: pathlib.Path) -> list[str]:
    """Stripped non-empty lines of a UTF-8 text file."""
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


def _load_asset(filename: str) -> list[str]:
    return _read_lines(asset_path(filename))


def _resolve_user_file(key: str, value: str, what: str) -> pathlib.Path:
    """Path given under ``prompts.<key>``: an existing file, or (like the
    reference) the bare name of a shipped asset such as ``simple_animals.txt``."""
    shipped = ", ".join(shipped_assets())
    fix = f"give an existing UTF-8 text file with one {what} per line, or the name of a shipped list ({shipped})"
    if not isinstance(value, (str, pathlib.PurePath)) or not str(value).strip():
        raise PromptError(f"prompts.{key}", repr(value), "not a file path", fix)
    path = pathlib.Path(str(value)).expanduser()
    if path.is_file():
        return path
    if path.exists():
        raise PromptError(f"prompts.{key}", value, "not a regular file", fix)
    if path.name == str(value):  # bare name: fall back to the shipped assets
        try:
            return asset_path(str(value))
        except FileNotFoundError:
            pass
    raise PromptError(f"prompts.{key}", value, "file not found", fix)


def _load_user_file(key: str, value: str, what: str) -> list[str]:
    path = _resolve_user_file(key, value, what)
    try:
        lines = _read_lines(path)
    except UnicodeDecodeError as e:
        raise PromptError(f"prompts.{key}", value, f"not UTF-8 text ({e})",
                          f"save the file as UTF-8 text, one {what} per line") from e
    except OSError as e:
        raise PromptError(f"prompts.{key}", value, f"cannot be read ({e})",
                          "check the path and its permissions") from e
    if not lines:
        raise PromptError(f"prompts.{key}", value, "the file is empty (no non-empty lines)",
                          f"put one {what} per line")
    return lines


# --------------------------------------------------------------------------- articles

# First words that start with a vowel letter but a consonant sound, and the reverse.
_A_PREFIXES = ("uni", "use", "usu", "uti", "ure", "uro", "eu", "ewe", "one", "once", "ubiq", "uku")
_AN_PREFIXES = ("hour", "honest", "honor", "honour", "heir")


def with_indefinite_article(noun: str) -> str:
    """``"cat" -> "a cat"``, ``"ant" -> "an ant"``.

    A small stand-in for ``inflect.engine().a`` (used by the reference) that is
    exact for ordinary English nouns, including every shipped noun.  Nouns that
    already start with an article are returned unchanged.
    """
    noun = noun.strip()
    lower = noun.lower()
    if not noun or lower.startswith(("a ", "an ", "the ")):
        return noun
    if lower.startswith(_AN_PREFIXES):
        article = "an"
    elif lower.startswith(_A_PREFIXES):
        article = "a"
    else:
        article = "an" if lower[0] in "aeiou" else "a"
    return f"{article} {noun}"


# --------------------------------------------------------------------------- sources


def _reject_unused(name: str, **unused: str | None) -> None:
    for key, value in unused.items():
        if value is not None:
            users = {"file": "from_file", "path": "dataset"}.get(key, "nouns_activities")
            raise PromptError(f"prompts.{key}", value, f"only used with prompts.name={users}, but "
                              f"prompts.name={name}", f"drop prompts.{key} or set it to null")


def make_prompt_source(
    name: str,
    file: str | None = None,
    nouns_file: str | None = None,
    activities_file: str | None = None,
    path: str | None = None,
    split: str = "train",
) -> PromptSource:
    """Build the prompt source named ``name`` (one of :data:`PROMPT_SETS`).

    ``file`` (``prompts.file``) is required for ``from_file``; ``nouns_file`` and
    ``activities_file`` are optional for ``nouns_activities``; ``path`` (a dataset folder or file) is required for
    ``dataset``, whose folder's file ``split`` chooses.  Giving an option
    that the chosen source does not use is an error.  Raises :class:`PromptError`.
    """
    if name not in PROMPT_SETS:
        raise PromptError("prompts.name", repr(name), "unknown prompt set", f"use one of {', '.join(PROMPT_SETS)}")
    if name != "dataset":
        _reject_unused(name, path=path)
    if name == "dataset":
        from ddpo_tpu.prompts.datasets import read_dataset

        _reject_unused(name, file=file, nouns_file=nouns_file, activities_file=activities_file)
        return read_dataset(path, split, name)
    if name == "imagenet_animals":
        _reject_unused(name, file=file, nouns_file=nouns_file, activities_file=activities_file)
        classes = _load_asset(IMAGENET_CLASSES_FILE)
        return PromptSource(name, [classes[:NUM_IMAGENET_ANIMALS]])
    if name == "simple_animals":
        _reject_unused(name, file=file, nouns_file=nouns_file, activities_file=activities_file)
        return PromptSource(name, [_load_asset(SIMPLE_ANIMALS_FILE)])
    if name == "nouns_activities":
        _reject_unused(name, file=file)
        nouns = (
            _load_asset(SIMPLE_ANIMALS_FILE)
            if nouns_file is None
            else _load_user_file("nouns_file", nouns_file, "noun")
        )
        activities = (
            _load_asset(ACTIVITIES_FILE)
            if activities_file is None
            else _load_user_file("activities_file", activities_file, "activity")
        )
        return PromptSource(name, [[with_indefinite_article(x) for x in nouns], activities])
    # from_file
    _reject_unused(name, nouns_file=nouns_file, activities_file=activities_file)
    if file is None:
        raise PromptError("prompts.file", None, "required when prompts.name=from_file",
                          "prompts.file=/path/to/prompts.txt")
    return PromptSource(name, [_load_user_file("file", file, "prompt")])


def source_from_config(p) -> PromptSource:
    """The prompt source of the typed `prompts` config (config/schema.py PromptsConfig): the same reader at compose
    time (config/inputs.py) and in the training process."""
    return make_prompt_source(p.name, file=p.file, nouns_file=p.nouns_file, activities_file=p.activities_file,
                              path=p.path, split=p.split)
