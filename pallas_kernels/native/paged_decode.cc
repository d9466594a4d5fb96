// One-token rows of ragged paged attention on the CPU, an XLA FFI custom call.
//
// The xla path's decode rows (pallas_kernels/xla.py blocks_attention at block_q 1) in one pass
// over each row's pages, read in place from the stacked head-major cache: no gathered copy of
// the pages, and the rows spread over XLA's intra-op thread pool. Each (row, kv head) walks its
// pages once with an online softmax (K then V of a page, the next page prefetched; P . V summed
// in registers per query head); head dims 64 and 128 are compiled for their size. XLA:CPU runs
// the jnp page loop (gather, two small batched products, the online softmax) one op at a time on
// one core; this kernel is what XLA does not write (BUILD_NOTES.md "CPU attention forms", stop 52).
// pallas_kernels/cpu_native.py builds it with the machine's C++ compiler and registers it;
// the jnp page loop stays the reference it is tested against.
//
// Operands (row n of NB, kv head h of Hkv, G query heads per kv head, head dim D):
//   q       f32[NB, Hkv, G, D]   the query, unscaled
//   k, v    [P, Hkv, bs, D]      every layer's pages (P = L * num_blocks): f32, or the bits of a
//                                bfloat16 cache (u16) or bf16; an 8-bit cache's values (s8 int8,
//                                u8 the bits of fp8 e4m3)
//   k_scales, v_scales u16[P, Hkv, bs]  an 8-bit cache's scales (bfloat16 bits), one per token
//                                and kv head (pallas_kernels/kv_quant.py); empty otherwise
//   tables  s32[NB, C]           each row's page ids within its layer (column j: kv positions
//                                j * bs .. j * bs + bs - 1)
//   start   s32[NB], end s32[NB] the kv positions [start, end) the row sees (end 0: none)
//   base    s32[]                the layer's first page: layer * num_blocks
// Attributes: scale (the scores' factor), soft_cap (0: none; else cap * tanh(s / cap)),
// num_blocks (pages per layer: ids are clamped into the layer, never read outside the cache),
// kv_format (0 float pages, 1 int8 values with scales, 2 fp8 e4m3 values with scales).
// Result: f32[NB, Hkv, G, D], softmax(scale * q . k) . v over the seen positions, 0 for a row
// that sees nothing. Scores, softmax and sums are float32; bfloat16 pages are widened exactly,
// 8-bit values decoded exactly and their scales applied to the scores and to P.

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// e^x for x <= 0 (a score minus the row's maximum), branch-free so the loops vectorize:
// x = n ln2 + r with |r| <= ln2 / 2, e^r by Cephes' expf polynomial (about 1 ulp), 2^n from
// the exponent bits. Below -87 the result is clamped to ~1e-38 instead of 0 (against the
// maximum's 1 it changes no sum).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return e * scale;
}

// cap * tanh(s / cap), from e^(-2|y|) so it never overflows.
inline float soft_capped(float s, float cap) {
  const float y = s / cap;
  const float e = exp_nonpositive(-2.0f * std::fabs(y));
  const float t = (1.0f - e) / (1.0f + e);
  return cap * (y < 0.0f ? -t : t);
}

inline float widen(float x) { return x; }
inline float widen(uint16_t bits) {  // bfloat16 bits -> float32, exact
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// e4m3fn bits -> float32, exact: sign bit 7, exponent bits 3-6 (bias 7), mantissa bits 0-2;
// exponent 0 is subnormal (mantissa * 2^-9). The NaN codes are never written (kv_quant.py).
const std::array<float, 256> kE4m3 = [] {
  std::array<float, 256> table{};
  for (int bits = 0; bits < 256; ++bits) {
    const int magnitude = bits & 0x7f, exponent = magnitude >> 3, mantissa = magnitude & 7;
    const float x = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -9)
                                  : std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
    table[bits] = bits & 0x80 ? -x : x;
  }
  return table;
}();

inline float widen(int8_t x) { return static_cast<float>(x); }
inline float widen(uint8_t e4m3) { return kE4m3[e4m3]; }

struct Job {
  const float* q;
  const void* k;
  const void* v;
  const uint16_t* k_scales;  // an 8-bit cache's scales (bfloat16 bits), else null
  const uint16_t* v_scales;
  const int32_t* tables;
  const int32_t* start;
  const int32_t* end;
  float* out;
  int64_t base, num_blocks, rows, heads, group, dim, block_size, columns;
  float scale, cap;
  std::atomic<int64_t> next{0};
};

