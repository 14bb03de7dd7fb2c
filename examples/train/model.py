"""The model: a small Qwen2-architecture decoder LM built from a transformers
Qwen2Config with random weights (nothing is downloaded). Sizes are presets."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import transformers


@dataclass(frozen=True)
class Size:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int


SIZES: dict[str, Size] = {
    # CPU and CI: 2 layers, GQA 4:2, head_dim 32
    "tiny": Size(layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=384),
    # between tiny and small: 4 layers, GQA 4:2, head_dim 64 (mtrain's tensor-core kernels on
    # the GPU take head_dim 64 or 128; tiny's 32 runs its SIMT path)
    "mini": Size(layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=768),
    # one GPU: 6 layers, GQA 8:2, head_dim 64 (24-26M parameters with a 6K-8K vocabulary)
    "small": Size(layers=6, hidden=512, heads=8, kv_heads=2, head_dim=64, intermediate=1536),
    # one GPU, head_dim 128 (about 40M parameters with an 8K vocabulary)
    "base": Size(layers=4, hidden=768, heads=8, kv_heads=2, head_dim=128, intermediate=2048),
}


def build(
    size: Size, vocab_size: int, max_len: int, rope_theta: float, attn: str, seed: int
) -> transformers.Qwen2ForCausalLM:
    """A randomly initialised Qwen2ForCausalLM (float32 weights) running the
    attention registered under ``attn``."""
    config = transformers.Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        head_dim=size.head_dim,
        max_position_embeddings=max_len,
        rope_theta=rope_theta,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        use_cache=False,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(config)
    set_attention(model, attn)
    return model


def set_attention(model: transformers.PreTrainedModel, attn: str) -> None:
    model.config._attn_implementation = attn


def set_rope_theta(model: transformers.PreTrainedModel, theta: float, max_len: int) -> None:
    """Raises (or sets) the RoPE base of a built model: context extension."""
    model.config.rope_parameters = {**(model.config.rope_parameters or {}), "rope_theta": theta}
    model.config.max_position_embeddings = max_len
    old = model.model.rotary_emb
    model.model.rotary_emb = type(old)(config=model.config).to(old.inv_freq.device)


def parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def describe(size: Size) -> dict[str, int]:
    return asdict(size)
