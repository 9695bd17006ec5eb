// One decode step of the gated delta rule on the CPU, as an XLA FFI handler (qwen35_lib/kernels/gdn/native.py
// calls it): the recurrent form of kernels/gdn/xla.py for one token per row, reading and writing each row's
// state slot in place.
//
// qwen35_gdn_decode:
//   q, k [D, Hk, dk] and v [D, Hv, dv] (float32 or bfloat16: the conv outputs, before the L2 norm);
//   g, beta [D, Hv] float32; slot [D] int32 (< 0: a padding row); start [D] int32 (0: the row starts from a zero
//   state, its sequence's first token; else from its slot); states [NS, Hv, dk, dv] float32
//   -> o [D, Hv, dv] float32, and states (the input buffer, aliased) with each real row's new state in its slot.
// Per row and value head h (key head h / (Hv / Hk)), in float32:
//   q' = q / |q| dk^-1/2, k' = k / |k| (|x| = sqrt(sum x^2 + 1e-6)); S = e^g S; S += k' (beta (v - S^T k'));
//   o = S^T q'.
// Two passes over the dk x dv state (it stays in L1): S^T k' of the decayed state, then the update and o.
// Padding rows start from a zero state, as in the XLA form, and write no slot (the XLA form writes the null one).
// Rows must name distinct slots (the engine gives each running sequence its own). Under `jax.vmap` (the model's
// data-parallel ranks) every operand gets a leading rank axis and each rank's rows update its own pool, one call.
//
// qwen35_gdn_prefill: the same step token after token, for whole sequences (prefill chunks, the dense form):
//   q, k [N, Hk, dk], v [N, Hv, dv], g, beta [N, Hv] as above; first, len, slot, start [S] int32: sequence s is
//   tokens [first, first + len) (len 0: no sequence), starting from slot `slot` (start != 0) or a zero state
//   (start 0), its final state written to that slot; states [NS, Hv, dk, dv] float32
//   -> o [N, Hv, dv] float32 (0 at tokens of no sequence), and states (aliased) updated in place.
// Work units are (sequence, value head): each runs its tokens in order on its slot's state, which stays in L1
// (16 KiB at dk = dv = 64). The chunked form (gdn_xla.gdn_chunked) computes the same recurrence in another order.
//
// qwen35_gdn_verify: speculative verification, V tokens a decode row (its last token and its drafts):
//   q, k [D V, Hk, dk], v [D V, Hv, dv], g, beta [D V, Hv] as above, row r's tokens at [r V, r V + V) (padding
//   tokens g = beta = 0: the state unchanged); slot, start [D] int32 as in qwen35_gdn_decode; states
//   [NS, Hv, dk, dv] and checkpoints [NS, V, Hv, dk, dv] float32
//   -> o [D V, Hv, dv] float32; states (aliased): each real row's state after its V tokens in its slot;
//   checkpoints (aliased): the state after each of its V tokens in its slot's V checkpoints.
// Work units are (row, value head): the row's tokens run in order on its slot's state (in L1), each token's state
// copied out to its checkpoint. The same token step as qwen35_gdn_decode: checkpoint n is bitwise the state of
// decoding the row's first n + 1 tokens one step at a time. Padding rows write nothing (the XLA form writes the
// null slot's).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "common.h"
#include "gemm.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using qwen35::bf16;
using qwen35::to_float;

// x[0:n] as float32, divided by its norm (sqrt(sum x^2 + 1e-6)) and scaled
template <typename T>
void l2_normed(const T* x, int64_t n, float scale, float* out) {
  float ss = 0;
  for (int64_t i = 0; i < n; ++i) {
    out[i] = to_float(x[i]);
    ss += out[i] * out[i];
  }
  const float inv = scale / std::sqrt(ss + 1e-6f);
  for (int64_t i = 0; i < n; ++i) out[i] *= inv;
}

struct Dims {
  int64_t B, D, Hk, Hv, dk, dv, NS;  // B: ranks (a vmapped call), each with its own D rows and NS-slot pool
};

// Columns [c, c + kLanes NV) of one token on one head's state S [dk, dv] (row stride dv), in place: S = e^g S
// (zero: S = 0); S += kn (beta (v - S^T kn)); out = S^T qn. kn, qn [dk] normalised; vf [dv] float32; S, vf and out
// start at column c. The columns are independent: a head's state goes by column blocks of kVecs vectors (3 kVecs
// accumulators, kv, u and o, in registers: 64 columns on AVX-512, 32 on AVX2 and NEON).
constexpr int kVecs = std::min(64 / qwen35::kLanes, (qwen35::kRegs - 4) / 3);

