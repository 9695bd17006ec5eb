// A standalone check of the native kernels' inner loops, built for one ISA variant and run as a program (for
// aarch64 on an x86-64 machine: under qemu-aarch64; tests/integration/test_native_isa.py builds and runs it). It
// includes a kernel's source whole (the handlers are never called, so no XLA is needed at run time):
//   default: moe.cc: qwen35::matmul (float32 and bfloat16 weights, row-major and packed, every register
//            block's row count, widths that are not whole vectors) and the SwiGLU's vectorised exp, against double
//            precision loops;
//   -DCHECK_GDN: gdn.cc: one token's delta-rule update of a state (column blocks, and the scalar loop of a
//            width that is not whole vectors) against a double precision loop.
// Prints the ISA and "ok", or the first mismatch, and exits 1 on a mismatch.

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#ifdef CHECK_GDN
#include "gdn.cc"
#else
#include "moe.cc"
#endif

namespace {

std::mt19937 rng(7);
float normal() { return std::normal_distribution<float>()(rng); }

bool close(double got, double want, double tol, const char* what, int64_t i) {
  if (std::fabs(got - want) <= tol * (1 + std::fabs(want))) return true;
  std::printf("%s: mismatch at %lld: %.8g vs %.8g\n", what, (long long)i, got, want);
  return false;
}

#ifdef CHECK_GDN
bool check() {
  bool ok = true;
  for (int64_t dv : {64, 32, 40, 16}) {
    const int64_t dk = 32;
    std::vector<float> S(dk * dv), kn(dk), qn(dk), vf(dv), out(dv);
    for (auto* v : {&S, &kn, &qn, &vf})
      for (auto& x : *v) x = normal() / 4;
    for (bool zero : {false, true}) {
      std::vector<double> Sd(S.begin(), S.end()), od(dv, 0.0);
      const float decay = 0.9f, b = 0.7f;
      for (int64_t j = 0; j < dv; ++j) {  // the column's update in double precision
        double kv = 0;
        for (int64_t i = 0; i < dk; ++i) kv += (zero ? 0.0 : Sd[i * dv + j]) * kn[i];
        const double u = b * (vf[j] - decay * kv);
        for (int64_t i = 0; i < dk; ++i) {
          Sd[i * dv + j] = (zero ? 0.0 : decay * Sd[i * dv + j]) + kn[i] * u;
          od[j] += Sd[i * dv + j] * qn[i];
        }
      }
      std::vector<float> St = S;
      update(St.data(), dk, dv, kn.data(), qn.data(), vf.data(), decay, b, zero, out.data());
      for (int64_t i = 0; i < dk * dv && ok; ++i) ok = close(St[i], Sd[i], 1e-5, "gdn state", i);
      for (int64_t j = 0; j < dv && ok; ++j) ok = close(out[j], od[j], 1e-5, "gdn output", j);
    }
  }
  return ok;
}
#else
template <typename W>
W as_w(float f) {
  if constexpr (std::is_same_v<W, float>) return f;
  else return round_bf16(f);
}

// C = A @ B for W weights, row-major or packed, against double precision over the weights as stored
template <typename W>
bool check_matmul(int64_t M, int64_t K, int64_t N, bool packed) {
  std::vector<float> A(M * K), C(M * N, -1.0f);
  std::vector<W> B(K * N), P(K * N);
  for (auto& a : A) a = normal();
  for (auto& b : B) b = as_w<W>(normal() / 8);
  for (int64_t n = 0, at = 0; n < N; n += qwen35::kPanel) {  // the panels (packed.pack_panels)
    const int64_t width = std::min<int64_t>(qwen35::kPanel, N - n);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t c = 0; c < width; ++c) P[at++] = B[k * N + n + c];
  }
  matmul(A.data(), K, packed ? P.data() : B.data(), N, M, K, N, C.data(), N, packed);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double want = 0;
      for (int64_t k = 0; k < K; ++k) want += double(A[m * K + k]) * to_float(B[k * N + n]);
      if (!close(C[m * N + n], want, 1e-4, "matmul", m * N + n)) {
        std::printf("  (M %lld, K %lld, N %lld, packed %d, %s weights)\n", (long long)M, (long long)K, (long long)N,
                    int(packed), sizeof(W) == 4 ? "float32" : "bfloat16");
        return false;
      }
    }
  return true;
}

bool check() {
  for (int64_t M : {1, 2, 3, 4, 5, 6, 7, 8, 13, 100})
    for (int64_t N : {64, 72, 200, 20})
      for (bool packed : {false, true})
        if (!check_matmul<float>(M, 150, N, packed) || !check_matmul<bf16>(M, 150, N, packed)) return false;
  const int64_t F = 44;  // a / of whole vectors and a scalar tail on every ISA
  std::vector<float> h(2 * F), a(F);
  for (int64_t i = 0; i < 2 * F; ++i) h[i] = 6 * normal();
  h[0] = 200.0f;  // past exp's clamp
  h[1] = -200.0f;
  swiglu<float>(h.data(), F, a.data());
  for (int64_t f = 0; f < F; ++f) {
    const double g = h[f], want = g / (1 + std::exp(-g)) * h[F + f];
    if (!close(a[f], want, 1e-5, "swiglu", f)) return false;
  }
  return true;
}
#endif

}  // namespace

int main() {
  const bool ok = check();
  std::printf("%s %s\n", qwen35_native_isa(), ok ? "ok" : "MISMATCH");
  return ok ? 0 : 1;
}
