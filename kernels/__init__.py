"""Triton kernels, each beside the plain-torch reference its tests compare against.

- ``fp8_quant``: E4M3 quantization with FP32 scales (1x128 activation groups, fused with the
  token-transposed per-expert layout; 128x128 weight blocks) and the Fp8Act / Fp8ActT / Fp8Weight
  containers.
- ``fp8_gemm``: block-scaled FP8 GEMM and expert-grouped GEMM (forward, input and weight gradient).
- ``fp8_linear``: the three steps of an FP8 linear and FP8 grouped linear layer as plain functions.
- ``fused``: SwiGLU (+ FP8 quantization of its output), RMSNorm (+ quantization) and the MoE
  output's weighted sum over top-k, with backwards.
- ``cross_entropy``: cross-entropy over the vocabulary from bf16 logits, no fp32 logits copy.
- ``adamw``: AdamW on fp32 master weights reading gradients of any float dtype, clip scale folded in.
- ``permute``: the stable expert sort and token permutation of MoE dispatch.

The FP8, fused, cross-entropy and AdamW kernels run on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``;
elsewhere, or with ``FMOE_KERNEL_BACKEND=torch``, their references run instead. ``permute``'s
public entry takes Triton on CUDA tensors only.
"""
