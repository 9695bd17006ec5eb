// The grouped SwiGLU expert FFNs on the CPU, as an XLA FFI handler: the `moe_matmul` slot's protocol
// (qwen35_lib/kernels/moe_xla.py) in native code, for float32 and bfloat16.
//
//   x [N, D] rows sorted by expert, group_sizes [E] int32, w_gate_up [E, D, 2, F], w_down [E, F, D] -> y [N, D]
//
// Work units are (expert, chunk of up to kChunk of its rows), for experts with rows only, handed out from an
// atomic counter to this thread and to helpers on XLA's intra-op thread pool. A unit runs two register-blocked
// matmuls straight from the expert's weights (each touched expert read in place, once per chunk):
//   h [m, 2F] = x_rows [m, D] @ w_gate_up[e]  (float32 accumulators)
//   a [m, F] = silu(h_gate) * h_up, rounded to x's dtype (as moe_xla's _swiglu)
//   y_rows [m, D] = a @ w_down[e], rounded to x's dtype
// Rows past the sum of the group sizes (padding) are written 0.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using bf16 = uint16_t;  // bfloat16 bits
typedef float v16 __attribute__((vector_size(64)));  // 16 floats: one AVX-512 register, two AVX2 ones
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

constexpr int kRows = 6;        // rows of a register block
constexpr int kVecs = 4;        // 16-float vectors of a register block: 6 x 64 accumulators
constexpr int64_t kChunk = 96;  // rows of a work unit

inline float to_float(float v) { return v; }
inline float to_float(bf16 v) {
  const uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline bf16 round_bf16(float f) {  // round to nearest even, as XLA's convert
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16((u >> 16) | 0x40);  // NaN stays a (quiet) NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16(u >> 16);
}

template <typename T>
inline T from_float(float f) {
  if constexpr (std::is_same_v<T, float>) return f;
  else return round_bf16(f);
}

template <typename T>
inline float rounded(float f) {  // f as x's dtype holds it
  return to_float(from_float<T>(f));
}

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline v16 load16(const bf16* p) {
  u16x16 h;
  std::memcpy(&h, p, sizeof h);
  const u32x16 u = __builtin_convertvector(h, u32x16) << 16;
  v16 v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

// C[MR, 16 NV] = A[MR, K] @ B[K, 16 NV]; A float32, B float32 or bfloat16; row strides lda, ldb, ldc
template <int MR, int NV, typename W>
void block(const float* A, int64_t lda, const W* B, int64_t ldb, int64_t K, float* C, int64_t ldc) {
  v16 acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[r][j] = v16{};
  for (int64_t k = 0; k < K; ++k) {
    v16 b[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) b[j] = load16(B + k * ldb + 16 * j);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const v16 a = v16{} + A[r * lda + k];
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) acc[r][j] += a * b[j];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) std::memcpy(C + r * ldc + 16 * j, &acc[r][j], sizeof(v16));
}

template <typename W>
using Block = void (*)(const float*, int64_t, const W*, int64_t, int64_t, float*, int64_t);

template <int MR, typename W>
Block<W> with_vecs(int nv) {
  return nv == 1 ? block<MR, 1, W> : nv == 2 ? block<MR, 2, W> : nv == 3 ? block<MR, 3, W> : block<MR, 4, W>;
}

template <typename W>
Block<W> pick(int mr, int nv) {
  switch (mr) {
    case 1: return with_vecs<1, W>(nv);
    case 2: return with_vecs<2, W>(nv);
    case 3: return with_vecs<3, W>(nv);
    case 4: return with_vecs<4, W>(nv);
    case 5: return with_vecs<5, W>(nv);
    default: return with_vecs<6, W>(nv);
  }
}

// C[M, N] = A[M, K] @ B[K, N]: register blocks over the whole 16-column vectors, a scalar loop over the rest
template <typename W>
void matmul(const float* A, int64_t lda, const W* B, int64_t ldb, int64_t M, int64_t K, int64_t N, float* C,
            int64_t ldc) {
  const int64_t n16 = N / 16 * 16;
  for (int64_t n = 0; n < n16; n += 16 * kVecs) {
    const int nv = int(std::min<int64_t>(kVecs, (n16 - n) / 16));
    for (int64_t m = 0; m < M; m += kRows)
      pick<W>(int(std::min<int64_t>(kRows, M - m)), nv)(A + m * lda, lda, B + n, ldb, K, C + m * ldc + n, ldc);
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = n16; n < N; ++n) {
      float s = 0;
      for (int64_t k = 0; k < K; ++k) s += A[m * lda + k] * to_float(B[k * ldb + n]);
      C[m * ldc + n] = s;
    }
}

struct Unit {
  int64_t expert, row, rows;
};

// One unit: rows [row, row + rows) of x, all of one expert. Scratch: xs [kChunk, D], h [kChunk, 2F],
// a [kChunk, F], o [kChunk, D], all float32.
template <typename T>
void run_unit(const Unit& u, int64_t D, int64_t F, const T* x, const T* w_gate_up, const T* w_down, T* y,
              float* scratch) {
  const int64_t m = u.rows;
  float* xs = scratch;
  float* h = xs + kChunk * D;
  float* a = h + kChunk * 2 * F;
  float* o = a + kChunk * F;
  for (int64_t i = 0; i < m * D; ++i) xs[i] = to_float(x[u.row * D + i]);
  matmul(xs, D, w_gate_up + u.expert * D * 2 * F, 2 * F, m, D, 2 * F, h, 2 * F);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t f = 0; f < F; ++f) {
      const float g = h[r * 2 * F + f], up = h[r * 2 * F + F + f];
      a[r * F + f] = rounded<T>(g / (1.0f + std::exp(-g)) * up);
    }
  matmul(a, F, w_down + u.expert * F * D, D, m, F, D, o, D);
  for (int64_t i = 0; i < m * D; ++i) y[u.row * D + i] = from_float<T>(o[i]);
}

