"""The FP8 benchmarks of issue 26 run on a CPU at a tiny size, so they cannot rot before their GPU run."""

import json
import math

from benchmarks import bench_fp8_gemms, fp8_curves


def test_fp8_gemm_table_has_every_gemm_of_the_layer_on_every_path(tmp_path, monkeypatch):
    monkeypatch.setenv("FMOE_KERNEL_BACKEND", "torch")  # the FP8 references: the interpreter is slow
    out = tmp_path / "gemms.json"
    bench_fp8_gemms.main(["--tiny", "--device", "cpu", "--out", str(out)])
    record = json.loads(out.read_text())
    assert {"gpu", "torch", "triton", "cpu", "date"} <= set(record["environment"])
    rows = record["rows"]
    spec = bench_fp8_gemms.TINY["tiny"]
    assert len(rows) == 3 * (len(spec["dense"]) + 2)  # forward, input and weight gradient of each weight
    assert {(r["gemm"], r["kind"]) for r in rows} >= {("experts_down", "weight_grad"), ("q_proj", "forward")}
    for r in rows:
        fp8 = r["torch_reference"]  # on a CPU without the interpreter the FP8 path is the reference
        assert r["bf16"]["tflops"] > 0 and fp8["tflops"] > 0 and fp8["with_quant_ms"] > 0
        assert (r["experts"] is None) == ("cublas" in r)  # dense rows say why cuBLAS did not run
    wgrad = next(r for r in rows if r["gemm"] == "experts_up" and r["kind"] == "weight_grad")
    assert (wgrad["M"], wgrad["N"], wgrad["K"]) == (
        2 * spec["moe_intermediate"],
        spec["hidden"],
        128 * spec["top_k"],
    )


def test_fp8_curves_train_both_sides_on_the_same_text_and_plot_them(tmp_path, monkeypatch):
    monkeypatch.setenv("FMOE_KERNEL_BACKEND", "torch")
    result = fp8_curves.main(
        ["--tiny", "--device", "cpu", "--out", str(tmp_path), "--data-dir", str(tmp_path / "data")]
    )
    bf16, fp8 = result["losses"]["bf16"], result["losses"]["fp8"]
    assert len(bf16) == len(fp8) == 3 and result["finite"]
    assert bf16[0] == fp8[0] or abs(bf16[0] - fp8[0]) < 0.05 * bf16[0]  # same init and first batch
    assert bf16 != fp8  # FP8 ran (the tiny model's q, o and expert GEMMs are in whole 128-blocks)
    # a byte model starts near ln(vocab) and learns within 3 steps on both sides
    assert abs(bf16[0] - math.log(fp8_curves.BYTE_VOCAB)) < 0.5 and bf16[-1] < bf16[0] and fp8[-1] < fp8[0]
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "curves.json").read_text())["final_loss_ratio_fp8_over_bf16"] > 0


def _profiled(
    layers: int, kernels: dict[str, dict[str, float]], step_ms: dict[str, float], fixed: tuple[str, ...] = ()
) -> dict:
    """A train_throughput --profile record: per side, {kernel: ms per step} and the step's ms; each
    kernel launched once a layer, but those named in ``fixed``: 8 times a step at any depth."""
    return {
        "shape": {"layers": layers},
        "results": {
            side: {
                "step_ms": step_ms[side],
                "profile": {
                    "top_kernels": [
                        {"kernel": k, "ms_per_step": ms, "calls_per_step": 8 if k in fixed else layers}
                        for k, ms in ks.items()
                    ]
                },
            }
            for side, ks in kernels.items()
        },
    }


def test_per_layer_kernels_differences_two_steps_and_bounds_fp8(tmp_path):
    from benchmarks import per_layer_kernels

    def run(layers):  # per layer: bf16 GEMMs 10 ms (two kernels of one cut name), attention 6; FP8
        # GEMMs 6, quantization 2; the head, launched 8 times a step at any depth, ran 30 ms a step in
        # both BF16 runs and 4 ms faster in the deeper FP8 one (a run-to-run difference of the fixed part)
        kernels = {
            "fmoe_graphs": {
                "nvjet_sm90_tst_256x128": 7.0 * layers,
                "cudnn_sdpa_bprop": 6.0 * layers,
                "lm_head_gemm_xmma": 30.0,
            },  # fmt: skip
            "fmoe_fp8_graphs": {
                "_nt_kernel": 6.0 * layers,
                "_quant_rows_kernel": 2.0 * layers,
                "cudnn_sdpa_bprop": 6.0 * layers,
                "lm_head_gemm_xmma": 30.0 if layers == 2 else 26.0,
            },  # fmt: skip
        }
        record = _profiled(
            layers, kernels, {"fmoe_graphs": 20.0 * layers + 50, "fmoe_fp8_graphs": 16.0 * layers + 50},
            fixed=("lm_head_gemm_xmma",),
        )  # fmt: skip
        # profile_step cuts names to 120 characters: two kernels may be listed under one name
        top = record["results"]["fmoe_graphs"]["profile"]["top_kernels"]
        top.append(
            {"kernel": "nvjet_sm90_tst_256x128", "ms_per_step": 3.0 * layers, "calls_per_step": layers}
        )
        return record

    paths = []
    for layers in (4, 2):  # given larger first: the tool orders them
        paths.append(tmp_path / f"L{layers}.json")
        paths[-1].write_text(json.dumps(run(layers)))
    out = per_layer_kernels.main([str(p) for p in paths])
    bf16, fp8 = out["sides"]["fmoe_graphs"], out["sides"]["fmoe_fp8_graphs"]
    assert out["layers"] == [2, 4]
    assert math.isclose(bf16["layer_ms"], 20.0) and math.isclose(fp8["layer_ms"], 16.0)
    assert bf16["classes"]["other GEMMs (head, projections)"]["ms"] == 10.0  # the head's 30 ms a step cancels
    assert fp8["classes"]["fp8 GEMMs"]["ms"] == 6.0 and fp8["classes"]["fp8 quantization"]["ms"] == 2.0
    assert fp8["classes"]["attention"]["ms"] == 6.0
    # the head's difference between the FP8 runs is the fixed part's, not a layer's "other GEMMs"
    assert "other GEMMs (head, projections)" not in fp8["classes"] and fp8["fixed_part_ms"] == -2.0
    assert bf16["fixed_part_ms"] == 0.0 and list(fp8["fixed_kernels"]) == ["lm_head_gemm_xmma"]
    bound = out["fp8_bound"]
    assert math.isclose(bound["best_fp8_layer_ms"], 20.0 - 10.0 / 2)  # GEMMs at 2x, no quantization
    assert math.isclose(bound["best_ratio"], 20.0 / 15.0) and math.isclose(bound["fp8_speedup"], 1.25)


def test_per_layer_kernels_names_a_file_that_is_not_a_profiled_record(tmp_path, capsys):
    import pytest

    from benchmarks import per_layer_kernels

    bad = tmp_path / "notes.json"
    bad.write_text('{"rows": []}')
    good = tmp_path / "L2.json"
    good.write_text(
        json.dumps(
            _profiled(2, {"fmoe_graphs": {}, "fmoe_fp8_graphs": {}}, {"fmoe_graphs": 1, "fmoe_fp8_graphs": 1})
        )
    )
    with pytest.raises(SystemExit) as e:
        per_layer_kernels.main([str(good), str(bad)])
    assert e.value.code == 2 and "notes.json: not a train_throughput record" in capsys.readouterr().err
