"""What is trained: LoRA adapters on the UNet attention (peft, as diffusers intends) or the whole UNet."""

from __future__ import annotations

import torch

from ddpo_tpu.config.schema import ModelConfig


def make_trainable(unet, cfg: ModelConfig) -> list[torch.nn.Parameter]:
    """Add adapters (or unfreeze the UNet) and return the trainable parameters, kept in float32."""
    if cfg.lora.enabled:
        from peft import LoraConfig

        unet.add_adapter(LoraConfig(r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, init_lora_weights="gaussian",
                                    target_modules=list(cfg.lora.target_modules)))
    else:
        unet.requires_grad_(True)
    params = [p for p in unet.parameters() if p.requires_grad]
    if not params:
        raise RuntimeError(f"model.lora.target_modules={list(cfg.lora.target_modules)} matched no UNet module")
    for p in params:
        p.data = p.data.float()
    return params  # host parameters: after moving the UNet to a device, collect them again


def trainable_state_dict(unet, cfg: ModelConfig, to_host: bool = True) -> dict[str, torch.Tensor]:
    """The trained weights: LoRA adapter weights (peft naming) or the full UNet state dict."""
    if cfg.lora.enabled:
        from peft.utils import get_peft_model_state_dict

        state = get_peft_model_state_dict(unet)
    else:
        state = unet.state_dict()
    if not to_host:
        return {k: v.detach() for k, v in state.items()}
    return {k: v.detach().to("cpu").contiguous() for k, v in state.items()}


def load_trainable_state_dict(unet, cfg: ModelConfig, state: dict[str, torch.Tensor]) -> None:
    if cfg.lora.enabled:
        from peft.utils import set_peft_model_state_dict

        result = set_peft_model_state_dict(unet, state)
        unexpected = getattr(result, "unexpected_keys", None)
        if unexpected:
            raise RuntimeError(f"checkpoint has LoRA weights this model does not: {unexpected[:3]}")
    else:
        unet.load_state_dict(state)