template <int NV>
void update_cols(float* S, int64_t dk, int64_t dv, const float* kn, const float* qn, const float* vf, float decay,
                 float b, bool zero, float* out) {
  using qwen35::kLanes;
  using qwen35::loadv;
  using qwen35::vec;
  vec kv[NV], u[NV], o[NV];
  for (int j = 0; j < NV; ++j) kv[j] = o[j] = vec{};
  if (!zero)
    for (int64_t i = 0; i < dk; ++i) {
      const float* row = S + i * dv;
      for (int j = 0; j < NV; ++j) kv[j] += loadv(row + kLanes * j) * kn[i];
    }
  for (int j = 0; j < NV; ++j) u[j] = b * (loadv(vf + kLanes * j) - decay * kv[j]);
  for (int64_t i = 0; i < dk; ++i) {
    float* row = S + i * dv;
    for (int j = 0; j < NV; ++j) {
      const vec s = zero ? kn[i] * u[j] : decay * loadv(row + kLanes * j) + kn[i] * u[j];
      qwen35::storev(row + kLanes * j, s);
      o[j] += s * qn[i];
    }
  }
  for (int j = 0; j < NV; ++j) qwen35::storev(out + kLanes * j, o[j]);
}

using Cols = void (*)(float*, int64_t, int64_t, const float*, const float*, const float*, float, float, bool,
                      float*);
template <int... J>
Cols cols_of(int nv, std::integer_sequence<int, J...>) {  // nv in [1, kVecs]
  static constexpr Cols table[] = {update_cols<J + 1>...};
  return table[nv - 1];
}

// One token on one head's state S [dk, dv], in place (see update_cols): by column blocks where dv is whole
// vectors, else a scalar loop.
void update(float* S, int64_t dk, int64_t dv, const float* kn, const float* qn, const float* vf, float decay,
            float b, bool zero, float* out) {
  constexpr int64_t kLanes = qwen35::kLanes;
  if (dv % kLanes == 0) {
    for (int64_t c = 0; c < dv; c += kLanes * kVecs) {
      const int nv = int(std::min<int64_t>(kVecs, (dv - c) / kLanes));
      cols_of(nv, std::make_integer_sequence<int, kVecs>{})(S + c, dk, dv, kn, qn, vf + c, decay, b, zero, out + c);
    }
    return;
  }
  std::vector<float> kv(dv, 0.0f), u(dv);
  if (!zero)
    for (int64_t i = 0; i < dk; ++i)
      for (int64_t j = 0; j < dv; ++j) kv[j] += S[i * dv + j] * kn[i];
  for (int64_t j = 0; j < dv; ++j) {
    u[j] = b * (vf[j] - decay * kv[j]);
    out[j] = 0.0f;
  }
  for (int64_t i = 0; i < dk; ++i)
    for (int64_t j = 0; j < dv; ++j) {
      const float s = (zero ? 0.0f : decay * S[i * dv + j]) + kn[i] * u[j];
      S[i * dv + j] = s;
      out[j] += s * qn[i];
    }
}

// Token t's step for value head h (key head h / (Hv / Hk)) on state S; scratch: kn, qn [dk], vf [dv]
template <typename T>
void token_step(const Dims& d, int64_t t, int64_t h, const T* q, const T* k, const T* v, const float* g,
                const float* beta, float* S, bool zero, float* o, float* scratch) {
  const int64_t dk = d.dk, dv = d.dv, kh = h / (d.Hv / d.Hk);
  float* kn = scratch;
  float* qn = kn + dk;
  float* vf = qn + dk;
  l2_normed(k + (t * d.Hk + kh) * dk, dk, 1.0f, kn);
  l2_normed(q + (t * d.Hk + kh) * dk, dk, 1.0f / std::sqrt(float(dk)), qn);
  const T* vr = v + (t * d.Hv + h) * dv;
  for (int64_t j = 0; j < dv; ++j) vf[j] = to_float(vr[j]);
  update(S, dk, dv, kn, qn, vf, std::exp(g[t * d.Hv + h]), beta[t * d.Hv + h], zero, o + (t * d.Hv + h) * dv);
}

