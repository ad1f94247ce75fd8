"""The digits demo model: an SD 1.x-shaped pipeline (diffusers' UNet2DConditionModel with cross-attention, an
AutoencoderKL with 4 latent channels and 4x down-sampling, the CLIP text encoder, byte-level tokenizer and DDIM
scheduler of models/tiny.py), narrower than the tiny model so that it pretrains in minutes on a CPU, pretrained here
on the UCI 8x8 handwritten digits (scikit-learn's copy, in models/assets) upscaled to 32x32, with the prompts "a
handwritten digit N". Built once per machine into the model cache (proc/build_cache.py: a killed or concurrent build
never leaves half a model) and loaded through the same from_pretrained code as real checkpoints, so the trainer cannot
tell it from a downloaded SD 1.x model.

The build, in three stages on one CPU thread (all seeded; minutes: benchmarks/RESULTS.md):
1. the VAE as an autoencoder of the digit images (reconstruction + a small KL term); its scaling factor is then set
   so that the latents have unit variance, as SD's 0.18215 does for SD's VAE;
2. the UNet and the text encoder together, predicting the noise of the latents at random DDPM timesteps (the
   scheduler's own schedule), with the prompt dropped to "" one time in ten so classifier-free guidance works; the
   exponential moving average of their weights is what is saved;
3. saved as a diffusers pipeline directory (model_index.json, unet/, vae/, text_encoder/, tokenizer/, scheduler/).

The reward that judges its images (rewards/digits.py) is a small classifier trained on the same images.
"""

from __future__ import annotations

import os
import pathlib
import time

import numpy as np
import torch
import torch.nn.functional as F

DIGITS_MODEL_VERSION = "v2"   # bump when the data, architecture or training below change: a new cache entry
IMAGE_SIZE = 32
PROMPT = "a handwritten digit {}"
SEED = 0

# training budget (steps of batch BATCH). Measured on the 2-core machine with other jobs running: 0.22 s per VAE
# step and 0.23 s per UNet step on one thread, 2.5-5.6 s with torch's default two (threads contending with the
# other processes), so the build runs on one thread.
VAE_STEPS = 300
UNET_STEPS = 2000
BATCH = 32
UNET_BATCH = 64
EMA_DECAY = 0.995            # the saved UNet and text encoder are the EMA of the trained ones: cleaner samples
                             # after a short training (v1, 1200 steps of 32 without EMA: no digit followed its prompt)
UNET_CHANNELS = (16, 32)     # the tiny model's (32, 64) would cost 4x the FLOPs per step
VAE_CHANNELS = (8, 16, 16)   # (32, 64, 64) in the tiny model: 32x32 RGB <-> 4x8x8 latents either way
NORM_GROUPS = 8
DIGITS_FILE = pathlib.Path(__file__).resolve().parent / "assets" / "digits.csv.gz"


def digit_images(size: int = IMAGE_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """The UCI handwritten digits (1797 images, 8x8, values 0-16; scikit-learn's `load_digits()` data, shipped in
    models/assets: its README says why) as float32 (N, size, size) in [0, 1], white on black, upscaled bilinearly;
    and their labels."""
    rows = np.loadtxt(DIGITS_FILE, delimiter=",", dtype=np.float32)
    x = torch.from_numpy(rows[:, :64].reshape(-1, 1, 8, 8) / 16.0)
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False).clamp(0, 1)
    return x[:, 0].numpy(), rows[:, 64].astype(np.int64)


def prompts_for(labels) -> list[str]:
    return [PROMPT.format(int(n)) for n in labels]


def _to_rgb(x: torch.Tensor) -> torch.Tensor:
    """(N, H, W) in [0, 1] -> (N, 3, H, W) in [-1, 1], the VAE's input range."""
    return (x * 2 - 1)[:, None].expand(-1, 3, -1, -1).contiguous()


def _train_vae(vae, x: torch.Tensor, gen: torch.Generator, log) -> float:
    opt = torch.optim.Adam(vae.parameters(), lr=1e-3)
    vae.train()
    for step in range(VAE_STEPS):
        idx = torch.randint(0, len(x), (BATCH,), generator=gen)
        img = _to_rgb(x[idx])
        post = vae.encode(img).latent_dist
        z = post.mean + post.std * torch.randn(post.mean.shape, generator=gen)
        rec = vae.decode(z).sample
        loss = F.mse_loss(rec, img) + 1e-6 * post.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == VAE_STEPS - 1:
            log(f"stage 1 of 2, the VAE: step {step + 1}/{VAE_STEPS}, loss {loss.item():.4f}")
    vae.eval()
    return float(loss.item())


