// CPU kernels for the native Llama/Qwen2 forward (AVX2 + FMA; the matrix products use AVX-512 where the build
// enables it, see kernels.py).
//
// Every output element is computed by the same sequence of instructions whatever the number of rows (tokens)
// in the call: a dot product accumulates kLanes lanes over k in order, then reduces the lanes in a fixed order.
// So a verify pass over k tokens gives bit-for-bit the logits that k one-token decode steps would give
// (batch invariance), and greedy speculative decoding is token-identical to plain decoding by construction.
// (An AVX2 build and an AVX-512 build sum in different orders: each is batch-invariant on its own.)
//
// Weights are read in their stored dtype (float32, bfloat16 or float16, widened in registers); activations, the KV
// cache and all accumulation are float32. Where the CPU has AVX512-BF16 (the "avx512bf16" build), a bfloat16
// weight instead meets the activations rounded to bfloat16 (round to nearest even, once per call, as a
// transformers bf16 forward rounds them) in `vdpbf16ps`: 32 weights per instruction, none widened, so a verify
// pass of many tokens costs half the instructions; accumulation stays float32, the invariance the same.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "unrolled.h"

namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const at::BFloat16* p) {
  // bf16 is the upper half of a float32: widen to 32 bits and shift into place
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// IEEE half (a GGUF's F16 matrices): F16C's conversion, exact (every half is a float32)
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }
inline float to_float(at::Half v) { return static_cast<float>(v); }

// Fixed-order horizontal sum of the 8 lanes.
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);                 // (0+4, 1+5, 2+6, 3+7)
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));        // (0+4+2+6, 1+5+3+7, ..)
  s = _mm_add_ss(s, _mm_movehdup_ps(s));         // lane0 + lane1
  return _mm_cvtss_f32(s);
}

// The vector type of the matrix products: 16 float lanes in 32 registers with AVX-512, else 8 lanes in 16.
#ifdef __AVX512F__
using Vec = __m512;
constexpr int kLanes = 16, kRegisters = 32;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vload(const at::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline Vec vload(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline Vec vfmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
// fixed order: the two 256-bit halves lane by lane, then as hsum above
inline float vsum(Vec v) {
  return hsum(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}
#if defined(__AMX_INT8__) && defined(__AVX512BF16__)
constexpr const char* kIsa = "amx";  // the avx512bf16 build, plus AMX tiles for the block formats' passes
#elif defined(__AVX512BF16__)
constexpr const char* kIsa = "avx512bf16";
#else
constexpr const char* kIsa = "avx512";
#endif
#else
using Vec = __m256;
constexpr int kLanes = 8, kRegisters = 16;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vload(const at::BFloat16* p) { return load8(p); }
inline Vec vload(const at::Half* p) { return load8(p); }
inline Vec vfmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return hsum(v); }
constexpr const char* kIsa = "avx2";
#endif

// Activations of a bf16-weight product in the avx512bf16 build: rounded to bfloat16, multiplied in pairs.
#ifdef __AVX512BF16__
constexpr bool kBf16Pairs = true;
inline Vec vload_bits(const at::BFloat16* p) { return _mm512_castsi512_ps(_mm512_loadu_si512(p)); }
// acc[i] += w[2i] * x[2i] + w[2i + 1] * x[2i + 1]: the 32 bfloat16 values of each operand as 16 pairs
inline Vec vdot_pairs(Vec w, Vec x, Vec acc) { return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x); }
#else
constexpr bool kBf16Pairs = false;
inline Vec vload_bits(const at::BFloat16* p) { return vload(p); }  // never called: no pairs in this build
inline Vec vdot_pairs(Vec w, Vec x, Vec acc) { return vfmadd(w, x, acc); }
#endif

// out[t, n] for R (<= 6) consecutive weight rows and TB (<= 6) consecutive tokens; x rows are K floats apart.
// R * TB accumulators, R weight vectors and one activation vector must fit in the registers.
// Each (row, token) pair owns one accumulator and sees the same instruction sequence in every tile shape, so
// the tile shape (chosen by the number of tokens) never changes a result. The accumulators are named
// variables, not an array, so that the compiler keeps them in registers.
//
// `ahead` (or nullptr): the same rows of the next row group, pulled into L2 while this tile computes. Without it
// the next group's weights are read only when its own compute starts, so streaming and arithmetic take turns;
// with it a multi-token tile's arithmetic overlaps the next tile's loads, and a one-token tile keeps more loads
// in flight than the hardware prefetcher does (docs/performance.md has the A/B). Prefetches change no result.
//
// XT, the activations' type: float (weights widened, one multiply-add per weight and token), or bfloat16 with
// bfloat16 weights in the avx512bf16 build (`vdot_pairs`: a vector holds 2 * kLanes weights, 2 per lane).
template <typename WT, typename XT, int R, int TB>
inline void dot_block(const WT* w, int64_t K, const XT* x, float* out, int64_t N, const float* bias,
                      const WT* ahead = nullptr) {
  static_assert(R >= 1 && R <= 6 && TB >= 1 && TB <= 6 && R * TB + R + 1 <= kRegisters,
                "tile does not fit in the vector registers");
  constexpr bool kPairs = std::is_same_v<XT, at::BFloat16>;
  static_assert(!kPairs || (kBf16Pairs && std::is_same_v<WT, at::BFloat16>), "pairs need bf16 weights and AVX512-BF16");
  constexpr int64_t kStep = kPairs ? 2 * kLanes : kLanes;  // weights of a row per vector
  constexpr int64_t kLine = 64 / sizeof(WT);  // weights per cache line
  const Vec zero = vzero();
#define SPECDRAFT_ACC(r) Vec a##r##0 = zero, a##r##1 = zero, a##r##2 = zero, a##r##3 = zero, \
                                a##r##4 = zero, a##r##5 = zero;
  SPECDRAFT_ACC(0) SPECDRAFT_ACC(1) SPECDRAFT_ACC(2) SPECDRAFT_ACC(3) SPECDRAFT_ACC(4) SPECDRAFT_ACC(5)
#undef SPECDRAFT_ACC
  const int64_t KV = K - K % kStep;
  auto load = [](const auto* p) { if constexpr (kPairs) return vload_bits(p); else return vload(p); };
  auto madd = [](Vec wv, Vec xv, Vec acc) { if constexpr (kPairs) return vdot_pairs(wv, xv, acc);
                                            else return vfmadd(wv, xv, acc); };
  for (int64_t k = 0; k < KV; k += kStep) {
    if (ahead && k % kLine == 0) {
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(ahead + r * K + k), _MM_HINT_T1);
    }
    const Vec wv0 = load(w + k);
    const Vec wv1 = R > 1 ? load(w + 1 * K + k) : zero;
    const Vec wv2 = R > 2 ? load(w + 2 * K + k) : zero;
    const Vec wv3 = R > 3 ? load(w + 3 * K + k) : zero;
    const Vec wv4 = R > 4 ? load(w + 4 * K + k) : zero;
    const Vec wv5 = R > 5 ? load(w + 5 * K + k) : zero;
#define SPECDRAFT_FMA(r, j) if constexpr (R > r) a##r##j = madd(wv##r, xv, a##r##j);
#define SPECDRAFT_STEP(j)                                                                    \
    if constexpr (TB > j) {                                                                  \
      const Vec xv = load(x + j * K + k);                                                    \
      SPECDRAFT_FMA(0, j) SPECDRAFT_FMA(1, j) SPECDRAFT_FMA(2, j) SPECDRAFT_FMA(3, j)        \
      SPECDRAFT_FMA(4, j) SPECDRAFT_FMA(5, j)                                                \
    }
    SPECDRAFT_STEP(0) SPECDRAFT_STEP(1) SPECDRAFT_STEP(2) SPECDRAFT_STEP(3) SPECDRAFT_STEP(4) SPECDRAFT_STEP(5)
#undef SPECDRAFT_STEP
#undef SPECDRAFT_FMA
  }
  const Vec acc[6][6] = {{a00, a01, a02, a03, a04, a05}, {a10, a11, a12, a13, a14, a15},
                            {a20, a21, a22, a23, a24, a25}, {a30, a31, a32, a33, a34, a35},
                            {a40, a41, a42, a43, a44, a45}, {a50, a51, a52, a53, a54, a55}};
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < TB; ++j) {
      float tail = 0.f;
      for (int64_t k = KV; k < K; ++k) tail += to_float(w[r * K + k]) * to_float(x[j * K + k]);
      float v = vsum(acc[r][j]) + tail;
      if (bias) v += bias[r];
      out[j * N + r] = v;
    }
  }
}