// row r of the B * D rows, value head h; scratch: kn, qn [dk], vf [dv], a padding row's state [dk, dv]
template <typename T>
void head_step(const Dims& d, int64_t r, int64_t h, const T* q, const T* k, const T* v, const float* g,
               const float* beta, const int32_t* slot, const int32_t* start, float* states, float* o,
               float* scratch) {
  const bool pad = slot[r] < 0, from_slot = !pad && start[r];
  const int64_t pool = r / d.D * d.NS;  // the first slot of row r's rank
  float* S = pad ? scratch + 2 * d.dk + d.dv : states + ((pool + slot[r]) * d.Hv + h) * d.dk * d.dv;
  token_step(d, r, h, q, k, v, g, beta, S, !from_slot, o, scratch);
}

template <typename T>
void decode(ffi::ThreadPool& pool, const Dims& d, const T* q, const T* k, const T* v, const float* g,
            const float* beta, const int32_t* slot, const int32_t* start, float* states, float* o) {
  const int64_t scratch = 2 * d.dk + d.dv + d.dk * d.dv;
  auto run = [&](int64_t unit) {
    thread_local std::vector<float> buf;
    if (int64_t(buf.size()) < scratch) buf.resize(scratch);
    head_step(d, unit / d.Hv, unit % d.Hv, q, k, v, g, beta, slot, start, states, o, buf.data());
  };
  constexpr int64_t kSerialFloats = 1 << 17;  // below half a MiB of states the pool's hand-off costs more
  const int64_t units = d.B * d.D * d.Hv;
  if (units * d.dk * d.dv < kSerialFloats)
    for (int64_t i = 0; i < units; ++i) run(i);
  else
    qwen35::parallel_for(pool, units, run);
}

// Sequences: per rank b, S of them; unit (b, s, h) runs sequence s's tokens on value head h from its slot.
template <typename T>
void prefill(ffi::ThreadPool& pool, const Dims& d, int64_t S, const T* q, const T* k, const T* v, const float* g,
             const float* beta, const int32_t* first, const int32_t* len, const int32_t* slot,
             const int32_t* start, float* states, float* o) {
  const int64_t scratch = 2 * d.dk + d.dv + d.dk * d.dv;
  std::fill(o, o + d.B * d.D * d.Hv * d.dv, 0.0f);  // tokens of no sequence
  auto run = [&](int64_t unit) {
    const int64_t h = unit % d.Hv, bs = unit / d.Hv, b = bs / S;
    if (len[bs] <= 0) return;
    thread_local std::vector<float> buf;
    if (int64_t(buf.size()) < scratch) buf.resize(scratch);
    float* st = slot[bs] < 0 ? buf.data() + 2 * d.dk + d.dv  // no slot: a scratch state, not kept
                             : states + ((b * d.NS + slot[bs]) * d.Hv + h) * d.dk * d.dv;
    const int64_t t0 = b * d.D + first[bs];  // d.D: the tokens of a rank
    for (int64_t t = t0; t < t0 + len[bs]; ++t)
      token_step(d, t, h, q, k, v, g, beta, st, t == t0 && (!start[bs] || slot[bs] < 0), o, buf.data());
  };
  qwen35::parallel_for(pool, d.B * S * d.Hv, run);
}

// Verification: per rank b, D rows of V tokens; unit (b, r, h) runs row r's tokens on value head h from its slot,
// copying the state after each token to its checkpoint. d.D: the tokens of a rank (D V).
template <typename T>
void verify(ffi::ThreadPool& pool, const Dims& d, int64_t D, int64_t V, const T* q, const T* k, const T* v,
            const float* g, const float* beta, const int32_t* slot, const int32_t* start, float* states,
            float* ckpt, float* o) {
  const int64_t state = d.dk * d.dv, scratch = 2 * d.dk + d.dv + state;
  auto run = [&](int64_t unit) {
    const int64_t h = unit % d.Hv, br = unit / d.Hv, b = br / D;
    thread_local std::vector<float> buf;
    if (int64_t(buf.size()) < scratch) buf.resize(scratch);
    const bool pad = slot[br] < 0, from_slot = !pad && start[br];
    const int64_t at = b * d.NS + (pad ? 0 : slot[br]);  // the row's slot in the ranks' pools
    float* S = pad ? buf.data() + 2 * d.dk + d.dv : states + (at * d.Hv + h) * state;
    for (int64_t j = 0; j < V; ++j) {
      token_step(d, br * V + j, h, q, k, v, g, beta, S, j == 0 && !from_slot, o, buf.data());
      if (!pad) std::copy(S, S + state, ckpt + ((at * V + j) * d.Hv + h) * state);
    }
  };
  constexpr int64_t kSerialFloats = 1 << 17;  // as in decode: below half a MiB of states, no hand-off
  const int64_t units = d.B * D * d.Hv;
  if (units * V * state < kSerialFloats)
    for (int64_t i = 0; i < units; ++i) run(i);
  else
    qwen35::parallel_for(pool, units, run);
}

