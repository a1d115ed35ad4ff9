"""Shared fixtures: tiny configs and batches made on the spot (no downloads)."""

from __future__ import annotations

import os

# Triton picks interpreter or compiler when a kernel is defined: set the flag before anything
# imports triton, so every kernel test in the session runs interpreted on the CPU. Training code
# on CPU tensors never takes the Triton path (kernels dispatch to Triton on CUDA only).
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from fmoe.stages import qwen3_moe  # noqa: E402


def tiny_config(**overrides) -> qwen3_moe.Qwen3MoeConfig:
    """A tiny Qwen3-MoE: 2 layers (one dense, one MoE unless overridden), 8 experts, top-2."""
    fields = dict(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        intermediate_size=48,
        router_aux_loss_coef=0.01,
    )
    fields.update(overrides)
    return qwen3_moe.Qwen3MoeConfig(**fields)


def random_batch(cfg, batch: int, seq: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    return {"tokens": tokens, "labels": labels}
