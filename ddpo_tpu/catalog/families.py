"""Model families: one spec each holding what validation and loading need to know about a family without torch.

A spec is read by the schema (which names are families and local builds), the rules (sampler, keys only the family
reads, checkpoint folders, LoRA layers, the memory model), `families.load_family` (the torch module, imported when a
run starts) and the docs. Adding a family: a spec registered here (or from your own module with `FAMILIES.register`),
its torch module (a `ModelFamily` subclass with `load(cfg, rt)`), and a YAML under conf/model/. docs/architecture.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping

from ddpo_tpu.catalog import wan_memory
from ddpo_tpu.catalog.memory_figures import GIB, FamilyMemory, split_transformer_memory
from ddpo_tpu.catalog.registry import Registry

@dataclass(frozen=True)
class FamilySpec:
    name: str                     # model.family
    title: str                    # for people: "Stable Diffusion 1.x (UNet, DDIM)"
    module: str                   # "package.module:Class", the ModelFamily subclass (imported by the training process)
    sampler: str                  # the sampler it samples with (catalog/samplers.py)
    denoiser: str                 # what is trained: "UNet", "transformer" (console, messages)
    subfolders: tuple[str, ...]   # what a local diffusers checkpoint dir must hold for its loader
    example_hub_id: str           # a real checkpoint, for fixes and docs
    builders: tuple[str, ...] = ()           # model.builder values: local builds (tests, smoke runs, benchmarks)
    full_size_builders: tuple[str, ...] = () # the builds at real widths: memory is estimated for them too
    lora_layers: tuple[str, ...] = ()        # paths of the adaptable layers inside a block (config/lora.py)
    lora_example: str = ""                   # a target to show in a fix
    # model keys only this family reads, with the value that means "unused" (another family refuses other values)
    own_keys: Mapping[str, Any] = field(default_factory=dict)
    # model.resolution: None = the family does not read it; else the multiple of pixels a size must be
    resolution_multiple: int | None = None
    # video families: the VAE's temporal compression; model.num_frames must then be 1 + a multiple of it (None: images)
    frame_step: int | None = None
    # None: no HBM estimate for this family; a function of the model config where the figures follow it (a video's
    # tokens: frames x patches), giving that model's figures (its per-evaluation tables at its own size, not 512 px)
    memory: FamilyMemory | Callable[[Any], FamilyMemory] | None = None
    # how sample.guidance_scale is applied: "cfg" = classifier-free guidance (an unconditional pass beside the
    # conditional one, train.cfg repeats it at train time); "embedded" = a guidance-distilled model reads the scale
    # as an input embedding (one pass, no unconditional prompt; train.cfg must be false)
    guidance: Literal["cfg", "embedded"] = "cfg"
    # what decode makes: uint8 images (B, H, W, 3) or videos (B, F, H, W, 3). The rewards say what they take
    # (catalog/rewards.py RewardSpec.takes): an image reward scores a video's frames, a video reward needs videos
    output: Literal["images", "videos"] = "images"


FAMILIES: Registry[FamilySpec] = Registry("model family")


def family(name: str) -> FamilySpec:
    return FAMILIES.get(name)


def memory_of(spec: FamilySpec, model) -> FamilyMemory | None:
    """The family's memory figures for this model config (None: not estimated)."""
    return spec.memory(model) if callable(spec.memory) else spec.memory


def family_of_builder(builder: str) -> FamilySpec | None:
    return next((f for f in FAMILIES if builder in f.builders), None)


def all_builders() -> tuple[str, ...]:
    return tuple(b for f in FAMILIES for b in f.builders)


def models_making(output: str) -> str:
    """The models of the families that decode `output` ("videos"), for a fix: their local builds, and the families."""
    specs = [f for f in FAMILIES if f.output == output]
    return ", ".join(f"model={b}" for f in specs for b in f.builders) + \
        f" or another model of the {'/'.join(f.name for f in specs)} family"


