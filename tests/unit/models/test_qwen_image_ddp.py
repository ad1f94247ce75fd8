"""Qwen-Image under DDP: the transformer's forward leaves the last block's text-stream weights without a gradient (the
model drops that stream after the last block: diffusers 0.42.1 transformers/transformer_qwenimage.py
``QwenImageTransformer2DModel.forward``, lines 949-983, reads only ``hidden_states`` into ``norm_out`` /
``proj_out``), the loader declares those modules (models/qwen_image.py ``unreached_modules``) and the runtime's DDP
leaves them out (runtime/distributed.py ``wrap_ddp``).

Without that, DDP's reducer waits for gradients that never come: nothing is reduced (each rank steps on its own rows'
gradients, tests/e2e/test_distributed.py ``ddp_qwen_image``, 9.4e-5 of the weights apart) and the next update's
forward raises. Here on one gloo process (the reducer's bookkeeping is the same at any world size): the tiny build
loaded through ``load_qwen_image``, two updates of two micro-steps as training/stepper.py runs them."""

from __future__ import annotations

import pytest
import torch

from ddpo_tpu.models.qwen_image import ensure_tiny_qwen_image, img_shapes, load_qwen_image, qwen_velocity

# flow_grpo's train_qwenimage.py target list, as conf/model/tiny_qwen_image.yaml
TARGETS = ["attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
           "attn.add_v_proj", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
           "txt_mlp.net.2"]


@pytest.fixture(scope="module")
def tiny_path(model_cache):
    return ensure_tiny_qwen_image(model_cache)


def trainable(path, lora: bool):
    from peft import LoraConfig

    t = load_qwen_image(str(path)).transformer
    if lora:
        t.add_adapter(LoraConfig(r=2, lora_alpha=4, init_lora_weights="gaussian", target_modules=TARGETS))
        with torch.no_grad():  # B away from zero, so every A on the graph gets a gradient too
            for n, p in t.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    else:
        t.requires_grad_(True)
    return t


def loss(model, seed: int, guided: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x, embeds = torch.randn(2, 16, 64, generator=g), torch.randn(2, 6, 32, generator=g)
    mask = torch.ones(2, 6, dtype=torch.long)
    neg = (torch.randn(2, 6, 32, generator=g), mask) if guided else (None, None)
    v = qwen_velocity(model, x, torch.tensor([700.0, 300.0]), embeds, mask, img_shapes(2, 4, 4), *neg,
                      guidance_scale=4.0 if guided else 1.0)
    return v.square().mean()


@pytest.mark.parametrize("lora, guided", [(True, False), (True, True), (False, False)],
                         ids=["lora", "lora_guided", "full"])
def test_the_declared_modules_hold_exactly_the_weights_a_step_leaves_without_gradient(tiny_path, lora, guided):
    from ddpo_tpu.runtime.distributed import unreached_parameter_names

    model = trainable(tiny_path, lora)
    assert model.ddp_unreached_modules == ("transformer_blocks.1.attn.to_add_out", "transformer_blocks.1.txt_mlp")
    loss(model, 0, guided).backward()
    without = {n for n, p in model.named_parameters() if p.requires_grad and p.grad is None}
    declared = set(unreached_parameter_names(model))
    assert without and without == {n for n in declared if model.get_parameter(n).requires_grad}
    # LoRA: the A and B of to_add_out, txt_mlp.net.0.proj and txt_mlp.net.2; full: their weights and biases
    assert len(without) == 6 and all(n.startswith("transformer_blocks.1.") for n in without)


@pytest.fixture
def one_process_group(tmp_path):
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def train_two_updates(model) -> None:
    """Two optimizer windows of two micro-steps, the first unsynchronised (training/stepper.py's order)."""
    for update in range(2):
        with model.no_sync():
            loss(model, 2 * update).backward()
        loss(model, 2 * update + 1).backward()
        for p in model.parameters():
            p.grad = None


def test_ddp_of_the_loaded_model_reduces_every_update(tiny_path, one_process_group):
    from ddpo_tpu.runtime.distributed import unreached_parameter_names, wrap_ddp

    model = trainable(tiny_path, lora=True)
    ddp = wrap_ddp(model, torch.device("cpu"))
    train_two_updates(ddp)  # the second update's forward raises if the first one's reduction never finished
    assert set(ddp.parameters_to_ignore) == set(unreached_parameter_names(model)) != set()

    # the same without the declaration: DDP's reducer waits on the unreached weights' bucket, and says so at the next
    # update (what two processes ran into; their first update was each rank's own gradient)
    bare = trainable(tiny_path, lora=True)
    bare.ddp_unreached_modules = ()
    with pytest.raises(RuntimeError, match="Expected to have finished reduction in the prior iteration"):
        train_two_updates(wrap_ddp(bare, torch.device("cpu")))


def test_a_declared_module_the_model_lacks_is_an_error(tiny_path):
    from ddpo_tpu.runtime.distributed import unreached_parameter_names

    model = trainable(tiny_path, lora=True)
    model.ddp_unreached_modules = ("transformer_blocks.7.txt_mlp",)
    with pytest.raises(ValueError, match=r"ddp_unreached_modules names \['transformer_blocks.7.txt_mlp'\]"):
        unreached_parameter_names(model)