// Rows [0, rows) (rows divides 12, or 1 for the tail) against all T tokens, in tiles whose row count grows as
// the token count of the tile shrinks: few tokens need more independent rows to hide the FMA latency.
template <typename WT, typename XT, int R, int TB>
inline void tile_rows(const WT* w, int64_t rows, int64_t K, const XT* x, float* out, int64_t N,
                      const float* bias, const WT* ahead) {
  for (int64_t r = 0; r < rows; r += R)
    dot_block<WT, XT, R, TB>(w + r * K, K, x, out + r, N, bias ? bias + r : nullptr, ahead ? ahead + r * K : nullptr);
}

// `next`: the next full group of 12 rows of this thread (or nullptr), prefetched while this group computes.
template <typename WT, typename XT>
inline void rows_all_tokens(const WT* w, int64_t rows, int64_t K, const XT* x, int64_t T, float* out,
                            int64_t N, const float* bias, const WT* next) {
  if (rows != 12) {  // the last rows of the matrix, one at a time
    for (int64_t r = 0; r < rows; ++r) {
      const float* b = bias ? bias + r : nullptr;
      int64_t t = 0;
      for (; t + 6 <= T; t += 6) dot_block<WT, XT, 1, 6>(w + r * K, K, x + t * K, out + t * N + r, N, b);
      for (; t < T; ++t) dot_block<WT, XT, 1, 1>(w + r * K, K, x + t * K, out + t * N + r, N, b);
    }
    return;
  }
  // the first tile that reads this group prefetches the next one (later tiles re-read this group from cache)
  // rows per tile by tokens per tile (1..6): as many as the registers hold, each a divisor of 12
  constexpr bool wide = kRegisters >= 32;
  constexpr int R1 = 6, R2 = wide ? 6 : 4, R3 = wide ? 6 : 3, R4 = wide ? 4 : 2, R5 = wide ? 4 : 2, R6 = wide ? 4 : 2;
  int64_t t = 0;
  for (; t + 6 <= T; t += 6) tile_rows<WT, XT, R6, 6>(w, 12, K, x + t * K, out + t * N, N, bias, t == 0 ? next : nullptr);
  const WT* rest_ahead = t == 0 ? next : nullptr;
  const XT* xt = x + t * K;
  float* ot = out + t * N;
  switch (T - t) {
    case 1: tile_rows<WT, XT, R1, 1>(w, 12, K, xt, ot, N, bias, rest_ahead); break;
    case 2: tile_rows<WT, XT, R2, 2>(w, 12, K, xt, ot, N, bias, rest_ahead); break;
    case 3: tile_rows<WT, XT, R3, 3>(w, 12, K, xt, ot, N, bias, rest_ahead); break;
    case 4: tile_rows<WT, XT, R4, 4>(w, 12, K, xt, ot, N, bias, rest_ahead); break;
    case 5: tile_rows<WT, XT, R5, 5>(w, 12, K, xt, ot, N, bias, rest_ahead); break;
    default: break;
  }
}

template <typename WT, typename XT>
void linear_impl(const XT* x, const WT* w, const float* bias, float* out, int64_t T, int64_t K, int64_t N) {
  constexpr int64_t G = 12;  // rows per work item
  const int64_t groups = (N + G - 1) / G;
  // Threads split the weight rows (each streams its own contiguous slice of memory); the split never changes
  // what any single output element computes.
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n = g * G, rows = std::min(G, N - n);
      const WT* next = g + 1 < end && n + 2 * G <= N ? w + (n + G) * K : nullptr;  // this thread's next group
      rows_all_tokens<WT, XT>(w + n * K, rows, K, x, T, out + n, N, bias ? bias + n : nullptr, next);
    }
  });
}

}  // namespace

// x: [T, K] float32, weight: [N, K] float32, bfloat16 or float16, bias: [N] float32 or None  ->  [T, N] float32
torch::Tensor linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x must be [T, K] float32");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(1), "weight must be [N, K]");
  const int64_t T = x.size(0), K = x.size(1), N = weight.size(0);
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->numel() == N && bias->is_contiguous(), "bad bias");
    bias_ptr = bias->data_ptr<float>();
  }
  auto out = torch::empty({T, N}, x.options());
  if (weight.scalar_type() == torch::kFloat) {
    linear_impl<float, float>(x.data_ptr<float>(), weight.data_ptr<float>(), bias_ptr, out.data_ptr<float>(),
                              T, K, N);
  } else if (weight.scalar_type() == torch::kBFloat16) {
#ifdef __AVX512BF16__
    // round to nearest even, element by element: a row rounds the same whatever else is in the call
    auto x_bf16 = x.to(torch::kBFloat16);
    linear_impl<at::BFloat16, at::BFloat16>(x_bf16.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(),
                                            bias_ptr, out.data_ptr<float>(), T, K, N);
#else
    linear_impl<at::BFloat16, float>(x.data_ptr<float>(), weight.data_ptr<at::BFloat16>(), bias_ptr,
                                     out.data_ptr<float>(), T, K, N);
#endif
  } else if (weight.scalar_type() == torch::kHalf) {  // widened to float32 in registers, float32 activations
    linear_impl<at::Half, float>(x.data_ptr<float>(), weight.data_ptr<at::Half>(), bias_ptr, out.data_ptr<float>(),
                                 T, K, N);
  } else {
    TORCH_CHECK(false, "weight must be float32, bfloat16 or float16");
  }
  return out;
}

namespace {

// ------------------------------------------------------------------------------------------- dense panels
// A dense matrix repacked in panels of kPanelRows rows stored k-major ([N / kPanelRows, K, kPanelRows]): at each k
// a panel's weights are two vectors, and each token of the tile multiplies them by its x[k], broadcast. An output
// (row, token) is one lane of one accumulator that adds w[k] x[k] for k = 0, 1, .., K - 1 in order, one multiply-add
// each, whatever the tile's shape: batch invariant, and no horizontal sum. Against `linear`'s tiles, whose
// accumulators run along k (each token's x re-read from L2 for every pair of rows), a prefill reads x as 4-byte
// broadcasts: a standalone loop on the Zen 3, one thread, f16 weights, 60 tokens, ran 45-48 GMAC/s against 24-27
// (the FMA pipes' peak there: 54). AVX2 builds only (`dense_panel_rows`); the AVX-512 builds keep `linear`.
constexpr int64_t kPanelRows = 2 * kLanes;
#ifdef __AVX512F__
inline Vec vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
constexpr bool kPanels = false;
#else
inline Vec vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
constexpr bool kPanels = true;
#endif

// out[t, r] for P panels from `panel` on (kPanelRows * K weights apart) and TB tokens from x on (K apart). Registers:
// 2 P TB accumulators, a panel's two weight vectors, one broadcast.
template <typename WT, int P, int TB>
inline void panel_tile(const WT* panel, int64_t K, const float* x, float* out, int64_t N, const float* bias) {
  static_assert(2 * P * TB + 3 <= kRegisters, "tile does not fit in the vector registers");
  Vec acc[P * TB * 2];  // panel p, token t, half h at 2 (p TB + t) + h
  specdraft::unrolled<P * TB * 2>([&](auto i) { acc[i] = vzero(); });
  for (int64_t k = 0; k < K; ++k) {
    specdraft::unrolled<P>([&](auto p) {
      const WT* w = panel + (p * K + k) * kPanelRows;
      const Vec low = vload(w), high = vload(w + kLanes);
      specdraft::unrolled<TB>([&](auto t) {
        const Vec xk = vbroadcast(x + t * K + k);
        acc[2 * (p * TB + t)] = vfmadd(low, xk, acc[2 * (p * TB + t)]);
        acc[2 * (p * TB + t) + 1] = vfmadd(high, xk, acc[2 * (p * TB + t) + 1]);
      });
    });
  }
  specdraft::unrolled<P * TB * 2>([&](auto i) {
    constexpr int p = i / (2 * TB), t = i / 2 % TB, h = i % 2;
    float lanes[kLanes];
    vstore(lanes, acc[i]);
    for (int l = 0; l < kLanes; ++l) {
      const int64_t row = p * kPanelRows + h * kLanes + l;
      out[t * N + row] = bias ? lanes[l] + bias[row] : lanes[l];
    }
  });
}

// Panels [0, n_panels) against all T tokens: 6 tokens at a time over one panel; the 1-5 left over the tile that
// keeps the FMA pipes busy (one token: 4 panels, 8 independent sums)
template <typename WT>
inline void panels_all_tokens(const WT* panels, int64_t n_panels, int64_t K, const float* x, int64_t T, float* out,
                              int64_t N, const float* bias) {
  const int64_t stride = K * kPanelRows;
  for (int64_t p = 0; p < n_panels; ++p)
    for (int64_t t = 0; t + 6 <= T; t += 6)
      panel_tile<WT, 1, 6>(panels + p * stride, K, x + t * K, out + t * N + p * kPanelRows, N,
                           bias ? bias + p * kPanelRows : nullptr);
  const int64_t t = T - T % 6;
  const float* xt = x + t * K;
  float* ot = out + t * N;
  auto tiles = [&](auto panels_per_tile, auto tokens) {
    constexpr int P = decltype(panels_per_tile)::value, TB = decltype(tokens)::value;
    int64_t p = 0;
    for (; p + P <= n_panels; p += P)
      panel_tile<WT, P, TB>(panels + p * stride, K, xt, ot + p * kPanelRows, N, bias ? bias + p * kPanelRows : nullptr);
    for (; p < n_panels; ++p)
      panel_tile<WT, 1, TB>(panels + p * stride, K, xt, ot + p * kPanelRows, N, bias ? bias + p * kPanelRows : nullptr);
  };
  using std::integral_constant;
  switch (T - t) {
    case 1: tiles(integral_constant<int, 4>{}, integral_constant<int, 1>{}); break;
    case 2: tiles(integral_constant<int, 3>{}, integral_constant<int, 2>{}); break;
    case 3: tiles(integral_constant<int, 2>{}, integral_constant<int, 3>{}); break;
    case 4: tiles(integral_constant<int, 1>{}, integral_constant<int, 4>{}); break;
    case 5: tiles(integral_constant<int, 1>{}, integral_constant<int, 5>{}); break;
    default: break;
  }
}

}  // namespace

