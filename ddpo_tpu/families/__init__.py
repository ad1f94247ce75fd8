"""Model families: what a text-to-image model is to the training loop (families/base.py), one module per family.
The loop, the runtime, checkpoints and rewards are written once against ModelFamily; a family is chosen by the
`model` config group and found through its catalog spec (ddpo_tpu/catalog/families.py)."""

from ddpo_tpu.families.base import Cond, ModelFamily, StepScore


def load_family(cfg, rt) -> ModelFamily:
    """The family of `cfg.model`, loaded through from_pretrained, trainable weights added, on rt.device."""
    from ddpo_tpu.catalog import family, load_object

    return load_object(family(cfg.model.family).module).load(cfg, rt)


__all__ = ["Cond", "ModelFamily", "StepScore", "load_family"]