# --- SD 1.x ----------------------------------------------------------------------------------------------------------
# Activation memory of one SD 1.x UNet evaluation at 512 px (64x64 latents) kept for the backward pass, per sample, on
# XLA. Two parts: (1) 2.3 GiB measured on eager CPU with the full-width random SD 1.4 build (model=sd14_random, LoRA,
# float32: peak RSS of a forward + backward at batch 1 and 2), halved for bf16 autocast; eager CPU attention does not
# keep its score matrices; (2) XLA lowers attention to matmul + softmax and keeps each softmax for the backward:
# 8 heads x S^2 x 4 bytes (softmax runs in float32 under autocast) over SD 1.4's 16 self-attentions (5 each at 4096,
# 1024 and 256 tokens, 1 at 64) = 2.7 GiB. On XLA CPU one training evaluation at full width did not fit in 24 GiB in
# either precision (benchmarks/RESULTS.md). An estimate for the HBM rule, not a TPU figure.
# Measured by: python scripts/bench.py --sd14-activations (the eager part, unchecked rows: 1.53 GiB per sample
# today, below the 2.3 kept here from the first measurement; the bf16 1.2 is half of it, not measured).
SD1_ATTENTION_SCORES_GIB_512 = 2.7
SD1_EAGER_GIB = {"no": 2.3, "bf16": 1.2}
# With activation checkpointing (diffusers' gradient checkpointing: every block keeps only its input and the backward
# runs it again; `python scripts/bench.py --checkpointing`): (1) the eager part shrinks by what eager CPU measured at
# full width per sample (batch 2 - batch 1 peak RSS): SD 1.4's UNet 1.53 -> 0.43 GiB (x 0.28); (2) the XLA scores:
# the forward graph hands no score matrix to the backward graph (AOTAutograd's partition on XLA tensors); what the
# backward then holds at once is XLA's schedule: on XLA CPU the peak RSS of one compiled forward + backward of SD
# 1.4's topology at 4096 tokens fell from 11.0 to 5.6 GiB above its baseline (x 0.51).
SD1_CKPT_EAGER_RATIO, CKPT_XLA_SCORES_RATIO = 0.28, 0.51
# frozen UNet + VAE + text encoder, LoRA and Adam state, sampling buffers (float32 weights): an estimate, no probe
SD1_RESIDENT_GIB = 6.0
# A full UNet fine-tune: 860M weights x (weight, gradient, 2 AdamW moments) x 4 bytes = 12.8 GiB, split by fsdp,
# plus ~3 GiB that stays whole (VAE, text encoder, 1-D tensors, activations of a small batch)
SD1_FULL_STATE_GIB, SD1_FULL_WHOLE_GIB = 12.8, 3.0

SD1 = FAMILIES.register(FamilySpec(
    name="sd1", title="Stable Diffusion 1.x (UNet, DDIM)", module="ddpo_tpu.families.sd1:SD1Family",
    sampler="ddim", denoiser="UNet",
    subfolders=("unet", "vae", "text_encoder", "tokenizer", "scheduler"),
    example_hub_id="CompVis/stable-diffusion-v1-4",
    builders=("tiny", "sd14_topology", "sd14_random", "digits"), full_size_builders=("sd14_random",),
    lora_layers=("attn1.to_k", "attn1.to_out.0", "attn1.to_q", "attn1.to_v", "attn2.to_k", "attn2.to_out.0",
                 "attn2.to_q", "attn2.to_v", "conv", "conv1", "conv2", "conv_in", "conv_out", "conv_shortcut",
                 "ff.net.0.proj", "ff.net.2", "proj_in", "proj_out", "time_emb_proj", "time_embedding.linear_1",
                 "time_embedding.linear_2"),
    lora_example="attn1.to_q",
    memory=FamilyMemory(
        activation_gib_per_eval_512={k: v + SD1_ATTENTION_SCORES_GIB_512 for k, v in SD1_EAGER_GIB.items()},
        checkpointed_gib_per_eval_512={k: round(v * SD1_CKPT_EAGER_RATIO
                                                + CKPT_XLA_SCORES_RATIO * SD1_ATTENTION_SCORES_GIB_512, 2)
                                       for k, v in SD1_EAGER_GIB.items()},
        resident_gib=lambda model, fsdp, dtype: SD1_RESIDENT_GIB,
        full_finetune_gib=lambda fsdp: SD1_FULL_STATE_GIB / fsdp + SD1_FULL_WHOLE_GIB,
    ),
))

# --- SD 3 / 3.5 ------------------------------------------------------------------------------------------------------
# One SD 3.5 Medium transformer evaluation at 512 px (1024 image tokens + 77 CLIP + 128 T5 text tokens, flow_grpo's
# max_sequence_length), LoRA rank 32 as model=sd35_medium. (1) SD3_EAGER_GIB: 2.9 GiB in float32 measured on eager CPU
# with SD 3.5 Medium's transformer at full width (1536, 24 heads of 64, RMS qk-norm) and random weights, 2 and 3
# layers deep, with and without dual attention, batch 1 and 2 (`python scripts/bench.py --sd3-activations`; peak RSS
# over a forward + backward, 2.87, and the bytes autograd saves, 2.80): per sample 0.24 for the first and last layers
# with the embeddings, 0.10 per middle joint layer, 0.14 per middle dual-attention layer, extrapolated to 24 layers.
# bf16 (frozen weights bfloat16 under bf16 autocast): 2.1 = float32's x 0.74, the bf16 / float32 ratio of a 1-layer
# build at batch 1 and 2. (2) XLA's softmaxes, as for SD 1.x: 24 heads x S^2 x 4 bytes over the 24 joint attentions
# (S = 1229) and the image-only attentions of dual layers 1-12 (S = 1024) = 4.4 GiB. An estimate, not a TPU figure.
SD3_ATTENTION_SCORES_GIB_512 = (24 * 24 * 1229 ** 2 + 12 * 24 * 1024 ** 2) * 4 / GIB  # 4.37
SD3_EAGER_GIB = {"no": 2.9, "bf16": 2.1}
# activation checkpointing: SD 3.5 Medium's transformer 2.9 -> 0.75 GiB per sample on eager CPU (x 0.26; 24 layers
# extrapolated from 2-3 as above, counting each layer's recomputation as if kept: an upper bound;
# `python scripts/bench.py --checkpointing`), the XLA scores as SD 1.x's
SD3_CKPT_EAGER_RATIO = 0.26


