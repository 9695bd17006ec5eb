// The register-blocked matmul the native CPU kernels share (native/moe.cc, native/dense.cc): float32 accumulators,
// weights float32 or bfloat16, row-major or packed in panels of kPanel columns.
//
// The register block is chosen for the ISA being built (native/common.h: kLanes floats a register, kRegs
// registers): a block of MR rows and NV vectors holds MR x NV accumulators, NV vectors of B (when MR > 1: each is
// read by every row; one row uses each once, straight from memory) and a broadcast of A, all in registers, so
//   NV(MR) = the largest power of two <= kPanel / kLanes with MR NV + (MR > 1 ? NV : 0) + 1 <= kRegs.
// kRows = 6 rows at most. The blocks (rows x columns) this gives:
//              MR = 1     2       3-6
//   AVX-512    1 x 64     2 x 64  6 x 64   (24 of 32 zmm at 6 rows: a block spans a panel)
//   AVX2       1 x 64     2 x 32  6 x 16   (12 of 16 ymm at 6 rows: a panel is 4 blocks wide)
//   NEON       1 x 64     2 x 32  6 x 16   (24 of 32 q registers at 6 rows)
// (AVX-512's 6 x 64 on AVX2 is 48 ymm accumulators: spilled, 60x slower.) The packed layout (kPanel = 64 columns,
// packed.PANEL) is the same for every ISA, so weights packed once serve any variant.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "common.h"

namespace qwen35 {
inline namespace QWEN35_ISA_NS {

constexpr int kRows = 6;                // rows of a register block, at most
constexpr int64_t kPanel = 64;          // columns of a packed weight panel
constexpr int kPanelVecs = kPanel / kLanes;  // vectors across a panel
constexpr int64_t kAhead = 32;  // rows of B a block prefetches ahead (8 KiB of a 64-column panel): a stream
                                // from memory keeps more lines in flight than the block's loads alone (a few
                                // rows of activations read each weight line twice as fast: 22 -> 26 GB/s).
                                // Where a row block spans the panel in several blocks (AVX2, NEON), each
                                // prefetches its columns of the next kDepth rows instead: the panel's lines come
                                // in over all the passes, not in the first pass's quarter of the time (AVX2, 8
                                // rows x 512 x 1024, from L3: 0.6 -> 0.85 of the AVX-512 build's speed)
constexpr int64_t kDepth = 128;  // rows of a panel a row block streams at a time: 128 x 64 floats, 32 KiB, stay
                                 // in L1 for the next row block (a whole panel, 128 KiB at K = 512, came from L2)

#if defined(__aarch64__)
#define QWEN35_IN_REGISTER(v) asm("" : "+w"(v))
#else
#define QWEN35_IN_REGISTER(v) asm("" : "+v"(v))
#endif

// The vectors of a register block of mr rows (see the top)
constexpr int vecs_for(int mr) {
  int nv = kPanelVecs;
  while (nv > 1 && mr * nv + (mr > 1 ? nv : 0) + 1 > kRegs) nv /= 2;
  return nv;
}
static_assert(kPanel % kLanes == 0 && vecs_for(kRows) >= 1 && kRows * vecs_for(kRows) + vecs_for(kRows) + 1 <= kRegs,
              "a register block must fit the registers");

// C[MR, kLanes NV] (+)= A[MR, K] @ B[K, kLanes NV] (ACC: added to C); A float32, B float32 or bfloat16; row
// strides lda, ldb, ldc; its columns of B prefetched `ahead` rows ahead
template <int MR, int NV, typename W, bool ACC>
void block(const float* A, int64_t lda, const W* B, int64_t ldb, int64_t K, float* C, int64_t ldc, int64_t ahead) {
  constexpr int kLine = 64 / int(sizeof(W) * kLanes);  // vectors of B in a cache line (1 or more)
  vec acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) acc[r][j] = ACC ? loadv(C + r * ldc + kLanes * j) : vec{};
  for (int64_t k = 0; k < K; ++k) {
    if constexpr (MR == 1) {  // each vector of B used once: straight into its FMA
      const float a = A[k];
#pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) acc[0][j] += a * loadv(B + k * ldb + kLanes * j);
    } else {
      vec b[NV];
#pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) {
        b[j] = loadv(B + k * ldb + kLanes * j);
        QWEN35_IN_REGISTER(b[j]);  // else GCC loads it again for each row's FMA (AVX2 6 x 16: 18 loads a k)
      }
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const float a = A[r * lda + k];  // broadcast by the vector ops (`vec{} + a` would cost an add)
#pragma GCC unroll 16
        for (int j = 0; j < NV; ++j) acc[r][j] += a * b[j];
      }
    }
#pragma GCC unroll 16
    for (int j = 0; j < NV; j += kLine) __builtin_prefetch(B + (k + ahead) * ldb + kLanes * j, 0, 2);  // into L2
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) storev(C + r * ldc + kLanes * j, acc[r][j]);
}