// rows per panel of `pack_panels` in this build; 0 where dense matrices keep `linear` (the AVX-512 builds)
int64_t dense_panel_rows() { return kPanels ? kPanelRows : 0; }

// x: [T, K] float32, panels: [N / kPanelRows, K, kPanelRows] float32, bfloat16 or float16 (a dense [N, K] matrix
// repacked), bias: [N] float32 or None  ->  [T, N] float32
torch::Tensor linear_panels(torch::Tensor x, torch::Tensor panels, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(kPanels, "this build has no dense panels");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x must be [T, K] float32");
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.size(1) == x.size(1) &&
              panels.size(2) == kPanelRows, "panels must be [N / ", kPanelRows, ", K, ", kPanelRows, "]");
  const int64_t T = x.size(0), K = x.size(1), n_panels = panels.size(0), N = n_panels * kPanelRows;
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->numel() == N && bias->is_contiguous(), "bad bias");
    bias_ptr = bias->data_ptr<float>();
  }
  auto out = torch::empty({T, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  auto run = [&](const auto* weights) {
    // threads own whole panels: which thread computes a row never changes its bits
    at::parallel_for(0, n_panels, 4, [&](int64_t begin, int64_t end) {
      panels_all_tokens(weights + begin * K * kPanelRows, end - begin, K, xp, T, op + begin * kPanelRows, N,
                        bias_ptr ? bias_ptr + begin * kPanelRows : nullptr);
    });
  };
  if (panels.scalar_type() == torch::kFloat) run(panels.data_ptr<float>());
  else if (panels.scalar_type() == torch::kBFloat16) run(panels.data_ptr<at::BFloat16>());
  else if (panels.scalar_type() == torch::kHalf) run(panels.data_ptr<at::Half>());
  else TORCH_CHECK(false, "panels must be float32, bfloat16 or float16");
  return out;
}

// x: [T, D] float32, weight: [D] float32 -> x / rms(x) * weight, each row reduced in a fixed order
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x must be [T, D] float32");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat && weight.numel() == x.size(1), "weight must be [D] float32");
  const int64_t T = x.size(0), D = x.size(1);
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const float* row = xp + t * D;
    __m256 acc = _mm256_setzero_ps();
    const int64_t D8 = D - D % 8;
    for (int64_t d = 0; d < D8; d += 8) {
      __m256 v = _mm256_loadu_ps(row + d);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    float sum = hsum(acc);
    for (int64_t d = D8; d < D; ++d) sum += row[d] * row[d];
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(D) + static_cast<float>(eps));
    for (int64_t d = 0; d < D; ++d) op[t * D + d] = wp[d] * (row[d] * inv);
  }
  return out;
}

// exp(x) lane by lane for x in [-87, 88] (callers clamp): x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor
// polynomial to degree 7 (truncation error below 1e-8 relative, under float precision), times 2^n put into the
// exponent bits (n <= 127 keeps it finite). A lane's result depends on that lane alone, so batching never changes
// a value.
inline __m256 exp_in_range(__m256 x) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - n ln2, with ln2 split in a high part exact in float and a low remainder
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
}

// exp(x) for x <= 0 (attention scores minus their maximum). Below -87 (a weight under 1e-38 next to the maximum's
// 1) it returns e^-87; above 0 it returns 1. That upper clamp matters: the lanes past a query's last key hold a
// score of 0, so they reach here as 0 - max, which is large when every score is far below zero, and 2^n for
// n >= 128 would overflow the exponent field into an inf (then inf times their weight mask of 0 is a NaN).
inline __m256 exp_nonpositive(__m256 x) {
  return exp_in_range(_mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_setzero_ps()));
}

// Gemma 2's soft cap for 8 lanes: cap tanh(x / cap) = cap (1 - 2 / (1 + e^(2x / cap))), e^(2x / cap) clamped to
// [e^-87, e^88] (there tanh is -1 or 1 to float precision). Near 0 the subtraction leaves an absolute error of about
// cap * 1e-7, as good as the logits' own rounding. A lane's result depends on that lane alone.
inline __m256 softcap8(__m256 x, float cap) {
  const __m256 twice = _mm256_mul_ps(_mm256_div_ps(x, _mm256_set1_ps(cap)), _mm256_set1_ps(2.0f));
  const __m256 e = exp_in_range(_mm256_min_ps(_mm256_max_ps(twice, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f)));
  const __m256 tanh = _mm256_sub_ps(_mm256_set1_ps(1.0f),
                                    _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
  return _mm256_mul_ps(_mm256_set1_ps(cap), tanh);
}

// softcap8 over n floats in place, a ragged end padded to 8 lanes
inline void softcap_row(float* row, int64_t n, float cap) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(row + i, softcap8(_mm256_loadu_ps(row + i), cap));
  if (i < n) {
    alignas(32) float lanes[8] = {};
    for (int64_t j = i; j < n; ++j) lanes[j - i] = row[j];
    _mm256_store_ps(lanes, softcap8(_mm256_load_ps(lanes), cap));
    for (int64_t j = i; j < n; ++j) row[j] = lanes[j - i];
  }
}

// The lane sums of four vectors: lane i holds the sum of v[i]'s lanes, always added in the same pattern
// ((0+1)+(2+3)) + ((4+5)+(6+7)).
inline __m128 transpose_sum4(const __m256 v[4]) {
  const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));  // per half: v0..v3
  return _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));
}

// Scores of one query against 4 key rows (lanes of the result), and of two queries against the same 4 rows (each
// key row loaded once for both). A score's arithmetic is the same in both: 8-lane multiply-adds over the head
// dimension in order, then `transpose_sum4`, then the scale.
inline __m128 scores4(const float* q, const float* const key[4], int64_t Dh, __m128 scale) {
  __m256 dots[4];
  for (int v = 0; v < 4; ++v) dots[v] = _mm256_setzero_ps();
  for (int64_t d = 0; d < Dh; d += 8) {
    const __m256 qd = _mm256_loadu_ps(q + d);
    for (int v = 0; v < 4; ++v) dots[v] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(key[v] + d), dots[v]);
  }
  return _mm_mul_ps(transpose_sum4(dots), scale);
}