// One (row, kv head), page by page with an online softmax: each page's K and V read once, one
// after the other, and the next page's rows prefetched while this one computes.
template <typename E, int kDim, bool kScaled>
void attend(const Job& job, int64_t item, std::vector<float>& scratch) {
  const int64_t n = item / job.heads, h = item % job.heads;
  const int64_t G = job.group, D = kDim ? kDim : job.dim, bs = job.block_size;
  float* out = job.out + item * G * D;
  std::fill(out, out + G * D, 0.0f);
  const int64_t lo = std::max<int64_t>(job.start[n], 0);
  const int64_t hi = std::min<int64_t>(job.end[n], job.columns * bs);
  if (hi <= lo) return;
  if (static_cast<int64_t>(scratch.size()) < G * (bs + 2)) scratch.resize(G * (bs + 2));
  float* s = scratch.data();         // [G, bs] this page's scores, then weights
  float* m = s + G * bs;             // [G] running maximum
  float* l = m + G;                  // [G] running sum
  const float* q = job.q + item * G * D;
  const int32_t* table = job.tables + n * job.columns;
  const E* K = static_cast<const E*>(job.k);
  const E* V = static_cast<const E*>(job.v);
  const int64_t row_elems = bs * D;  // one (page, head) row
  // (page, head) row of a column's page in the whole cache, its id clamped into the layer
  auto page_row = [&](int64_t column) {
    const int64_t id = std::min<int64_t>(std::max<int32_t>(table[column], 0), job.num_blocks - 1);
    return (job.base + id) * job.heads + h;
  };
  const int64_t first = lo / bs, last = (hi - 1) / bs;
  for (int64_t column = first; column <= last; ++column) {
    if (column < last) {  // the next page's K and V rows, ahead of their use
      const int64_t next = page_row(column + 1) * row_elems;
      const char* nk = reinterpret_cast<const char*>(K + next);
      const char* nv = reinterpret_cast<const char*>(V + next);
      for (int64_t b = 0; b < row_elems * static_cast<int64_t>(sizeof(E)); b += 64) {
        __builtin_prefetch(nk + b);
        __builtin_prefetch(nv + b);
      }
    }
    const int64_t t0 = std::max(lo, column * bs) - column * bs, t1 = std::min(hi, column * bs + bs) - column * bs;
    const int64_t count = t1 - t0;
    const int64_t row = page_row(column);
    const E* kp = K + row * row_elems + t0 * D;
    const E* vp = V + row * row_elems + t0 * D;
    // An 8-bit cache's scales of those tokens (one per token, rows as the values'); else unused.
    const uint16_t* ks = kScaled ? job.k_scales + row * bs + t0 : nullptr;
    const uint16_t* vs = kScaled ? job.v_scales + row * bs + t0 : nullptr;
    for (int64_t t = 0; t < count; ++t) {
      const E* k = kp + t * D;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + g * D;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qg[d] * widen(k[d]);
        s[g * bs + t] = kScaled ? dot * job.scale * widen(ks[t]) : dot * job.scale;
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float* sg = s + g * bs;
      if (job.cap > 0.0f) {
        const float cap = job.cap;
#pragma omp simd
        for (int64_t t = 0; t < count; ++t) sg[t] = soft_capped(sg[t], cap);
      }
      float page_max = sg[0];
      for (int64_t t = 1; t < count; ++t) page_max = std::max(page_max, sg[t]);
      const float new_max = column == first ? page_max : std::max(m[g], page_max);
      const float alpha = column == first ? 0.0f : exp_nonpositive(m[g] - new_max);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < count; ++t) {
        sg[t] = exp_nonpositive(sg[t] - new_max);
        sum += sg[t];
      }
      m[g] = new_max;
      l[g] = (column == first ? 0.0f : alpha * l[g]) + sum;
      float* o = out + g * D;
      if (column != first) {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] *= alpha;
      }
    }
    if constexpr (kScaled) {  // P times each token's V scale: the value rows stay 8-bit
      for (int64_t g = 0; g < G; ++g)
        for (int64_t t = 0; t < count; ++t) s[g * bs + t] *= widen(vs[t]);
    }
    for (int64_t g = 0; g < G; ++g) {
      float* o = out + g * D;
      const float* pg = s + g * bs;
      if constexpr (kDim > 0) {
        float acc[kDim];
        for (int64_t d = 0; d < kDim; ++d) acc[d] = o[d];
        for (int64_t t = 0; t < count; ++t) {
          const E* v = vp + t * kDim;
          const float p = pg[t];
#pragma omp simd
          for (int64_t d = 0; d < kDim; ++d) acc[d] += p * widen(v[d]);
        }
        for (int64_t d = 0; d < kDim; ++d) o[d] = acc[d];
      } else {
        for (int64_t t = 0; t < count; ++t) {
          const E* v = vp + t * D;
          const float p = pg[t];
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o[d] += p * widen(v[d]);
        }
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = 1.0f / l[g];
    float* o = out + g * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
  }
}

template <typename E, bool kScaled>
void drain(Job* job) {
  std::vector<float> scores;
  const int64_t items = job->rows * job->heads;
  auto one = job->dim == 64    ? attend<E, 64, kScaled>
             : job->dim == 128 ? attend<E, 128, kScaled>
                               : attend<E, 0, kScaled>;
  for (int64_t item; (item = job->next.fetch_add(1, std::memory_order_relaxed)) < items;) {
    one(*job, item, scores);
  }
}

