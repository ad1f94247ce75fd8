"""What one FLUX.1-dev transformer evaluation keeps for the backward at 512 px, probed on eager CPU (the figures in
ddpo_tpu/catalog/families.py's FLUX entry).

FLUX.1-dev's transformer (black-forest-labs/FLUX.1-dev transformer/config.json) at full width (3072 = 24 heads of 128)
with random weights, 1-2 double-stream and 1-2 single-stream blocks, LoRA as model=flux1_dev (flow_grpo's rank 64 and
targets), batch 1, 1024 image tokens (512 px: 64x64 latents in 2x2 patches) + 128 T5 tokens (flow_grpo's
max_sequence_length). Counted: the bytes of the distinct storages autograd saves during the forward
(saved_tensors_hooks; weights excluded) -- what the backward of that forward needs. A middle double block = (2, 1) -
(1, 1), a middle single block = (1, 2) - (1, 1) (the first block keeps less: its input needs no gradient), the whole
model = (1, 1) + 18 double + 37 single. float32 only (bf16 matmuls are ~20x slower on this CPU).

    PYTHONPATH=. python scripts/flux_activations.py        # about 5 minutes on one core, ~4 GiB
"""

from __future__ import annotations

import json
import time

FLUX1_DEV_TRANSFORMER = dict(patch_size=1, in_channels=64, attention_head_dim=128, num_attention_heads=24,
                             joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                             axes_dims_rope=(16, 56, 56))
IMAGE_TOKENS, TEXT_TOKENS = 1024, 128
PROBES = [(1, 1), (2, 1), (1, 2)]


def saved_gib(double: int, single: int) -> float:
    import torch
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig

    from ddpo_tpu.catalog import family

    torch.manual_seed(0)
    with torch.device("meta"):
        model = FluxTransformer2DModel(**FLUX1_DEV_TRANSFORMER, num_layers=double, num_single_layers=single)
    model = model.to_empty(device="cpu").eval().requires_grad_(False)
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.normal_(0.0, 0.02)
    targets = ["attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
               "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
               "ff_context.net.2"]
    assert all(t in family("flux").lora_layers for t in targets)
    model.add_adapter(LoraConfig(r=64, lora_alpha=128, init_lora_weights="gaussian", target_modules=targets))
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in weights:
            saved[st.data_ptr()] = st.nbytes()
        return t

    g = torch.Generator().manual_seed(0)
    img_ids = torch.zeros(32, 32, 3)
    img_ids[..., 1] += torch.arange(32)[:, None]
    img_ids[..., 2] += torch.arange(32)[None, :]
    inputs = dict(hidden_states=torch.randn(1, IMAGE_TOKENS, 64, generator=g),
                  encoder_hidden_states=torch.randn(1, TEXT_TOKENS, 4096, generator=g),
                  pooled_projections=torch.randn(1, 768, generator=g), timestep=torch.tensor([0.5]),
                  guidance=torch.tensor([3.5]), img_ids=img_ids.reshape(-1, 3), txt_ids=torch.zeros(TEXT_TOKENS, 3))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(**inputs, return_dict=False)[0]
    assert out.requires_grad
    return sum(saved.values()) / 2 ** 30


def main() -> None:
    import torch

    torch.set_num_threads(1)
    rows = {}
    for double, single in PROBES:
        t0 = time.perf_counter()
        rows[(double, single)] = saved_gib(double, single)
        print(json.dumps({"double": double, "single": single, "saved_gib": round(rows[(double, single)], 4),
                          "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    d = rows[(2, 1)] - rows[(1, 1)]
    s = rows[(1, 2)] - rows[(1, 1)]
    total = rows[(1, 1)] + 18 * d + 37 * s
    print(json.dumps({"per_double_gib": round(d, 4), "per_single_gib": round(s, 4),
                      "first_blocks_and_embedders_gib": round(rows[(1, 1)], 4),
                      "flux1_dev_57_blocks_gib": round(total, 3)}))


if __name__ == "__main__":
    main()