@torch.no_grad()
def _latents(vae, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([vae.encode(_to_rgb(x[i:i + 256])).latent_dist.mean for i in range(0, len(x), 256)])


def _train_unet(unet, text_encoder, tokenizer, scheduler, latents: torch.Tensor, labels: np.ndarray,
                gen: torch.Generator, log) -> float:
    prompts = prompts_for(range(10)) + [""]
    ids = tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                    return_tensors="pt").input_ids
    params = list(unet.parameters()) + list(text_encoder.parameters())
    opt = torch.optim.AdamW(params, lr=2e-3, weight_decay=1e-4)
    ema = [p.detach().clone() for p in params]
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, UNET_STEPS, eta_min=1e-5)
    alphas = scheduler.alphas_cumprod.float()
    lab = torch.from_numpy(labels)
    unet.train()
    text_encoder.train()
    for step in range(UNET_STEPS):
        idx = torch.randint(0, len(latents), (UNET_BATCH,), generator=gen)
        z0 = latents[idx]
        which = torch.where(torch.rand(UNET_BATCH, generator=gen) < 0.1, 10, lab[idx])  # 10: the empty prompt
        cond = text_encoder(ids[which])[0]
        t = torch.randint(0, len(alphas), (UNET_BATCH,), generator=gen)
        noise = torch.randn(z0.shape, generator=gen)
        a = alphas[t].view(-1, 1, 1, 1)
        zt = a.sqrt() * z0 + (1 - a).sqrt() * noise
        loss = F.mse_loss(unet(zt, t, encoder_hidden_states=cond).sample, noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        with torch.no_grad():
            for e, p in zip(ema, params):
                e.lerp_(p, 1 - EMA_DECAY)
        if step % 100 == 0 or step == UNET_STEPS - 1:
            log(f"stage 2 of 2, the UNet and text encoder: step {step + 1}/{UNET_STEPS}, "
                f"loss {loss.item():.4f}")
    with torch.no_grad():
        for e, p in zip(ema, params):
            p.copy_(e)
    unet.eval()
    text_encoder.eval()
    return float(loss.item())


def _build_unet():
    from diffusers import UNet2DConditionModel

    from ddpo_tpu.models import tiny

    return UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), mid_block_type="UNetMidBlock2DCrossAttn",
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), block_out_channels=UNET_CHANNELS, layers_per_block=1,
        cross_attention_dim=tiny.TINY_TEXT_HIDDEN, norm_num_groups=NORM_GROUPS, act_fn="silu",
        attention_head_dim=2,  # 2 heads of 8 and 16 channels (v1: 8 heads of 2 and 4)
        flip_sin_to_cos=True, freq_shift=0)


def _build_vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=VAE_CHANNELS, layers_per_block=1,
        latent_channels=4, norm_num_groups=NORM_GROUPS, sample_size=IMAGE_SIZE, scaling_factor=1.0)


def build_digits_pipeline(out_dir: str | os.PathLike, seed: int = SEED, log=print) -> pathlib.Path:
    """Pretrain the digits model and save it into out_dir as a diffusers pipeline. Leaves the caller's global RNG
    state alone."""
    from diffusers import StableDiffusionPipeline

    from ddpo_tpu.models import tiny

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec = tiny.SPECS["tiny"]
    t0 = time.monotonic()
    x, labels = digit_images()
    x = torch.from_numpy(x)
    tokenizer = tiny._build_tokenizer(out)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see VAE_STEPS
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = tiny._build_text_encoder(spec, len(tokenizer), tokenizer.convert_tokens_to_ids(tiny.BOS_TOKEN),
                                                tokenizer.convert_tokens_to_ids(tiny.EOS_TOKEN))
        unet = _build_unet()
        vae = _build_vae()
        gen = torch.Generator().manual_seed(seed)
        _train_vae(vae, x, gen, log)
        raw = _latents(vae, x)
        scale = float(1.0 / raw.std())
        vae.register_to_config(scaling_factor=scale)  # latents of unit variance, as SD's 0.18215 gives SD's VAE
        scheduler = tiny._build_scheduler()
        _train_unet(unet, text_encoder, tokenizer, scheduler, raw * scale, labels, gen, log)
    torch.set_num_threads(threads)
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    pipe.save_pretrained(str(out), safe_serialization=True)
    tok_dir = out / "tokenizer"
    if not (tok_dir / "vocab.json").exists() or not (tok_dir / "merges.txt").exists():
        tiny._write_tokenizer_files(tok_dir)
    log(f"digits model built in {time.monotonic() - t0:.0f} s")
    return out


def ensure_digits_model(cache_dir: str | os.PathLike, seed: int = SEED) -> pathlib.Path:
    """cache_dir/digits-sd-{version}-seed{seed}, pretrained on first use (about 10 minutes on a
    2-core machine, 7 CPU-minutes, once per machine: docs/running.md)."""
    from ddpo_tpu.models import tiny
    from ddpo_tpu.proc.build_cache import build_once

    def build(tmp: pathlib.Path) -> None:
        print(f"ddpo_tpu: pretraining the digits demo model once into {cache_dir} (about 10 minutes on 2 cores; "
              "once per machine)", flush=True)
        build_digits_pipeline(tmp, seed=seed, log=lambda line: print(f"ddpo_tpu: digits model: {line}", flush=True))

    return build_once(cache_dir, f"digits-sd-{DIGITS_MODEL_VERSION}-seed{seed}", tiny._REQUIRED_FILES, build)