struct Counter {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> busy{0};
};

template <typename T>
void grouped(ffi::ThreadPool& pool, int64_t N, int64_t D, int64_t E, int64_t F, const T* x, const int32_t* sizes,
             const T* w_gate_up, const T* w_down, T* y) {
  auto units = std::make_shared<std::vector<Unit>>();
  int64_t row = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = std::min<int64_t>(std::max<int32_t>(sizes[e], 0), N - row);
    for (int64_t i = 0; i < n; i += kChunk) units->push_back({e, row + i, std::min<int64_t>(kChunk, n - i)});
    row += n;
  }
  std::memset(static_cast<void*>(y + row * D), 0, sizeof(T) * (N - row) * D);  // padding rows
  const int64_t scratch = kChunk * (2 * D + 3 * F);
  auto counter = std::make_shared<Counter>();
  // A helper that starts after this call returned finds the counter spent and touches no buffer.
  auto work = [=](Counter* c) {
    std::unique_ptr<float[]> s;
    for (int64_t i; (i = c->next.fetch_add(1)) < int64_t(units->size());) {
      if (!s) s.reset(new float[scratch]);
      run_unit((*units)[i], D, F, x, w_gate_up, w_down, y, s.get());
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), int64_t(units->size())) - 1;
  for (int64_t t = 0; t < helpers; ++t)
    pool.Schedule([counter, work]() {
      counter->busy.fetch_add(1);
      work(counter.get());
      counter->busy.fetch_sub(1);
    });
  work(counter.get());
  while (counter->busy.load() != 0) std::this_thread::yield();
}

ffi::Error GroupedSwiglu(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> group_sizes,
                         ffi::AnyBuffer w_gate_up, ffi::AnyBuffer w_down, ffi::Result<ffi::AnyBuffer> y) {
  const auto xd = x.dimensions(), gd = w_gate_up.dimensions(), dd = w_down.dimensions();
  if (xd.size() != 2 || gd.size() != 4 || dd.size() != 3 || group_sizes.dimensions().size() != 1)
    return ffi::Error::InvalidArgument("moe_native: want x [N, D], group_sizes [E], w_gate_up [E, D, 2, F], "
                                       "w_down [E, F, D]");
  const int64_t N = xd[0], D = xd[1], E = gd[0], F = gd[3];
  if (gd[1] != D || gd[2] != 2 || dd[0] != E || dd[1] != F || dd[2] != D || group_sizes.dimensions()[0] != E)
    return ffi::Error::InvalidArgument("moe_native: shapes disagree (x [N, D], group_sizes [E], "
                                       "w_gate_up [E, D, 2, F], w_down [E, F, D])");
  const auto t = x.element_type();
  if (w_gate_up.element_type() != t || w_down.element_type() != t || y->element_type() != t)
    return ffi::Error::InvalidArgument("moe_native: x and the expert weights must share one dtype");
  const int32_t* gs = group_sizes.typed_data();
  if (t == ffi::DataType::F32) {
    grouped(pool, N, D, E, F, static_cast<const float*>(x.untyped_data()), gs,
            static_cast<const float*>(w_gate_up.untyped_data()), static_cast<const float*>(w_down.untyped_data()),
            static_cast<float*>(y->untyped_data()));
  } else if (t == ffi::DataType::BF16) {
    grouped(pool, N, D, E, F, static_cast<const bf16*>(x.untyped_data()), gs,
            static_cast<const bf16*>(w_gate_up.untyped_data()), static_cast<const bf16*>(w_down.untyped_data()),
            static_cast<bf16*>(y->untyped_data()));
  } else {
    return ffi::Error::InvalidArgument("moe_native: float32 or bfloat16 only");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(qwen35_moe_grouped_swiglu, GroupedSwiglu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