ffi::Error GdnDecode(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                     ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::S32> slot,
                     ffi::Buffer<ffi::S32> start, ffi::Buffer<ffi::F32> states, ffi::Result<ffi::Buffer<ffi::F32>> o,
                     ffi::Result<ffi::Buffer<ffi::F32>> states_out) {
  // each operand as documented, or all with one leading rank axis B (`vmap_method="broadcast_all"`)
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), sd = states.dimensions();
  const size_t lead = qd.size() == 4 ? 1 : 0;
  if (qd.size() != 3 + lead || kd.size() != 3 + lead || vd.size() != 3 + lead || sd.size() != 4 + lead)
    return ffi::Error::InvalidArgument("gdn.native: want q, k [D, Hk, dk], v [D, Hv, dv], states [NS, Hv, dk, dv]");
  const Dims d{lead ? qd[0] : 1, qd[lead], qd[lead + 1], vd[lead + 1], qd[lead + 2], vd[lead + 2], sd[lead]};
  if ((lead && (kd[0] != d.B || vd[0] != d.B || sd[0] != d.B)) || vd[lead] != d.D || kd[lead] != d.D ||
      kd[lead + 1] != d.Hk || kd[lead + 2] != d.dk || d.Hv % d.Hk != 0 || sd[lead + 1] != d.Hv ||
      sd[lead + 2] != d.dk || sd[lead + 3] != d.dv)
    return ffi::Error::InvalidArgument("gdn.native: shapes disagree (q, k [D, Hk, dk], v [D, Hv, dv], states "
                                       "[NS, Hv, dk, dv], Hv a multiple of Hk)");
  const int64_t rows = d.B * d.D;
  if (g.element_count() != rows * d.Hv || beta.element_count() != rows * d.Hv || slot.element_count() != rows ||
      start.element_count() != rows)
    return ffi::Error::InvalidArgument("gdn.native: want g, beta [D, Hv], slot and start [D]");
  if (q.element_type() != k.element_type() || q.element_type() != v.element_type() ||
      (q.element_type() != ffi::DataType::F32 && q.element_type() != ffi::DataType::BF16))
    return ffi::Error::InvalidArgument("gdn.native: q, k, v float32 or bfloat16, one dtype");
  const int32_t* slots = slot.typed_data();
  for (int64_t r = 0; r < rows; ++r)
    if (slots[r] >= d.NS) return ffi::Error::InvalidArgument("gdn.native: a slot beyond the state pool");
  float* S = states_out->typed_data();  // aliased with `states`: updated in place
  if (S != states.typed_data())
    std::copy(states.typed_data(), states.typed_data() + states.element_count(), S);
  if (q.element_type() == ffi::DataType::F32)
    decode(pool, d, static_cast<const float*>(q.untyped_data()), static_cast<const float*>(k.untyped_data()),
           static_cast<const float*>(v.untyped_data()), g.typed_data(), beta.typed_data(), slots,
           start.typed_data(), S, o->typed_data());
  else
    decode(pool, d, static_cast<const bf16*>(q.untyped_data()), static_cast<const bf16*>(k.untyped_data()),
           static_cast<const bf16*>(v.untyped_data()), g.typed_data(), beta.typed_data(), slots,
           start.typed_data(), S, o->typed_data());
  return ffi::Error::Success();
}

