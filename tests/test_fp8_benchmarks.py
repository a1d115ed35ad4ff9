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
