// The grouped SwiGLU expert FFNs on the CPU, as XLA FFI handlers, for float32 and bfloat16
// (qwen35_lib/kernels/moe/native.py calls them):
//
// qwen35_moe_grouped_swiglu, the `moe_matmul` slot's protocol (qwen35_lib/kernels/moe/xla.py):
//   x [N, D] rows sorted by expert, group_sizes [E] int32, w_gate_up [E, D, 2, F], w_down [E, F, D] -> y [N, D]
//   (the weights may come packed instead, [E, D * 2F] and [E, F * D]: each expert's matrix as its 64-column
//   panels one after another, so that a register block streams its panel contiguously; moe/native.py pack_experts)
// qwen35_moe_grouped_swiglu_fused, dispatch and combine inside (as moe_xla.moe_loop_fused):
//   x [T, D], ids [T, k] int32 (>= E: routed nowhere), weights [T, k], w_gate_up, w_down
//   -> out [T, D] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t]), and copies [T * k, D] float32 (scratch)
//
// Work units are (expert, chunk of up to kChunk of its rows), for experts with rows only, handed out from an
// atomic counter to this thread and to helpers on XLA's intra-op thread pool. A unit gathers its rows (converted
// to float32) and runs two register-blocked matmuls straight from the expert's weights (each touched expert read
// in place, once per chunk):
//   h [m, 2F] = x_rows [m, D] @ w_gate_up[e]  (float32 accumulators)
//   a [m, F] = silu(h_gate) * h_up (a vectorised exp), rounded to x's dtype (as moe/xla.py's _swiglu)
//   y_rows [m, D] = a @ w_down[e], rounded to x's dtype
// Sorted: rows past the sum of the group sizes (padding) are written 0. Fused: each copy's rounded output times
// its routing weight goes to its row of `copies`; a second parallel pass sums each token's k rows in slot order
// (deterministic) and rounds the sum to x's dtype once.

#include <algorithm>
#include <cmath>
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
using qwen35::ivec;
using qwen35::kLanes;
using qwen35::loadv;
using qwen35::matmul;
using qwen35::storev;
using qwen35::to_float;
using qwen35::vec;
constexpr int64_t kChunk = 96;  // rows of a work unit
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

// exp of a vector (Cephes' expf: 2^n e^r, |r| <= ln2 / 2, a degree-6 polynomial; ~1 ulp), inputs clamped to
// +-88.3 (exp's float range): the SwiGLU's sigmoid over whole vectors instead of one libm call per element
inline vec expv(vec x) {
  x = x > 88.3762626647949f ? vec{} + 88.3762626647949f : x;
  x = x < -88.3762626647949f ? vec{} - 88.3762626647949f : x;
  const vec t = x * 1.44269504088896341f + 0.5f;
  vec n = __builtin_convertvector(__builtin_convertvector(t, ivec), vec);  // toward zero, then floor:
  n = n > t ? n - 1.0f : n;
  x = x - n * 0.693359375f + n * 2.12194440e-4f;
  vec y = vec{} + 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * x * x + x + 1.0f;
  const ivec scale = (__builtin_convertvector(n, ivec) + 127) << 23;  // 2^n
  vec two_n;
  std::memcpy(&two_n, &scale, sizeof two_n);
  return y * two_n;
}

// a[F] = silu(h[:F]) * h[F:], rounded to T
template <typename T>
void swiglu(const float* h, int64_t F, float* a) {
  int64_t f = 0;
  for (; f + kLanes <= F; f += kLanes) {
    const vec g = loadv(h + f), up = loadv(h + F + f);
    storev(a + f, g / (1.0f + expv(-g)) * up);
  }
  for (; f < F; ++f) a[f] = h[f] / (1.0f + std::exp(-h[f])) * h[F + f];
  if constexpr (!std::is_same_v<T, float>)
    for (f = 0; f < F; ++f) a[f] = rounded<T>(a[f]);
}

struct Unit {
  int64_t expert, row, rows;  // rows [row, row + rows) of the expert-sorted order
};

// Where a unit's rows come from and where its outputs go.
// Sorted (the slot's protocol): row i is x[i]; y[i] = the expert's output in x's dtype.
// Fused (dispatch and combine inside): sorted position i is copy c = order[i] of token c / k; the output, rounded
// to x's dtype as the sorted path returns it, times the copy's routing weight goes to float32 row c of `copies`.
template <typename T>
struct Rows {
  const T* x;
  const int32_t* order;  // nullptr: sorted
  int64_t k;
  const T* weights;  // [T * k] (fused)
  T* y;              // [N, D] (sorted)
  float* copies;     // [T * k, D] (fused)
  bool packed;       // the expert weights panel-major (see `matmul`)
};

