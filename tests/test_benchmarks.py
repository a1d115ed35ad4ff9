"""The GPU benchmarks also run on CPU at a tiny size, so they cannot rot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import bench_stages, train_throughput


def test_stage_benchmark_runs_on_cpu(tmp_path):
    out = tmp_path / "stages.json"
    result = bench_stages.main(["--device", "cpu", "--tiny", "--iters", "1", "--out", str(out)])
    assert set(result["ms_per_stage"]) == {"attn", "dispatch", "mlp", "combine", "aggregate"}
    assert result["layer_ms"]["ratio"] > 0
    assert json.loads(out.read_text())["environment"]["torch"]


def test_throughput_benchmark_runs_on_cpu_for_fmoe_and_the_eager_baseline(tmp_path):
    out = tmp_path / "throughput.json"
    result = train_throughput.main(
        ["--device", "cpu", "--tiny", "--steps", "1", "--warmup", "1", "--host-profile", "--out", str(out)]
    )
    for side in ("eager", "fmoe"):
        assert result["results"][side]["model_tflops"] > 0
        host = result["results"][side]["host_profile"]
        assert host["wall_ms"] > 0 and len(host["top_own_time"]) == 30
        own = [f["own_ms"] for f in host["top_own_time"]]
        assert own == sorted(own, reverse=True) and all(f["calls"] >= 1 for f in host["top_own_time"])
    assert result["results"]["fmoe_over_eager"] > 0


def test_throughput_benchmark_op_profile_names_the_ops_with_their_shapes_longest_first():
    result = train_throughput.main(
        ["--device", "cpu", "--tiny", "--steps", "1", "--warmup", "1", "--sides", "fmoe", "--op-profile"]
    )
    prof = result["results"]["fmoe"]["op_profile"]
    ops = prof["top_ops"]
    assert prof["time"] == "host" and 0 < len(ops) <= 25
    assert [o["ms"] for o in ops] == sorted((o["ms"] for o in ops), reverse=True)
    assert all(o["op"].startswith("aten::") and o["calls"] >= 1 for o in ops)
    assert any(o["input_shapes"].startswith("[[") for o in ops)  # shapes recorded, not blank
    args = ["--device", "cpu", "--tiny", "--steps", "1", "--warmup", "0", "--sides", "fmoe", "--op-profile"]
    few = train_throughput.main([*args, "--op-profile-top", "3"])["results"]["fmoe"]["op_profile"]["top_ops"]
    assert len(few) == 3  # the count asked (the step has more than 3 kinds of op)
    for flag in ("--op-profile-top", "--top-kernels"):
        with pytest.raises(SystemExit) as e:
            train_throughput.main([*args, flag, "0"])
        assert e.value.code == 2


def test_throughput_benchmark_takes_another_familys_recipe(tmp_path):
    """--recipe: the fmoe sides on a recipe's model cut to --layers (DeepSeek-V3 here), its FLOPs from
    its family; the eager side, a Qwen3 module, is refused beside it."""
    recipe = str(Path(__file__).resolve().parents[1] / "recipes" / "deepseek_v3_tiny.toml")
    args = ["--device", "cpu", "--tiny", "--steps", "1", "--warmup", "1", "--layers", "2", "--recipe", recipe]
    result = train_throughput.main([*args, "--sides", "fmoe"])
    assert result["shape"]["recipe"] == recipe and result["shape"]["num_hidden_layers"] == 2
    assert result["shape"]["kv_lora_rank"] and result["results"]["fmoe"]["model_tflops"] > 0
    with pytest.raises(SystemExit):
        train_throughput.main([*args, "--sides", "eager,fmoe"])


def test_throughput_benchmark_variants_run_on_cpu(tmp_path):
    sides = ",".join(["fmoe_fp8", *train_throughput.FMOE_VARIANTS])
    args = ["--device", "cpu", "--tiny", "--steps", "1", "--warmup", "1", "--microbatches", "2", "--sides"]
    result = train_throughput.main([*args, sides])
    for side in sides.split(","):
        assert result["results"][side]["step_ms"] > 0, side


def test_throughput_benchmark_takes_several_sequences_per_micro_batch(tmp_path, monkeypatch):
    seen = []
    real = train_throughput.runner.run_sequential

    def spy(model, params, batch, num_microbatches, **kw):
        seen.append((batch["tokens"].shape[0], num_microbatches))
        return real(model, params, batch, num_microbatches, **kw)

    monkeypatch.setattr(train_throughput.runner, "run_sequential", spy)
    args = ["--device", "cpu", "--tiny", "--steps", "1", "--warmup", "0", "--microbatches", "2"]
    result = train_throughput.main([*args, "--micro-batch", "3", "--sides", "eager,fmoe"])
    assert seen and set(seen) == {(6, 2)}  # 2 micro-batches of 3 sequences
    assert result["shape"]["micro_batch"] == 3 and result["shape"]["microbatches_per_step"] == 2
    with pytest.raises(SystemExit):
        train_throughput.main([*args, "--micro-batch", "0"])


def test_throughput_benchmark_times_the_fp8_gemms_on_the_tiles_asked_for(monkeypatch):
    from benchmarks.bench_fp8_grouped import CONFIGS
    from fmoe.kernels import fp8_gemm

    defaults = fp8_gemm.DEFAULT_CONFIG, fp8_gemm.WGRAD_CONFIG
    in_use = []

    def timed(fn, **kw):  # the tiles in force while a side is timed
        in_use.append((fp8_gemm.DEFAULT_CONFIG, fp8_gemm.WGRAD_CONFIG))
        return 1.0

    monkeypatch.setattr(train_throughput, "time_ms", timed)
    args = ["--device", "cpu", "--tiny", "--steps", "1", "--warmup", "0", "--sides", "fmoe"]
    result = train_throughput.main([*args, "--fp8-tiles", "2x4,2x4_pf"])
    assert in_use == [(CONFIGS["2x4"], CONFIGS["2x4_pf"])] and result["shape"]["fp8_tiles"] == "2x4,2x4_pf"
    assert defaults == (fp8_gemm.DEFAULT_CONFIG, fp8_gemm.WGRAD_CONFIG)  # restored after
    train_throughput.main(args)
    assert in_use[-1] == defaults
    for bad in ("nope,base", "base"):
        with pytest.raises(SystemExit) as e:
            train_throughput.main([*args, "--fp8-tiles", bad])
        assert e.value.code == 2

    def fails(fn, **kw):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(train_throughput, "time_ms", fails)
    with pytest.raises(RuntimeError):
        train_throughput.main([*args, "--fp8-tiles", "2x4, 2x4_pf"])
    assert defaults == (fp8_gemm.DEFAULT_CONFIG, fp8_gemm.WGRAD_CONFIG)  # restored after a failed side too


def test_cross_entropy_benchmark_runs_on_cpu():
    from benchmarks import bench_cross_entropy

    bench_cross_entropy.main(["--device", "cpu", "--tiny"])


def test_throughput_benchmark_keeps_finished_sides_when_a_later_one_fails(tmp_path, monkeypatch):
    out = tmp_path / "throughput.json"

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory in the fp8 side")

    monkeypatch.setattr(train_throughput, "fmoe_fp8_step_fn", broken)
    args = ["--device", "cpu", "--tiny", "--steps", "1", "--warmup", "1", "--out", str(out)]
    with pytest.raises(RuntimeError, match="fp8 side"):
        train_throughput.main([*args, "--sides", "eager,fmoe,fmoe_fp8"])
    saved = json.loads(out.read_text())
    assert set(saved["results"]) == {"eager", "fmoe", "fmoe_over_eager"}
    assert saved["sides_not_run"] == ["fmoe_fp8"]
    assert not (tmp_path / "throughput.json.tmp").exists()


def test_throughput_benchmark_refuses_an_unknown_side(capsys):
    with pytest.raises(SystemExit):
        train_throughput.main(["--device", "cpu", "--tiny", "--sides", "eager,fmoe_fp9"])
    assert "fmoe_fp9" in capsys.readouterr().err


def test_measure_role_costs_smoke_run_gives_rates_the_time_model_reads(tmp_path):
    """``benchmarks/measure_role_costs.py --smoke`` on the CPU: its "rates" build a ``Rates``."""
    import json

    from benchmarks import measure_role_costs
    from fmoe.plan_time import Rates

    out = tmp_path / "role_costs.json"
    measure_role_costs.main(["--device", "cpu", "--smoke", "--out", str(out)])
    rates = json.loads(out.read_text())["rates"]
    built = Rates(**{**rates, "grouped_tflops": tuple(tuple(p) for p in rates["grouped_tflops"])})
    assert built.grouped(1) > 0 and built.dense_tflops > 0


def test_the_fp8_gemm_probe_names_an_unknown_config_and_exits_2(capsys):
    from benchmarks import probe_fp8_gemm_once

    with pytest.raises(SystemExit) as e:
        probe_fp8_gemm_once.main(["base", "nope"])
    assert e.value.code == 2 and "unknown configs ['nope']" in capsys.readouterr().err


def test_the_gluon_benchmark_names_an_unknown_variant_and_exits_2(capsys):
    from benchmarks import bench_gluon_fp8

    with pytest.raises(SystemExit) as e:
        bench_gluon_fp8.main(["--variants", "ws_s4,nope"])
    assert e.value.code == 2 and "unknown ['nope']" in capsys.readouterr().err


def test_the_two_pass_swiglu_with_its_transpose_writes_the_bits_of_the_one_pass():
    # bench_fp8's swiglu_t part times swiglu_quant(with_t=True) against two passes; the two must
    # give the same bits (rows and token-wise transpose, over ragged experts, one of them empty)
    import torch

    from benchmarks import bench_fp8
    from fmoe.kernels import fused

    h = (torch.randn(300, 2 * 256, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    offs = torch.tensor([100, 100, 300], dtype=torch.int32)
    one, two = fused.swiglu_quant(h, offs, with_t=True), bench_fp8.swiglu_t_two_pass(h, offs)
    flat_one, flat_two = bench_fp8._flat(one), bench_fp8._flat(two)
    assert len(flat_one) == len(flat_two) == 4
    assert all(bench_fp8.bits_equal(a, b) for a, b in zip(flat_one, flat_two, strict=True))


def test_deepgemm_benchmark_lays_fmoes_fp8_operands_out_as_deepgemm_reads_them():
    # what DeepGEMM is timed on must be the very operands fmoe's kernels get, moved, not changed
    import torch

    from benchmarks.bench_deepgemm_fp8 import dg_rows, dg_wgrad_operand, padded_rows
    from fmoe.kernels import fp8_quant as fq

    counts = [0, 1, 127, 128, 129, 0, 300]
    offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    dest, layout, padded = padded_rows(offs, 128)
    sizes = [(c + 127) // 128 * 128 for c in counts]
    assert padded == sum(sizes)
    start = 0
    for e, (c, size) in enumerate(zip(counts, sizes)):  # expert e's rows first in its aligned block
        assert layout[start : start + c].eq(e).all() and layout[start + c : start + size].eq(-1).all()
        start += size
    assert dest.unique().numel() == dest.numel() and torch.equal(
        layout[dest].long(), torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    )

    g = torch.Generator().manual_seed(0)
    x = torch.randn(int(offs[-1]), 256, generator=g).bfloat16()
    a = fq.quantize_act(x)
    data, scale = dg_rows(a, dest, padded)
    assert torch.equal(data[dest].view(torch.uint8), a.data.view(torch.uint8)) and torch.equal(
        scale[dest], a.scale
    )
    pad = layout.eq(-1)
    assert data[pad].view(torch.uint8).eq(0).all() and scale[pad].eq(1).all()
    assert scale.stride() == (1, padded)  # MN-major

    t = fq.quantize_act_t(x, offs)
    flat, sf, ks = dg_wgrad_operand(t)
    assert ks == t.group_len.tolist() and flat.numel() == 256 * sum(ks)
    at = 0
    assert sf.shape == (256, sum(ks) // 128) and sf.stride() == (1, 256)  # MN-major
    for s, k in zip(t.group_start.tolist(), ks):  # each expert's [cols, K_e] block, K-major, and its scales
        block = flat[at : at + 256 * k].view(256, k)
        assert torch.equal(block.view(torch.uint8), t.data[:, s : s + k].view(torch.uint8))
        assert torch.equal(
            sf[:, at // 256 // 128 : (at // 256 + k) // 128], t.scale[:, s // 128 : (s + k) // 128]
        )
        at += 256 * k