def _split_transformer_memory(*args) -> FamilyMemory:
    """memory_figures.split_transformer_memory with SD 3.5's measured eager ratio and SD 1.x's scores ratio."""
    return split_transformer_memory(SD3_CKPT_EAGER_RATIO, CKPT_XLA_SCORES_RATIO, *args)

# SD 3.5 Medium's parts in billions of values (the diffusers / transformers classes built with the checkpoint's configs
# on the meta device): the transformer's weights (split over mesh.fsdp with the training state) and its positional
# table (a buffer, whole on every chip); CLIP-L and CLIP-G; T5-XXL's encoder (model.text_encoder_3); the VAE (float32).
# Measured by: python scripts/bench.py --sd3-parameters
SD35_MEDIUM_BILLIONS = {"transformer": 2.243, "pos_embed": 0.227, "clips": 0.124 + 0.695, "t5": 4.762, "vae": 0.084}
# plus LoRA's 18.8M values x (weight, gradient, 2 AdamW moments, EMA) in float32 (0.35 GiB), an epoch's trajectories
# and prompt embeddings (0.6 GiB at flow_grpo's 144 samples a chip) and ~1 GiB for the runtime and fragmentation
SD3_STATE_GIB = 2.0


def _sd3_resident_gib(model, fsdp: int, dtype: str) -> float:
    b = SD35_MEDIUM_BILLIONS
    size = 2 if dtype == "bfloat16" else 4
    frozen = b["transformer"] / fsdp + b["pos_embed"] + b["clips"] + (b["t5"] if model.text_encoder_3 else 0.0)
    return (frozen * size + b["vae"] * 4) * 1e9 / GIB + SD3_STATE_GIB


def _sd3_full_finetune_gib(fsdp: int) -> float:
    # the transformer's weights x (weight, gradient, 2 AdamW moments) x 4 bytes split by fsdp, the rest whole
    b = SD35_MEDIUM_BILLIONS
    whole = (b["pos_embed"] + b["clips"] + b["vae"]) * 4 * 1e9 / GIB + SD3_STATE_GIB
    return b["transformer"] * 16 * 1e9 / GIB / fsdp + whole