inline void scores4x2(const float* q0, const float* q1, const float* const key[4], int64_t Dh, __m128 scale,
                      float* out0, float* out1) {
  __m256 dots0[4], dots1[4];
  for (int v = 0; v < 4; ++v) dots0[v] = dots1[v] = _mm256_setzero_ps();
  for (int64_t d = 0; d < Dh; d += 8) {
    const __m256 a = _mm256_loadu_ps(q0 + d), b = _mm256_loadu_ps(q1 + d);
    for (int v = 0; v < 4; ++v) {
      const __m256 k = _mm256_loadu_ps(key[v] + d);
      dots0[v] = _mm256_fmadd_ps(a, k, dots0[v]);
      dots1[v] = _mm256_fmadd_ps(b, k, dots1[v]);
    }
  }
  _mm_storeu_ps(out0, _mm_mul_ps(transpose_sum4(dots0), scale));
  _mm_storeu_ps(out1, _mm_mul_ps(transpose_sum4(dots1), scale));
}

// Queries that share one KV head, attended together so that each key and value row is read from memory once
// for all of them (grouped-query attention: with 12 query heads over 2 KV heads, 6 per head and token) instead
// of once per query. Query u sees n_keys[u] keys, its i-th at cache slot key_slot(u, i), in order; when
// kSameKeys, key i is the same slot for every query (causal attention), and queries go in pairs that share each
// key row they load.
//
// Per query the arithmetic is fixed by the query and its key sequence alone, never by the other queries in the
// block: scores 4 keys at a time (`scores4`, `scores4x2`: the same arithmetic; a key past the end is a row of
// zeros, or a real row whose score is never used), softmax weights 8 at a time, then the weighted values summed
// key by key in order (the running sums go to `outs` between key tiles, which changes no value). So a verify pass
// gives what single steps give, and a tree node what its branch gives as a chain, whatever the blocks and thread
// count.
// out[0 .. 8 kChunks) += sum over keys i0 .. end - 1, in order, of weights[i] * value_row(i)[0 .. 8 kChunks): the
// running sums stay in registers (a fixed count, so the compiler does not keep them in memory)
template <int kChunks, typename ValueRow>
inline void weighted_sum(const float* weights, int64_t i0, int64_t end, ValueRow value_row, float* out) {
  __m256 acc[kChunks];
  for (int c = 0; c < kChunks; ++c) acc[c] = _mm256_loadu_ps(out + c * 8);
  for (int64_t i = i0; i < end; ++i) {
    const __m256 p = _mm256_set1_ps(weights[i]);
    const float* value = value_row(i);
    for (int c = 0; c < kChunks; ++c) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(value + c * 8), acc[c]);
  }
  for (int c = 0; c < kChunks; ++c) _mm256_storeu_ps(out + c * 8, acc[c]);
}

constexpr int64_t kQueriesPerBlock = 48;  // queries attended together (their scores stay in one buffer)
constexpr int64_t kValueTile = 32;        // value rows kept in L1 while every query of the block uses them

template <bool kSameKeys, typename KeySlot>
void attend_block(const float* const* qrows, float* const* outs, const int64_t* n_keys, int64_t n_queries,
                  const float* keys, const float* values, int64_t Dh, float scale, float softcap, KeySlot key_slot,
                  std::vector<float>& scores) {
  int64_t longest = 0;
  for (int64_t u = 0; u < n_queries; ++u) longest = std::max(longest, n_keys[u]);
  const int64_t stride = (longest + 7) / 8 * 8;  // a query's scores, rounded up to whole blocks of 8
  scores.resize(n_queries * stride);
  const __m128 vscale = _mm_set1_ps(scale);
  const std::vector<float> zeros(Dh, 0.0f);  // the key row of a lane past the end
  // scores (every entry of a query's row up to its whole blocks of 8 is written), the keys in the outer loop: 4
  // key rows (2 KiB at Dh 128) stay in L1 for every query
  const auto covered = [&](int64_t u) { return (n_keys[u] + 7) / 8 * 8; };
  for (int64_t i0 = 0; i0 < stride; i0 += 4) {
    int64_t u = 0;
    if constexpr (kSameKeys) {
      const float* key[4];
      for (int v = 0; v < 4; ++v) key[v] = i0 + v < longest ? keys + key_slot(0, i0 + v) * Dh : zeros.data();
      for (; u + 1 < n_queries; u += 2) {
        if (i0 >= std::max(covered(u), covered(u + 1))) continue;
        scores4x2(qrows[u], qrows[u + 1], key, Dh, vscale, scores.data() + u * stride + i0,
                  scores.data() + (u + 1) * stride + i0);
      }
    }
    for (; u < n_queries; ++u) {
      if (i0 >= covered(u)) continue;
      const float* key[4];
      for (int v = 0; v < 4; ++v) key[v] = i0 + v < n_keys[u] ? keys + key_slot(u, i0 + v) * Dh : zeros.data();
      _mm_storeu_ps(scores.data() + u * stride + i0, scores4(qrows[u], key, Dh, vscale));
    }
  }
  // softmax weights, query by query; the sums are kept for the final scaling
  std::vector<float> totals(n_queries);
  for (int64_t u = 0; u < n_queries; ++u) {
    float* row = scores.data() + u * stride;
    if (softcap > 0.0f) softcap_row(row, n_keys[u], softcap);  // Gemma 2's soft cap of the scores
    __m256 lane_max = _mm256_set1_ps(-INFINITY);  // over the query's own keys only
    int64_t i = 0;
    for (; i + 8 <= n_keys[u]; i += 8) lane_max = _mm256_max_ps(lane_max, _mm256_loadu_ps(row + i));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, lane_max);
    float max_score = lanes[0];
    for (int v = 1; v < 8; ++v) max_score = std::max(max_score, lanes[v]);
    for (; i < n_keys[u]; ++i) max_score = std::max(max_score, row[i]);
    const __m256 vmax = _mm256_set1_ps(max_score);
    __m256 vtotal = _mm256_setzero_ps();
    for (int64_t i0 = 0; i0 < n_keys[u]; i0 += 8) {
      __m256 w = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(row + i0), vmax));
      const int64_t valid = std::min<int64_t>(8, n_keys[u] - i0);
      if (valid < 8) {  // lanes past the end weigh nothing
        alignas(32) float keep[8];
        for (int v = 0; v < 8; ++v) keep[v] = v < valid ? 1.0f : 0.0f;
        w = _mm256_mul_ps(w, _mm256_load_ps(keep));
      }
      _mm256_storeu_ps(row + i0, w);
      vtotal = _mm256_add_ps(vtotal, w);
    }
    totals[u] = hsum(vtotal);
    for (int64_t d = 0; d < Dh; ++d) outs[u][d] = 0.0f;
  }
  // weighted values, tile by tile of keys; within a query the keys are summed in order
  for (int64_t i0 = 0; i0 < longest; i0 += kValueTile) {
    for (int64_t u = 0; u < n_queries; ++u) {
      const int64_t end = std::min(n_keys[u], i0 + kValueTile);
      if (i0 >= end) continue;
      const float* weights = scores.data() + u * stride;
      for (int64_t d0 = 0; d0 < Dh; d0 += 64) {  // up to 8 running sums of 8 lanes, in registers
        const auto value_row = [&](int64_t i) { return values + key_slot(u, i) * Dh + d0; };
        switch (std::min<int64_t>(8, (Dh - d0) / 8)) {
          case 8: weighted_sum<8>(weights, i0, end, value_row, outs[u] + d0); break;
          case 7: weighted_sum<7>(weights, i0, end, value_row, outs[u] + d0); break;
          case 6: weighted_sum<6>(weights, i0, end, value_row, outs[u] + d0); break;
          case 5: weighted_sum<5>(weights, i0, end, value_row, outs[u] + d0); break;
          case 4: weighted_sum<4>(weights, i0, end, value_row, outs[u] + d0); break;
          case 3: weighted_sum<3>(weights, i0, end, value_row, outs[u] + d0); break;
          case 2: weighted_sum<2>(weights, i0, end, value_row, outs[u] + d0); break;
          default: weighted_sum<1>(weights, i0, end, value_row, outs[u] + d0); break;
        }
      }
    }
  }
  for (int64_t u = 0; u < n_queries; ++u) {
    const __m256 inv = _mm256_set1_ps(1.0f / totals[u]);
    for (int64_t d = 0; d < Dh; d += 8) _mm256_storeu_ps(outs[u] + d, _mm256_mul_ps(_mm256_loadu_ps(outs[u] + d), inv));
  }
}

