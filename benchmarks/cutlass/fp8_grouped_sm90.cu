// The expert GEMMs of DeepSeek-V3's block-scaled FP8 recipe on CUTLASS's Hopper ptr-array kernels with
// blockwise scaling: the production side benchmarks/bench_cutlass_fp8.py compares fmoe's Triton kernels
// (fmoe.kernels.fp8_gemm) with. Built by build.sh with nvcc against the nvidia-cutlass package's headers;
// called through ctypes on raw device pointers and the caller's stream (no torch headers).
//
// forward / input gradient, fmoe_fp8_grouped_gemm_nt:   y[rows of e] = x[rows of e] @ w[e]^T
//   x:    float8_e4m3 [rows, K] row-major; its scales float32 [rows, K/128] ROW-major, the transpose of
//         what fmoe.kernels.fp8_quant.quantize_act writes: CUTLASS's ptr-array mainloop rebuilds each
//         group's scale layout as the compact one of its own problem (it reads no layout_SFA entry), so
//         an expert's scales must be one contiguous [M_e, K/128] block, which only K-major ones are
//   w:    float8_e4m3 [E, N, K]; its scales float32 [E, N/128, K/128] (Fp8Weight.data / .scale, or
//         .data_t / .scale_t for the input gradient)
//   y:    bfloat16 [rows, N]
//   offs: int32 [E] cumulative row ends, read on the device: a setup kernel writes every group's
//         problem size, pointers and strides, so the host never learns the routing (no sync)
// weight gradient, fmoe_fp8_grouped_gemm_wgrad:          dW[e] = dy_e^T @ x_e over expert e's tokens
//   the Fp8ActT of dy and x (fmoe.kernels.fp8_quant.quantize_act_t): [features, cap] with 1x128 scales
//   along tokens, [features, cap / 128] column-major, each expert's tokens a 128-aligned column range
#include <cstdint>
#include <cuda_runtime.h>

#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/numeric_types.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/detail/blockwise_scale_layout.hpp"

using namespace cute;

namespace fmoe_sm90 {

using Problem = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
using ElementIn = cutlass::float_e4m3_t;
using ElementOut = cutlass::bfloat16_t;
using LayoutX = cutlass::layout::RowMajor;     // x [M, K], K contiguous
using LayoutW = cutlass::layout::ColumnMajor;  // w[e] [N, K], K contiguous (B as K x N, column-major)
using LayoutY = cutlass::layout::RowMajor;     // y [M, N]
// activations: one scale per row and 128 columns, K-major (a row-major [rows, K/128] tensor);
// weights: one per 128 x 128 block, K-major (the row-major [N/128, K/128] tensor)
using Scales = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128, cute::GMMA::Major::K, cute::GMMA::Major::K>;
using LayoutSFA = decltype(Scales::deduce_layoutSFA());
using LayoutSFB = decltype(Scales::deduce_layoutSFB());

template <class Tile, class Cluster, class MainSchedule, class EpiSchedule, class LayoutSFA_ = LayoutSFA,
          class LayoutSFB_ = LayoutSFB>
struct Config {
  using LayoutSFA = LayoutSFA_;
  using LayoutSFB = LayoutSFB_;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      ElementOut, LayoutY*, 8, ElementOut, LayoutY*, 8, EpiSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementOut, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      ElementIn, cute::tuple<LayoutX*, LayoutSFA*>, 16,
      ElementIn, cute::tuple<LayoutW*, LayoutSFB*>, 16,
      float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      MainSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Problem, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideX = typename Kernel::InternalStrideA;
  using StrideW = typename Kernel::InternalStrideB;
  using StrideY = typename Kernel::InternalStrideD;
};

// 0: two consumer warpgroups share a 128-row tile; 1: they take turns on 64-row tiles
using Cooperative = Config<Shape<_128, _128, _128>, Shape<_1, _1, _1>,
                           cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise,
                           cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
using Pingpong = Config<Shape<_64, _128, _128>, Shape<_1, _1, _1>,
                        cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise,
                        cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;

// The weight gradient dW[e] = dy_e^T @ x_e over expert e's tokens (K = tokens): both operands are
// token-transposed (fmoe's Fp8ActT: [features, cap] with 1x128 scales along tokens, [features, cap/128]
// column-major), so both scale per row / column and 128 tokens, M- and N-major.
using WgradScales = cutlass::detail::Sm90BlockwiseScaleConfig<1, 1, 128, cute::GMMA::Major::MN, cute::GMMA::Major::MN>;
using WgradCooperative = Config<Shape<_128, _128, _128>, Shape<_1, _1, _1>,
                                cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise,
                                cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
                                decltype(WgradScales::deduce_layoutSFA()), decltype(WgradScales::deduce_layoutSFB())>;
using WgradPingpong = Config<Shape<_64, _128, _128>, Shape<_1, _1, _1>,
                             cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise,
                             cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                             decltype(WgradScales::deduce_layoutSFA()), decltype(WgradScales::deduce_layoutSFB())>;

// The per-group argument arrays, laid out one after another in one device buffer.
template <class C>
struct GroupArgs {
  typename Problem::UnderlyingProblemShape* size;
  ElementIn const** x;
  ElementIn const** w;
  float const** sx;
  float const** sw;
  ElementOut** y;
  ElementOut const** c;  // no source: every entry stays null
  typename C::StrideX* dx;
  typename C::StrideW* dw;
  typename C::StrideY* dy;
  typename C::LayoutSFA* lx;
  typename C::LayoutSFB* lw;