SD3 = FAMILIES.register(FamilySpec(
    name="sd3", title="Stable Diffusion 3 / 3.5 (MMDiT, flow matching)", module="ddpo_tpu.families.sd3:SD3Family",
    sampler="flow_sde", denoiser="transformer",
    subfolders=("transformer", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler"),
    example_hub_id="stabilityai/stable-diffusion-3.5-medium",
    builders=("tiny_sd3",),
    lora_layers=("attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k",
                 "attn.to_out.0", "attn.to_q", "attn.to_v", "attn2.to_k", "attn2.to_out.0", "attn2.to_q",
                 "attn2.to_v", "context_embedder", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                 "ff_context.net.2", "norm1.linear", "norm1_context.linear", "norm_out.linear", "pos_embed.proj",
                 "proj_out", "time_text_embed.text_embedder.linear_1", "time_text_embed.text_embedder.linear_2",
                 "time_text_embed.timestep_embedder.linear_1", "time_text_embed.timestep_embedder.linear_2"),
    lora_example="attn.add_q_proj",
    own_keys={"text_encoder_3": False},
    resolution_multiple=16,  # VAE factor 8 x the transformer's 2x2 patches
    memory=FamilyMemory(
        activation_gib_per_eval_512={k: v + SD3_ATTENTION_SCORES_GIB_512 for k, v in SD3_EAGER_GIB.items()},
        checkpointed_gib_per_eval_512={k: round(v * SD3_CKPT_EAGER_RATIO
                                                + CKPT_XLA_SCORES_RATIO * SD3_ATTENTION_SCORES_GIB_512, 2)
                                       for k, v in SD3_EAGER_GIB.items()},
        resident_gib=_sd3_resident_gib,
        full_finetune_gib=_sd3_full_finetune_gib,
        fsdp_splits_frozen_weights=True,
        # 1024 image + 77 CLIP + 128 T5 tokens; SD 3.5 Medium's transformer sample_size 128 x the VAE's 8 = 1024 px
        tokens_512=(1024, 205), scores_gib_512=SD3_ATTENTION_SCORES_GIB_512,
        checkpointed_scores_gib_512=CKPT_XLA_SCORES_RATIO * SD3_ATTENTION_SCORES_GIB_512, native_pixels=1024,
    ),
))

# --- FLUX.1 ----------------------------------------------------------------------------------------------------------
# FLUX.1-dev's parts in billions of values (diffusers' FluxTransformer2DModel and AutoencoderKL, transformers'
# CLIPTextModel and T5EncoderModel built with the checkpoint's configs on the meta device): the transformer (19
# double-stream blocks of 0.340 and 38 single-stream blocks of 0.142), CLIP-L, T5-XXL's encoder, the VAE (float32).
# The transformer has no positional table (RoPE from the ids).
# Measured by: python scripts/bench.py --flux-activations (tests/unit/models/test_flux_model.py counts them again)
FLUX1_DEV_BILLIONS = {"transformer": 11.901, "clip": 0.123, "t5": 4.762, "vae": 0.084}
# flow_grpo's LoRA (rank 64 on the attention and feed-forward layers, model=flux1_dev): 179.3M values x (weight,
# gradient, 2 AdamW moments, EMA) in float32 = 3.3 GiB; an epoch's trajectories and prompt embeddings (36 samples a
# chip as flow_grpo: 7 packed latents of 1024 x 64 and 128 x 4096 T5 features each) ~0.1 GiB; ~1 GiB for the runtime
# and fragmentation. Whole on every chip (the estimate does not split the trained state over fsdp).
FLUX_STATE_GIB = 0.1793 * 20 * 1e9 / GIB + 0.1 + 1.0
# One FLUX.1-dev transformer evaluation at 512 px: 1024 image tokens + 128 T5 tokens (flow_grpo's
# max_sequence_length), LoRA as model=flux1_dev. (1) FLUX_EAGER_GIB, float32: the bytes autograd saves in a forward +
# backward of the transformer at full width (3072, 24 heads of 128) with random weights on eager CPU, 1-2 double and
# 1-2 single blocks deep, batch 1: 0.400 GiB with one block of each kind and the embedders, 0.239 per further double
# block, 0.159 per further single block (the first block keeps less: its input needs no gradient), extrapolated to
# 19 + 38 blocks: 10.61 GiB (peak RSS: 10.79). Per sample: SD 3.5's probe found the batch-0 intercept under 2%.
# Measured by: python scripts/bench.py --flux-activations (benchmarks/RESULTS.md 2026-11-25 02:02)
# bf16: float32's x 0.74, the ratio SD 3.5's probe measured (an estimate: bf16 matmuls are too slow to probe here).
# (2) XLA's softmaxes, as for SD 1.x and SD 3: 24 heads x S^2 x 4 bytes over the 57 joint attentions (S = 1152).
# Activation checkpointing: the eager part x SD 3.5's measured 0.26 (the same kind of transformer block; not probed
# for FLUX), the scores as SD 1.x's. An estimate for the HBM rule, not a TPU figure.
FLUX_ATTENTION_SCORES_GIB_512 = 57 * 24 * 1152 ** 2 * 4 / GIB  # 6.76 (the probe's attention_scores_gib())
FLUX_EAGER_F32_GIB = 10.61  # the probe's saved-bytes "57_blocks_eager"
FLUX_EAGER_GIB = {"no": FLUX_EAGER_F32_GIB, "bf16": round(FLUX_EAGER_F32_GIB * 0.74, 2)}


FLUX = FAMILIES.register(FamilySpec(
    name="flux", title="FLUX.1 (MMDiT, flow matching, guidance-distilled)", module="ddpo_tpu.families.flux:FluxFamily",
    sampler="flow_sde", denoiser="transformer",
    subfolders=("transformer", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler"),
    example_hub_id="black-forest-labs/FLUX.1-dev",
    builders=("tiny_flux",),
    lora_layers=("attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k",
                 "attn.to_out.0", "attn.to_q", "attn.to_v", "context_embedder", "ff.net.0.proj", "ff.net.2",
                 "ff_context.net.0.proj", "ff_context.net.2", "norm.linear", "norm1.linear", "norm1_context.linear",
                 "norm_out.linear", "proj_mlp", "proj_out", "time_text_embed.guidance_embedder.linear_1",
                 "time_text_embed.guidance_embedder.linear_2", "time_text_embed.text_embedder.linear_1",
                 "time_text_embed.text_embedder.linear_2", "time_text_embed.timestep_embedder.linear_1",
                 "time_text_embed.timestep_embedder.linear_2", "x_embedder"),
    lora_example="attn.to_q",
    resolution_multiple=16,  # VAE factor 8 x the 2x2 packing of the latents
    guidance="embedded",     # FLUX.1-dev is guidance-distilled: sample.guidance_scale is the guidance embedding's input
    memory=_split_transformer_memory(FLUX1_DEV_BILLIONS, ("clip", "t5"), FLUX_STATE_GIB, FLUX_EAGER_GIB,
                                     FLUX_ATTENTION_SCORES_GIB_512),
))

# --- Wan 2.1 text-to-video -------------------------------------------------------------------------------------------
# Video latents (16 channels x (F - 1) / 4 + 1 frames x H / 8 x W / 8), flow_grpo's Wan SDE (sampler wan_sde). The
# LoRA layers: WanTransformer3DModel's module paths (Wan 2.1 T2V 1.3B's and 14B's configs and the tiny build, on the
# meta device: tests/unit/models/test_wan_model.py). Memory: computed from the transformer's config and the video's
# tokens (model.num_frames x the frame's patches), catalog/wan_memory.py says how each figure was measured or derived.
WAN = FAMILIES.register(FamilySpec(
    name="wan", title="Wan 2.1 / 2.2 text-to-video (WanTransformer3DModel, flow matching; A14B's two experts)",
    module="ddpo_tpu.families.wan:WanFamily",
    sampler="wan_sde", denoiser="transformer",
    subfolders=("transformer", "vae", "text_encoder", "tokenizer", "scheduler"),
    example_hub_id="Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
    builders=("tiny_wan", "tiny_wan22", "tiny_wan22_ti2v"),
    lora_layers=("attn1.to_k", "attn1.to_out.0", "attn1.to_q", "attn1.to_v", "attn2.to_k", "attn2.to_out.0",
                 "attn2.to_q", "attn2.to_v", "condition_embedder.text_embedder.linear_1",
                 "condition_embedder.text_embedder.linear_2", "condition_embedder.time_embedder.linear_1",
                 "condition_embedder.time_embedder.linear_2", "condition_embedder.time_proj", "ffn.net.0.proj",
                 "ffn.net.2", "patch_embedding", "proj_out"),
    lora_example="attn1.to_q",
    own_keys={"num_frames": None, "train_experts": None},
    resolution_multiple=16,  # WanPipeline.check_inputs: height and width divisible by 16 (VAE 8 x 2x2 patches)
    output="videos",
    # AutoencoderKLWan's 4x temporal compression keeps the first frame apart: F = 4k + 1 frames, (F - 1) / 4 + 1
    # latent frames (diffusers 0.42.1 pipelines/wan/pipeline_wan.py:494-498: WanPipeline.__call__ warns on any other
    # count and samples F // 4 * 4 + 1 instead; :341 the latent frames)
    frame_step=4,
    memory=wan_memory.figures,
))

# --- Qwen-Image ------------------------------------------------------------------------------------------------------
# Packed 2x2 latents as FLUX's, Qwen2.5-VL's masked prompt states, true CFG with the norm rescaling, Flow-GRPO's SDE
# step (sampler flow_sde: flow_grpo's Qwen-Image code calls its SD 3 step). The LoRA layers: the module paths of
# QwenImageTransformer2DModel (Qwen-Image's config and the tiny build on the meta device: test_qwen_image_model.py).
# Qwen/Qwen-Image's parts in billions of values (diffusers' QwenImageTransformer2DModel and AutoencoderKLQwenImage,
# transformers' Qwen2_5_VLForConditionalGeneration built with the checkpoint's configs on the meta device): the
# transformer (60 double-stream blocks of 0.340), Qwen2.5-VL 7B whole (its vision tower 0.677 and LM head 0.545
# included: flow_grpo loads the class whole), the VAE (float32). No positional table (RoPE from the shapes).
# Measured by: python scripts/bench.py --qwen-image-activations (benchmarks/RESULTS.md 2026-11-26 09:27)
QWEN_IMAGE_BILLIONS = {"transformer": 20.430, "text_encoder": 8.292, "vae": 0.127}
# flow_grpo's LoRA (rank 64 on its 12 attention and feed-forward targets, model=qwen_image): 424.7M values x (weight,
# gradient, 2 AdamW moments, EMA) in float32 = 7.9 GiB; an epoch's trajectories and prompt states (64 samples a chip as
# flow_grpo's 8-GPU config: 3 packed latents of 1024 x 64 in its 2-step window, 128 x 3584 prompt states) ~0.1 GiB;
# ~1 GiB for the runtime and fragmentation. Whole on every chip, as FLUX's.
QWEN_IMAGE_STATE_GIB = 0.4247 * 20 * 1e9 / GIB + 0.1 + 1.0
# One Qwen-Image transformer evaluation at 512 px: 1024 image tokens + 128 prompt tokens (the family's TEXT_TOKENS),
# LoRA as model=qwen_image. (1) float32: the bytes autograd saves in a forward + backward at full width (3072, 24 heads
# of 128) with random weights on eager CPU, 1 and 2 blocks deep, batch 1: 0.240 GiB with one block and the embedders,
# 0.239 per further block (FLUX.1's double block measured the same), extrapolated to 60 blocks: 14.37 GiB (peak RSS:
# 14.49). bf16: float32's x 0.74 (SD 3.5's measured ratio). (2) XLA's softmaxes: 24 heads x S^2 x 4 bytes over the 60
# joint attentions (S = 1152). Activation checkpointing: the eager part x SD 3.5's measured 0.26 (the same kind of
# block; not probed here), the scores as SD 1.x's. An estimate for the HBM rule, not a TPU figure.
QWEN_IMAGE_ATTENTION_SCORES_GIB_512 = 60 * 24 * 1152 ** 2 * 4 / GIB  # 7.12 (the probe's attention_scores_gib())
QWEN_IMAGE_EAGER_F32_GIB = 14.37  # the probe's saved-bytes "60_blocks_eager"
QWEN_IMAGE_EAGER_GIB = {"no": QWEN_IMAGE_EAGER_F32_GIB, "bf16": round(QWEN_IMAGE_EAGER_F32_GIB * 0.74, 2)}


QWEN_IMAGE = FAMILIES.register(FamilySpec(
    name="qwen_image", title="Qwen-Image (MMDiT, Qwen2.5-VL prompts, flow matching)",
    module="ddpo_tpu.families.qwen_image:QwenImageFamily",
    sampler="flow_sde", denoiser="transformer",
    subfolders=("transformer", "vae", "text_encoder", "tokenizer", "scheduler"),
    example_hub_id="Qwen/Qwen-Image",
    builders=("tiny_qwen_image",),
    lora_layers=("attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k",
                 "attn.to_out.0", "attn.to_q", "attn.to_v", "img_in", "img_mlp.net.0.proj", "img_mlp.net.2",
                 "img_mod.1", "norm_out.linear", "proj_out", "time_text_embed.timestep_embedder.linear_1",
                 "time_text_embed.timestep_embedder.linear_2", "txt_in", "txt_mlp.net.0.proj", "txt_mlp.net.2",
                 "txt_mod.1"),
    lora_example="attn.to_q",
    resolution_multiple=16,  # QwenImagePipeline.check_inputs: height and width divisible by vae_scale_factor x 2
    memory=_split_transformer_memory(QWEN_IMAGE_BILLIONS, ("text_encoder",), QWEN_IMAGE_STATE_GIB,
                                     QWEN_IMAGE_EAGER_GIB, QWEN_IMAGE_ATTENTION_SCORES_GIB_512),
))

# --- Z-Image ---------------------------------------------------------------------------------------------------------
# Z-Image-Turbo and Z-Image base (one architecture): a single-stream DiT on FLUX.1's 16-channel latents, a Qwen3-4B
# text encoder's second-to-last states of the real prompt tokens, Flow-GRPO's SDE step (Flow-Factory's "Flow-SDE",
# src/flow_factory/scheduler/flow_match_euler_discrete.py:342-371 at a0b2bc5a). The LoRA layers: the Linear module
# paths of ZImageTransformer2DModel (inside its layers / noise_refiner / context_refiner blocks, and the top-level
# ones; tests/unit/models/test_z_image_model.py builds both the tiny and the published config on the meta
# device).
# Parts in billions of values (diffusers' ZImageTransformer2DModel at its default config, which is the published one:
# dim 3840, 30 layers + 2 noise and 2 context refiner layers, 30 heads, cap_feat_dim 2560; transformers' Qwen3Model
# at Qwen3-4B's config, no LM head, as ZImagePipeline holds it; FLUX.1's AutoencoderKL), on the meta device:
# tests/unit/models/test_z_image_model.py asserts them (test_lora_layer_table_and_parameter_counts_...).
Z_IMAGE_BILLIONS = {"transformer": 6.155, "text_encoder": 4.022, "vae": 0.084}
# Flow-Factory's LoRA (rank 64 on its 7 default targets, examples/grpo/lora/z_image*/default.yaml): 158.8M values x
# (weight, gradient, 2 AdamW moments, EMA) in float32 = 2.96 GiB; an epoch's trajectories and prompt states ~0.1 GiB;
# ~1 GiB for the runtime and fragmentation. Whole on every chip, as FLUX's.
Z_IMAGE_STATE_GIB = 0.1588 * 20 * 1e9 / GIB + 0.1 + 1.0
# One Z-Image transformer evaluation at 512 px: 1024 image tokens + up to 128 prompt tokens. NOT probed: (1) the eager
# float32 saved bytes are Qwen-Image's measured 0.239 GiB per block (width 3072, 1152 tokens) scaled by width (3840 /
# 3072) over the 30 joint blocks, plus the 2 noise refiner blocks at 1024 tokens: 30 x 0.299 + 2 x 0.265 = 9.5 GiB;
# bf16 x 0.74 (SD 3.5's measured ratio). (2) XLA's softmaxes: 30 heads x S^2 x 4 bytes over the 30 joint blocks at
# S = 1152 and the 2 noise refiners at 1024. Checkpointing as the other transformer families. An estimate for the HBM
# rule, not a TPU figure; `scripts/bench.py` has no Z-Image probe yet.
Z_IMAGE_ATTENTION_SCORES_GIB_512 = (30 * 30 * 1152 ** 2 + 2 * 30 * 1024 ** 2) * 4 / GIB  # 4.68
Z_IMAGE_EAGER_F32_GIB = 9.5
Z_IMAGE_EAGER_GIB = {"no": Z_IMAGE_EAGER_F32_GIB, "bf16": round(Z_IMAGE_EAGER_F32_GIB * 0.74, 2)}

Z_IMAGE = FAMILIES.register(FamilySpec(
    name="z_image", title="Z-Image (single-stream DiT, Qwen3 prompts, flow matching; Turbo and base)",
    module="ddpo_tpu.families.z_image:ZImageFamily",
    sampler="flow_sde", denoiser="transformer",
    subfolders=("transformer", "vae", "text_encoder", "tokenizer", "scheduler"),
    example_hub_id="Tongyi-MAI/Z-Image-Turbo",
    builders=("tiny_z_image",),
    lora_layers=("adaLN_modulation.0", "all_final_layer.2-1.adaLN_modulation.1", "all_final_layer.2-1.linear",
                 "all_x_embedder.2-1", "attention.to_k", "attention.to_out.0", "attention.to_q", "attention.to_v",
                 "cap_embedder.1", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3", "t_embedder.mlp.0",
                 "t_embedder.mlp.2"),
    lora_example="attention.to_q",
    resolution_multiple=16,  # ZImagePipeline.__call__: height and width divisible by vae_scale_factor x 2
    memory=_split_transformer_memory(Z_IMAGE_BILLIONS, ("text_encoder",), Z_IMAGE_STATE_GIB, Z_IMAGE_EAGER_GIB,
                                     Z_IMAGE_ATTENTION_SCORES_GIB_512),
    # fixed shapes: on a runtime that compiles graphs every caption row is held at the encoder's 512 tokens and its
    # own 32-token bucket is data (models/z_image.py::z_forward_fixed, equal to diffusers' list forward)
))

# --- FLUX.2-klein ----------------------------------------------------------------------------------------------------
# Packed 2x2 latents normalised by the VAE's batch-norm statistics, Qwen3's hidden states 9/18/27 of the chat-templated
# prompt (512 tokens), true CFG on the negative prompt "" (the base checkpoints; the step-distilled ones ignore the
# scale), Flow-GRPO's SDE step (Flow-Factory@a0b2bc5's "Flow-SDE", the same step as SD 3's: sampler flow_sde). The LoRA
# layers: Flux2Transformer2DModel's module paths (klein 4B's config on the meta device; the tiny build has the same
# block kinds). FLUX.2-klein's parts in billions of values (diffusers' Flux2Transformer2DModel and AutoencoderKLFlux2,
# transformers' Qwen3ForCausalLM built with the published configs on the meta device: 4B 5 double + 20 single blocks,
# 24 heads of 128, joint_attention_dim 7680; 9B 8 + 24 blocks, 32 heads, 12288; the text encoders Qwen3-4B (its LM
# head tied to the embedding, counted once) and Qwen3-8B loaded whole as the pipeline holds them; the VAE float32).
# No positional table (RoPE from the ids). Counted by the meta-device build in tests/unit/models/test_flux2_model.py.
FLUX2_KLEIN_BILLIONS = {
    "4b": {"transformer": 3.876, "text_encoder": 4.022, "vae": 0.084},
    "9b": {"transformer": 9.079, "text_encoder": 8.191, "vae": 0.084},
}
# Flow-Factory's LoRA (rank 64 on its 13 default targets, examples/grpo/lora/flux2_klein*/default.yaml): 76.7M values
# (4B) / 142.6M (9B) x (weight, gradient, 2 AdamW moments, EMA) in float32; an epoch's trajectories and prompt states
# (512 x 7680 or 12288 bf16 values a prompt, twice with CFG) ~0.3 GiB; ~1 GiB for the runtime and fragmentation.
FLUX2_LORA_MILLIONS = {"4b": 76.68, "9b": 142.61}
FLUX2_STATE_GIB = {k: v * 1e6 * 20 / GIB + 0.3 + 1.0 for k, v in FLUX2_LORA_MILLIONS.items()}
# One transformer evaluation at 512 px: 1024 image + 512 text tokens (the pipeline pads every prompt to 512). Not
# probed at full width: FLUX.1's measured saved bytes per block (float32, 3072 wide, 1152 tokens: 0.400 GiB for the
# first block of each kind with the embedders, 0.239 per further double block, 0.159 per further single block) scaled
# linearly to 1536 tokens and (9B) to 4096 wide: 4B (0.400 + 4 x 0.239 + 19 x 0.159) x 1536 / 1152 = 5.84 GiB; 9B
# (0.400 + 7 x 0.239 + 23 x 0.159) x 1536 / 1152 x 4096 / 3072 = 10.19 GiB. bf16: x 0.74 (SD 3.5's measured ratio).
# XLA's softmaxes: heads x S^2 x 4 bytes over every block (S = 1536). Checkpointing: SD 3.5's ratio, as FLUX.1's.
FLUX2_EAGER_F32_GIB = {"4b": 5.84, "9b": 10.19}
FLUX2_ATTENTION_SCORES_GIB_512 = {"4b": 25 * 24 * 1536 ** 2 * 4 / GIB, "9b": 32 * 32 * 1536 ** 2 * 4 / GIB}


def _flux2_figures(size: str) -> FamilyMemory:
    from dataclasses import replace

    eager = {"no": FLUX2_EAGER_F32_GIB[size], "bf16": round(FLUX2_EAGER_F32_GIB[size] * 0.74, 2)}
    figures = _split_transformer_memory(FLUX2_KLEIN_BILLIONS[size], ("text_encoder",), FLUX2_STATE_GIB[size], eager,
                                        FLUX2_ATTENTION_SCORES_GIB_512[size])
    return replace(figures, tokens_512=(1024, 512))  # 512 text tokens, not FLUX.1's 128


FLUX2_MEMORY = {size: _flux2_figures(size) for size in FLUX2_KLEIN_BILLIONS}


def flux2_size(model) -> str:
    """Which klein a model config is: "9b" when its checkpoint id or name says 9B, else "4b"."""
    text = f"{getattr(model, 'pretrained', '') or ''} {getattr(model, 'name', '') or ''}".lower()
    return "9b" if "9b" in text else "4b"


def _flux2_memory(model) -> FamilyMemory:
    """The figures of the model's klein at the size it samples (a function of the model config, so the memory rule
    takes them as they are: scaled here from 512 px to model.resolution, or to the checkpoint's own 1024 px when it
    is null, as config/memory.py scales a table's)."""
    mem = FLUX2_MEMORY[flux2_size(model)]
    pixels = getattr(model, "resolution", None) or (mem.native_pixels if getattr(model, "builder", None) is None
                                                    else None)
    return mem if pixels in (None, 512) else mem.at_pixels(pixels)


FLUX2 = FAMILIES.register(FamilySpec(
    name="flux2", title="FLUX.2-klein (MMDiT, Qwen3 prompts, flow matching)",
    module="ddpo_tpu.families.flux2:Flux2Family",
    sampler="flow_sde", denoiser="transformer",
    subfolders=("transformer", "vae", "text_encoder", "tokenizer", "scheduler"),
    example_hub_id="black-forest-labs/FLUX.2-klein-base-4B",
    builders=("tiny_flux2",),
    lora_layers=("attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k",
                 "attn.to_out", "attn.to_out.0", "attn.to_q", "attn.to_qkv_mlp_proj", "attn.to_v", "context_embedder",
                 "double_stream_modulation_img.linear", "double_stream_modulation_txt.linear", "ff.linear_in",
                 "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out", "norm_out.linear", "proj_out",
                 "single_stream_modulation.linear", "time_guidance_embed.timestep_embedder.linear_1",
                 "time_guidance_embed.timestep_embedder.linear_2", "x_embedder"),
    lora_example="attn.to_q",
    resolution_multiple=16,  # Flux2KleinPipeline: height and width multiples of vae_scale_factor x 2
    memory=_flux2_memory,
))

# --- Qwen-Image-Edit-2509 ("edit plus") ------------------------------------------------------------------------------
# Qwen-Image's transformer, VAE and text encoder (the same parts and sizes: Qwen/Qwen-Image-Edit-2509's configs are
# Qwen-Image's), conditioned on each prompt's input images: their VAE latents appended to the generated tokens and
# their patches in the prompt's Qwen2.5-VL states (families/qwen_image_edit.py). LoRA as flow_grpo's edit script
# (rank 64 on the same 12 targets): the same state as Qwen-Image's. One transformer evaluation at 512 px with
# flow_grpo's two 512 x 512 pictures: 1024 generated + 2 x 1024 picture tokens and 512 prompt tokens (the family's
# fixed text length, pictures' 2 x 196 included). NOT probed: Qwen-Image's measured eager float32 bytes (14.37 GiB at
# 1152 tokens) scaled linearly to 3584 tokens, 44.7 GiB; bf16 x 0.74; XLA's softmaxes 60 x 24 heads x 3584^2 x 4 bytes.
QWEN_IMAGE_EDIT_TOKENS = 1024 + 2 * 1024 + 512
QWEN_IMAGE_EDIT_EAGER_F32_GIB = round(QWEN_IMAGE_EAGER_F32_GIB * QWEN_IMAGE_EDIT_TOKENS / 1152, 2)
QWEN_IMAGE_EDIT_ATTENTION_SCORES_GIB_512 = 60 * 24 * QWEN_IMAGE_EDIT_TOKENS ** 2 * 4 / GIB


def _qwen_image_edit_memory() -> FamilyMemory:
    from dataclasses import replace

    eager = {"no": QWEN_IMAGE_EDIT_EAGER_F32_GIB, "bf16": round(QWEN_IMAGE_EDIT_EAGER_F32_GIB * 0.74, 2)}
    figures = _split_transformer_memory(QWEN_IMAGE_BILLIONS, ("text_encoder",), QWEN_IMAGE_STATE_GIB, eager,
                                        QWEN_IMAGE_EDIT_ATTENTION_SCORES_GIB_512)
    return replace(figures, tokens_512=(3 * 1024, 512))


QWEN_IMAGE_EDIT = FAMILIES.register(FamilySpec(
    name="qwen_image_edit", title="Qwen-Image-Edit-2509 (Qwen-Image conditioned on input images; edit datasets)",
    module="ddpo_tpu.families.qwen_image_edit:QwenImageEditFamily",
    sampler="flow_sde", denoiser="transformer",
    subfolders=("transformer", "vae", "text_encoder", "tokenizer", "scheduler", "processor"),
    example_hub_id="Qwen/Qwen-Image-Edit-2509",
    builders=("tiny_qwen_image_edit",),
    lora_layers=QWEN_IMAGE.lora_layers,
    lora_example="attn.to_q",
    resolution_multiple=16,  # QwenImageEditPlusPipeline: height and width multiples of vae_scale_factor x 2
    memory=_qwen_image_edit_memory(),
    # fixed shapes: on a runtime that compiles graphs the prompts with their pictures reach the VL encoder as one
    # batch padded to the family's text length (models/qwen_image_edit.py::encode_edit_prompts); before that, epoch 1
    # of the smoke on XLA CPU compiled 6 new sampling graphs (2026-11-29). Measured since: docs/families.md
))
