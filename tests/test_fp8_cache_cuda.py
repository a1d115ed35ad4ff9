"""FP8 activation caching on a GPU, with the compiled Triton kernels: the step's bits are those without
caching, the rows the caching pass writes are ``quantize_act``'s, and each stage's saved bytes move
by the plan's ``fp8_cache_bytes`` (which assumes flash attention's output is saved and read by o_proj
as a view: checked here).

Marked ``cuda`` (``TRITON_INTERPRET=0 python3 -m pytest -m cuda tests/test_fp8_cache_cuda.py``).
"""

from __future__ import annotations

import pytest
import torch
from conftest import random_batch, tiny_config
from test_fp8_cache import saved_per_stage

from fmoe import runner
from fmoe.kernels import fp8_quant
from fmoe.memory_policy import MemoryPolicy
from fmoe.plan_activations import moe_stages
from fmoe.plan_fp8 import Fp8Caching, fp8_cache_bytes
from fmoe.stages import qwen3_moe
from fmoe.stages.primitives import fp8_training

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def config():
    return tiny_config(vocab_size=512, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                       intermediate_size=512, num_hidden_layers=2, mlp_only_layers=(0,))  # fmt: skip


def test_the_caching_pass_writes_the_rows_of_quantize_act_bitwise():
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1000, 384, device="cuda", generator=gen).to(torch.bfloat16)
    offs = torch.tensor([130, 130, 500, 777, 1000], dtype=torch.int32, device="cuda")  # one empty
    for o in (offs, None):
        rows, cols = fp8_quant.quantize_act_t(x, o, with_rows=True)
        alone = fp8_quant.quantize_act(x)
        assert torch.equal(rows.data.view(torch.uint8), alone.data.view(torch.uint8))
        assert torch.equal(rows.scale, alone.scale)
        want = fp8_quant.quantize_act_t(x, o)
        assert torch.equal(cols.data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(cols.scale, want.scale)


def step(model, params, batch, window: int, cache: bool) -> runner.StepResult:
    policy = MemoryPolicy(merge_window=window)
    with fp8_training(True, cache_inputs=cache, cache_expert_inputs=cache and policy.fp8_cache_experts(1, 2)):
        return runner.run_sequential(model, params, batch, 2, memory=policy)


def unequal(a: runner.StepResult, b: runner.StepResult) -> list[str]:
    out = [] if torch.equal(a.loss, b.loss) else ["loss"]
    return out + [n for n in a.grads if not torch.equal(a.grads[n], b.grads[n])]


@pytest.mark.parametrize("window", [1, 0])
def test_fp8_cache_gives_bitwise_the_step_without_on_the_gpu(window, monkeypatch):
    cfg = config()
    model = qwen3_moe.build(cfg)
    params = {n: t.to(torch.bfloat16) for n, t in model.init(seed=1, device="cuda").items()}
    batch = {k: v.cuda() for k, v in random_batch(cfg, 4, 256, seed=5).items()}
    ref = step(model, params, batch, window, cache=False)
    assert not unequal(step(model, params, batch, window, cache=False), ref), "the step is not deterministic"
    cached = []
    real = fp8_quant.quantize_act_t

    def spy(x, offs=None, **kw):
        cached.append(kw.get("with_rows", False))
        return real(x, offs, **kw)

    monkeypatch.setattr(fp8_quant, "quantize_act_t", spy)
    got = step(model, params, batch, window, cache=True)
    assert any(cached), "nothing was cached"
    assert not unequal(got, ref)


def test_each_stage_saves_the_bytes_the_plan_says_on_the_gpu():
    cfg = config()
    model = qwen3_moe.build(cfg)
    params = {n: t.to(torch.bfloat16) for n, t in model.init(seed=1, device="cuda").items()}
    batch = runner.with_positions({k: v.cuda() for k, v in random_batch(cfg, 2, 256, seed=5).items()})
    caching = Fp8Caching(dense=True, experts=True, local_experts=cfg.num_experts)
    without, with_cache = (saved_per_stage(model, params, batch, c) for c in (None, caching))
    moe = moe_stages(model)
    planned = [  # the fused FP8 experts read their rows from the tokens: no gathered copy to cache
        fp8_cache_bytes("qwen3_moe", cfg, st.role, i in moe, 512, 2, caching, device="cuda")
        for i, st in enumerate(model.stages)
    ]
    measured = [c - n for c, n in zip(with_cache, without)]
    assert measured == planned, [(st.name, m, p) for st, m, p in zip(model.stages, measured, planned)]
    assert sum(planned) < 0