// One unit, scratch xs [kChunk, D], h [kChunk, 2F], a [kChunk, F], o [kChunk, D], all float32.
template <typename T>
void run_unit(const Unit& u, int64_t D, int64_t F, const Rows<T>& io, const T* w_gate_up, const T* w_down,
              float* scratch) {
  const int64_t m = u.rows;
  float* xs = scratch;
  float* h = xs + kChunk * D;
  float* a = h + kChunk * 2 * F;
  float* o = a + kChunk * F;
  for (int64_t r = 0; r < m; ++r) {
    const int64_t src = io.order ? io.order[u.row + r] / io.k : u.row + r;
    for (int64_t d = 0; d < D; ++d) xs[r * D + d] = to_float(io.x[src * D + d]);
  }
  matmul(xs, D, w_gate_up + u.expert * D * 2 * F, 2 * F, m, D, 2 * F, h, 2 * F, io.packed);
  for (int64_t r = 0; r < m; ++r) swiglu<T>(h + r * 2 * F, F, a + r * F);
  matmul(a, F, w_down + u.expert * F * D, D, m, F, D, o, D, io.packed);
  for (int64_t r = 0; r < m; ++r) {
    if (io.order) {
      const int64_t c = io.order[u.row + r];
      const float w = to_float(io.weights[c]);
      for (int64_t d = 0; d < D; ++d) io.copies[c * D + d] = rounded<T>(o[r * D + d]) * w;
    } else {
      for (int64_t d = 0; d < D; ++d) io.y[(u.row + r) * D + d] = from_float<T>(o[r * D + d]);
    }
  }
}

template <typename T>
void run_units(ffi::ThreadPool& pool, const std::vector<Unit>& units, int64_t D, int64_t F, const Rows<T>& io,
               const T* w_gate_up, const T* w_down) {
  const size_t scratch = kChunk * (2 * D + 3 * F);
  qwen35::parallel_for(pool, int64_t(units.size()), [&](int64_t i) {
    thread_local std::vector<float> buf;  // each thread's, kept between calls
    if (buf.size() < scratch) buf.resize(scratch);
    run_unit(units[i], D, F, io, w_gate_up, w_down, buf.data());
  });
}

// The units of groups of the given sizes (negative: 0; clamped to `rows` in all), in order; returns the rows used.
int64_t make_units(const int32_t* sizes, int64_t E, int64_t rows, std::vector<Unit>& units) {
  int64_t row = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = std::min<int64_t>(std::max<int32_t>(sizes[e], 0), rows - row);
    for (int64_t i = 0; i < n; i += kChunk) units.push_back({e, row + i, std::min<int64_t>(kChunk, n - i)});
    row += n;
  }
  return row;
}

template <typename T>
void grouped(ffi::ThreadPool& pool, int64_t N, int64_t D, int64_t E, int64_t F, const T* x, const int32_t* sizes,
             const T* w_gate_up, const T* w_down, bool packed, T* y) {
  std::vector<Unit> units;
  const int64_t used = make_units(sizes, E, N, units);
  std::memset(static_cast<void*>(y + used * D), 0, sizeof(T) * (N - used) * D);  // padding rows
  run_units(pool, units, D, F, Rows<T>{x, nullptr, 1, nullptr, y, nullptr, packed}, w_gate_up, w_down);
}

// out [Tn, D] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t]); ids >= E (or < 0): routed nowhere. `copies`
// [Tn * k, D] float32 holds each copy's weighted output before the per-token sum (in j order).
template <typename T>
void grouped_fused(ffi::ThreadPool& pool, int64_t Tn, int64_t k, int64_t D, int64_t E, int64_t F, const T* x,
                   const int32_t* ids, const T* weights, const T* w_gate_up, const T* w_down, bool packed, T* out,
                   float* copies) {
  std::vector<int32_t> sizes(E, 0), order(Tn * k);
  for (int64_t c = 0; c < Tn * k; ++c)
    if (ids[c] >= 0 && ids[c] < E) ++sizes[ids[c]];
  std::vector<int64_t> next(E, 0);
  for (int64_t e = 1; e < E; ++e) next[e] = next[e - 1] + sizes[e - 1];
  for (int64_t c = 0; c < Tn * k; ++c)  // a stable counting sort of the copies by expert
    if (ids[c] >= 0 && ids[c] < E) order[next[ids[c]]++] = int32_t(c);
  std::vector<Unit> units;
  make_units(sizes.data(), E, Tn * k, units);
  run_units(pool, units, D, F, Rows<T>{x, order.data(), k, weights, nullptr, copies, packed}, w_gate_up, w_down);
  constexpr int64_t kTokens = 16;  // tokens of a combine unit
  qwen35::parallel_for(pool, (Tn + kTokens - 1) / kTokens, [&](int64_t b) {
    std::vector<float> acc(D);
    for (int64_t t = b * kTokens; t < std::min(Tn, (b + 1) * kTokens); ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t c = t * k + j;
        if (ids[c] < 0 || ids[c] >= E) continue;
        for (int64_t d = 0; d < D; ++d) acc[d] += copies[c * D + d];
      }
      for (int64_t d = 0; d < D; ++d) out[t * D + d] = from_float<T>(acc[d]);
    }
  });
}

