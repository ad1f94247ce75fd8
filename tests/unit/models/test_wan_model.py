"""The Wan 2.1 family's model pieces (ddpo_tpu.models.wan, families/wan.py, rewards/video.py): the tiny build loaded
through from_pretrained (and by diffusers' own WanPipeline), prompt encoding against flow_grpo's Wan prompt embedding,
the catalog's LoRA layer table against the tiny and the real Wan 2.1 transformers on the meta device, the per-frame
reward, the compose-time rules of the family and its sampler, load errors, and one eager epoch whose sample grid holds
each video's frames side by side."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ddpo_tpu.catalog import family
from ddpo_tpu.config.compose import compose_and_validate
from ddpo_tpu.models.wan import encode_prompts_wan, ensure_tiny_wan, load_wan
from ddpo_tpu.problems import ConfigError

PROMPTS = ["a photo of a cat", "an astronaut riding a horse on the moon, oil painting", ""]

# Wan-AI/Wan2.1-T2V-1.3B-Diffusers and -14B-Diffusers transformer/config.json (the keys that differ from the class
# defaults, which are the 14B's widths)
WAN21_T2V = {"1.3B": dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30),
             "14B": dict(num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, num_layers=40)}


@pytest.fixture(scope="module")
def tiny_path(model_cache):
    return ensure_tiny_wan(model_cache)


@pytest.fixture(scope="module")
def comps(tiny_path):
    return load_wan(str(tiny_path))


def test_build_is_cached_and_loads_through_from_pretrained(model_cache, tiny_path, comps):
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5EncoderModel

    assert ensure_tiny_wan(model_cache) == tiny_path
    index = json.loads((tiny_path / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline" and index["transformer_2"] == [None, None]
    assert isinstance(comps.transformer, WanTransformer3DModel) and isinstance(comps.vae, AutoencoderKLWan)
    assert isinstance(comps.text_encoder, UMT5EncoderModel)
    assert isinstance(comps.scheduler, UniPCMultistepScheduler) and comps.scheduler.config.use_flow_sigmas
    assert not any(p.requires_grad for p in comps.transformer.parameters())
    assert comps.scale_factors == (4, 8) and comps.latent_shape(5, 32, 32) == (16, 2, 4, 4)
    assert comps.latent_shape(33, 240, 416) == (16, 9, 30, 52)  # flow_grpo's Wan video
    # flow_grpo loads it whole: WanPipeline.from_pretrained reads the same directory
    pipe = WanPipeline.from_pretrained(str(tiny_path))
    assert torch.equal(pipe.transformer.proj_out.weight, comps.transformer.proj_out.weight)


def ref_get_t5_prompt_embeds(text_encoder, tokenizer, prompt, max_sequence_length=226):
    """flow_grpo's wan_prompt_embedding.py::_get_t5_prompt_embeds (9745241), one video per prompt."""
    text_inputs = tokenizer(prompt, padding="max_length", max_length=max_sequence_length, truncation=True,
                            add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
    text_input_ids, mask = text_inputs.input_ids, text_inputs.attention_mask
    seq_lens = mask.gt(0).sum(dim=1).long()
    prompt_embeds = text_encoder(text_input_ids, mask).last_hidden_state
    prompt_embeds = prompt_embeds.to(dtype=text_encoder.dtype)
    prompt_embeds = [u[:v] for u, v in zip(prompt_embeds, seq_lens)]
    return torch.stack([torch.cat([u, u.new_zeros(max_sequence_length - u.size(0), u.size(1))])
                        for u in prompt_embeds], dim=0)


@pytest.mark.parametrize("tokens", [512, 16])
def test_prompt_embeddings_equal_flow_grpos(comps, tokens):
    with torch.no_grad():
        ours = encode_prompts_wan(comps, PROMPTS, "cpu", max_sequence_length=tokens)
        ref = ref_get_t5_prompt_embeds(comps.text_encoder, comps.tokenizer, PROMPTS, tokens)
    assert ours.shape == (3, tokens, 32)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    lengths = (ours.abs().sum(-1) > 0).sum(-1).tolist()
    assert lengths[2] == 1  # "" is its end token alone
    assert lengths[0] < lengths[1] < tokens if tokens == 512 else lengths[0] == lengths[1] == tokens  # cut at 16


def test_decoding_under_xla_safe_vae_is_bit_identical_and_upsamples_with_nearest(comps, monkeypatch):
    """models/vae_ops.py rewrites two eager-only idioms of the VAE for XLA; on the CPU the video must not change by a
    bit, and no interpolate inside the decode may reach the kernel as nearest-exact (XLA runs that one on the host).
    On XLA itself: tests/e2e/test_xla_families.py."""
    import contextlib

    from ddpo_tpu.models import wan

    from tests.unit.models.test_vae_ops import Modes

    latents = torch.randn(2, comps.vae.config.z_dim, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), Modes() as seen:  # entered before decode_wan's mode: it sees what that passes on
        safe, safe_modes, seen.seen = wan.decode_wan(comps.vae, latents), list(seen.seen), []
        monkeypatch.setattr(wan, "xla_safe_vae", contextlib.nullcontext)  # diffusers' decode as it is
        plain = wan.decode_wan(comps.vae, latents)
    modes = seen.seen
    assert set(modes) == {"nearest-exact"} and set(safe_modes) == {"nearest"} and len(modes) == len(safe_modes)
    assert torch.equal(safe, plain)


def test_lora_layer_table_matches_the_tiny_and_the_real_transformers():
    from diffusers import WanTransformer3DModel

    from ddpo_tpu.launch import lora_targets
    from ddpo_tpu.models import wan

    from tests.helpers import block_layers

    layers = lambda model: block_layers(model, "wan")

    with torch.device("meta"):
        tiny = layers(wan._build_transformer())
        real = {k: layers(WanTransformer3DModel(**cfg)) for k, cfg in WAN21_T2V.items()}
    assert tiny == real["1.3B"] == real["14B"] == set(family("wan").lora_layers)
    assert lora_targets.is_known("blocks.3.attn2.to_k", "wan") and lora_targets.is_known("to_out.0", "wan")
    assert not lora_targets.is_known("attn.to_q", "wan") and not lora_targets.is_known("add_q_proj", "wan")


def test_per_frame_reward_scores_every_frame_and_reduces():
    from ddpo_tpu.rewards.jpeg import JpegCompressibility
    from ddpo_tpu.rewards.video import PerFrame

    rng = np.random.default_rng(0)
    videos = rng.integers(0, 255, (3, 4, 16, 16, 3), dtype=np.uint8)
    videos[1, 2] = 128  # one flat frame: far more compressible
    image = JpegCompressibility()
    per_frame = np.stack([image(videos[i], ["p"] * 4) for i in range(3)])
    np.testing.assert_allclose(PerFrame(image)(videos, ["a", "b", "c"]), per_frame.mean(axis=1), rtol=1e-6)
    np.testing.assert_allclose(PerFrame(image, "min")(videos, ["a", "b", "c"]), per_frame.min(axis=1), rtol=1e-6)
    seen = []
    PerFrame(lambda im, p: seen.append(p) or np.zeros(len(p), np.float32))(videos, ["a", "b", "c"])
    assert seen == [["a"] * 4 + ["b"] * 4 + ["c"] * 4]  # each frame with its video's prompt
    with pytest.raises(Exception, match=r"\(B, F, H, W, 3\)"):
        PerFrame(image)(videos[0], ["a"] * 4)
    with pytest.raises(ValueError, match="reduction"):
        PerFrame(image, "max")


def test_the_family_and_its_sampler_compose(model_cache):
    v = compose_and_validate(["+experiment=wan_grpo_smoke", f"model.cache_dir={model_cache}"])
    assert (v.cfg.model.family, v.cfg.sample.name, v.cfg.sample.noise_level) == ("wan", "wan_sde", None)
    for model in ("wan21_t2v_1_3b", "wan21_t2v_14b"):
        real = compose_and_validate(["+experiment=wan_grpo_smoke", f"model={model}", "train.mixed_precision=bf16"])
        assert real.cfg.model.pretrained.startswith("Wan-AI/Wan2.1-T2V-") and real.cfg.model.lora.rank == 32
    windowed = compose_and_validate(["+experiment=wan_grpo_smoke", "sample.sde_window.size=2"])  # video wants them
    assert windowed.cfg.sample.sde_window.size == 2
    with pytest.raises(ConfigError) as e:  # another family's sampler
        compose_and_validate(["+experiment=wan_grpo_smoke", "sampler=flow_sde10"])
    assert any(p.key == "sample.name" and p.suggested() == ["sampler=wan_sde20"] for p in e.value.problems)
    with pytest.raises(ConfigError) as e:  # the Wan SDE has no noise knob
        compose_and_validate(["+experiment=wan_grpo_smoke", "sample.noise_level=0.7"])
    assert [p.key for p in e.value.problems] == ["sample.noise_level"]
    from ddpo_tpu.launch import lora_targets  # the front end's check of the names, before a run dir exists

    assert lora_targets.problems(v.cfg.model) == []
    bad = compose_and_validate(["+experiment=wan_grpo_smoke", "model.lora.target_modules=[attn.to_q]"])
    (line,) = lora_targets.problems(bad.cfg.model)
    assert "attn.to_q is not a layer of the wan family's denoiser" in line and "attn1.to_q" in line
    with pytest.raises(ConfigError):
        compose_and_validate(["+experiment=flow_grpo_smoke", "sampler=wan_sde20"])  # an SD 3 model, Wan's sampler


def test_a_directory_that_is_not_a_wan_checkpoint_is_named_with_the_fix(tmp_path):
    from ddpo_tpu.models.loading import ModelLoadError

    (tmp_path / "transformer").mkdir()
    with pytest.raises(ModelLoadError, match=r"model.pretrained=.*missing vae/, text_encoder/.*model=tiny_wan"):
        load_wan(str(tmp_path))


def test_one_epoch_scores_videos_per_frame_and_writes_mp4s_and_a_contact_sheet(tmp_path, model_cache):
    """One eager GRPO epoch with an SDE window: sampled, scored per frame with the reward's frame reduction,
    trained; its samples in the run dir as mp4 files that decode back to the videos' frames and size, a contact sheet
    PNG, and TensorBoard's animated GIF."""
    import av
    from PIL import Image

    from ddpo_tpu.training import loop
    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.runtime import make_runtime
    from tests.helpers import read_metrics

    v = compose_and_validate(["+experiment=wan_grpo_smoke", f"model.cache_dir={model_cache}", "num_epochs=1",
                              "sample.batch_size=4", "sample.num_batches_per_epoch=1", "sample.num_steps=3",
                              "algorithm.group_size=2", "train.batch_size=4", "train.gradient_accumulation_steps=1",
                              "sample.sde_window.size=2",  # the ODE's step outside the window, too
                              "reward.frame_reduction=min", "logger=tensorboard"])
    trainer = loop.Trainer(v.cfg, make_runtime(v.cfg), RunDir(tmp_path), tree=v.tree,
                           stop=SimpleNamespace(requested=False))
    assert type(trainer.reward).__name__ == "PerFrame" and trainer.reward.reduction == "min"
    trainer.fit()
    (epoch,) = read_metrics(tmp_path, "epoch")
    assert np.isfinite(epoch["reward_mean"]) and epoch["reward_mean"] < 0  # minus kilobytes per frame
    assert len(read_metrics(tmp_path, "step")) == 1 and np.isfinite(read_metrics(tmp_path, "step")[0]["loss"])
    sheet = Image.open(tmp_path / "samples" / "epoch_0000.png")
    assert sheet.size == (5 * 32, 4 * 32)  # the contact sheet: a row per video, its 5 frames of 32 px side by side
    mp4s = sorted((tmp_path / "samples").glob("epoch_0000_*.mp4"))
    assert [p.name for p in mp4s] == [f"epoch_0000_{i:02d}.mp4" for i in range(4)]
    for path in mp4s:
        with av.open(str(path)) as container:
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        assert len(frames) == 5 and frames[0].shape == (32, 32, 3)
    # the sheet's last row is the last video's frames: its mp4's first frame decodes close to the row's first
    assert np.abs(frames[0].astype(int) - np.asarray(sheet)[96:, :32].astype(int)).mean() < 12
    captions = json.loads((tmp_path / "samples" / "epoch_0000.json").read_text())
    assert [c["file"] for c in captions] == [p.name for p in mp4s]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0})
    acc.Reload()
    gif = Image.open(io.BytesIO(acc.Images("videos")[0].encoded_image_string))
    assert (gif.format, gif.n_frames, gif.size) == ("GIF", 5, (4 * 32, 32))  # the 4 videos side by side
