"""The flow families beyond SD 3 on torch_xla's PJRT CPU device, through the real launcher: FLUX, Wan (video),
Qwen-Image, FLUX.2-klein, Qwen-Image-Edit and Z-Image each compile their graphs in epoch 0 and nothing after, run no
op on the host while sampling but the text encoders' mask checks (and Qwen2.5-VL's vision tables: FALLBACKS), and copy
to the host only what is counted below (torch_xla's own counters, exact).

What this caught (both fixed in ddpo_tpu/models): Wan's VAE decode raised on XLA ("Value out of range": diffusers'
AutoencoderKLWan slices x[:, :, -2:] on a one-frame axis) and both video VAEs ran each 2x upsampling on the host
(aten::_upsample_nearest_exact2d; models/vae_ops.py); Qwen-Image compiled a new text-encoder graph whenever a batch's
longest prompt was new (prompts are now tokenized to a fixed length; models/qwen_image.py::encode_prompts_qwen) and
put its RoPE tables, which stay on the host when the model moves, into every compiled graph as CPU constants
(models/qwen_image.py::rope_tables_to); Qwen-Image-Edit compiled 6 new sampling graphs in epoch 1 while it encoded
each prompt with its pictures at the prompt's own length (now one batch padded to a fixed length on XLA:
models/qwen_image_edit.py::encode_edit_prompts)."""

from __future__ import annotations

import pytest

from tests.helpers import FAST_XLA_CPU, read_metrics, run_train

pytestmark = [pytest.mark.slow, pytest.mark.xla]

BATCHES = 2  # sampling batches an epoch (below)

# host reads a sampling batch makes: the uint8 images (or video frames) once, plus transformers' SDPA mask check on a
# padded prompt batch (masking_utils reads `padding_mask.all()` on the host: UMT5's bidirectional mask once,
# Qwen2.5-VL's and Qwen3's (FLUX.2-klein) causal masks twice); FLUX's CLIP and T5 run unmasked
HOST_READS_PER_BATCH = {"flux_grpo_smoke": 1, "wan_grpo_smoke": 2, "qwen_image_grpo_smoke": 3, "flux2_grpo_smoke": 3,
                        # Wan 2.2 A14B's two experts: Wan's 2, plus the step indices read once a step (6 steps) to
                        # pick the expert from the fixed schedule (families/wan.py: the host-side schedule)
                        "wan22_grpo_smoke": 2 + 6,
                        # Qwen-Image-Edit: the images, and 13 reads inside Qwen2.5-VL's forward with pictures (its mask
                        # checks, the image grid read for the vision tower's positions, windows and segments, the
                        # rope index, the split of the picture features), one encoder call a batch (measured)
                        "qwen_image_edit_grpo_smoke": 14,
                        # Z-Image: the images, and Qwen3's causal mask check twice (as FLUX.2-klein's)
                        "z_image_grpo_smoke": 3}
# host reads a training epoch makes beyond the metrics copy of each of its 2 optimizer steps: wan22's step indices,
# once per score call (the policy's and the KL reference's) of each micro-step (5 trained timesteps x 2 train batches)
TRAIN_READS = {"wan22_grpo_smoke": 2 * 5 * 2}
# wan22 under torch_xla's lazy tracing: its host-side expert schedule reads the step indices, which a dynamo-captured
# step cannot do (families/wan.py refuses two experts under dynamo). Measured once: 12 graphs in epoch 0 (4 sampling,
# 8 training), none in epoch 1; 112 s on this machine (so it is extended)
EXTRA = {"wan22_grpo_smoke": ["xla.step_compiler=lazy"]}
# ops run on the host while sampling beyond the mask checks' scalar reads: Qwen2.5-VL's vision tower (reading the edit
# family's pictures) computes its attention segments from the image grid with repeat_interleave and
# unique_consecutive (transformers' vision_utils.py), which torch_xla runs on the CPU; their shapes are the grid's,
# the same every batch, so they add no graph
FALLBACKS = {"qwen_image_edit_grpo_smoke": {"aten::repeat_interleave.Tensor", "aten::unique_consecutive"}}


# over ~30 s here. CI compiles FLUX (the MMDiT with two text encoders) and Wan (video); Qwen-Image (~105 s) and
# FLUX.2-klein, whose text encoders are the other decoder LMs, in the extended tier (docs/testing.md, 2026-11-29)
# qwen_image_edit_grpo_smoke (2026-11-29): 23 graphs in epoch 0 (12 sampling, 11 training), none in epoch 1; ~80-97 s
# z_image_grpo_smoke (2026-11-29): 17 graphs in epoch 0 (4 sampling, 13 training), none in epoch 1; ~400 s here with
# the machine shared (its captions held at 512 tokens with their 32-token buckets as data: models/z_image.py)
EXTENDED = {"wan22_grpo_smoke", "qwen_image_grpo_smoke", "flux2_grpo_smoke", "qwen_image_edit_grpo_smoke",
            "z_image_grpo_smoke"}


@pytest.mark.parametrize("experiment", [pytest.param(e, marks=[pytest.mark.extended] if e in EXTENDED else [])
                                        for e in HOST_READS_PER_BATCH])
def test_a_flow_family_compiles_its_graphs_once_and_samples_on_the_device(experiment, tmp_path, model_cache):
    proc = run_train([f"+experiment={experiment}", "tpu_topology=cpu", "num_epochs=2", "sample.batch_size=8",
                      f"sample.num_batches_per_epoch={BATCHES}", "train.batch_size=8",
                      "train.gradient_accumulation_steps=1", "reward.host_workers=0", f"model.cache_dir={model_cache}",
                      FAST_XLA_CPU, *EXTRA.get(experiment, [])], tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    epochs = read_metrics(tmp_path / "outputs" / experiment, "epoch")
    assert [e["epoch"] for e in epochs] == [0, 1]
    assert epochs[0]["new_compilations"] > 0
    assert epochs[1]["new_compilations"] == 0, epochs[1]["phases"]
    # no host tensor inside a compiled graph (Qwen-Image's RoPE tables were: models/qwen_image.rope_tables_to)
    assert "on cpu. Please move all tensors to xla device" not in (tmp_path / "outputs" / experiment / "train.log"
                                                                    ).read_text()
    for e in epochs:
        sampling = e["phases"]["sampling"]
        allowed = {"aten::_local_scalar_dense", *FALLBACKS.get(experiment, ())}  # the mask checks and the above
        assert set(sampling.get("cpu_fallbacks", {})) <= allowed, sampling
        assert sampling["host_transfers"] == BATCHES * HOST_READS_PER_BATCH[experiment], sampling
        # one metrics copy per optimizer step (2 an epoch)
        assert e["phases"]["training"]["host_transfers"] == 2 + TRAIN_READS.get(experiment, 0), e["phases"]
