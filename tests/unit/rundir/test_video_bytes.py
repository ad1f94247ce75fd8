"""The sample videos' bytes are a function of their frames (issue 43 item 9): rundir/video.py encode_mp4 pins the
encoder's threads and options, so the same frames give the same mp4 on every call, in every process, on any number of
CPUs.

Before the fix (checked by running this file against the parent commit's video.py): the encoder ran with PyAV's
default thread count (0, auto), and a 9-frame 256x256 video encoded on one CPU (x264 threads=1) and on two (threads=2
sliced_threads=1) gave different bytes, so test_the_cpus_a_process_may_use_do_not_change_the_bytes and
test_the_stream_says_it_was_encoded_with_one_thread failed; the first-call and two-process tests passed then too (no
other source of difference was found on this machine: 300 encodes of one video in one process, encodes beside busy
torch threads, and two one-epoch runs of wan_grpo_smoke, whose eight mp4s matched byte for byte, all agreed). A
wan_grpo_smoke run takes 40-85 s here, twice is over the budget of a test: the encoder-level tests stand for it."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ddpo_tpu.rundir.video import encode_mp4

pytestmark = pytest.mark.torch_free  # no torch in the test or what it starts (tests/conftest.py)

REPO = Path(__file__).resolve().parents[3]

ENCODE = """
import hashlib, sys
import numpy as np
from ddpo_tpu.rundir.video import encode_mp4
size, calls = int(sys.argv[1]), int(sys.argv[2])
rng = np.random.default_rng(0)
base = rng.integers(0, 256, (9, size // 8, size // 8, 3)).astype(np.float32)
video = np.clip(base.repeat(8, 1).repeat(8, 2) + rng.normal(0, 20, (9, size, size, 3)), 0, 255).astype(np.uint8)
print(" ".join(hashlib.sha256(encode_mp4(video)).hexdigest() for _ in range(calls)))
"""


def _encode_elsewhere(size: int, calls: int, cpus: set[int] | None = None) -> list[str]:
    """The sha256 of each of `calls` encodes of one fixed video in a fresh process (the first call of that process
    included), optionally restricted to the given CPUs."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    pre = (lambda: os.sched_setaffinity(0, cpus)) if cpus is not None else None
    out = subprocess.run([sys.executable, "-c", ENCODE, str(size), str(calls)], env=env, capture_output=True,
                         text=True, timeout=120, preexec_fn=pre)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


def _video(size: int = 32, frames: int = 5, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (frames, size // 8, size // 8, 3)).astype(np.float32)
    return np.clip(base.repeat(8, 1).repeat(8, 2) + rng.normal(0, 20, (frames, size, size, 3)), 0, 255).astype(
        np.uint8)


def test_first_and_later_calls_and_two_processes_give_the_same_bytes():
    """Wan smoke's size (5 frames of 32x32) and a larger one; the first encode of a process is compared with the
    later ones and with another process's."""
    for size in (32, 256):
        one, two = _encode_elsewhere(size, 3), _encode_elsewhere(size, 3)
        assert len(set(one + two)) == 1, (size, one, two)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to compare one with two")
def test_the_cpus_a_process_may_use_do_not_change_the_bytes():
    cpus = sorted(os.sched_getaffinity(0))
    assert _encode_elsewhere(256, 1, {cpus[0]}) == _encode_elsewhere(256, 1, set(cpus))


def test_the_stream_says_it_was_encoded_with_one_thread():
    """x264 writes its settings into the stream (an SEI message): the pinned ones, whatever this machine has."""
    data = encode_mp4(_video(256, 3))
    assert b"threads=1 lookahead_threads=1 sliced_threads=0" in data
    assert b"Lavf" not in data  # bitexact: no FFmpeg version string in the container


def test_in_process_calls_repeat_and_decode_to_the_frames():
    import av

    videos = [_video(32, 5, seed) for seed in range(4)]
    first = [encode_mp4(v) for v in videos]
    assert [encode_mp4(v) for v in videos] == first
    assert len({hashlib.sha256(b).hexdigest() for b in first}) == 4
    with av.open(io.BytesIO(first[0])) as container:
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    assert frames.shape == videos[0].shape
    assert np.abs(frames.astype(int) - videos[0]).mean() < 20  # lossy, but these frames


def test_an_odd_size_is_padded_and_still_repeats():
    video = _video(32, 3)[:, :31, :29]
    assert encode_mp4(video) == encode_mp4(video.copy())
