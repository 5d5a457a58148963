"""Transformer model (Llama / Qwen2 / GPT-2 / GPT-NeoX), scalar head, presets, Hugging Face import."""

from rloo_jax.models.transformer import (
    DecodeCache,
    ModelFns,
    PrefixKV,
    Transformer,
    TransformerConfig,
    abstract,
    create,
    from_experiment_config,
    init_cache,
    model_fns,
)

__all__ = [
    'DecodeCache', 'ModelFns', 'PrefixKV', 'Transformer', 'TransformerConfig', 'abstract',
    'create', 'from_experiment_config', 'init_cache', 'model_fns',
]
