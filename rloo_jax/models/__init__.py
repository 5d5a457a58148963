"""The decoder-only transformer (Llama, Mistral, Qwen2/3, GPT-2, GPT-NeoX, Gemma 2/3), its scalar
head, presets, and Hugging Face import and export."""

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