// How one sequence's queries split into tasks: (KV head, part of its queries), `parts` per KV head. A KV head's
// queries split further when there are fewer KV heads than threads.
struct AttentionTasks {
  int64_t group, per_head, parts;
  AttentionTasks(int64_t T, int64_t H, int64_t Hkv) : group(H / Hkv), per_head(T * (H / Hkv)) {
    const int64_t blocks = (per_head + kQueriesPerBlock - 1) / kQueriesPerBlock;
    const int64_t split = std::max<int64_t>(1, std::min<int64_t>(per_head, (at::get_num_threads() + Hkv - 1) / Hkv));
    parts = std::max(blocks, split);
  }
  int64_t count(int64_t Hkv) const { return Hkv * parts; }
};

inline float attention_scale_for(double scale_or_zero, int64_t Dh) {
  return scale_or_zero > 0 ? static_cast<float>(scale_or_zero) : 1.0f / std::sqrt(static_cast<float>(Dh));
}

// One task of `AttentionTasks`: `attend_block` over KV head task / parts's queries of part task % parts. Query (t, h)
// reads KV head h / group; its keys come from key_count(t) and key_slot(t, i). scale: what a score q.k is multiplied
// by; softcap: Gemma 2's cap of the scaled scores (0: none). scores: the thread's buffer.
template <bool kSameKeys, typename KeyCount, typename KeySlot>
void attend_task(const AttentionTasks& tasks, int64_t task, const float* qp, float* op, int64_t H, int64_t C,
                 int64_t Dh, const float* kp, const float* vp, float scale, double softcap, KeyCount key_count,
                 KeySlot key_slot, std::vector<float>& scores) {
  const float* qrows[kQueriesPerBlock];
  float* outs[kQueriesPerBlock];
  int64_t n_keys[kQueriesPerBlock], times[kQueriesPerBlock];
  const int64_t group = tasks.group, per_head = tasks.per_head, parts = tasks.parts;
  const int64_t kvh = task / parts, part = task % parts;
  const int64_t first = per_head * part / parts, last = per_head * (part + 1) / parts;
  for (int64_t b0 = first; b0 < last; b0 += kQueriesPerBlock) {
    const int64_t n = std::min(kQueriesPerBlock, last - b0);
    for (int64_t u = 0; u < n; ++u) {  // the kv head's query j: token j / group, head kvh * group + j % group
      const int64_t t = (b0 + u) / group, h = kvh * group + (b0 + u) % group;
      qrows[u] = qp + (t * H + h) * Dh;
      outs[u] = op + (t * H + h) * Dh;
      n_keys[u] = key_count(t);
      times[u] = t;
    }
    attend_block<kSameKeys>(qrows, outs, n_keys, n, kp + kvh * C * Dh, vp + kvh * C * Dh, Dh, scale,
                            static_cast<float>(softcap), [&](int64_t u, int64_t i) { return key_slot(times[u], i); },
                            scores);
  }
}

// Runs every task of one sequence's queries in parallel. scale_or_zero: as `attention`'s scale.
template <bool kSameKeys, typename KeyCount, typename KeySlot>
void attend_all(const float* qp, float* op, int64_t T, int64_t H, int64_t Hkv, int64_t C, int64_t Dh,
                const float* kp, const float* vp, double scale_or_zero, double softcap, KeyCount key_count,
                KeySlot key_slot) {
  const AttentionTasks tasks(T, H, Hkv);
  const float scale = attention_scale_for(scale_or_zero, Dh);
  at::parallel_for(0, tasks.count(Hkv), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task)
      attend_task<kSameKeys>(tasks, task, qp, op, H, C, Dh, kp, vp, scale, softcap, key_count, key_slot, scores);
  });
}

// Causal attention of T new queries against a cache that already holds their keys and values.
// q: [T, H, Dh]; k_cache, v_cache: [Hkv, C, Dh] (C = capacity); query t sits at position start + t and sees
// keys 0 .. start + t, or with a sliding window (window > 0) the last `window` of them (Gemma's local layers: key j
// is seen when start + t - j < window). Grouped-query attention: head h reads kv head h / (H / Hkv). scale,
// softcap: as `attend_all`.  ->  [T, H, Dh]
torch::Tensor attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, int64_t start, int64_t window,
                        double scale, double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat && q.is_contiguous(), "q must be [T, H, Dh] float32");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be [Hkv, C, Dh]");
  const int64_t T = q.size(0), H = q.size(1), Dh = q.size(2);
  const int64_t Hkv = k_cache.size(0), C = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == Dh && H % Hkv == 0 && start + T <= C, "attention shapes do not match");
  TORCH_CHECK(Dh % 8 == 0, "head size must be a multiple of 8");
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (window <= 0 || start + T <= window) {  // no query's window cuts a key: every query starts at slot 0
    attend_all<true>(qp, op, T, H, Hkv, C, Dh, kp, vp, scale, softcap, [start](int64_t t) { return start + t + 1; },
                     [](int64_t t, int64_t i) { return i; });
  } else {  // each query's keys start where its own window does (the same per-query arithmetic as above)
    const auto first = [start, window](int64_t t) { return std::max<int64_t>(0, start + t + 1 - window); };
    attend_all<false>(qp, op, T, H, Hkv, C, Dh, kp, vp, scale, softcap,
                      [start, first](int64_t t) { return start + t + 1 - first(t); },
                      [first](int64_t t, int64_t i) { return first(t) + i; });
  }
  return out;
}

// `attention` of several sequences (a batched pass: q[s] [T_s, H, Dh] against its own cache layer k_caches[s],
// v_caches[s] [Hkv, C_s, Dh] from slot starts[s]) in one parallel region over all their tasks, where every
// sequence's queries see all their earlier keys (no window cuts one); each task is the one `attention` runs for
// that sequence alone, so the same bits. Otherwise `attention` one sequence at a time.  ->  [T_s, H, Dh] each
std::vector<torch::Tensor> attention_segments(const std::vector<torch::Tensor>& qs,
                                              const std::vector<torch::Tensor>& k_caches,
                                              const std::vector<torch::Tensor>& v_caches,
                                              const std::vector<int64_t>& starts, int64_t window, double scale,
                                              double softcap) {
  const size_t n = qs.size();
  bool windowed = false;
  for (size_t s = 0; s < n; ++s) windowed = windowed || (window > 0 && starts[s] + qs[s].size(0) > window);
  std::vector<torch::Tensor> outs(n);
  if (n == 1 || windowed) {
    for (size_t s = 0; s < n; ++s) outs[s] = attention(qs[s], k_caches[s], v_caches[s], starts[s], window, scale,
                                                       softcap);
    return outs;
  }
  std::vector<AttentionTasks> tasks;
  std::vector<int64_t> task_starts{0};  // sequence s's tasks: task_starts[s] ..
  for (size_t s = 0; s < n; ++s) {
    const auto &q = qs[s], &k_cache = k_caches[s];
    TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat && q.is_contiguous(), "q must be [T, H, Dh] float32");
    TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_caches[s].is_contiguous() &&
                v_caches[s].sizes() == k_cache.sizes(), "caches must be [Hkv, C, Dh]");
    TORCH_CHECK(k_cache.size(2) == q.size(2) && q.size(1) % k_cache.size(0) == 0 &&
                starts[s] + q.size(0) <= k_cache.size(1), "attention shapes do not match");
    TORCH_CHECK(q.size(2) % 8 == 0, "head size must be a multiple of 8");
    tasks.emplace_back(q.size(0), q.size(1), k_cache.size(0));
    task_starts.push_back(task_starts.back() + tasks.back().count(k_cache.size(0)));
    outs[s] = torch::empty_like(q);
  }
  at::parallel_for(0, task_starts.back(), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    size_t s = 0;
    for (int64_t task = begin; task < end; ++task) {
      while (task >= task_starts[s + 1]) ++s;
      const auto &q = qs[s], &k_cache = k_caches[s];
      const int64_t start = starts[s], Dh = q.size(2);
      attend_task<true>(tasks[s], task - task_starts[s], q.data_ptr<float>(), outs[s].data_ptr<float>(), q.size(1),
                        k_cache.size(1), Dh, k_cache.data_ptr<float>(), v_caches[s].data_ptr<float>(),
                        attention_scale_for(scale, Dh), softcap, [start](int64_t t) { return start + t + 1; },
                        [](int64_t t, int64_t i) { return i; }, scores);
    }
  });
  return outs;
}

