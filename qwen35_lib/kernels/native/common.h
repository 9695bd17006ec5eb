// What the native CPU kernels (kernels/*.cc) share: the ISA they are built for and its vectors, bfloat16 to
// float32, and parallel_for over XLA's intra-op pool.
//
// One source serves every ISA: the build (kernels/native/build.py) picks the variant with -march, and the macros below
// give the vector width (kLanes floats), the register count (kRegs) and the name the library records
// (`qwen35_native_isa()`, which native.py checks against the variant it asked for):
//   x86-64-v4  AVX-512: 32 registers of 16 floats
//   x86-64-v3  AVX2 + FMA: 16 registers of 8 floats
//   aarch64    NEON (Advanced SIMD): 32 registers of 4 floats
// Anything else does not compile (native.py then runs the XLA kernels, with a warning that says so).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define QWEN35_ISA "x86-64-v4"
#define QWEN35_ISA_NS isa_x86_64_v4
#define QWEN35_LANES 16
#define QWEN35_REGS 32
#elif defined(__AVX2__) && defined(__FMA__)
#define QWEN35_ISA "x86-64-v3"
#define QWEN35_ISA_NS isa_x86_64_v3
#define QWEN35_LANES 8
#define QWEN35_REGS 16
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define QWEN35_ISA "aarch64"
#define QWEN35_ISA_NS isa_aarch64
#define QWEN35_LANES 4
#define QWEN35_REGS 32
#else
#error "qwen35 native kernels: unsupported ISA (built for x86-64-v3, x86-64-v4 and aarch64 only)"
#endif

namespace qwen35 {
inline namespace QWEN35_ISA_NS {  // each variant's symbols its own, so two variants loaded at once never mix

using bf16 = uint16_t;  // bfloat16 bits

constexpr int kLanes = QWEN35_LANES;  // floats of a vector register
constexpr int kRegs = QWEN35_REGS;    // vector registers
typedef float vec __attribute__((vector_size(4 * kLanes)));  // one register
typedef int32_t ivec __attribute__((vector_size(4 * kLanes)));
typedef uint32_t uvec __attribute__((vector_size(4 * kLanes)));
typedef uint16_t hvec __attribute__((vector_size(2 * kLanes)));  // kLanes bfloat16

inline float to_float(float v) { return v; }
inline float to_float(bf16 v) {
  const uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// kLanes floats from p (unaligned), float32 or bfloat16
inline vec loadv(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vec loadv(const bf16* p) {
  hvec h;
  std::memcpy(&h, p, sizeof h);
  const uvec u = __builtin_convertvector(h, uvec) << 16;
  vec v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
inline void storev(float* p, vec v) { std::memcpy(p, &v, sizeof v); }

// fn(i) for i in [0, n), spread over this thread and helpers on XLA's intra-op pool (fn runs concurrently: its
// state must be per thread); returns when all are done. A helper that starts after the return finds the counter
// spent and runs nothing.
template <typename Fn>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t n, Fn fn) {
  struct Counter {
    std::atomic<int64_t> next{0}, busy{0};
  };
  auto counter = std::make_shared<Counter>();
  auto work = std::make_shared<std::function<void()>>([c = counter.get(), n, fn]() {
    for (int64_t i; (i = c->next.fetch_add(1)) < n;) fn(i);
  });
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t t = 0; t < helpers; ++t)
    pool.Schedule([counter, work]() {
      counter->busy.fetch_add(1);
      (*work)();
      counter->busy.fetch_sub(1);
    });
  (*work)();
  while (counter->busy.load() != 0) std::this_thread::yield();
}

}  // namespace QWEN35_ISA_NS
}  // namespace qwen35

// The ISA this library was built for (kernels/native/build.py reads it): one of the names above.
extern "C" const char* qwen35_native_isa() { return QWEN35_ISA; }
