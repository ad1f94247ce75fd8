"""Which `model.lora.target_modules` a model family has, checked before a run dir exists (no torch, no model).

peft matches a target name against the denoiser's module paths by suffix ("to_q" matches
"down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q") and adds an adapter to each Linear/Conv layer found; a
list with some unknown names trains fewer modules without a word, and one with none known fails only after the model
has loaded, with the run dir written. The denoiser's module paths are fixed by its family's architecture (diffusers'
UNet2DConditionModel for `sd1`, SD3Transformer2DModel for `sd3`); widths and block counts change only the indices in
them. So the check is a table, not a model: per family, the paths of the adaptable layers inside one block
(`LAYERS`, below the numbered block containers `CONTAINERS`). A target is known when it is one of those paths or a
dotted suffix of one (not starting at an index: "to_out.0", not "0"), optionally under block containers
("down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q").

tests/test_bad_input.py checks the table against every builder's model on the meta device (tiny, sd14_topology,
sd14_random; tiny_sd3 and SD 3.5 Medium's config), so a diffusers upgrade that renames a layer fails there first.
"""

from __future__ import annotations

# the numbered containers of blocks (and the unnumbered mid block) the paths of LAYERS sit under
CONTAINERS = frozenset({"down_blocks", "up_blocks", "mid_block", "attentions", "resnets", "transformer_blocks",
                        "downsamplers", "upsamplers"})

# per family: the paths of the Linear/Conv layers within a block (or at the top level), which peft can adapt
LAYERS: dict[str, tuple[str, ...]] = {
    "sd1": ("attn1.to_k", "attn1.to_out.0", "attn1.to_q", "attn1.to_v", "attn2.to_k", "attn2.to_out.0", "attn2.to_q",
            "attn2.to_v", "conv", "conv1", "conv2", "conv_in", "conv_out", "conv_shortcut", "ff.net.0.proj",
            "ff.net.2", "proj_in", "proj_out", "time_emb_proj", "time_embedding.linear_1", "time_embedding.linear_2"),
    "sd3": ("attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k", "attn.to_out.0",
            "attn.to_q", "attn.to_v", "attn2.to_k", "attn2.to_out.0", "attn2.to_q", "attn2.to_v", "context_embedder",
            "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "norm1.linear",
            "norm1_context.linear", "norm_out.linear", "pos_embed.proj", "proj_out",
            "time_text_embed.text_embedder.linear_1", "time_text_embed.text_embedder.linear_2",
            "time_text_embed.timestep_embedder.linear_1", "time_text_embed.timestep_embedder.linear_2"),
}
EXAMPLE = {"sd1": "attn1.to_q", "sd3": "attn.add_q_proj"}


def _suffixes(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[i:]) for i in range(len(parts)) if not parts[i].isdigit()]


def known_names(family: str) -> set[str]:
    """Every target name that matches a layer of the family's denoiser, without block containers."""
    return {s for path in LAYERS[family] for s in _suffixes(path)}


def short_names(family: str) -> list[str]:
    """The shortest name of each layer (what the error offers): "to_q", "to_out.0", "proj", "linear_1", ..."""
    return sorted({_suffixes(path)[-1] for path in LAYERS[family]})


def is_known(name: str, family: str) -> bool:
    names = known_names(family)
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
    if not lora.enabled or model.family not in LAYERS:
        return []
    unknown = [t for t in lora.target_modules if not is_known(t, model.family)]
    if not unknown:
        return []
    return [f"model.lora.target_modules={list(lora.target_modules)}: {', '.join(unknown)} "
            f"{'is not a layer' if len(unknown) == 1 else 'are not layers'} of the {model.family} family's "
            f"denoiser (valid: {', '.join(short_names(model.family))}; or a dotted path ending in one, e.g. "
            f"{EXAMPLE[model.family]})"]