template <typename W>
using Block = void (*)(const float*, int64_t, const W*, int64_t, int64_t, float*, int64_t, int64_t);

template <int MR, typename W, bool ACC, int... J>
Block<W> with_vecs(int nv, std::integer_sequence<int, J...>) {  // nv in [1, vecs_for(MR)]
  static constexpr Block<W> table[] = {block<MR, J + 1, W, ACC>...};
  return table[nv - 1];
}

template <typename W, bool ACC, int... R>
Block<W> with_rows(int mr, int nv, std::integer_sequence<int, R...>) {  // mr in [1, kRows]
  Block<W> found = nullptr;
  ((mr == R + 1 ? (found = with_vecs<R + 1, W, ACC>(nv, std::make_integer_sequence<int, vecs_for(R + 1)>{})) : 0),
   ...);
  return found;
}

// The block of mr rows and nv vectors (nv <= vecs_for(mr)), adding to C or not
template <typename W>
Block<W> pick(int mr, int nv, bool acc) {
  constexpr auto rows = std::make_integer_sequence<int, kRows>{};
  return acc ? with_rows<W, true>(mr, nv, rows) : with_rows<W, false>(mr, nv, rows);
}

// C[M, kLanes nv] = A[M, K] @ B[K, kLanes nv] (nv <= kPanelVecs: one panel's whole vectors). A row block covers
// the panel in blocks of vecs_for(its rows) vectors. Over one row block of one block, B streams once; else kDepth
// rows of B at a time, every block over them (the second one on reads them from L1), each block's sums carried in
// C from one depth to the next (the same order of additions).
template <typename W>
void blocks(const float* A, int64_t lda, const W* B, int64_t ldb, int64_t M, int64_t K, int nv, float* C,
            int64_t ldc) {
  const bool split = vecs_for(int(std::min<int64_t>(M, kRows))) < nv;  // a row block spans the panel in several
  const int64_t depth = (M > kRows || split) ? kDepth : K;
  for (int64_t k = 0; k < K; k += depth)
    for (int64_t m = 0; m < M; m += kRows) {
      const int mr = int(std::min<int64_t>(kRows, M - m));
      const int step = vecs_for(mr);
      for (int j = 0; j < nv; j += step)
        pick<W>(mr, std::min(step, nv - j), k > 0)(A + m * lda + k, lda, B + k * ldb + kLanes * j, ldb,
                                                   std::min<int64_t>(depth, K - k), C + m * ldc + kLanes * j, ldc,
                                                   split ? depth : kAhead);
    }
}

// C[M, N] = A[M, K] @ B[K, N]: register blocks over the whole kLanes-column vectors, a scalar loop over the rest.
// B row-major (row stride ldb), or packed: its kPanel-column panels one after another, each [K, width] row-major
// (the last one narrower when N is not a multiple of kPanel), so that a block streams its panel contiguously.
template <typename W>
void matmul(const float* A, int64_t lda, const W* B, int64_t ldb, int64_t M, int64_t K, int64_t N, float* C,
            int64_t ldc, bool packed) {
  const int64_t nfull = N / kLanes * kLanes;
  auto panel = [&](int64_t n) { return packed ? B + n * K : B + n; };  // n: a multiple of kPanel
  auto stride = [&](int64_t n) { return packed ? std::min<int64_t>(kPanel, N - n) : ldb; };
  for (int64_t n = 0; n < nfull; n += kPanel) {
    const int nv = int(std::min<int64_t>(kPanelVecs, (nfull - n) / kLanes));
    const W* Bn = panel(n);
    const int64_t ld = stride(n);
    if (!std::is_same_v<W, float> && M > kRows) {  // bf16: the panel converted once, not once per row block
      thread_local std::vector<float> converted;
      converted.resize(K * kLanes * nv);
      for (int64_t k = 0; k < K; ++k)
        for (int j = 0; j < nv; ++j) storev(&converted[(k * nv + j) * kLanes], loadv(Bn + k * ld + kLanes * j));
      blocks<float>(A, lda, converted.data(), kLanes * nv, M, K, nv, C + n, ldc);
      continue;
    }
    blocks<W>(A, lda, Bn, ld, M, K, nv, C + n, ldc);
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = nfull; n < N; ++n) {
      const int64_t n0 = n / kPanel * kPanel;  // column n's panel
      const W* Bn = packed ? panel(n0) + (n - n0) : B + n;
      const int64_t ld = stride(n0);
      float s = 0;
      for (int64_t k = 0; k < K; ++k) s += A[m * lda + k] * to_float(Bn[k * ld]);
      C[m * ldc + n] = s;
    }
}

}  // namespace QWEN35_ISA_NS
}  // namespace qwen35