ffi::Error GdnPrefill(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                      ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::S32> first,
                      ffi::Buffer<ffi::S32> len, ffi::Buffer<ffi::S32> slot, ffi::Buffer<ffi::S32> start,
                      ffi::Buffer<ffi::F32> states, ffi::Result<ffi::Buffer<ffi::F32>> o,
                      ffi::Result<ffi::Buffer<ffi::F32>> states_out) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), sd = states.dimensions(),
             fd = first.dimensions();
  const size_t lead = qd.size() == 4 ? 1 : 0;  // a leading rank axis (`vmap_method="broadcast_all"`)
  if (qd.size() != 3 + lead || kd.size() != 3 + lead || vd.size() != 3 + lead || sd.size() != 4 + lead ||
      fd.size() != 1 + lead)
    return ffi::Error::InvalidArgument("gdn.native: want q, k [N, Hk, dk], v [N, Hv, dv], first [S], states "
                                       "[NS, Hv, dk, dv]");
  const Dims d{lead ? qd[0] : 1, qd[lead], qd[lead + 1], vd[lead + 1], qd[lead + 2], vd[lead + 2], sd[lead]};
  if ((lead && (kd[0] != d.B || vd[0] != d.B || sd[0] != d.B || fd[0] != d.B)) || vd[lead] != d.D ||
      kd[lead] != d.D || kd[lead + 1] != d.Hk || kd[lead + 2] != d.dk || d.Hv % d.Hk != 0 || sd[lead + 1] != d.Hv ||
      sd[lead + 2] != d.dk || sd[lead + 3] != d.dv)
    return ffi::Error::InvalidArgument("gdn.native: shapes disagree (q, k [N, Hk, dk], v [N, Hv, dv], states "
                                       "[NS, Hv, dk, dv], Hv a multiple of Hk)");
  const int64_t S = fd[lead], seqs = d.B * S;
  if (g.element_count() != d.B * d.D * d.Hv || beta.element_count() != d.B * d.D * d.Hv ||
      len.element_count() != seqs || slot.element_count() != seqs || start.element_count() != seqs)
    return ffi::Error::InvalidArgument("gdn.native: want g, beta [N, Hv], and first, len, slot, start [S]");
  if (q.element_type() != k.element_type() || q.element_type() != v.element_type() ||
      (q.element_type() != ffi::DataType::F32 && q.element_type() != ffi::DataType::BF16))
    return ffi::Error::InvalidArgument("gdn.native: q, k, v float32 or bfloat16, one dtype");
  const int32_t *fs = first.typed_data(), *ls = len.typed_data(), *ss = slot.typed_data();
  for (int64_t i = 0; i < seqs; ++i)
    if (ls[i] > 0 && (fs[i] < 0 || int64_t(fs[i]) + ls[i] > d.D || ss[i] >= d.NS))
      return ffi::Error::InvalidArgument("gdn.native: a sequence beyond the tokens, or a slot beyond the pool");
  float* St = states_out->typed_data();  // aliased with `states`: updated in place
  if (St != states.typed_data())
    std::copy(states.typed_data(), states.typed_data() + states.element_count(), St);
  if (q.element_type() == ffi::DataType::F32)
    prefill(pool, d, S, static_cast<const float*>(q.untyped_data()), static_cast<const float*>(k.untyped_data()),
            static_cast<const float*>(v.untyped_data()), g.typed_data(), beta.typed_data(), fs, ls, ss,
            start.typed_data(), St, o->typed_data());
  else
    prefill(pool, d, S, static_cast<const bf16*>(q.untyped_data()), static_cast<const bf16*>(k.untyped_data()),
            static_cast<const bf16*>(v.untyped_data()), g.typed_data(), beta.typed_data(), fs, ls, ss,
            start.typed_data(), St, o->typed_data());
  return ffi::Error::Success();
}