struct Dims {
  int64_t E, D, F;
  bool packed;
};

// w_gate_up [E, D, 2, F], w_down [E, F, D], or both packed ([E, D * 2F] and [E, F * D]: each expert's matrix as
// its panels, see `matmul`), of x's dtype; an error message or "" when they are
const char* check_experts(ffi::AnyBuffer& w_gate_up, ffi::AnyBuffer& w_down, int64_t D, ffi::DataType t,
                          Dims& dims) {
  const auto gd = w_gate_up.dimensions(), dd = w_down.dimensions();
  if (gd.size() == 2 && dd.size() == 2) {
    dims = {gd[0], D, D > 0 ? gd[1] / (2 * D) : 0, true};
    if (D <= 0 || gd[1] != 2 * D * dims.F || dd[0] != dims.E || dd[1] != dims.F * D)
      return "moe.native: packed shapes disagree (x [.., D], w_gate_up [E, D * 2F], w_down [E, F * D])";
  } else if (gd.size() == 4 && dd.size() == 3) {
    dims = {gd[0], gd[1], gd[3], false};
    if (gd[1] != D || gd[2] != 2 || dd[0] != dims.E || dd[1] != dims.F || dd[2] != D)
      return "moe.native: shapes disagree (x [.., D], w_gate_up [E, D, 2, F], w_down [E, F, D])";
  } else {
    return "moe.native: want w_gate_up [E, D, 2, F] and w_down [E, F, D] (or both packed: [E, D * 2F], [E, F * D])";
  }
  if (w_gate_up.element_type() != t || w_down.element_type() != t)
    return "moe.native: x and the expert weights must share one dtype";
  if (t != ffi::DataType::F32 && t != ffi::DataType::BF16) return "moe.native: float32 or bfloat16 only";
  return "";
}

template <typename T>
const T* data(const ffi::AnyBuffer& b) {
  return static_cast<const T*>(b.untyped_data());
}

ffi::Error GroupedSwiglu(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> group_sizes,
                         ffi::AnyBuffer w_gate_up, ffi::AnyBuffer w_down, ffi::Result<ffi::AnyBuffer> y) {
  const auto xd = x.dimensions();
  if (xd.size() != 2 || group_sizes.dimensions().size() != 1)
    return ffi::Error::InvalidArgument("moe.native: want x [N, D] and group_sizes [E]");
  Dims w;
  if (const char* bad = check_experts(w_gate_up, w_down, xd[1], x.element_type(), w); *bad)
    return ffi::Error::InvalidArgument(bad);
  if (group_sizes.dimensions()[0] != w.E || y->element_type() != x.element_type())
    return ffi::Error::InvalidArgument("moe.native: group_sizes [E] and y of x's dtype");
  const int32_t* gs = group_sizes.typed_data();
  if (x.element_type() == ffi::DataType::F32)
    grouped(pool, xd[0], w.D, w.E, w.F, data<float>(x), gs, data<float>(w_gate_up), data<float>(w_down),
            w.packed, static_cast<float*>(y->untyped_data()));
  else
    grouped(pool, xd[0], w.D, w.E, w.F, data<bf16>(x), gs, data<bf16>(w_gate_up), data<bf16>(w_down),
            w.packed, static_cast<bf16*>(y->untyped_data()));
  return ffi::Error::Success();
}

ffi::Error GroupedSwigluFused(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> ids,
                              ffi::AnyBuffer weights, ffi::AnyBuffer w_gate_up, ffi::AnyBuffer w_down,
                              ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> copies) {
  const auto xd = x.dimensions(), id = ids.dimensions();
  if (xd.size() != 2 || id.size() != 2 || id[0] != xd[0] || weights.dimensions().size() != 2 ||
      weights.dimensions()[0] != id[0] || weights.dimensions()[1] != id[1])
    return ffi::Error::InvalidArgument("moe.native: want x [T, D], ids [T, k] and weights [T, k]");
  Dims w;
  if (const char* bad = check_experts(w_gate_up, w_down, xd[1], x.element_type(), w); *bad)
    return ffi::Error::InvalidArgument(bad);
  if (weights.element_type() != x.element_type() || out->element_type() != x.element_type())
    return ffi::Error::InvalidArgument("moe.native: weights and the output of x's dtype");
  float* cp = copies->typed_data();
  if (x.element_type() == ffi::DataType::F32)
    grouped_fused(pool, xd[0], id[1], w.D, w.E, w.F, data<float>(x), ids.typed_data(), data<float>(weights),
                  data<float>(w_gate_up), data<float>(w_down), w.packed, static_cast<float*>(out->untyped_data()),
                  cp);
  else
    grouped_fused(pool, xd[0], id[1], w.D, w.E, w.F, data<bf16>(x), ids.typed_data(), data<bf16>(weights),
                  data<bf16>(w_gate_up), data<bf16>(w_down), w.packed, static_cast<bf16*>(out->untyped_data()),
                  cp);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(qwen35_moe_grouped_swiglu_fused, GroupedSwigluFused,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
