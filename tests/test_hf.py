"""Hugging Face export/import for Qwen3-MoE, checked against transformers' own model."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config

from fmoe import hf
from fmoe.stages import qwen3_moe


@pytest.mark.parametrize("dense_first", [False, True])
def test_export_loads_in_transformers_with_equal_logits_and_imports_back_identically(tmp_path, dense_first):
    transformers = pytest.importorskip("transformers")
    cfg = tiny_config(
        num_hidden_layers=2, mlp_only_layers=(0,) if dense_first else (), norm_topk_prob=dense_first
    )
    params = qwen3_moe.init_params(cfg, seed=7)
    folder = hf.export_hf("qwen3_moe", cfg, params, tmp_path / "hf")

    model = transformers.Qwen3MoeForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = model(tokens).logits
        ours = qwen3_moe.logits(cfg, params, tokens)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)

    family, cfg_back, params_back = hf.import_hf(folder)
    assert family == "qwen3_moe" and cfg_back == cfg
    assert set(params_back) == set(params)
    for name, t in params.items():
        assert torch.equal(params_back[name], t), name


def test_import_of_a_folder_missing_a_tensor_names_it(tmp_path):
    from safetensors.torch import load_file, save_file

    cfg = tiny_config()
    folder = hf.export_hf("qwen3_moe", cfg, qwen3_moe.init_params(cfg), tmp_path / "hf")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"lacks tensor 'model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight'"
    ):
        hf.import_hf(folder)
