"""Which `model.lora.target_modules` a model family has, checked before a run dir exists (no torch, no model).

peft matches a target name against the denoiser's module paths by suffix ("to_q" matches
"down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q") and adds an adapter to each Linear/Conv layer found; a
list with some unknown names trains fewer modules without a word, and one with none known fails only after the model
has loaded, with the run dir written. The denoiser's module paths are fixed by its family's architecture (diffusers'
UNet2DConditionModel for `sd1`, SD3Transformer2DModel for `sd3`); widths and block counts change only the indices in
them. So the check is a table, not a model: per family, the paths of the adaptable layers inside one block (its
catalog spec's `lora_layers`, below the numbered block containers `CONTAINERS`). A target is known when it is one of
those paths or a dotted suffix of one (not starting at an index: "to_out.0", not "0"), optionally under block containers
("down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q").

tests/unit/config/test_bad_input.py checks the table against every builder's model on the meta device (tiny,
sd14_topology, sd14_random; tiny_sd3 and SD 3.5 Medium's config), so a diffusers upgrade that renames a layer fails
there first.
"""

from __future__ import annotations

from ddpo_tpu.catalog import FAMILIES, family

# the numbered containers of blocks (and the unnumbered mid block) the paths of a family's lora_layers sit under
CONTAINERS = frozenset({"down_blocks", "up_blocks", "mid_block", "attentions", "resnets", "transformer_blocks",
                        "single_transformer_blocks", "downsamplers", "upsamplers",
                        "blocks"})  # Wan's WanTransformer3DModel: blocks.N.attn1.to_q


def _suffixes(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[i:]) for i in range(len(parts)) if not parts[i].isdigit()]


def known_names(family_name: str) -> set[str]:
    """Every target name that matches a layer of the family's denoiser, without block containers."""
    return {s for path in family(family_name).lora_layers for s in _suffixes(path)}


def short_names(family_name: str) -> list[str]:
    """The shortest name of each layer (what the error offers): "to_q", "to_out.0", "proj", "linear_1", ..."""
    return sorted({_suffixes(path)[-1] for path in family(family_name).lora_layers})


def is_known(name: str, family_name: str) -> bool:
    names = known_names(family_name)
    if name in names:
        return True
    parts = name.split(".")
    for i in range(1, len(parts)):  # under block containers: down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q
        head, tail = parts[:i], ".".join(parts[i:])
        if tail in names and all(p.isdigit() or p in CONTAINERS for p in head):
            return True
    return False


def problems(model) -> list[str]:
    """One line naming model.lora.target_modules, the unknown names and the valid ones; [] when all are known (or
    LoRA is off, or the family has no table)."""
    lora = model.lora
    if not lora.enabled or model.family not in FAMILIES or not family(model.family).lora_layers:
        return []
    unknown = [t for t in lora.target_modules if not is_known(t, model.family)]
    if not unknown:
        return []
    return [f"model.lora.target_modules={list(lora.target_modules)}: {', '.join(unknown)} "
            f"{'is not a layer' if len(unknown) == 1 else 'are not layers'} of the {model.family} family's "
            f"denoiser (valid: {', '.join(short_names(model.family))}; or a dotted path ending in one, e.g. "
            f"{family(model.family).lora_example})"]