ffi::Future failed(std::string message) {
  ffi::Promise promise;
  ffi::Future future(promise);
  promise.SetError(ffi::Error::InvalidArgument("jaxserve_paged_decode: " + message));
  return future;
}

std::string dims(ffi::Span<const int64_t> d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

ffi::Future paged_decode(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                         ffi::AnyBuffer k_scales, ffi::AnyBuffer v_scales, ffi::Buffer<ffi::S32> tables,
                         ffi::Buffer<ffi::S32> start, ffi::Buffer<ffi::S32> end, ffi::Buffer<ffi::S32> base,
                         ffi::ResultBuffer<ffi::F32> out, float scale, float soft_cap, int64_t num_blocks,
                         int64_t kv_format) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), td = tables.dimensions();
  if (qd.size() != 4) return failed("q must be [rows, kv heads, group, head dim]; got " + dims(qd));
  if (kd.size() != 4 || kd[1] != qd[1] || kd[3] != qd[3])
    return failed("k must be [pages, kv heads, block size, head dim] matching q " + dims(qd) + "; got " + dims(kd));
  if (vd.size() != 4 || !std::equal(kd.begin(), kd.end(), vd.begin()) || v.element_type() != k.element_type())
    return failed("v must match k " + dims(kd) + "; got " + dims(vd));
  const auto type = k.element_type();
  void (*run)(Job*) = nullptr;
  if (kv_format == 0 && type == ffi::F32) run = drain<float, false>;
  if (kv_format == 0 && (type == ffi::U16 || type == ffi::BF16)) run = drain<uint16_t, false>;
  if (kv_format == 1 && type == ffi::S8) run = drain<int8_t, true>;
  if (kv_format == 2 && type == ffi::U8) run = drain<uint8_t, true>;
  if (run == nullptr)
    return failed("k and v must be float32, bfloat16 or bfloat16 bits (uint16) with kv_format 0, int8 "
                  "values with kv_format 1, or fp8 e4m3 bits (uint8) with kv_format 2; got kv_format " +
                  std::to_string(kv_format));
  if (kv_format != 0) {
    const auto sd = k_scales.dimensions(), vsd = v_scales.dimensions();
    if (k_scales.element_type() != ffi::U16 || v_scales.element_type() != ffi::U16 || sd.size() != 3 ||
        vsd.size() != 3 || !std::equal(sd.begin(), sd.end(), kd.begin()) ||
        !std::equal(sd.begin(), sd.end(), vsd.begin()))
      return failed("an 8-bit cache's scales must be bfloat16 bits (uint16) [pages, kv heads, block size] = " +
                    dims(kd) + " without its head dim; got " + dims(sd));
  }
  if (td.size() != 2 || td[0] != qd[0]) return failed("tables must be [rows, columns]; got " + dims(td));
  if (start.element_count() != qd[0] || end.element_count() != qd[0] || base.element_count() != 1)
    return failed("start and end need one entry per row and base one value");
  const int64_t layer_base = base.typed_data()[0];
  if (num_blocks < 1 || layer_base < 0 || layer_base + num_blocks > kd[0])
    return failed("layer pages [" + std::to_string(layer_base) + ", +" + std::to_string(num_blocks) +
                  ") fall outside the cache's " + std::to_string(kd[0]) + " pages");

  auto job = std::make_shared<Job>();
  job->q = q.typed_data();
  job->k = k.untyped_data();
  job->v = v.untyped_data();
  job->k_scales = kv_format != 0 ? static_cast<const uint16_t*>(k_scales.untyped_data()) : nullptr;
  job->v_scales = kv_format != 0 ? static_cast<const uint16_t*>(v_scales.untyped_data()) : nullptr;
  job->tables = tables.typed_data();
  job->start = start.typed_data();
  job->end = end.typed_data();
  job->out = out->typed_data();
  job->base = layer_base;
  job->num_blocks = num_blocks;
  job->rows = qd[0];
  job->heads = qd[1];
  job->group = qd[2];
  job->dim = qd[3];
  job->block_size = kd[2];
  job->columns = td[1];
  job->scale = scale;
  job->cap = soft_cap;

  // The calling thread drains items too; each pool task joins it until the items run out.
  const int64_t items = job->rows * job->heads;
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), items));
  ffi::CountDownPromise done(workers);
  ffi::Future future(done);
  for (int64_t i = 1; i < workers; ++i) {
    pool.Schedule([job, done, run]() mutable {
      run(job.get());
      done.CountDown();
    });
  }
  run(job.get());
  done.CountDown();
  return future;
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedDecode, paged_decode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // k pages
                                  .Arg<ffi::AnyBuffer>()         // v pages
                                  .Arg<ffi::AnyBuffer>()         // k scales (8-bit caches)
                                  .Arg<ffi::AnyBuffer>()         // v scales
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // start
                                  .Arg<ffi::Buffer<ffi::S32>>()  // end
                                  .Arg<ffi::Buffer<ffi::S32>>()  // base
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("num_blocks")
                                  .Attr<int64_t>("kv_format"));
