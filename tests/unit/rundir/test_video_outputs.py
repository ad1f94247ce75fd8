"""What a video run leaves to look at (rundir/video.py, RunDir.save_videos, the trackers' log_videos): mp4 files
that decode back (PyAV) to the frames, size and rate written, written whole like the PNGs; the contact sheet; the
TensorBoard event file's animated GIF and still; wandb's Video files in an offline run."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from ddpo_tpu.config.schema import LoggerConfig
from ddpo_tpu.display import tracking
from ddpo_tpu.rundir.video import FPS, contact_sheet, encode_gif, encode_mp4, sheet_frames, tiled
from ddpo_tpu.rundir.files import VIDEO_SAMPLES, RunDir, interrupted_writes


def smooth_videos(b: int, f: int, h: int, w: int) -> np.ndarray:
    """Each video a colour ramp that slides a step a frame (what H.264 codes closely), each a different hue."""
    y, x = np.mgrid[0:h, 0:w]
    out = np.empty((b, f, h, w, 3), np.uint8)
    for i in range(b):
        for t in range(f):
            out[i, t, ..., 0] = (x * 4 + 6 * t) % 256
            out[i, t, ..., 1] = (y * 4 + 30 * i) % 256
            out[i, t, ..., 2] = 60 + 20 * i
    return out


def decode(data: bytes) -> tuple[np.ndarray, float, str]:
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
        return frames, float(stream.average_rate), stream.codec_context.name


@pytest.mark.parametrize("shape", [(5, 32, 32), (9, 48, 80), (4, 31, 17)])
def test_mp4_decodes_back_to_the_frames_written(shape):
    f, h, w = shape
    video = smooth_videos(1, f, h, w)[0]
    frames, fps, codec = decode(encode_mp4(video))
    assert codec == "h264" and fps == FPS
    assert frames.shape == (f, h + h % 2, w + w % 2, 3)  # an odd side gets its last row / column repeated
    err = np.abs(frames[:, :h, :w].astype(int) - video.astype(int))
    assert err.mean() < 6, err.mean()  # lossy, but the same pictures in the same order
    order = [int(np.argmin([np.abs(d.astype(int) - v.astype(int)).mean() for v in video])) for d in frames[:, :h, :w]]
    assert order == list(range(f))


def test_gif_contact_sheet_and_tiling():
    from PIL import Image

    videos = smooth_videos(3, 12, 16, 24)
    gif = Image.open(io.BytesIO(encode_gif(videos[0])))
    assert (gif.format, gif.n_frames, gif.size) == ("GIF", 12, (24, 16))
    assert gif.info["duration"] == pytest.approx(1000 / FPS, abs=10)  # GIF keeps hundredths of a second
    assert list(sheet_frames(12)) == [0, 2, 3, 5, 6, 8, 9, 11] and list(sheet_frames(5)) == [0, 1, 2, 3, 4]
    sheet = contact_sheet(videos)  # a strip a video, 8 of its 12 frames from the first to the last
    assert sheet.shape == (3, 16, 8 * 24, 3)
    assert np.array_equal(sheet[1, :, :24], videos[1, 0]) and np.array_equal(sheet[2, :, -24:], videos[2, 11])
    assert np.array_equal(sheet[0, :, 24:48], videos[0, 2])
    side = tiled(videos)
    assert side.shape == (12, 16, 72, 3) and np.array_equal(side[7, :, 24:48], videos[1, 7])


def test_run_dir_holds_mp4s_and_their_contact_sheet(tmp_path):
    from PIL import Image

    videos = smooth_videos(VIDEO_SAMPLES + 2, 5, 32, 32)
    prompts = [f"prompt {i}" for i in range(len(videos))]
    rewards = np.arange(len(videos), dtype=np.float64)
    paths = RunDir(tmp_path).save_videos(3, videos, prompts, rewards, name="eval")
    assert [p.name for p in paths] == [f"eval_0003_{i:02d}.mp4" for i in range(VIDEO_SAMPLES)]
    for path, video in zip(paths, videos):
        frames, _, _ = decode(path.read_bytes())
        assert frames.shape == video.shape
    sheet = Image.open(tmp_path / "samples" / "eval_0003.png")
    assert sheet.size == (5 * 32, VIDEO_SAMPLES * 32)  # a row per video, its frames left to right
    assert np.array_equal(np.asarray(sheet)[32:64, 64:96], videos[1, 2])
    captions = json.loads((tmp_path / "samples" / "eval_0003.json").read_text())
    assert captions[1] == {"prompt": "prompt 1", "reward": 1.0, "file": "eval_0003_01.mp4"}
    assert interrupted_writes(tmp_path / "samples") == []  # written whole (temp name, rename), as the PNGs


def _logger(**kw) -> LoggerConfig:
    base = dict(name="none", mode="disabled", project="p", entity=None, group=None, tags=[], notes=None)
    return LoggerConfig(**{**base, **kw})


def test_tensorboard_gets_an_animated_gif_and_the_still(tmp_path):
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    videos = smooth_videos(6, 5, 16, 16)
    t = tracking.make_tracker(_logger(name="tensorboard"), tmp_path, "id", "run", {}, is_main=True)
    t.log_videos(7, videos, [], [f"p{i} | 0.5" for i in range(6)])
    t.finish()
    acc = EventAccumulator(str(tmp_path / tracking.TENSORBOARD_DIR), size_guidance={"images": 0})
    acc.Reload()
    assert {"videos", "samples"} <= set(acc.Tags()["images"])
    (event,) = acc.Images("videos")
    gif = Image.open(io.BytesIO(event.encoded_image_string))
    # TB_VIDEOS of them side by side, every frame
    assert (event.step, gif.format, gif.n_frames) == (7, "GIF", 5)
    assert gif.size == (event.width, event.height) == (tracking.TB_VIDEOS * 16, 16)
    (still,) = acc.Images("samples")
    assert (still.width, still.height) == (5 * 16, 6 * 16)


def test_wandb_offline_run_gets_the_mp4_files(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    videos = smooth_videos(2, 5, 16, 16)
    files = RunDir(tmp_path).save_videos(0, videos, ["a", "b"], np.zeros(2))
    t = tracking.make_tracker(_logger(name="wandb", mode="offline"), tmp_path, "vid0001", "run", {}, is_main=True)
    t.log_videos(1, videos, files, ["a | 0.0", "b | 0.0"])
    t.finish()
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    logged = sorted(run.glob("files/media/videos/videos_*.mp4"))
    assert len(logged) == 2 and {p.read_bytes() for p in logged} == {f.read_bytes() for f in files}
    assert decode(logged[0].read_bytes())[0].shape == (5, 16, 16, 3)


def test_no_videos_without_a_tracker_and_nothing_for_image_trackers(tmp_path):
    # logger=none: the curve only; its log_videos is the base's (nothing)
    t = tracking.make_tracker(_logger(), tmp_path, "id", "run", {}, is_main=True)
    t.log_videos(0, smooth_videos(1, 3, 8, 8), [Path("x.mp4")], ["c"])
    t.finish()
    assert not (tmp_path / tracking.TENSORBOARD_DIR).exists() and not (tmp_path / "wandb").exists()