  static size_t align(size_t n) { return (n + 255) / 256 * 256; }
  static size_t bytes(int g) {
    return align(g * sizeof(*size)) + 6 * align(g * sizeof(void*)) + align(g * sizeof(*dx)) +
           align(g * sizeof(*dw)) + align(g * sizeof(*dy)) + align(g * sizeof(*lx)) + align(g * sizeof(*lw));
  }
  GroupArgs(void* base, int g) {
    char* p = static_cast<char*>(base);
    auto take = [&](size_t n) { char* q = p; p += align(n); return q; };
    size = reinterpret_cast<decltype(size)>(take(g * sizeof(*size)));
    x = reinterpret_cast<decltype(x)>(take(g * sizeof(void*)));
    w = reinterpret_cast<decltype(w)>(take(g * sizeof(void*)));
    sx = reinterpret_cast<decltype(sx)>(take(g * sizeof(void*)));
    sw = reinterpret_cast<decltype(sw)>(take(g * sizeof(void*)));
    y = reinterpret_cast<decltype(y)>(take(g * sizeof(void*)));
    c = reinterpret_cast<decltype(c)>(take(g * sizeof(void*)));
    dx = reinterpret_cast<decltype(dx)>(take(g * sizeof(*dx)));
    dw = reinterpret_cast<decltype(dw)>(take(g * sizeof(*dw)));
    dy = reinterpret_cast<decltype(dy)>(take(g * sizeof(*dy)));
    lx = reinterpret_cast<decltype(lx)>(take(g * sizeof(*lx)));
    lw = reinterpret_cast<decltype(lw)>(take(g * sizeof(*lw)));
  }
};

template <class C>
__global__ void fill_groups(GroupArgs<C> a, int32_t const* offs, int groups, int n, int k,
                            ElementIn const* x, float const* sx, ElementIn const* w, float const* sw, ElementOut* y) {
  int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= groups) return;
  int start = e == 0 ? 0 : offs[e - 1];
  int m = offs[e] - start;
  int kb = k / 128, nb = n / 128;
  a.size[e] = make_shape(m, n, k);
  a.x[e] = x + int64_t(start) * k;
  a.w[e] = w + int64_t(e) * n * k;
  a.sx[e] = sx + int64_t(start) * (k / 128);  // row-major scales: row r, block j at r * K/128 + j
  a.sw[e] = sw + int64_t(e) * nb * kb;
  a.y[e] = y + int64_t(start) * n;
  a.c[e] = nullptr;
  a.dx[e] = typename C::StrideX{int64_t(k), _1{}, _0{}};
  a.dw[e] = typename C::StrideW{int64_t(k), _1{}, _0{}};
  a.dy[e] = typename C::StrideY{int64_t(n), _1{}, _0{}};
  a.lx[e] = typename C::LayoutSFA{make_shape(make_shape(_1{}, m), make_shape(_128{}, kb), 1),
                                  make_stride(make_stride(_0{}, int32_t(kb)), make_stride(_0{}, _1{}), int32_t(0))};
  a.lw[e] = typename C::LayoutSFB{make_shape(make_shape(_128{}, nb), make_shape(_128{}, kb), 1),
                      make_stride(make_stride(_0{}, int32_t(kb)), make_stride(_0{}, _1{}), int32_t(0))};
}