// Tree attention: the same arithmetic as `attention`, over an explicit set of keys per query. Query t sees
// keys 0 .. prefix - 1 and key prefix + j wherever mask[t, j] is set; mask: [T, W] bool, prefix + W <= C (the
// new tokens' own keys are the last T of those W). Visible keys are visited in increasing position, exactly as
// `attention` visits them, so a node whose visible keys are its root-to-node branch gets bit for bit the
// output that the branch run as a chain gets from `attention` (the same `attend_one` over the same key
// sequence). With a sliding window (window > 0; positions [T] int64, each query's rotary position p), a query
// sees the prefix keys j with p - j < window, as its branch run as a chain would; the window must span the W slots.
// scale, softcap: as `attend_all`.  ->  [T, H, Dh]
torch::Tensor tree_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, int64_t prefix,
                             torch::Tensor mask, int64_t window, c10::optional<torch::Tensor> positions, double scale,
                             double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat && q.is_contiguous(), "q must be [T, H, Dh] float32");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be [Hkv, C, Dh]");
  TORCH_CHECK(mask.dim() == 2 && mask.scalar_type() == torch::kBool && mask.is_contiguous() &&
              mask.size(0) == q.size(0), "mask must be [T, W] bool");
  const int64_t T = q.size(0), H = q.size(1), Dh = q.size(2), W = mask.size(1);
  const int64_t Hkv = k_cache.size(0), C = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == Dh && H % Hkv == 0 && prefix >= 0 && prefix + W <= C,
              "tree attention shapes do not match");
  TORCH_CHECK(Dh % 8 == 0, "head size must be a multiple of 8");
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const bool* mp = mask.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  std::vector<int64_t> first_prefix_key(T, 0);  // the first prefix slot each query's window reaches
  if (window > 0) {
    TORCH_CHECK(window >= W, "a sliding window of ", window, " does not span the tree's ", W, " slots");
    TORCH_CHECK(positions.has_value() && positions->dim() == 1 && positions->scalar_type() == torch::kLong &&
                positions->numel() == T, "a sliding window needs the queries' positions, [T] int64");
    auto ids = positions->contiguous();
    for (int64_t t = 0; t < T; ++t)
      first_prefix_key[t] = std::max<int64_t>(0, ids.data_ptr<int64_t>()[t] + 1 - window);
  }
  // visible key positions of each query, in increasing order
  std::vector<std::vector<int64_t>> visible(T);
  for (int64_t t = 0; t < T; ++t) {
    visible[t].reserve(prefix + W);
    for (int64_t j = first_prefix_key[t]; j < prefix; ++j) visible[t].push_back(j);
    for (int64_t j = 0; j < W; ++j)
      if (mp[t * W + j]) visible[t].push_back(prefix + j);
  }
  attend_all<false>(qp, op, T, H, Hkv, C, Dh, kp, vp, scale, softcap,
                    [&visible](int64_t t) { return static_cast<int64_t>(visible[t].size()); },
                    [&visible](int64_t t, int64_t i) { return visible[t][i]; });
  return out;
}

// silu(gate) * up for 8 lanes: g / (1 + e^-g) * u, e^-g clamped to [e^-87, e^88] (there the quotient is g itself
// or 0 to float precision anyway)
inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 e = exp_in_range(_mm256_min_ps(_mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), g),
                                                            _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f)));
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

// gelu(gate) * up for 8 lanes, gelu in its tanh form (Gemma's gelu_pytorch_tanh): 0.5 g (1 + tanh(z)) with
// z = sqrt(2 / pi) (g + 0.044715 g^3), computed as g / (1 + e^(-2z)), e^(-2z) clamped as in `silu_mul8`
inline __m256 gelu_tanh_mul8(__m256 g, __m256 u) {
  const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
  const __m256 z2 = _mm256_mul_ps(_mm256_set1_ps(-1.5957691216057308f),  // -2 sqrt(2 / pi)
                                  _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(0.044715f), cube)));
  const __m256 e = exp_in_range(_mm256_min_ps(_mm256_max_ps(z2, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f)));
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

// act(gate) * up, element-wise: gate, up [T, I] float32  ->  [T, I]. Every element goes through the same lane
// arithmetic (a ragged end is padded to 8 lanes), so an element's value never depends on where it sits.
template <__m256 (*kGatedLanes)(__m256, __m256)>
torch::Tensor gated_mul(torch::Tensor gate, torch::Tensor up) {
  TORCH_CHECK(gate.scalar_type() == torch::kFloat && up.scalar_type() == torch::kFloat && gate.is_contiguous() &&
              up.is_contiguous() && gate.sizes() == up.sizes(), "gate and up must be float32 tensors of one shape");
  auto out = torch::empty_like(gate);
  const float* gp = gate.data_ptr<float>();
  const float* up_ = up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t n = gate.numel(), whole = n / 8;
  at::parallel_for(0, whole, 512, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      _mm256_storeu_ps(op + 8 * i, kGatedLanes(_mm256_loadu_ps(gp + 8 * i), _mm256_loadu_ps(up_ + 8 * i)));
  });
  if (n % 8) {
    alignas(32) float g[8] = {}, u[8] = {}, o[8];
    for (int64_t i = 8 * whole; i < n; ++i) g[i - 8 * whole] = gp[i], u[i - 8 * whole] = up_[i];
    _mm256_store_ps(o, kGatedLanes(_mm256_load_ps(g), _mm256_load_ps(u)));
    for (int64_t i = 8 * whole; i < n; ++i) op[i] = o[i - 8 * whole];
  }
  return out;
}

torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up) { return gated_mul<silu_mul8>(gate, up); }

torch::Tensor gelu_tanh_mul(torch::Tensor gate, torch::Tensor up) { return gated_mul<gelu_tanh_mul8>(gate, up); }

// cap tanh(x / cap), element by element (Gemma 2's final logits, `softcap8`): a value's result depends on it alone.
torch::Tensor softcap(torch::Tensor x, double cap) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.is_contiguous() && cap > 0, "softcap takes contiguous float32");
  auto out = x.clone();
  float* op = out.data_ptr<float>();
  const int64_t n = x.numel(), chunks = (n + 4095) / 4096;
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) softcap_row(op + c * 4096, std::min<int64_t>(4096, n - c * 4096),
                                                      static_cast<float>(cap));
  });
  return out;
}

