// What the native CPU kernels (kernels/*.cc) share: bfloat16 to float32, and parallel_for over XLA's intra-op pool.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace qwen35 {

using bf16 = uint16_t;  // bfloat16 bits

inline float to_float(float v) { return v; }
inline float to_float(bf16 v) {
  const uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

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

}  // namespace qwen35