ffi::Error GdnVerify(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                     ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::S32> slot,
                     ffi::Buffer<ffi::S32> start, ffi::Buffer<ffi::F32> states, ffi::Buffer<ffi::F32> ckpt,
                     ffi::Result<ffi::Buffer<ffi::F32>> o, ffi::Result<ffi::Buffer<ffi::F32>> states_out,
                     ffi::Result<ffi::Buffer<ffi::F32>> ckpt_out) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), sd = states.dimensions(),
             cd = ckpt.dimensions(), rd = slot.dimensions();
  const size_t lead = qd.size() == 4 ? 1 : 0;  // a leading rank axis (`vmap_method="broadcast_all"`)
  if (qd.size() != 3 + lead || kd.size() != 3 + lead || vd.size() != 3 + lead || sd.size() != 4 + lead ||
      cd.size() != 5 + lead || rd.size() != 1 + lead)
    return ffi::Error::InvalidArgument("gdn.native: want q, k [D V, Hk, dk], v [D V, Hv, dv], slot [D], states "
                                       "[NS, Hv, dk, dv], checkpoints [NS, V, Hv, dk, dv]");
  const Dims d{lead ? qd[0] : 1, qd[lead], qd[lead + 1], vd[lead + 1], qd[lead + 2], vd[lead + 2], sd[lead]};
  const int64_t D = rd[lead], V = cd[lead + 1];
  if ((lead && (kd[0] != d.B || vd[0] != d.B || sd[0] != d.B || cd[0] != d.B || rd[0] != d.B)) ||
      vd[lead] != d.D || kd[lead] != d.D || kd[lead + 1] != d.Hk || kd[lead + 2] != d.dk || d.Hv % d.Hk != 0 ||
      sd[lead + 1] != d.Hv || sd[lead + 2] != d.dk || sd[lead + 3] != d.dv || d.D != D * V || cd[lead] != d.NS ||
      cd[lead + 2] != d.Hv || cd[lead + 3] != d.dk || cd[lead + 4] != d.dv)
    return ffi::Error::InvalidArgument("gdn.native: shapes disagree (q, k [D V, Hk, dk], v [D V, Hv, dv], slot "
                                       "[D], states [NS, Hv, dk, dv], checkpoints [NS, V, Hv, dk, dv])");
  if (g.element_count() != d.B * d.D * d.Hv || beta.element_count() != d.B * d.D * d.Hv ||
      start.element_count() != d.B * D)
    return ffi::Error::InvalidArgument("gdn.native: want g, beta [D V, Hv], slot and start [D]");
  if (q.element_type() != k.element_type() || q.element_type() != v.element_type() ||
      (q.element_type() != ffi::DataType::F32 && q.element_type() != ffi::DataType::BF16))
    return ffi::Error::InvalidArgument("gdn.native: q, k, v float32 or bfloat16, one dtype");
  const int32_t* slots = slot.typed_data();
  for (int64_t r = 0; r < d.B * D; ++r)
    if (slots[r] >= d.NS) return ffi::Error::InvalidArgument("gdn.native: a slot beyond the state pool");
  float* St = states_out->typed_data();  // aliased with `states` and `ckpt`: updated in place
  float* Ck = ckpt_out->typed_data();
  if (St != states.typed_data())
    std::copy(states.typed_data(), states.typed_data() + states.element_count(), St);
  if (Ck != ckpt.typed_data()) std::copy(ckpt.typed_data(), ckpt.typed_data() + ckpt.element_count(), Ck);
  if (q.element_type() == ffi::DataType::F32)
    verify(pool, d, D, V, static_cast<const float*>(q.untyped_data()), static_cast<const float*>(k.untyped_data()),
           static_cast<const float*>(v.untyped_data()), g.typed_data(), beta.typed_data(), slots,
           start.typed_data(), St, Ck, o->typed_data());
  else
    verify(pool, d, D, V, static_cast<const bf16*>(q.untyped_data()), static_cast<const bf16*>(k.untyped_data()),
           static_cast<const bf16*>(v.untyped_data()), g.typed_data(), beta.typed_data(), slots,
           start.typed_data(), St, Ck, o->typed_data());
  return ffi::Error::Success();
}

}  // namespace

// q, k, v, g, beta: the operands both handlers start with
inline auto BindRecurrence() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(qwen35_gdn_decode, GdnDecode,
                              BindRecurrence()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot
                                  .Arg<ffi::Buffer<ffi::S32>>()  // start
                                  .Arg<ffi::Buffer<ffi::F32>>()  // states
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(qwen35_gdn_prefill, GdnPrefill,
                              BindRecurrence()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // first
                                  .Arg<ffi::Buffer<ffi::S32>>()  // len
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot
                                  .Arg<ffi::Buffer<ffi::S32>>()  // start
                                  .Arg<ffi::Buffer<ffi::F32>>()  // states
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(qwen35_gdn_verify, GdnVerify,
                              BindRecurrence()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot
                                  .Arg<ffi::Buffer<ffi::S32>>()  // start
                                  .Arg<ffi::Buffer<ffi::F32>>()  // states
                                  .Arg<ffi::Buffer<ffi::F32>>()  // checkpoints
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