// Rotary embedding of new queries and keys, and the keys and values written to their cache slots, in one pass.
// q [T, H, Dh], k and v [T, Hkv, Dh] float32; cos, sin [P, Dh] (each row two copies of a half: the half-split
// convention of Llama/Qwen2); positions: [T] int64 rotary positions, or None for start + t; k_cache, v_cache
// [Hkv, C, Dh] (a layer of the cache), token t going to slot start + t. Element i < Dh / 2 of a rotated row is
// x[i] cos[i] - x[i + Dh/2] sin[i], element i + Dh/2 is x[i + Dh/2] cos[i] + x[i] sin[i]: products rounded apart,
// then summed (torch's x * cos + rotate_half(x) * sin, bit for bit).  ->  the rotated queries [T, H, Dh]
torch::Tensor rope_store(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos, torch::Tensor sin,
                         c10::optional<torch::Tensor> positions, torch::Tensor k_cache, torch::Tensor v_cache,
                         int64_t start) {
  for (const auto* t : {&q, &k, &v, &cos, &sin, &k_cache, &v_cache})
    TORCH_CHECK(t->scalar_type() == torch::kFloat && t->is_contiguous(), "rope_store takes contiguous float32");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.sizes() == v.sizes() && q.size(0) == k.size(0) &&
              q.size(2) == k.size(2), "q must be [T, H, Dh], k and v [T, Hkv, Dh]");
  const int64_t T = q.size(0), H = q.size(1), Hkv = k.size(1), Dh = q.size(2), half = Dh / 2;
  TORCH_CHECK(Dh % 2 == 0, "head size must be even");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) == Dh, "cos and sin must be [P, Dh]");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == Hkv &&
              k_cache.size(2) == Dh && start >= 0 && start + T <= k_cache.size(1), "cache layer shapes do not match");
  std::vector<int64_t> where(T);
  if (positions.has_value()) {
    TORCH_CHECK(positions->dim() == 1 && positions->scalar_type() == torch::kLong && positions->numel() == T,
                "positions must be [T] int64");
    auto ids = positions->contiguous();
    for (int64_t t = 0; t < T; ++t) where[t] = ids.data_ptr<int64_t>()[t];
  } else {
    for (int64_t t = 0; t < T; ++t) where[t] = start + t;
  }
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(where[t] >= 0 && where[t] < cos.size(0), "position out of the table");
  auto rotated_q = torch::empty_like(q);
  const int64_t C = k_cache.size(1);
  // each product rounded on its own: the empty asm keeps the compiler from fusing a product into the add (FMA)
  const auto product = [](__m256 a, __m256 b) {
    __m256 p = _mm256_mul_ps(a, b);
    __asm__("" : "+x"(p));
    return p;
  };
  const auto scalar_product = [](float a, float b) {
    float p = a * b;
    __asm__("" : "+x"(p));
    return p;
  };
  const auto rotate = [&](const float* x, const float* c, const float* s, float* out) {
    int64_t i = 0;
    for (; i + 8 <= half; i += 8) {
      const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + half + i);
      _mm256_storeu_ps(out + i, _mm256_sub_ps(product(a, _mm256_loadu_ps(c + i)), product(b, _mm256_loadu_ps(s + i))));
      _mm256_storeu_ps(out + half + i, _mm256_add_ps(product(b, _mm256_loadu_ps(c + half + i)),
                                                     product(a, _mm256_loadu_ps(s + half + i))));
    }
    for (; i < half; ++i) {  // head sizes that are not multiples of 16
      out[i] = scalar_product(x[i], c[i]) - scalar_product(x[half + i], s[i]);
      out[half + i] = scalar_product(x[half + i], c[half + i]) + scalar_product(x[i], s[half + i]);
    }
  };
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float *rq = rotated_q.data_ptr<float>(), *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cos.data_ptr<float>() + where[t] * Dh;
    const float* s = sin.data_ptr<float>() + where[t] * Dh;
    for (int64_t h = 0; h < H; ++h) rotate(qp + (t * H + h) * Dh, c, s, rq + (t * H + h) * Dh);
    for (int64_t h = 0; h < Hkv; ++h) {
      rotate(kp + (t * Hkv + h) * Dh, c, s, kc + (h * C + start + t) * Dh);
      std::memcpy(vc + (h * C + start + t) * Dh, vp + (t * Hkv + h) * Dh, Dh * sizeof(float));
    }
  }
  return rotated_q;
}

// How at::parallel_for runs in this build: it is a header template, parallel only when this file is compiled
// with OpenMP (-fopenmp); without it every kernel silently runs on one thread.
// The instruction set of the matrix products in this build: "amx", "avx512bf16", "avx512" or "avx2".
std::string isa() { return kIsa; }

std::string parallel_backend() {
#ifdef _OPENMP
  return "openmp";
#else
  return "sequential";
#endif
}

// quant_kernels.cpp: products over GGUF block formats
torch::Tensor qlinear(torch::Tensor x, torch::Tensor weight, int64_t type, c10::optional<torch::Tensor> bias);
torch::Tensor qdequantize_rows(torch::Tensor weight, int64_t type, int64_t K, torch::Tensor rows);
torch::Tensor qconvert_iq3_rows(torch::Tensor raw, int64_t type, int64_t K, torch::Tensor grid, torch::Tensor ksigns);
std::vector<torch::Tensor> quantize_activations(torch::Tensor x, int64_t block);
bool quant_vnni();
bool quant_amx();
bool set_quant_amx(bool allowed);
void qinterleave_into(torch::Tensor weight, int64_t type, int64_t K, torch::Tensor out);
torch::Tensor qdeinterleave_rows(torch::Tensor packed, int64_t type, int64_t K, torch::Tensor rows);
torch::Tensor qlinear_x8(torch::Tensor x, torch::Tensor packed, int64_t type, c10::optional<torch::Tensor> bias);
std::vector<torch::Tensor> qlinear_x8_shared(
    torch::Tensor x, const std::vector<std::tuple<torch::Tensor, int64_t, c10::optional<torch::Tensor>>>& matrices);

// ------------------------------------------------------------------------------------------- the layer stack
// Every decoder layer of a chain pass in one call: the same kernels in the same order as the Python layer
// (llama.py, NativeLlama._layer), so a row comes out bit for bit as it does there, without the ~140 us of
// interpreter work per layer between the kernels (4 ms of a 45 ms one-token step of the 1.5B, 2026-12-03).
namespace {

// A matrix as the kernels take it: dense float32/bfloat16/float16 (`linear`; in panels, `linear_panels`), or a GGUF
// block format (`qlinear`; over interleaved groups of 8 rows, `qlinear_x8`).
constexpr int64_t kDensePanels = -2;

struct StackMatrix {
  // dense [N, K] float32/bf16/f16, or [N / P, K, P] in panels; else uint8 blocks [N, row bytes] or [N / 8, group bytes]
  torch::Tensor weight;
  int64_t qtype;  // ggml type number; -1: dense; kDensePanels: dense in panels (`linear_panels`)
  bool interleaved;
  c10::optional<torch::Tensor> bias;  // [N] float32