// dW[e] [m, n] = A_e @ B_e^T: A = dy^T [m, cap], B = x^T [n, cap], expert e's tokens the columns
// [start[e], start[e] + len[e]) of both; an expert with no tokens gets zeros (its rows are written
// here: a GEMM with K = 0 is given no tiles)
template <class C>
__global__ void fill_wgrad_groups(GroupArgs<C> a, int32_t const* start, int32_t const* len, int groups, int m, int n,
                                  int64_t cap, ElementIn const* dyt, float const* sdy, ElementIn const* xt,
                                  float const* sx, ElementOut* dw) {
  int e = blockIdx.x;
  int s = start[e], k = len[e];
  if (threadIdx.x == 0) {
    a.size[e] = make_shape(k == 0 ? 0 : m, n, k);
    a.x[e] = dyt + s;
    a.w[e] = xt + s;
    a.sx[e] = sdy + int64_t(s / 128) * m;  // column-major [m, cap/128]: feature r, block j at r + j * m
    a.sw[e] = sx + int64_t(s / 128) * n;
    a.y[e] = dw + int64_t(e) * m * n;
    a.c[e] = nullptr;
    a.dx[e] = typename C::StrideX{cap, _1{}, _0{}};
    a.dw[e] = typename C::StrideW{cap, _1{}, _0{}};
    a.dy[e] = typename C::StrideY{int64_t(n), _1{}, _0{}};
    a.lx[e] = typename C::LayoutSFA{make_shape(make_shape(_1{}, m), make_shape(_128{}, k / 128), 1),
                                    make_stride(make_stride(_0{}, _1{}), make_stride(_0{}, int32_t(m)), int32_t(0))};
    a.lw[e] = typename C::LayoutSFB{make_shape(make_shape(_1{}, n), make_shape(_128{}, k / 128), 1),
                                    make_stride(make_stride(_0{}, _1{}), make_stride(_0{}, int32_t(n)), int32_t(0))};
  }
  if (k == 0) {
    ElementOut* out = dw + int64_t(e) * m * n;
    for (int64_t i = threadIdx.x; i < int64_t(m) * n; i += blockDim.x) out[i] = ElementOut(0.0f);
  }
}

template <class C>
typename C::Gemm::Arguments arguments(GroupArgs<C> const& a, int groups, int sm_count) {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = 0;
  hw.sm_count = sm_count;
  typename C::Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {groups, a.size, nullptr},
      {a.x, a.dx, a.w, a.dw, a.sx, a.lx, a.sw, a.lw},
      {{}, a.c, a.dy, a.y, a.dy},  // no source C (null pointers); its strides are the output's
      hw};
  auto& f = args.epilogue.thread;
  f.alpha = 1.0f;
  f.beta = 0.0f;
  f.alpha_ptr = nullptr;
  f.beta_ptr = nullptr;
  f.alpha_ptr_array = nullptr;
  f.beta_ptr_array = nullptr;
  f.dAlpha = {_0{}, _0{}, 0};
  f.dBeta = {_0{}, _0{}, 0};
  args.scheduler.raster_order = cutlass::gemm::kernel::detail::RasterOrderOptions::AlongN;
  args.scheduler.max_swizzle_size = 1;
  return args;
}

template <class C>
size_t workspace_bytes(int groups, int sm_count) {
  GroupArgs<C> a(nullptr, groups);
  return C::Gemm::get_workspace_size(arguments<C>(a, groups, sm_count));
}

// After a fill kernel wrote the group arrays: CUTLASS's checks, then the GEMM (0, or where it failed)
template <class C>
int launch(GroupArgs<C> const& a, int groups, void* workspace, size_t workspace_size, int sm_count,
           cudaStream_t stream) {
  if (cudaGetLastError() != cudaSuccess) return 10;
  auto args = arguments<C>(a, groups, sm_count);
  if (C::Gemm::get_workspace_size(args) > workspace_size) return 11;
  typename C::Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return 12;
  if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) return 13;
  if (gemm.run(stream) != cutlass::Status::kSuccess) return 14;
  return cudaGetLastError() == cudaSuccess ? 0 : 15;
}

