// A few rows times a dense weight on the CPU, as an XLA FFI handler (qwen35_lib/kernels/dense/native.py calls it):
// the decode step's projections, whose XLA:CPU dots read the weight at 13-23 GB/s at 8 rows.
//
// qwen35_dense_rows: x [M, K] (float32 or bfloat16), w [K * N] packed in kPanel-column panels (`PanelPacked`,
//   each panel [K, width] row-major, the last one narrower), of x's dtype -> y [M, N] float32 (accumulated in float32).
// The panels are the work units, over XLA's intra-op threads: each streams its panel once per register block of
// rows (a panel is K x 64 x 4 bytes, 128 KiB at K = 512: the second row block reads it from L2).

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common.h"
#include "gemm.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using qwen35::bf16;
using qwen35::kPanel;

template <typename W>
void rows(ffi::ThreadPool& pool, const W* x, const W* w, int64_t M, int64_t K, int64_t N, float* y) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  qwen35::parallel_for(pool, panels, [&](int64_t p) {
    const int64_t n = p * kPanel, width = std::min<int64_t>(kPanel, N - n);
    thread_local std::vector<float> a, c;  // x as float32 [M, K] (bfloat16 x); the panel's outputs [M, width]
    const float* xf;
    if constexpr (std::is_same_v<W, float>) {
      xf = x;
    } else {
      a.resize(M * K);
      for (int64_t i = 0; i < M * K; ++i) a[i] = qwen35::to_float(x[i]);
      xf = a.data();
    }
    c.resize(M * kPanel);
    qwen35::matmul(xf, K, w + n * K, width, M, K, width, c.data(), width, false);
    for (int64_t m = 0; m < M; ++m) std::memcpy(y + m * N + n, c.data() + m * width, sizeof(float) * width);
  });
}

ffi::Error DenseRows(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  const auto xd = x.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || w.dimensions().size() != 1 || yd[0] != xd[0] ||
      int64_t(w.element_count()) != xd[1] * yd[1])
    return ffi::Error::InvalidArgument("dense.native: want x [M, K], w [K * N] (packed) and y [M, N]");
  if (x.element_type() != w.element_type() ||
      (x.element_type() != ffi::DataType::F32 && x.element_type() != ffi::DataType::BF16))
    return ffi::Error::InvalidArgument("dense.native: x and w float32 or bfloat16, one dtype");
  if (x.element_type() == ffi::DataType::F32)
    rows(pool, static_cast<const float*>(x.untyped_data()), static_cast<const float*>(w.untyped_data()), xd[0],
         xd[1], yd[1], y->typed_data());
  else
    rows(pool, static_cast<const bf16*>(x.untyped_data()), static_cast<const bf16*>(w.untyped_data()), xd[0],
         xd[1], yd[1], y->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(qwen35_dense_rows, DenseRows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
