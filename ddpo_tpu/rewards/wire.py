"""The remote reward's wire format, version 1 (the contract is written in ddpo_tpu/rewards/remote.py's docstring):
images and prompts (and optional metadata) in, rewards (and optional extras) out, as JSON. Shared by the client
(rewards/remote.py), the reward process (rewards/serve.py) and the reference server (scripts/reward_server.py)."""

from __future__ import annotations

import base64
import io
import json
import math
from typing import Any, Mapping, Sequence

import numpy as np

from ddpo_tpu.rewards.base import Metadata, RewardScores

WIRE_VERSION = 1
IMAGE_FORMATS = ("png", "raw")
_TEXT_LIMIT = 500  # characters of a server's error text kept in messages


def encode_image(image: np.ndarray, image_format: str = "png") -> dict[str, Any]:
    """One uint8 (H, W, 3) image as a wire-format IMAGE object."""
    image = np.ascontiguousarray(image, dtype=np.uint8)
    if image_format == "png":
        from PIL import Image

        buffer = io.BytesIO()
        Image.fromarray(image, mode="RGB").save(buffer, format="PNG", compress_level=1)
        return {"format": "png", "data": base64.b64encode(buffer.getvalue()).decode("ascii")}
    if image_format == "raw":
        return {
            "format": "raw",
            "dtype": "uint8",
            "shape": [int(s) for s in image.shape],
            "data": base64.b64encode(image.tobytes()).decode("ascii"),
        }
    raise ValueError(f"unknown image format {image_format!r}; expected one of {IMAGE_FORMATS}")


def decode_image(obj: Any) -> np.ndarray:
    """A wire-format IMAGE object back to a uint8 (H, W, 3) array. Raises ValueError on bad input."""
    if not isinstance(obj, Mapping):
        raise ValueError(f"an image must be a JSON object, got {type(obj).__name__}")
    fmt = obj.get("format")
    data = obj.get("data")
    if not isinstance(data, str):
        raise ValueError("an image needs a base64 string 'data'")
    try:
        raw = base64.b64decode(data, validate=True)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"image 'data' is not valid base64: {exc}") from exc
    if fmt == "png":
        from PIL import Image

        try:
            with Image.open(io.BytesIO(raw)) as img:
                array = np.asarray(img.convert("RGB"), dtype=np.uint8)
        except Exception as exc:
            raise ValueError(f"image 'data' is not a readable PNG: {type(exc).__name__}: {exc}") from exc
        return array
    if fmt == "raw":
        if obj.get("dtype", "uint8") != "uint8":
            raise ValueError(f"raw images must have dtype 'uint8', got {obj.get('dtype')!r}")
        shape = obj.get("shape")
        if (not isinstance(shape, list) or len(shape) != 3 or shape[2] != 3
                or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shape)):
            raise ValueError(f"raw images need 'shape': [H, W, 3] with positive integers, got {shape!r}")
        if len(raw) != shape[0] * shape[1] * 3:
            raise ValueError(f"raw image has {len(raw)} bytes, shape {shape} needs {shape[0] * shape[1] * 3}")
        return np.frombuffer(raw, dtype=np.uint8).reshape(shape)
    raise ValueError(f"unknown image format {fmt!r}; expected one of {list(IMAGE_FORMATS)}")


def encode_request(images: np.ndarray, prompts: Sequence[str], image_format: str = "png",
                   metadata: Metadata = None) -> bytes:
    """The JSON body of one request (wire format version 1); ``metadata`` (one mapping per image) only when given.
    Raises TypeError/ValueError when a metadata value is not JSON (the caller names the setting)."""
    body: dict[str, Any] = {
        "version": WIRE_VERSION,
        "images": [encode_image(image, image_format) for image in images],
        "prompts": [str(p) for p in prompts],
    }
    if metadata is not None:
        if len(metadata) != len(body["prompts"]):
            raise ValueError(f"{len(metadata)} metadata rows for {len(body['prompts'])} prompts")
        body["metadata"] = [dict(m) for m in metadata]
    return json.dumps(body, separators=(",", ":"), allow_nan=False).encode("utf-8")


