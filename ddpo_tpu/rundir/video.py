"""Sample videos as people look at them: an mp4 file's bytes (H.264 through PyAV, whose wheel carries FFmpeg's
libraries), an animated GIF (what TensorBoard's image dashboard plays: torch's SummaryWriter.add_video writes the same
GIF but through moviepy, which the project does not install), and a still contact sheet of several videos. numpy and
PIL here; PyAV is imported where an mp4 is encoded."""

from __future__ import annotations

import io
from fractions import Fraction

import numpy as np

# frames a second of the sample videos: flow_grpo's Wan script writes its samples at 8 (zhtmike/flow_grpo@9745241
# scripts/train_wan2_1.py:768, imageio with libx264)
FPS = 8
SHEET_FRAMES = 8  # frames of each video a contact sheet shows (evenly spaced, first and last included)


# What makes an mp4's bytes a function of its frames alone (tests/unit/rundir/test_video_bytes.py). PyAV leaves the
# encoder's thread count at 0 (auto: x264 takes 1.5 threads a CPU this process may use, capped by the frame height, and
# slices the frames with thread_type SLICE): measured with PyAV 18.1 / libx264 core 164, a 9-frame 256x256 video encodes
# to other bytes on 1 CPU (threads=1) than on 2 (threads=2 sliced_threads=1), so the same run on another machine, or
# under another CPU mask, wrote other videos. One thread, for x264, its lookahead and the RGB->YUV conversion (which
# PyAV runs with the encoder's thread count), makes the bytes the same on every machine with the same libx264; bitexact
# keeps FFmpeg's version string out of the container and the stream.
X264_OPTIONS = {"threads": "1", "lookahead_threads": "1", "sliced_threads": "0", "non_deterministic": "0"}


def encode_mp4(video: np.ndarray, fps: int = FPS) -> bytes:
    """uint8 (F, H, W, 3) -> the bytes of an H.264 mp4 in yuv420p (what browsers, wandb and players decode), the same
    bytes for the same frames on every call and machine (X264_OPTIONS). 4:2:0 chroma needs an even size: an odd
    height or width gets its last row or column repeated."""
    import av

    f, h, w, _ = video.shape
    video = np.pad(video, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4", options={"fflags": "+bitexact"}) as container:
        stream = container.add_stream("libx264", rate=Fraction(fps))
        stream.height, stream.width = video.shape[1:3]
        stream.pix_fmt = "yuv420p"
        stream.codec_context.thread_count = 1  # also the RGB->YUV conversion's threads (PyAV's reformatter)
        stream.codec_context.thread_type = "NONE"
        stream.codec_context.flags |= av.codec.context.Flags.bitexact
        stream.options = {"x264-params": ":".join(f"{k}={v}" for k, v in X264_OPTIONS.items())}
        for i, frame in enumerate(video):
            picture = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")
            picture.pts = i  # the frame's own index, not the encoder's running count
            container.mux(stream.encode(picture))
        container.mux(stream.encode())  # flush the frames the encoder still holds
    return buf.getvalue()


def encode_gif(video: np.ndarray, fps: int = FPS) -> bytes:
    """uint8 (F, H, W, 3) -> the bytes of a looping animated GIF."""
    from PIL import Image

    frames = [Image.fromarray(np.ascontiguousarray(f)) for f in video]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=round(1000 / fps), loop=0)
    return buf.getvalue()


def sheet_frames(num_frames: int, most: int = SHEET_FRAMES) -> np.ndarray:
    """The frame indices a contact sheet shows: all of them, or `most` evenly spaced from the first to the last."""
    return np.unique(np.linspace(0, num_frames - 1, min(num_frames, most)).round().astype(int))


def contact_sheet(videos: np.ndarray, most: int = SHEET_FRAMES) -> np.ndarray:
    """uint8 (B, F, H, W, 3) -> (B, H, F' * W, 3): each video's frames (F' of them, sheet_frames) side by side, one
    strip per video; a grid of one column of strips is the contact sheet (a row per video)."""
    picked = videos[:, sheet_frames(videos.shape[1], most)]
    b, f, h, w, c = picked.shape
    return np.ascontiguousarray(picked.transpose(0, 2, 1, 3, 4).reshape(b, h, f * w, c))


def tiled(videos: np.ndarray) -> np.ndarray:
    """uint8 (B, F, H, W, 3) -> one video (F, H, B * W, 3), the videos side by side (TensorBoard's one video a tag)."""
    b, f, h, w, c = videos.shape
    return np.ascontiguousarray(videos.transpose(1, 2, 0, 3, 4).reshape(f, h, b * w, c))
