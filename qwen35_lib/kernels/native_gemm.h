// The register-blocked matmul the native CPU kernels share (moe_native.cc, dense_native.cc): float32 accumulators,
// weights float32 or bfloat16, row-major or packed in panels of kPanel columns.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "native_common.h"

namespace qwen35 {

typedef float v16 __attribute__((vector_size(64)));  // 16 floats: one AVX-512 register, two AVX2 ones
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

constexpr int kRows = 6;        // rows of a register block
constexpr int kVecs = 4;        // 16-float vectors of a register block: 6 x 64 accumulators
constexpr int64_t kPanel = 16 * kVecs;  // columns of a packed weight panel
constexpr int64_t kAhead = 32;  // rows of B a block prefetches ahead (8 KiB of a 64-column panel): a stream
                                // from memory keeps more lines in flight than the block's loads alone (a few
                                // rows of activations read each weight line twice as fast: 22 -> 26 GB/s)
constexpr int64_t kDepth = 128;  // rows of a panel a register block streams at a time: 128 x 64 floats, 32 KiB, stay
                                 // in L1 for the next row block (a whole panel, 128 KiB at K = 512, came from L2)

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


// C[MR, 16 NV] (+)= A[MR, K] @ B[K, 16 NV] (ACC: added to C); A float32, B float32 or bfloat16; row strides lda,
// ldb, ldc
template <int MR, int NV, typename W, bool ACC>
void block(const float* A, int64_t lda, const W* B, int64_t ldb, int64_t K, float* C, int64_t ldc) {
  v16 acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[r][j] = ACC ? load16(C + r * ldc + 16 * j) : v16{};
  for (int64_t k = 0; k < K; ++k) {
    v16 b[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) b[j] = load16(B + k * ldb + 16 * j);
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) __builtin_prefetch(B + (k + kAhead) * ldb + 16 * j, 0, 2);  // into L2
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const float a = A[r * lda + k];  // broadcast by the vector ops (`v16{} + a` would cost an add)
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

template <int MR, typename W, bool ACC>
Block<W> with_vecs(int nv) {
  return nv == 1 ? block<MR, 1, W, ACC> : nv == 2 ? block<MR, 2, W, ACC> : nv == 3 ? block<MR, 3, W, ACC>
                                                                                   : block<MR, 4, W, ACC>;
}

template <typename W, bool ACC>
Block<W> with_rows(int mr, int nv) {
  switch (mr) {
    case 1: return with_vecs<1, W, ACC>(nv);
    case 2: return with_vecs<2, W, ACC>(nv);
    case 3: return with_vecs<3, W, ACC>(nv);
    case 4: return with_vecs<4, W, ACC>(nv);
    case 5: return with_vecs<5, W, ACC>(nv);
    default: return with_vecs<6, W, ACC>(nv);
  }
}

template <typename W>
Block<W> pick(int mr, int nv, bool acc) {
  return acc ? with_rows<W, true>(mr, nv) : with_rows<W, false>(mr, nv);
}

// C[M, 16 nv] = A[M, K] @ B[K, 16 nv]. Over one row block, B streams once; over several, kDepth rows of B at a
// time, every row block over them (the second one on reads them from L1), each block's sums carried in C from one
// depth to the next (the same order of additions).
template <typename W>
void blocks(const float* A, int64_t lda, const W* B, int64_t ldb, int64_t M, int64_t K, int nv, float* C,
            int64_t ldc) {
  const int64_t depth = M > kRows ? kDepth : K;
  for (int64_t k = 0; k < K; k += depth)
    for (int64_t m = 0; m < M; m += kRows)
      pick<W>(int(std::min<int64_t>(kRows, M - m)), nv, k > 0)(A + m * lda + k, lda, B + k * ldb, ldb,
                                                              std::min<int64_t>(depth, K - k), C + m * ldc, ldc);
}

// C[M, N] = A[M, K] @ B[K, N]: register blocks over the whole 16-column vectors, a scalar loop over the rest.
// B row-major (row stride ldb), or packed: its kPanel-column panels one after another, each [K, width] row-major
// (the last one narrower when N is not a multiple of kPanel), so that a block streams its panel contiguously.
template <typename W>
void matmul(const float* A, int64_t lda, const W* B, int64_t ldb, int64_t M, int64_t K, int64_t N, float* C,
            int64_t ldc, bool packed) {
  const int64_t n16 = N / 16 * 16;
  auto panel = [&](int64_t n) { return packed ? B + n * K : B + n; };  // n: a multiple of kPanel
  auto stride = [&](int64_t n) { return packed ? std::min<int64_t>(kPanel, N - n) : ldb; };
  for (int64_t n = 0; n < n16; n += kPanel) {
    const int nv = int(std::min<int64_t>(kVecs, (n16 - n) / 16));
    const W* Bn = panel(n);
    const int64_t ld = stride(n);
    if (!std::is_same_v<W, float> && M > kRows) {  // bf16: the panel converted once, not once per row block
      thread_local std::vector<float> converted;
      converted.resize(K * 16 * nv);
      for (int64_t k = 0; k < K; ++k)
        for (int j = 0; j < nv; ++j) {
          const v16 b = load16(Bn + k * ld + 16 * j);
          std::memcpy(&converted[(k * nv + j) * 16], &b, sizeof b);
        }
      blocks<float>(A, lda, converted.data(), 16 * nv, M, K, nv, C + n, ldc);
      continue;
    }
    blocks<W>(A, lda, Bn, ld, M, K, nv, C + n, ldc);
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = n16; n < N; ++n) {
      const int64_t n0 = n / kPanel * kPanel;  // column n's panel
      const W* Bn = packed ? panel(n0) + (n - n0) : B + n;
      const int64_t ld = stride(n0);
      float s = 0;
      for (int64_t k = 0; k < K; ++k) s += A[m * lda + k] * to_float(Bn[k * ld]);
      C[m * ldc + n] = s;
    }
}

}  // namespace qwen35
