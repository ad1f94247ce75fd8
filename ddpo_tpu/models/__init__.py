"""Model loading (real ``from_pretrained`` path) and the tiny random-weight SD pipeline used by tests/smoke runs."""

from ddpo_tpu.models.loading import Components, ModelLoadError, load_components
from ddpo_tpu.models.tiny import (
    TINY_IMAGE_SIZE,
    TINY_LATENT_SIZE,
    TINY_MODEL_VERSION,
    TOKENIZER_MAX_LENGTH,
    VAE_SCALING_FACTOR,
    build_tiny_pipeline,
    ensure_tiny_model,
)

__all__ = [
    "Components",
    "ModelLoadError",
    "load_components",
    "TINY_MODEL_VERSION",
    "TINY_IMAGE_SIZE",
    "TINY_LATENT_SIZE",
    "TOKENIZER_MAX_LENGTH",
    "VAE_SCALING_FACTOR",
    "build_tiny_pipeline",
    "ensure_tiny_model",
]