def decode_request(body: bytes) -> tuple[list[np.ndarray], list[str], list[dict[str, Any]] | None]:
    """A request body back to (images, prompts, metadata or None), for servers. Raises ValueError (a 400) when
    malformed; the message says what is wrong."""
    try:
        request = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"the body is not JSON: {exc}") from None
    if not isinstance(request, dict):
        raise ValueError('the body must be a JSON object {"images": [...], "prompts": [...]}')
    version = request.get("version", WIRE_VERSION)
    if version != WIRE_VERSION:
        raise ValueError(f"unsupported wire format version {version!r}; this server speaks version {WIRE_VERSION}")
    images, prompts = request.get("images"), request.get("prompts")
    if not isinstance(images, list) or not isinstance(prompts, list):
        raise ValueError('"images" and "prompts" must both be lists')
    if len(images) != len(prompts):
        raise ValueError(f"got {len(images)} images but {len(prompts)} prompts")
    if not all(isinstance(p, str) for p in prompts):
        raise ValueError('"prompts" must be strings')
    metadata = request.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, list) or not all(isinstance(m, dict) for m in metadata):
            raise ValueError('"metadata" must be a list of JSON objects, one per image')
        if len(metadata) != len(images):
            raise ValueError(f"got {len(metadata)} metadata objects for {len(images)} images")
    decoded = []
    for i, obj in enumerate(images):
        try:
            decoded.append(decode_image(obj))
        except ValueError as exc:
            raise ValueError(f"images[{i}]: {exc}") from None
    return decoded, prompts, metadata


def encode_reply(values: Sequence[float], extras: Mapping[str, Sequence[float]] | None = None) -> bytes:
    """A reply body for servers: the rewards (non-finite ones as Python's NaN/Infinity literals, which the client
    reads back) and the extras (NaN as null: the value does not apply to that image)."""
    reply: dict[str, Any] = {"rewards": [float(v) for v in values]}
    if extras:
        reply["extras"] = {str(k): [float(x) if math.isfinite(float(x)) else None for x in v]
                           for k, v in extras.items()}
    return json.dumps(reply).encode("utf-8")


def parse_reply(payload: bytes, expected: int) -> RewardScores:
    """Validate a reply body: its rewards as float32 (expected,) and its extras (name -> float32 (expected,), null
    as NaN). Raises ValueError when malformed."""
    try:
        reply = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"the reply is not JSON ({exc}): {_excerpt(payload)!r}") from exc
    if not isinstance(reply, dict) or "rewards" not in reply:
        raise ValueError(f'the reply must be a JSON object with a "rewards" list, got {_excerpt(payload)!r}')
    rewards = reply["rewards"]
    if not isinstance(rewards, list):
        raise ValueError(f'"rewards" must be a list, got {type(rewards).__name__}')
    if len(rewards) != expected:
        raise ValueError(f'"rewards" has {len(rewards)} values for {expected} images')
    bad = [i for i, r in enumerate(rewards) if isinstance(r, bool) or not isinstance(r, (int, float))]
    if bad:
        i = bad[0]
        raise ValueError(
            f'"rewards" must hold numbers; rewards[{i}] is {rewards[i]!r}'
            + (f" ({len(bad)} non-numbers in all)" if len(bad) > 1 else "")
        )
    values = np.asarray([float(r) for r in rewards], dtype=np.float32)
    extras = reply.get("extras") or {}
    if not isinstance(extras, dict):
        raise ValueError(f'"extras" must be an object of lists, got {type(extras).__name__}')
    out: dict[str, np.ndarray] = {}
    for name, column in extras.items():
        if not isinstance(column, list) or len(column) != expected:
            raise ValueError(f'"extras.{name}" must be a list of {expected} numbers or nulls')
        if any(x is not None and (isinstance(x, bool) or not isinstance(x, (int, float))) for x in column):
            raise ValueError(f'"extras.{name}" must hold numbers or nulls')
        out[name] = np.asarray([np.nan if x is None else float(x) for x in column], dtype=np.float32)
    return RewardScores(values, out)


def parse_rewards(payload: bytes, expected: int) -> np.ndarray:
    """Validate a reply body and return its rewards as float32 (expected,). Raises ValueError when malformed."""
    return parse_reply(payload, expected).values


def _excerpt(payload: bytes | str, limit: int = _TEXT_LIMIT) -> str:
    text = payload.decode("utf-8", "replace") if isinstance(payload, bytes) else payload
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + "..."