template <class C>
int run(void const* x, float const* sx, int64_t rows, void const* w, float const* sw, void* y, int32_t const* offs,
        int groups, int n, int k, void* args_buf, void* workspace, size_t workspace_size, int sm_count,
        cudaStream_t stream) {
  GroupArgs<C> a(args_buf, groups);
  fill_groups<C><<<(groups + 127) / 128, 128, 0, stream>>>(
      a, offs, groups, n, k, static_cast<ElementIn const*>(x), sx, static_cast<ElementIn const*>(w), sw,
      static_cast<ElementOut*>(y));
  return launch<C>(a, groups, workspace, workspace_size, sm_count, stream);
}

template <class C>
int run_wgrad(void const* dyt, float const* sdy, void const* xt, float const* sx, void* dw, int32_t const* start,
              int32_t const* len, int groups, int m, int n, int64_t cap, void* args_buf, void* workspace,
              size_t workspace_size, int sm_count, cudaStream_t stream) {
  GroupArgs<C> a(args_buf, groups);
  fill_wgrad_groups<C><<<groups, 256, 0, stream>>>(a, start, len, groups, m, n, cap,
                                                   static_cast<ElementIn const*>(dyt), sdy,
                                                   static_cast<ElementIn const*>(xt), sx, static_cast<ElementOut*>(dw));
  return launch<C>(a, groups, workspace, workspace_size, sm_count, stream);
}

}  // namespace fmoe_sm90

extern "C" {

static size_t max4(size_t a, size_t b, size_t c, size_t d) {
  size_t x = a > b ? a : b, y = c > d ? c : d;
  return x > y ? x : y;
}

size_t fmoe_fp8_grouped_args_bytes(int groups) {
  using namespace fmoe_sm90;
  return max4(GroupArgs<Cooperative>::bytes(groups), GroupArgs<Pingpong>::bytes(groups),
              GroupArgs<WgradCooperative>::bytes(groups), GroupArgs<WgradPingpong>::bytes(groups));
}

size_t fmoe_fp8_grouped_workspace_bytes(int groups, int sm_count) {
  using namespace fmoe_sm90;
  return max4(workspace_bytes<Cooperative>(groups, sm_count), workspace_bytes<Pingpong>(groups, sm_count),
              workspace_bytes<WgradCooperative>(groups, sm_count), workspace_bytes<WgradPingpong>(groups, sm_count));
}

// dW[e] = dy_e^T @ x_e: dyt / xt the data of fmoe's Fp8ActT of dy and x ([m, cap] and [n, cap]), sdy /
// sx their scales, start / len their group_start / group_len; dw bf16 [groups, m, n]. 0 on success.
int fmoe_fp8_grouped_gemm_wgrad(int variant, void const* dyt, float const* sdy, void const* xt, float const* sx,
                                void* dw, int32_t const* start, int32_t const* len, int groups, int m, int n,
                                int64_t cap, void* args_buf, void* workspace, size_t workspace_size, int sm_count,
                                cudaStream_t stream) {
  using namespace fmoe_sm90;
  if (cap % 128 != 0) return 1;
  if (variant == 0)
    return run_wgrad<WgradCooperative>(dyt, sdy, xt, sx, dw, start, len, groups, m, n, cap, args_buf, workspace,
                                       workspace_size, sm_count, stream);
  if (variant == 1)
    return run_wgrad<WgradPingpong>(dyt, sdy, xt, sx, dw, start, len, groups, m, n, cap, args_buf, workspace,
                                    workspace_size, sm_count, stream);
  return 2;
}

// 0 on success; variant 0: cooperative 128x128 tiles, 1: ping-pong 64x128 tiles
int fmoe_fp8_grouped_gemm_nt(int variant, void const* x, float const* sx, int64_t rows, void const* w,
                             float const* sw, void* y, int32_t const* offs, int groups, int n, int k,
                             void* args_buf, void* workspace, size_t workspace_size, int sm_count,
                             cudaStream_t stream) {
  using namespace fmoe_sm90;
  if (n % 128 != 0 || k % 128 != 0) return 1;
  if (variant == 0)
    return run<Cooperative>(x, sx, rows, w, sw, y, offs, groups, n, k, args_buf, workspace, workspace_size,
                            sm_count, stream);
  if (variant == 1)
    return run<Pingpong>(x, sx, rows, w, sw, y, offs, groups, n, k, args_buf, workspace, workspace_size,
                         sm_count, stream);
  return 2;
}

}  // extern "C"