  torch::Tensor apply(const torch::Tensor& x) const {  // x [T, K] -> [T, N]
    if (qtype == kDensePanels) return ::linear_panels(x, weight, bias);
    if (qtype < 0) return ::linear(x, weight, bias);
    return interleaved ? ::qlinear_x8(x, weight, qtype, bias) : ::qlinear(x, weight, qtype, bias);
  }
};

// The products of matrices that read one input (a layer's q, k and v; its gate and up): where all are interleaved
// block formats, in one call that quantizes x once per layout and runs each format's matrices in one parallel region
// (`qlinear_x8_shared`: the bits of one product at a time); otherwise one at a time.
std::vector<torch::Tensor> apply_shared(const torch::Tensor& x, const std::vector<const StackMatrix*>& matrices) {
  std::vector<std::tuple<torch::Tensor, int64_t, c10::optional<torch::Tensor>>> interleaved;
  for (const StackMatrix* matrix : matrices) {
    if (matrix->qtype < 0 || !matrix->interleaved) {
      std::vector<torch::Tensor> outs;
      for (const StackMatrix* each : matrices) outs.push_back(each->apply(x));
      return outs;
    }
    interleaved.emplace_back(matrix->weight, matrix->qtype, matrix->bias);
  }
  return ::qlinear_x8_shared(x, interleaved);
}

struct StackLayer {
  torch::Tensor input_norm, post_norm;  // [D] float32
  c10::optional<torch::Tensor> q_norm, k_norm;  // [Dh] float32: Qwen3's and Gemma 3's norm of each head's q and k
  // [D] float32: Gemma's norms of the attention's and the MLP's outputs, before each joins the residual (or none)
  c10::optional<torch::Tensor> attention_output_norm, mlp_output_norm;
  int64_t window;      // sliding-window attention over this many positions (0: every earlier position)
  int64_t rope_table;  // which of the rotary tables `forward` is given this layer rotates by
  StackMatrix q, k, v, o, gate, up, down;
};

class LayerStack {
 public:
  // attention_scale: what q.k is multiplied by (0: 1 / sqrt(head_dim)); attention_softcap: Gemma 2's cap of the
  // scores (0: none); gelu: the MLP gates by gelu in its tanh form (Gemma) instead of silu
  LayerStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double attention_scale,
             double attention_softcap, bool gelu)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), attention_scale_(attention_scale),
        attention_softcap_(attention_softcap), gelu_(gelu) {}

  // matrices: q, k, v, o, gate, up, down, each (weight, qtype or -1 or kDensePanels, interleaved, bias or None)
  void add_layer(torch::Tensor input_norm, torch::Tensor post_norm, c10::optional<torch::Tensor> q_norm,
                 c10::optional<torch::Tensor> k_norm,
                 std::vector<std::tuple<torch::Tensor, int64_t, bool, c10::optional<torch::Tensor>>> matrices,
                 c10::optional<torch::Tensor> attention_output_norm, c10::optional<torch::Tensor> mlp_output_norm,
                 int64_t window, int64_t rope_table) {
    TORCH_CHECK(matrices.size() == 7, "a layer has 7 matrices: q, k, v, o, gate, up, down");
    for (const auto& norm : {q_norm, k_norm})
      TORCH_CHECK(!norm.has_value() || norm->numel() == head_dim_, "a head norm has head_dim weights");
    TORCH_CHECK(window >= 0 && rope_table >= 0, "a window and a rotary table index are not negative");
    std::vector<StackMatrix> stacked;
    for (auto& [weight, qtype, interleaved, bias] : matrices) stacked.push_back({weight, qtype, interleaved, bias});
    layers_.push_back({input_norm, post_norm, q_norm, k_norm, attention_output_norm, mlp_output_norm, window,
                       rope_table, stacked[0], stacked[1], stacked[2], stacked[3], stacked[4], stacked[5], stacked[6]});
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

  // hidden [T, D] float32: rows firsts[s] .. firsts[s] + counts[s] - 1 belong to sequence s, whose K/V go to
  // slots starts[s] .. of keys[s], values[s] ([layers, Hkv, C, Dh] each) and which attend to every earlier slot.
  // cos, sin: the rotary tables [P, Dh] (one pair per `rope_table` of the layers), covering every position of the
  // pass.  ->  [T, D] after the last layer
  torch::Tensor forward(torch::Tensor hidden, const std::vector<int64_t>& firsts, const std::vector<int64_t>& counts,
                        const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values,
                        const std::vector<int64_t>& starts, const std::vector<torch::Tensor>& cos,
                        const std::vector<torch::Tensor>& sin) const {
    const size_t n_segments = firsts.size();
    TORCH_CHECK(cos.size() == sin.size(), "one sine table per cosine table");
    for (const auto& layer : layers_)
      TORCH_CHECK(layer.rope_table < static_cast<int64_t>(cos.size()), "a layer's rotary table is missing");
    TORCH_CHECK(n_segments > 0 && counts.size() == n_segments && keys.size() == n_segments &&
                values.size() == n_segments && starts.size() == n_segments, "one entry per sequence in each list");
    TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "hidden must be [T, D] contiguous");
    const int64_t rows = hidden.size(0);
    for (size_t s = 0; s < n_segments; ++s)
      TORCH_CHECK(keys[s].dim() == 4 && keys[s].size(0) >= size() && values[s].sizes() == keys[s].sizes() &&
                  firsts[s] == (s ? firsts[s - 1] + counts[s - 1] : 0) && counts[s] > 0 &&
                  firsts[s] + counts[s] <= rows, "sequence ", s, " does not follow the previous one's rows");
    std::vector<torch::Tensor> rotated(n_segments), layer_keys(n_segments), layer_values(n_segments);
    for (int64_t index = 0; index < size(); ++index) {
      const StackLayer& layer = layers_[index];
      auto x = ::rms_norm(hidden, layer.input_norm, eps_);  // [T, D]
      const auto qkv = apply_shared(x, {&layer.q, &layer.k, &layer.v});
      auto q = qkv[0], k = qkv[1], v = qkv[2];  // [T, H * Dh], [T, Hkv * Dh] x 2
      if (layer.q_norm) q = ::rms_norm(q.view({-1, head_dim_}), *layer.q_norm, eps_).view({rows, -1});
      if (layer.k_norm) k = ::rms_norm(k.view({-1, head_dim_}), *layer.k_norm, eps_).view({rows, -1});
      for (size_t s = 0; s < n_segments; ++s) {
        const int64_t first = firsts[s], n = counts[s];
        auto keys_layer = keys[s].select(0, index), values_layer = values[s].select(0, index);  // [Hkv, C, Dh]
        auto q_rotated = ::rope_store(q.narrow(0, first, n).view({n, heads_, head_dim_}),
                                    k.narrow(0, first, n).view({n, kv_heads_, head_dim_}),
                                    v.narrow(0, first, n).view({n, kv_heads_, head_dim_}), cos[layer.rope_table],
                                    sin[layer.rope_table], c10::nullopt, keys_layer, values_layer, starts[s]);
        rotated[s] = q_rotated, layer_keys[s] = keys_layer, layer_values[s] = values_layer;
      }
      // every sequence's attention in one parallel region ([n, H, Dh] each)
      const auto attended = ::attention_segments(rotated, layer_keys, layer_values, starts, layer.window,
                                                 attention_scale_, attention_softcap_);
      auto heads = n_segments == 1 ? attended[0] : torch::cat(attended);  // [T, H, Dh]
      auto attention_out = layer.o.apply(heads.view({rows, -1}));  // [T, D]
      if (layer.attention_output_norm) attention_out = ::rms_norm(attention_out, *layer.attention_output_norm, eps_);
      hidden = hidden + attention_out;
      x = ::rms_norm(hidden, layer.post_norm, eps_);
      const auto gate_up = apply_shared(x, {&layer.gate, &layer.up});
      const auto &gate = gate_up[0], &up = gate_up[1];  // [T, I]
      auto mlp_out = layer.down.apply(gelu_ ? ::gelu_tanh_mul(gate, up) : ::silu_mul(gate, up));  // [T, D]
      if (layer.mlp_output_norm) mlp_out = ::rms_norm(mlp_out, *layer.mlp_output_norm, eps_);
      hidden = hidden + mlp_out;
    }
    return hidden;
  }

 private:
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, attention_scale_, attention_softcap_;
  bool gelu_;
  std::vector<StackLayer> layers_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<LayerStack>(m, "LayerStack", "a model's decoder layers, run over a chain pass in one call")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double, double, bool>())
      .def("add_layer", &LayerStack::add_layer)
      .def("__len__", &LayerStack::size)
      // no Python object is touched inside: other threads (the server's event loop) run during the pass
      .def("forward", &LayerStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("parallel_backend", &parallel_backend, "\"openmp\" when the kernels use several threads");
  m.def("isa", &isa, "the instruction set of the matrix products: \"amx\", \"avx512bf16\", \"avx512\" or \"avx2\"");
  m.def("linear", &linear, "batch-invariant x @ W.T (+ b), float32, bfloat16 or float16 weights");
  m.def("linear_panels", &linear_panels, "batch-invariant x @ W.T (+ b) over W repacked in panels (dense_panel_rows)");
  m.def("dense_panel_rows", &dense_panel_rows, "rows per dense panel in this build (0: none, `linear` only)");
  m.def("rms_norm", &rms_norm, "row-wise RMSNorm, fixed reduction order");
  m.def("attention", &attention, "causal GQA attention of new queries against the KV cache (a sliding window)",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("start"),
        pybind11::arg("window") = 0, pybind11::arg("scale") = 0.0, pybind11::arg("softcap") = 0.0);
  m.def("tree_attention", &tree_attention, "GQA attention of new queries against chosen keys (token trees)",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("prefix"),
        pybind11::arg("mask"), pybind11::arg("window") = 0, pybind11::arg("positions") = pybind11::none(),
        pybind11::arg("scale") = 0.0, pybind11::arg("softcap") = 0.0);
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("gelu_tanh_mul", &gelu_tanh_mul, "gelu(gate) * up, gelu in its tanh form");
  m.def("softcap", &softcap, "cap tanh(x / cap), element by element");
  m.def("rope_store", &rope_store, "rotary embedding of q and k, k and v written to their cache slots");
  m.def("qlinear", &qlinear, "batch-invariant x @ W.T (+ b) with W in a GGUF block format (int8 activations)");
  m.def("qdequantize_rows", &qdequantize_rows, "rows of a GGUF block-format matrix as float32");
  m.def("qconvert_iq3_rows", &qconvert_iq3_rows, "IQ3_XXS or IQ3_S rows as Q6_K rows of the same values");
  m.def("quantize_activations", &quantize_activations, "x as the block kernels quantize it: (int8, scales)");
  m.def("quant_vnni", &quant_vnni, "whether the block kernels use AVX512-VNNI");
  m.def("quant_amx", &quant_amx, "whether passes of several tokens over Q4_K/Q6_K/Q8_0/Q5_0 use AMX tiles");
  m.def("set_quant_amx", &set_quant_amx, "allow or forbid the AMX tiles (same bits); returns the previous setting");
  m.def("qinterleave_into", &qinterleave_into, "repack a block-format matrix into interleaved groups of 8 rows (a given [N / 8, ...] uint8 tensor)");
  m.def("qdeinterleave_rows", &qdeinterleave_rows, "rows of an interleaved matrix back in the file's block layout");
  m.def("qlinear_x8", &qlinear_x8, "qlinear over a matrix interleaved in groups of 8 rows (batch-invariant)");
  m.def("qlinear_x8_shared", &qlinear_x8_shared,
        "qlinear_x8 of several matrices (packed, type, bias) over one input, quantized once; the same bits");
}
