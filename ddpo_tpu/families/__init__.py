"""Model families: what a text-to-image model is to the training loop (families/base.py), one module per family.
The loop, the runtime, checkpoints and rewards are written once against ModelFamily; a family is chosen by the
`model` config group."""

from ddpo_tpu.families.base import Cond, ModelFamily, StepScore


def load_family(cfg, rt) -> ModelFamily:
    """The family of `cfg.model`, loaded through from_pretrained, trainable weights added, on rt.device."""
    if cfg.model.family == "sd3":
        from ddpo_tpu.families.sd3 import SD3Family

        return SD3Family.load(cfg, rt)
    from ddpo_tpu.families.sd1 import SD1Family

    return SD1Family.load(cfg, rt)


__all__ = ["Cond", "ModelFamily", "StepScore", "load_family"]
