"""The digits demo's reward: a small CNN digit classifier, trained here on the same UCI digits (models/assets) the
demo model is pretrained on (models/digits.py), built once per machine into the model cache. A person can judge it by
looking at the sample grid.

`reward.target=N` (the demo's default, 7): the classifier's probability that an image is the digit N ("make every
digit a 7": the grids change from ten digits to sevens). `reward.target=null`: its probability of the digit the
prompt asks for ("a handwritten digit 3" -> P(3)): prompt alignment.
"""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np

from ddpo_tpu.catalog.rewards import PROMPTED_DIGIT
from ddpo_tpu.rewards.base import Metadata, Reward, register_reward

CLASSIFIER_VERSION = "v1"
CLASSIFIER_STEPS = 400
_WEIGHTS, _META = "classifier.safetensors", "classifier.json"


def _net():
    """32x32 grey images -> 10 logits: average-pooled to 16x16 (the digits' own detail is 8x8), two small
    convolutions and a linear layer; ~20k parameters, trained in seconds on one CPU thread."""
    import torch.nn as nn

    return nn.Sequential(
        nn.AvgPool2d(2),                                               # 16x16
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),    # 8x8
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),   # 4x4
        nn.Flatten(), nn.Linear(32 * 16, 10),
    )


def build_classifier(out_dir: pathlib.Path, seed: int = 0, log=print) -> pathlib.Path:
    """Train on 80% of the digits with random shifts and noise (generated images are neither centred nor clean);
    the held-out accuracy is saved beside the weights."""
    import torch
    import torch.nn.functional as F
    from safetensors.torch import save_file

    from ddpo_tpu.models.digits import digit_images

    x, y = digit_images()
    x, y = torch.from_numpy(x)[:, None], torch.from_numpy(y)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(x))
    tr, te = order[:cut], order[cut:]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the digits model's build (models/digits.py): faster on a shared machine
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = _net()
        gen = torch.Generator().manual_seed(seed)
        opt = torch.optim.Adam(net.parameters(), lr=2e-3)
        for step in range(CLASSIFIER_STEPS):
            idx = tr[torch.randint(0, len(tr), (128,), generator=gen)]
            dx, dy = (int(v) for v in torch.randint(-3, 4, (2,), generator=gen))
            xb = torch.roll(x[idx], shifts=(dy, dx), dims=(2, 3))
            xb = (xb + 0.1 * torch.randn(xb.shape, generator=gen)).clamp(0, 1)
            loss = F.cross_entropy(net(xb), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        net.eval()
        with torch.no_grad():
            acc = float((net(x[te]).argmax(1) == y[te]).float().mean())
    torch.set_num_threads(threads)
    log(f"digit classifier: held-out accuracy {acc:.3f}")
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(out_dir / _WEIGHTS))
    (out_dir / _META).write_text(json.dumps({"version": CLASSIFIER_VERSION, "heldout_accuracy": acc}) + "\n")
    return out_dir


def ensure_classifier(cache_dir: str | os.PathLike) -> pathlib.Path:
    from ddpo_tpu.proc.build_cache import build_once

    log = lambda line: print(f"ddpo_tpu: {line}", flush=True)  # noqa: E731
    return build_once(pathlib.Path(cache_dir).expanduser(), f"digit-classifier-{CLASSIFIER_VERSION}",
                      (_WEIGHTS, _META), lambda tmp: build_classifier(tmp, log=log))


def prompted_digit(prompt: str) -> int | None:
    m = PROMPTED_DIGIT.search(prompt)
    return int(m.group(1)) if m else None


@register_reward("digit_classifier")
class DigitClassifier(Reward):
    """P(digit) under the classifier, per image, in [0, 1]. Runs on the host CPU (a 20k-parameter CNN)."""

    def __init__(self, target: int | None = 7, cache_dir: str = "~/.cache/ddpo_tpu/models"):
        import torch
        from safetensors.torch import load_file

        self.target = target
        self._torch = torch
        self.net = _net()
        self.net.load_state_dict(load_file(str(ensure_classifier(cache_dir) / _WEIGHTS)))
        self.net.eval()

    def probabilities(self, images: np.ndarray) -> np.ndarray:
        """(B, 10) class probabilities of uint8 (B, H, W, 3) images (resized to 32x32 if need be)."""
        torch = self._torch
        x = torch.from_numpy(np.ascontiguousarray(images)).float().mean(-1)[:, None] / 255.0
        if x.shape[-1] != 32 or x.shape[-2] != 32:
            x = torch.nn.functional.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False)
        with torch.no_grad():
            return torch.softmax(self.net(x), dim=1).numpy().astype(np.float64)

    def __call__(self, images: np.ndarray, prompts: list[str], metadata: Metadata = None) -> np.ndarray:
        images = self._check_host_images(images, prompts)
        p = self.probabilities(images)
        if self.target is not None:
            return p[:, self.target]
        wanted = [prompted_digit(q) for q in prompts]
        if any(w is None for w in wanted):
            raise self._error(f"reward.target=null scores the digit a prompt names; a prompt names none: "
                              f"{next(q for q, w in zip(prompts, wanted) if w is None)!r}")
        return p[np.arange(len(p)), wanted]
