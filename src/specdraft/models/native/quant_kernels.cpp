// Matrix products over weights kept in their GGUF block formats (Q2_K to Q6_K, Q8_0, Q5_0, Q4_0, Q4_1, IQ4_NL,
// IQ4_XS).
//
// Activations are quantized per row to int8 blocks (one float scale per 256 values for the 256-weight formats, per 32
// for the 32-value formats; each row on its own, so a row quantizes the same whatever else is in the call). A weight
// block is unpacked once per pass into registers (unsigned or signed bytes, and its scales as int16 or int32 vectors)
// and then used for every token of a group of tokens: integer dot products (`vpmaddubsw` + `vpmaddwd`, or AVX512-VNNI
// `vpdpbusd` + `vpmulld` and `vpdpwssd` where the build has them) give per-lane int32 sums, exact, so their order does
// not matter; the float part, per (weight row, token): lane-wise multiply-adds into 8 float lanes, block after block in
// order, and one fixed-order lane sum at the end. Every output element gets the same integer sums and the same float
// operations in the same order whatever the number of tokens in the call (batch invariance: a verify pass of k tokens
// gives the logits of k single steps, bit for bit), and the VNNI and plain-AVX2 builds give the same bits (the integer
// sums are the same numbers; the float part is the same 256-bit code in both). Where the CPU has AMX-INT8, passes of
// several tokens over Q4_K, Q6_K, Q8_0 and Q5_0 take their integer sums from tile multiplies ("AMX tiles" below): the
// same integers again.
//
// Block layouts (ggml's, little-endian; "d" fields are IEEE half floats):
//   Q2_K, 256 weights in 84 bytes: scales[16] (per 16 weights: scale in the low nibble, min in the high), qs[64],
//         d, dmin; weight 128n + 32j + l is (qs[32n + l] >> 2j) & 3, value d * scale * q - dmin * min of sub-block
//         8n + 2j + l / 16.
//   Q3_K, 256 weights in 110 bytes: hmask[32], qs[64], scales[12] (16 six-bit scales), d; weight 128n + 32j + 16p
//         + l has low bits (qs[32n + 16p + l] >> 2j) & 3 and high bit (hmask[16p + l] >> 4n + j) & 1; value
//         d * (scale[8n + 2j + p] - 32) * (q - 4), q in 0..7.
//   Q4_K, 256 weights in 144 bytes: d, dmin, scales[12] (8 six-bit scales and 8 six-bit mins), qs[128];
//         weight 64j + 32s + l is nibble s of qs[32j + l]; its value d * scale[2j+s] * q - dmin * min[2j+s].
//   Q5_K, 256 weights in 176 bytes: d, dmin, scales[12] (as Q4_K's), qh[32], qs[128]; weight 64j + 32s + l is
//         nibble s of qs[32j + l] plus 16 times bit 2j + s of qh[l]; its value as Q4_K's, q in 0..31.
//   Q6_K, 256 weights in 210 bytes: ql[128], qh[64], scales[16] (int8, one per 16 weights), d;
//         in half h, weight 128h + 32k + l has low bits: nibble k/2 of ql[64h + 32(k%2) + l], high bits:
//         bits 2k..2k+1 of qh[32h + l]; value d * scale * (q - 32).
//   Q8_0, 32 weights in 34 bytes: d, int8 qs[32]; value d * q.
//   Q5_0, 32 weights in 22 bytes: d, qh (32 bits: bit j the 5th bit of weight j), qs[16] (weight j: low nibble of
//         qs[j], weight j + 16: high nibble); value d * (q - 16).
//   Q4_0, 32 weights in 18 bytes: d, qs[16] (as Q5_0's nibbles); value d * (q - 8).
//   Q4_1, 32 weights in 20 bytes: d, m, qs[16] (as Q5_0's nibbles); value d * q + m.
//   IQ4_NL, 32 weights in 18 bytes: d, qs[16] (as Q5_0's nibbles); value d * kvalues[q], kvalues 16 int8 (iq4_values).
//   IQ4_XS, 256 weights in 136 bytes: d, scales_h (uint16), scales_l[4], qs[128]; sub-block c (32 weights) has the
//         six-bit scale ls (low four bits nibble c % 2 of scales_l[c / 2], high two bits 2c.. of scales_h), its
//         weights the nibbles of qs[16c ..] as IQ4_NL's; value d * (ls - 32) * kvalues[q].

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "unrolled.h"

namespace {

// ggml's type numbers
enum QType : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
  kIQ4_NL = 20, kIQ4_XS = 23
};

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

// ------------------------------------------------------------------------------------------- integer dot products
// acc + v, lane by lane, written into acc's register. GCC compiles `acc = _mm256_add_epi16(acc, v)` in a loop into an
// add to a temporary and a copy back, so a loop of 8 accumulators keeps 16 registers busy, spills one accumulator
// and waits every iteration for a store-to-load round trip. Measured on the Q4_K inner loop (Zen 3, 2026-12-03):
// 1.36 -> 1.06 cycles per vpmaddubsw. The sums are the same integer additions. AVX-512 builds (BW and VL always
// on) may use all 32 vector registers ("v"; an EVEX vpaddw for the upper 16); the text has both asm dialects.
#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define SPECDRAFT_VREG "v"
#else
#define SPECDRAFT_VREG "x"
#endif
inline __m256i add_i16_into(__m256i acc, __m256i v) {
  asm("vpaddw {%1, %0, %0|%0, %0, %1}" : "+" SPECDRAFT_VREG(acc) : SPECDRAFT_VREG(v));
  return acc;
}
inline __m256i add_i32_into(__m256i acc, __m256i v) {
  asm("vpaddd {%1, %0, %0|%0, %0, %1}" : "+" SPECDRAFT_VREG(acc) : SPECDRAFT_VREG(v));
  return acc;
}
#undef SPECDRAFT_VREG

using specdraft::unrolled;  // unrolled.h

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool kVnni = true;
// acc + per lane: the sum of 4 products of unsigned bytes `u` and signed bytes `s`
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
// acc + per lane: the sum of 2 products of int16 `a` and `b`
inline __m256i dot_s16(__m256i acc, __m256i a, __m256i b) { return _mm256_dpwssd_epi32(acc, a, b); }
#else
constexpr bool kVnni = false;
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
  // no saturation: every format below keeps |u * s + u' * s'| <= 2 * 128 * 127 < 32768
  return add_i32_into(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
inline __m256i dot_s16(__m256i acc, __m256i a, __m256i b) { return add_i32_into(acc, _mm256_madd_epi16(a, b)); }
#endif

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512BW__)
#define SPECDRAFT_AMX 1  // this build has the tile instructions (and AVX-512 BW for the vector work around them)
#else
#define SPECDRAFT_AMX 0
#endif
constexpr bool kAmxBuild = SPECDRAFT_AMX;
// AVX-512 VNNI builds without the tiles run Q4_K's and Q6_K's passes on 512-bit vectors over layouts of their own
// (Q4Kx8, Q6Kx8); the amx build keeps the 256-bit loops and layouts that its tile unpacking reads.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && !SPECDRAFT_AMX
#define SPECDRAFT_WIDE_K 1
#else
#define SPECDRAFT_WIDE_K 0
#endif
constexpr bool kWideK = SPECDRAFT_WIDE_K;

inline int32_t hsum_i32(__m256i v) {  // exact: integer addition in any order gives the same sum
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
  return _mm_cvtsi128_si32(s);
}

// Fixed-order lane sum of 8 floats.
inline float hsum_f32(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// acc + (int32 lanes as floats) * scale, lane by lane
inline __m256 scaled_add(__m256 acc, __m256i lanes, float scale) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_set1_ps(scale), acc);
}

// A vector whose resize leaves new elements uninitialized (std::vector zero-fills them): QuantizedRows' arrays are
// written whole right after. The zero-fill was a serial memset of T K bytes and more per product, 1.5 % of a pass of
// 16 one-token sequences (perf, Zen 4, 2026-12-07), while the other thread waited.
template <typename T>
struct UninitializedAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = UninitializedAllocator<U>;
  };
  UninitializedAllocator() = default;
  template <typename U>
  UninitializedAllocator(const UninitializedAllocator<U>&) noexcept {}
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
template <typename T>
using UninitializedVector = std::vector<T, UninitializedAllocator<T>>;

// ----------------------------------------------------------------------------------------------- activations
// x [T, K] float32 as int8 blocks of `block` values (256 or 32) with one float scale each, and the sums of every 16
// consecutive int8 values (the k-quants' mins and offsets, Q4_1's min, need them).
struct QuantizedRows {
  int64_t T = 0, K = 0, blocks = 0;  // blocks: activation blocks per row (K / 256 or K / 32)
  // by_block: the arrays hold block b of every token, then block b + 1 ([K / block, T, ...] instead of [T, ...]:
  // BlockMajorRows reads them so); row(t) and the like are for the row-by-row order
  bool by_block = false;
  UninitializedVector<int8_t> q;     // [T, K]
  UninitializedVector<float> d;      // [T, K / block]
  UninitializedVector<int16_t> s16;  // [T, K / 16]
  UninitializedVector<int16_t> s32;  // [T, K / 32]: sums of 32 (pairs of s16)
  // [T, K / 16, 2], only where Q6_K's 512-bit loop needs them (`add_offsets`): -32 times the sums of the values
  // 0-3 and 8-11, and of 4-7 and 12-15, of each 16
  UninitializedVector<int32_t> offsets;

  const int8_t* row(int64_t t) const { return q.data() + t * K; }
  const int16_t* sums(int64_t t) const { return s16.data() + t * K / 16; }
  const int16_t* sums32(int64_t t) const { return s32.data() + t * K / 32; }
  const int32_t* offsets_of(int64_t t) const { return offsets.empty() ? nullptr : offsets.data() + t * K / 8; }
};

// 32 floats times `inverse`, rounded to the nearest integer (ties to even, the default rounding mode), as int8 in
// order; also the sums of the first and the last 16 of them.
inline void quantize32(const float* v, __m256 inverse, int8_t* q, int16_t* sums) {
  __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v), inverse));
  __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8), inverse));
  __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 16), inverse));
  __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 24), inverse));
  sums[0] = static_cast<int16_t>(hsum_i32(_mm256_add_epi32(i0, i1)));
  sums[1] = static_cast<int16_t>(hsum_i32(_mm256_add_epi32(i2, i3)));
  // the packs interleave 128-bit halves: put the 32-bit groups back in order
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

QuantizedRows quantize_rows(const float* x, int64_t T, int64_t K, int64_t block, bool by_block = false) {
  QuantizedRows out;
  out.T = T, out.K = K, out.blocks = K / block, out.by_block = by_block;
  out.q.resize(T * K);
  out.d.resize(T * (K / block));
  out.s16.resize(T * (K / 16));
  const __m256 sign_off = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t t = 0; t < T; ++t) {
    const float* row = x + t * K;
    for (int64_t b = 0; b < K / block; ++b) {
      const float* v = row + b * block;
      __m256 vmax = _mm256_setzero_ps();
      for (int64_t i = 0; i < block; i += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(v + i), sign_off));
      __m128 m = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
      m = _mm_max_ps(m, _mm_movehl_ps(m, m));
      const float amax = std::max(_mm_cvtss_f32(m), _mm_cvtss_f32(_mm_movehdup_ps(m)));
      // below 127 * FLT_MIN the inverse would overflow to inf (and -inf * 0 quantize to -128): such a block is zero
      const float d = amax >= 127.f * FLT_MIN ? amax / 127.f : 0.f;
      const __m256 inverse = _mm256_set1_ps(d > 0.f ? 127.f / amax : 0.f);
      const int64_t at = by_block ? b * T + t : t * (K / block) + b;  // the block's index in the arrays' order
      for (int64_t i = 0; i < block; i += 32)
        quantize32(v + i, inverse, out.q.data() + at * block + i, out.s16.data() + (at * block + i) / 16);
      out.d[at] = d;
    }
  }
  out.s32.resize(T * (K / 32));
  for (int64_t i = 0; i < T * (K / 32); ++i) out.s32[i] = static_cast<int16_t>(out.s16[2 * i] + out.s16[2 * i + 1]);
  return out;
}

#if SPECDRAFT_WIDE_K
// QuantizedRows::offsets from the int8 values, 64 at a time: a `vpdpbusd` against ones sums each 4, and the sums 2
// apart within a 128-bit chunk (one 16) add up.
void add_offsets(QuantizedRows& x) {
  x.offsets.resize(x.T * x.K / 8);
  const __m512i ones = _mm512_set1_epi8(1), low_qwords = _mm512_setr_epi64(0, 2, 4, 6, 0, 2, 4, 6);
  for (int64_t i = 0; i < x.T * x.K; i += 64) {
    const __m512i fours = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_loadu_si512(x.q.data() + i));
    const __m512i pairs = _mm512_add_epi32(fours, _mm512_shuffle_epi32(fours, _MM_PERM_BADC));  // lanes 0, 1 of 4
    const __m512i scaled = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(pairs, 5));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x.offsets.data() + i / 8),
                        _mm512_castsi512_si256(_mm512_permutexvar_epi64(low_qwords, scaled)));
  }
}
#endif

// ------------------------------------------------------------------------------------------------- formats
// Each format: kWeights per block, kBytes per block, kActBlock (the activation block it pairs with) and `dot<G>`:
// one weight block's contribution to G tokens' accumulators. The block is unpacked in registers once for the G
// tokens (a pass re-unpacks it for each group of kGroup tokens: a few instructions against 8 multiply-adds per
// token and chunk). Token g's arithmetic is the same for every G and every position in the group, so the grouping
// never changes a result.

// One token's view of an activation block: its int8 values, its sums of 16, its scale.
struct TokenBlock {
  const int8_t* q;
  const int16_t* sums;
  float d;
};

inline __m256i load256(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Byte-shuffle masks that spread byte c of a 16-byte table (broadcast to both 128-bit halves) over int16 lanes.
struct SpreadMasks {
  __m256i low_byte[8];   // every int16 lane's low byte = byte c, high byte zero (an unsigned value as int16)
  __m256i both_bytes[8]; // low half: byte 2c in both bytes of every lane; high half: byte 2c + 1 (sign-extend with srai)
  __m256i pairs;         // int16 lane i = byte 8 + i / 2 (lanes 0-7) and byte 12 + (i - 8) / 2 (lanes 8-15)
  SpreadMasks() {
    for (int c = 0; c < 8; ++c) {
      alignas(32) int8_t a[32], b[32];
      for (int i = 0; i < 32; ++i) {
        a[i] = i % 2 ? static_cast<int8_t>(0x80) : static_cast<int8_t>(c);
        b[i] = static_cast<int8_t>(i < 16 ? 2 * c : 2 * c + 1);
      }
      low_byte[c] = load256(a);
      both_bytes[c] = load256(b);
    }
    alignas(32) int8_t m[32];
    for (int i = 0; i < 32; ++i) {
      const int lane = i / 2;
      m[i] = i % 2 ? static_cast<int8_t>(0x80) : static_cast<int8_t>(8 + lane / 2);
    }
    pairs = load256(m);
  }
};
const SpreadMasks kSpread;

// The k-quants' integer part for G tokens: sums[g] += scale_c * (w_c . x[g] chunk c) for the chunks c of one
// weight vector; two running sums per token (even and odd chunks) so that a pass of few tokens does not wait on
// the latency of one chain (integer sums: the split changes no lane).
template <int G>
inline void chunk_products(__m256i w, __m256i scale, const TokenBlock* x, int64_t at, __m256i* sums) {
  for (int g = 0; g < G; ++g) sums[g] = dot_s16(sums[g], _mm256_maddubs_epi16(w, load256(x[g].q + at)), scale);
}

struct Q4K {
  static constexpr int64_t kWeights = 256, kBytes = 144, kActBlock = 256;

  // The 12 bytes of 6-bit scales and mins at `packed`: bytes 0-3 scales 0-3 (low 6 bits), 4-7 mins 0-3; bytes 8-11
  // the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble), whose top 2 bits are the top bits of bytes
  // 0-3 and 4-7. Returned as bytes 0-7: scales 0-7, bytes 8-15: mins 0-7, in both halves.
  static __m256i scale_min_table(const uint8_t* packed_bytes) {
    uint32_t packed[3];
    std::memcpy(packed, packed_bytes, 12);
    const uint32_t scales_low = packed[0] & 0x3f3f3f3f, mins_low = packed[1] & 0x3f3f3f3f;
    const uint32_t scales_high = (packed[2] & 0x0f0f0f0f) | ((packed[0] >> 2) & 0x30303030);
    const uint32_t mins_high = ((packed[2] >> 4) & 0x0f0f0f0f) | ((packed[1] >> 2) & 0x30303030);
    return _mm256_broadcastsi128_si256(_mm_setr_epi32(static_cast<int>(scales_low), static_cast<int>(scales_high),
                                                      static_cast<int>(mins_low), static_cast<int>(mins_high)));
  }

  // sum_i w_i x_i = d dx sum_c scale_c (sum_{i in c} q_i xq_i) - dmin dx sum_c min_c (sum_{i in c} xq_i)
  template <int G>
  static void dot(const uint8_t* block, const TokenBlock* x, __m256* acc) {
    const __m256i table = scale_min_table(block + 4);
    const uint8_t* qs = block + 16;  // weight 64j + 32s + l: nibble s of qs[32j + l] (sub-block 2j + s)
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i even[G], odd[G];
    for (int g = 0; g < G; ++g) even[g] = odd[g] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i bytes = load256(qs + 32 * j);
      chunk_products<G>(_mm256_and_si256(bytes, low), _mm256_shuffle_epi8(table, kSpread.low_byte[2 * j]), x,
                        64 * j, even);
      chunk_products<G>(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), low),
                        _mm256_shuffle_epi8(table, kSpread.low_byte[2 * j + 1]), x, 64 * j + 32, odd);
    }
    finish<G>(block, table, x, even, odd, acc);
  }

  // the mins' part and the float part (Q5_K's too: the same d, dmin and table)
  template <int G>
  static void finish(const uint8_t* block, __m256i table, const TokenBlock* x, const __m256i* even,
                     const __m256i* odd, __m256* acc) {
    const __m256i mins = _mm256_shuffle_epi8(table, kSpread.pairs);  // each min twice, one per 16 activations
    const float d = half_to_float(block), dmin = half_to_float(block + 2);
    for (int g = 0; g < G; ++g) {
      const __m256i offsets = _mm256_madd_epi16(mins, load256(x[g].sums));
      acc[g] = scaled_add(acc[g], _mm256_add_epi32(even[g], odd[g]), d * x[g].d);
      acc[g] = scaled_add(acc[g], offsets, -(dmin * x[g].d));
    }
  }
};

// Q5_K's fifth bits: byte b of the result holds 16 times bit `bit` of byte b of `qh` (shifts within int16 lanes
// followed by a byte mask: no bit of one byte reaches the masked bit of another).
template <int bit>
inline __m256i fifth_bits(__m256i qh) {
  const __m256i sixteen = _mm256_set1_epi8(0x10);
  if constexpr (bit < 4) return _mm256_and_si256(_mm256_slli_epi16(qh, 4 - bit), sixteen);
  else if constexpr (bit == 4) return _mm256_and_si256(qh, sixteen);
  else return _mm256_and_si256(_mm256_srli_epi16(qh, bit - 4), sixteen);
}

struct Q5K {
  static constexpr int64_t kWeights = 256, kBytes = 176, kActBlock = 256;
  // As Q4K with q in 0..31: a vpmaddubsw lane (2 products, at most 2 * 31 * 127) goes to int32 at once.
  template <int G>
  static void dot(const uint8_t* block, const TokenBlock* x, __m256* acc) {
    const __m256i table = Q4K::scale_min_table(block + 4);
    const __m256i qh = load256(block + 16);
    const uint8_t* qs = block + 48;
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i even[G], odd[G];
    for (int g = 0; g < G; ++g) even[g] = odd[g] = _mm256_setzero_si256();
    unrolled<4>([&](auto chunk) __attribute__((always_inline)) {
      constexpr int j = chunk;
      const __m256i bytes = load256(qs + 32 * j);
      chunk_products<G>(_mm256_or_si256(_mm256_and_si256(bytes, low), fifth_bits<2 * j>(qh)),
                        _mm256_shuffle_epi8(table, kSpread.low_byte[2 * j]), x, 64 * j, even);
      chunk_products<G>(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), low), fifth_bits<2 * j + 1>(qh)),
                        _mm256_shuffle_epi8(table, kSpread.low_byte[2 * j + 1]), x, 64 * j + 32, odd);
    });
    Q4K::finish<G>(block, table, x, even, odd, acc);
  }
};

struct Q6K {
  static constexpr int64_t kWeights = 256, kBytes = 210, kActBlock = 256;
  // sum_i w_i x_i = d dx (sum_g scale_g sum_{i in g} (q_i + 32) xq_i - 32 sum_g scale_g sum_{i in g} xq_i)
  template <int G>
  static void dot(const uint8_t* block, const TokenBlock* x, __m256* acc) {
    const uint8_t* ql = block;
    const uint8_t* qh = block + 128;
    const __m128i scale_bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192));  // 16 int8
    const __m256i table = _mm256_broadcastsi128_si256(scale_bytes);
    // chunk c (weights 32c..32c+31): 8 int16 lanes of scale 2c, then 8 of scale 2c + 1
    const auto scale = [&](int c) { return _mm256_srai_epi16(_mm256_shuffle_epi8(table, kSpread.both_bytes[c]), 8); };
    const __m256i low = _mm256_set1_epi8(0x0F), high = _mm256_set1_epi8(0x30);
    __m256i even[G], odd[G];
    for (int g = 0; g < G; ++g) even[g] = odd[g] = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      // weights q + 32 in 0..63: low 4 bits from ql, bits 2k..2k+1 of qh moved to bits 4..5
      const __m256i l0 = load256(ql + 64 * h), l1 = load256(ql + 64 * h + 32), hb = load256(qh + 32 * h);
      const int64_t at = 128 * h;
      chunk_products<G>(_mm256_or_si256(_mm256_and_si256(l0, low), _mm256_and_si256(_mm256_slli_epi16(hb, 4), high)),
                        scale(4 * h), x, at, even);
      chunk_products<G>(_mm256_or_si256(_mm256_and_si256(l1, low), _mm256_and_si256(_mm256_slli_epi16(hb, 2), high)),
                        scale(4 * h + 1), x, at + 32, odd);
      chunk_products<G>(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low), _mm256_and_si256(hb, high)),
                        scale(4 * h + 2), x, at + 64, even);
      chunk_products<G>(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low),
                                        _mm256_and_si256(_mm256_srli_epi16(hb, 2), high)),
                        scale(4 * h + 3), x, at + 96, odd);
    }
    const __m256i scales = _mm256_cvtepi8_epi16(scale_bytes);
    const float d = half_to_float(block + 208);
    for (int g = 0; g < G; ++g) {
      const __m256i offsets = _mm256_slli_epi32(_mm256_madd_epi16(scales, load256(x[g].sums)), 5);
      acc[g] = scaled_add(acc[g], _mm256_sub_epi32(_mm256_add_epi32(even[g], odd[g]), offsets), d * x[g].d);
    }
  }
};

// Q3_K's scale s (of 16) as the signed value it multiplies by: s - 32 of its six bits, whose low four bits are
// nibble s / 8 of packed[s % 8] and high two bits 2(s / 4).. of packed[8 + s % 4] (`packed`: the block's scales[12]).
inline int8_t q3_k_scale(const uint8_t* packed, int s) {
  const int six = ((packed[s % 8] >> (4 * (s / 8))) & 0x0F) | (((packed[8 + s % 4] >> (2 * (s / 4))) & 3) << 4);
  return static_cast<int8_t>(six - 32);
}

// Bit `from` of each byte of v moved to bit `to`, masked (shifts within int16 lanes, then a byte mask: what crosses
// into a neighbouring byte lands on other bits than `to` and is masked off, or is shifted out).
template <int from, int to>
inline __m256i move_bits(__m256i v, __m256i mask) {
  if constexpr (from > to) return _mm256_and_si256(_mm256_srli_epi16(v, from - to), mask);
  else if constexpr (from < to) return _mm256_and_si256(_mm256_slli_epi16(v, to - from), mask);
  else return _mm256_and_si256(v, mask);
}

// Q2_K row by row: weights 128n + 32j .. + 31 are one vector, (qs[32n ..] >> 2j) & 3; the scales and mins are the
// low and high nibbles of the block's first 16 bytes. As Q4K, with a min per 16 weights.
struct Q2K {
  static constexpr int64_t kWeights = 256, kBytes = 84, kActBlock = 256;
  template <int G>
  static void dot(const uint8_t* block, const TokenBlock* x, __m256* acc) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block)), nibble = _mm_set1_epi8(0x0F);
    const __m256i table = _mm256_broadcastsi128_si256(_mm_and_si128(packed, nibble));
    // chunk c (weights 32c..32c+31): 8 int16 lanes of scale 2c, then 8 of scale 2c + 1
    const auto scale = [&](int c) { return _mm256_srai_epi16(_mm256_shuffle_epi8(table, kSpread.both_bytes[c]), 8); };
    const __m256i crumb = _mm256_set1_epi8(3);
    __m256i even[G], odd[G];
    for (int g = 0; g < G; ++g) even[g] = odd[g] = _mm256_setzero_si256();
    unrolled<2>([&](auto half) __attribute__((always_inline)) {
      constexpr int n = half;
      const __m256i qs = load256(block + 16 + 32 * n);
      unrolled<4>([&](auto shift) __attribute__((always_inline)) {
        constexpr int j = shift;
        chunk_products<G>(move_bits<2 * j, 0>(qs, crumb), scale(4 * n + j), x, 128 * n + 32 * j, j % 2 ? odd : even);
      });
    });
    const __m256i mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), nibble));
    const float d = half_to_float(block + 80), dmin = half_to_float(block + 82);
    for (int g = 0; g < G; ++g) {
      acc[g] = scaled_add(acc[g], _mm256_add_epi32(even[g], odd[g]), d * x[g].d);
      acc[g] = scaled_add(acc[g], _mm256_madd_epi16(mins, load256(x[g].sums)), -(dmin * x[g].d));
    }
  }
};

// Q3_K row by row (matrices not in 8-row groups: other row counts, a draft's vocabulary rows). Weights 128n + 32j ..
// + 31 are one vector: the two low bits from qs[32n ..] shifted by 2j, the high bit from hmask shifted from 4n + j,
// q in 0..7; as Q6K with the scales decoded from their six bits and an offset of 4.
struct Q3K {
  static constexpr int64_t kWeights = 256, kBytes = 110, kActBlock = 256;

  // the 16 scales (int8, s - 32) from their 12 bytes, four at a time (q3_k_scale's bits in 32-bit words)
  static __m128i scales16(const uint8_t* packed_bytes) {
    uint32_t packed[3];
    std::memcpy(packed, packed_bytes, 12);
    const uint32_t low = 0x0F0F0F0F, top = 0x03030303;
    const __m128i six = _mm_setr_epi32(static_cast<int>((packed[0] & low) | ((packed[2] & top) << 4)),
                                       static_cast<int>((packed[1] & low) | (((packed[2] >> 2) & top) << 4)),
                                       static_cast<int>(((packed[0] >> 4) & low) | (((packed[2] >> 4) & top) << 4)),
                                       static_cast<int>(((packed[1] >> 4) & low) | (((packed[2] >> 6) & top) << 4)));
    return _mm_sub_epi8(six, _mm_set1_epi8(32));
  }

  template <int G>
  static void dot(const uint8_t* block, const TokenBlock* x, __m256* acc) {
    const __m128i scale_bytes = scales16(block + 96);
    const __m256i table = _mm256_broadcastsi128_si256(scale_bytes);
    // chunk c (weights 32c..32c+31): 8 int16 lanes of scale 2c, then 8 of scale 2c + 1
    const auto scale = [&](int c) { return _mm256_srai_epi16(_mm256_shuffle_epi8(table, kSpread.both_bytes[c]), 8); };
    const __m256i crumb = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
    const __m256i hmask = load256(block);
    __m256i even[G], odd[G];
    for (int g = 0; g < G; ++g) even[g] = odd[g] = _mm256_setzero_si256();
    unrolled<2>([&](auto half) __attribute__((always_inline)) {
      constexpr int n = half;
      const __m256i qs = load256(block + 32 + 32 * n);
      unrolled<4>([&](auto shift) __attribute__((always_inline)) {
        constexpr int j = shift;
        const __m256i w = _mm256_or_si256(move_bits<2 * j, 0>(qs, crumb), move_bits<4 * n + j, 2>(hmask, four));
        chunk_products<G>(w, scale(4 * n + j), x, 128 * n + 32 * j, j % 2 ? odd : even);
      });
    });
    const __m256i scales = _mm256_cvtepi8_epi16(scale_bytes);
    const float d = half_to_float(block + 108);
    for (int g = 0; g < G; ++g) {
      const __m256i offsets = _mm256_slli_epi32(_mm256_madd_epi16(scales, load256(x[g].sums)), 2);
      acc[g] = scaled_add(acc[g], _mm256_sub_epi32(_mm256_add_epi32(even[g], odd[g]), offsets), d * x[g].d);
    }
  }
};

// The 32-weight formats with signed weights: |q| as unsigned bytes against x carrying q's sign.
template <int G>
inline void signed_dot(__m256i q, float d, const TokenBlock* x, __m256* acc) {
  const __m256i magnitude = _mm256_sign_epi8(q, q);
  for (int g = 0; g < G; ++g) {
    const __m256i xs = _mm256_sign_epi8(load256(x[g].q), q);
    acc[g] = scaled_add(acc[g], dot_u8s8(_mm256_setzero_si256(), magnitude, xs), d * x[g].d);
  }
}

// Unsigned nibbles of 16 bytes as 32 bytes: low nibbles first (weights 0-15), then high nibbles (16-31).
inline __m256i nibbles32(const uint8_t* qs) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i low = _mm_set1_epi8(0x0F);
  return _mm256_setr_m128i(_mm_and_si128(bytes, low), _mm_and_si128(_mm_srli_epi16(bytes, 4), low));
}

struct Q80 {
  static constexpr int64_t kWeights = 32, kBytes = 34, kActBlock = 32;
  template <int G>
  static void dot(const uint8_t* block, const TokenBlock* x, __m256* acc) {
    signed_dot<G>(load256(block + 2), half_to_float(block), x, acc);
  }
};

struct Q50 {
  static constexpr int64_t kWeights = 32, kBytes = 22, kActBlock = 32;
  template <int G>
  static void dot(const uint8_t* block, const TokenBlock* x, __m256* acc) {
    uint32_t high_bits;
    std::memcpy(&high_bits, block + 2, 4);
    // byte j takes bit j of high_bits: spread the 4 bytes over 8 lanes each, keep each lane's own bit
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(static_cast<int32_t>(high_bits)),
        _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
    const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
    const __m256i is_set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    const __m256i q = _mm256_or_si256(nibbles32(block + 6), _mm256_and_si256(is_set, _mm256_set1_epi8(0x10)));
    signed_dot<G>(_mm256_sub_epi8(q, _mm256_set1_epi8(16)), half_to_float(block), x, acc);
  }
};

struct Q40 {
  static constexpr int64_t kWeights = 32, kBytes = 18, kActBlock = 32;
  template <int G>
  static void dot(const uint8_t* block, const TokenBlock* x, __m256* acc) {
    signed_dot<G>(_mm256_sub_epi8(nibbles32(block + 2), _mm256_set1_epi8(8)), half_to_float(block), x, acc);
  }
};

struct Q41 {
  static constexpr int64_t kWeights = 32, kBytes = 20, kActBlock = 32;
  // sum_i w_i x_i = d dx sum_i q_i xq_i + m dx sum_i xq_i (the second as 2 lanes: the block's two sums of 16)
  template <int G>
  static void dot(const uint8_t* block, const TokenBlock* x, __m256* acc) {
    const float d = half_to_float(block), m = half_to_float(block + 2);
    const __m256i w = nibbles32(block + 4);
    for (int g = 0; g < G; ++g) {
      acc[g] = scaled_add(acc[g], dot_u8s8(_mm256_setzero_si256(), w, load256(x[g].q)), d * x[g].d);
      const __m256i sums = _mm256_setr_epi32(x[g].sums[0], x[g].sums[1], 0, 0, 0, 0, 0, 0);
      acc[g] = scaled_add(acc[g], sums, m * x[g].d);
    }
  }
};

// IQ4_NL and IQ4_XS: a weight's nibble indexes 16 non-uniform int8 values (ggml's kvalues_iq4nl); a byte shuffle
// looks up 32 nibbles at once. |value| <= 127, so the signed products of `signed_dot` stay in range.
inline __m256i iq4_values(__m256i nibbles) {
  const __m256i values = _mm256_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
                                          -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
  return _mm256_shuffle_epi8(values, nibbles);
}

// The same values plus 128 (1..241) as unsigned bytes: what the VNNI loops multiply, the sums then less 128 * (sum of x).
inline __m256i iq4_values_plus_128(__m256i nibbles) {
  return _mm256_xor_si256(iq4_values(nibbles), _mm256_set1_epi8(static_cast<char>(0x80)));
}

struct IQ4NL {
  static constexpr int64_t kWeights = 32, kBytes = 18, kActBlock = 32;
  template <int G>
  static void dot(const uint8_t* block, const TokenBlock* x, __m256* acc) {
    signed_dot<G>(iq4_values(nibbles32(block + 2)), half_to_float(block), x, acc);
  }
};

// IQ4_XS's sub-block scale c (of 8) as the signed value it multiplies by: ls - 32 of its six bits, whose low four are
// nibble c % 2 of scales_l[c / 2] (the block's bytes 4-7) and high two bits 2c.. of scales_h (bytes 2-3).
inline int8_t iq4_xs_scale(const uint8_t* block, int c) {
  const int high = ((block[2] | (block[3] << 8)) >> (2 * c)) & 3;
  return static_cast<int8_t>((((block[4 + c / 2] >> (4 * (c % 2))) & 0x0F) | (high << 4)) - 32);
}

// IQ4_XS row by row: sub-block c's 32 weights are the nibbles of qs[16c ..] looked up; per sub-block the signed
// products' int16 pairs (at most 2 * 127 * 127 = 32258) go to int32 in the `vpmaddwd` that multiplies them by the
// scale (|scale| <= 32: a block's total at most 256 * 127 * 127 * 32, about 1.3e8).
struct IQ4XS {
  static constexpr int64_t kWeights = 256, kBytes = 136, kActBlock = 256;
  template <int G>
  static void dot(const uint8_t* block, const TokenBlock* x, __m256* acc) {
    __m256i even[G], odd[G];
    for (int g = 0; g < G; ++g) even[g] = odd[g] = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      const __m256i q = iq4_values(nibbles32(block + 8 + 16 * c)), magnitude = _mm256_sign_epi8(q, q);
      const __m256i scale = _mm256_set1_epi16(iq4_xs_scale(block, c));
      for (int g = 0; g < G; ++g) {
        const __m256i p = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(load256(x[g].q + 32 * c), q));
        __m256i& sums = c % 2 ? odd[g] : even[g];
        sums = add_i32_into(sums, _mm256_madd_epi16(p, scale));
      }
    }
    const float d = half_to_float(block);
    for (int g = 0; g < G; ++g) acc[g] = scaled_add(acc[g], _mm256_add_epi32(even[g], odd[g]), d * x[g].d);
  }
};

// ------------------------------------------------------------------------------------------------ the product
constexpr int64_t kTokenTile = 64;  // tokens whose accumulators a row keeps at once (a pass longer than this
                                    // reads each weight block once per tile of tokens)
constexpr int kGroup = 4;           // tokens that share one unpacking of a weight block (a format may set more)
constexpr int64_t kPrefetchBytes = 4096;  // how far ahead a pass asks for its weights

// Threads take the units of a product (rows, row groups or pairs of them) in chunks from a shared counter, not a
// half each: on a shared host one core is at times slowed by a neighbour (Xeon model 207, 2026-12-06: a tile
// multiply took 6.5 ns on one vCPU and 14 on the other in the same minute, docs/performance.md), and a pass that
// waits for the slower half runs at its speed. The chunks are guided: half of what is left per thread, never below
// kLeastChunkBytes of weights (a new chunk is a new stream for the prefetchers) or a quarter of a thread's share,
// whichever is smaller (a small matrix still gives each thread several chunks). A unit's arithmetic is the same
// whoever computes it, so the results do not change. Measured there (the 1.5B's 197 matrices in a row, 2 threads,
// each round alternated with halves, 20 rounds; ratio per round, median): 1 token 1.02-1.06x, 4 1.05x, 8
// 1.03-1.13x, 16 1.16x faster, best rounds alike. `thread_body(queue)` runs once on each thread and calls
// `queue.take` until it returns false.
constexpr int64_t kLeastChunkBytes = 128 * 1024;  // the smallest chunk a thread takes (in a large product)
struct ChunkQueue {
  std::atomic<int64_t> next{0};
  int64_t units = 0, least = 1, threads = 1;
  // guided: a share of what is left (large chunks first, small ones at the end, where the threads meet)
  bool take(int64_t& begin, int64_t& end) {
    begin = next.load(std::memory_order_relaxed);
    do {
      if (begin >= units) return false;
      end = std::min(units, begin + std::max(least, (units - begin) / (2 * threads)));
    } while (!next.compare_exchange_weak(begin, end, std::memory_order_relaxed));
    return true;
  }
};

// units of `unit_bytes` weights each
template <typename ThreadBody>
void parallel_chunks(int64_t units, int64_t unit_bytes, const ThreadBody& thread_body) {
  ChunkQueue queue;
  queue.units = units, queue.threads = at::get_num_threads();
  queue.least = std::max<int64_t>(1, std::min(kLeastChunkBytes / std::max<int64_t>(unit_bytes, 1),
                                               (units + 4 * queue.threads - 1) / (4 * queue.threads)));
  const int64_t workers = std::min(queue.threads, (units + queue.least - 1) / queue.least);
  at::parallel_for(0, workers, 1, [&](int64_t first, int64_t last) {
    for (int64_t w = first; w < last; ++w) thread_body(queue);
  });
}

// The weight stream kPrefetchBytes past a block (past a row's end: the next row's, contiguous), 3 cache lines: a
// block is at most 210 bytes. A step is bound by reading the weights, and the hardware prefetcher alone leaves the
// memory bus idle (measured on the 1.5B target, Xeon, 2 threads: a decode step 92 -> 70 ms; Zen 3, 2 threads,
// 2026-12-03: 2048 bytes ahead 64.4 ms, 4096 61.9, 8192 61.7, 16384 62.5). Changes no result.
inline void prefetch_ahead(const uint8_t* block) {
  const char* ahead = reinterpret_cast<const char*>(block) + kPrefetchBytes;
  _mm_prefetch(ahead, _MM_HINT_T0);
  _mm_prefetch(ahead + 64, _MM_HINT_T0);
  _mm_prefetch(ahead + 128, _MM_HINT_T0);
}

// The same for every cache line of an interleaved format's block (8 rows' blocks: up to 1680 bytes).
template <typename F>
inline void prefetch_block_ahead(const uint8_t* block) {
  for (int64_t at = 0; at < F::kBytes; at += 64)
    _mm_prefetch(reinterpret_cast<const char*>(block) + kPrefetchBytes + at, _MM_HINT_T0);
}

// Part `part` of kParts of those cache lines: a format that spreads them over its loop (kSpreadsPrefetch) calls this
// once per part. With all of a block's lines asked for at once, a pass of 8 tokens over Q6_K blocks streamed from
// memory took about the time of a one-token pass plus that of the arithmetic (Zen 4, 2026-12-07: 263-335 ns per
// block, 137-161 in cache, 78-94 for one token), and no longer with no prefetch at all; asked for a few at a time,
// 164-191 (Q6Kx8's 512-bit dot). Only the first group of a tile's tokens asks (`dot<G, true>`): the others meet the
// block in cache. Q4_K's 512-bit loop, 5 lines per quarter of a block: 4096 x 1536 random blocks streamed, 2
// threads, one process switching per call, 10 rounds: 8 and 16 tokens 0.94x and 0.95x the time, in cache 0.97x (one
// token 0.98-1.05x: steps keep the burst); the 1.5B's products at 8 and 16 tokens 0.97x and 0.99x, its passes 0.98x
// and 0.94x. (Its 19 lines in 16 parts: 0.96-0.97x from memory but one token 1.17x in cache.)
template <typename F, int kParts>
inline void prefetch_part_ahead(const uint8_t* block, int part) {
  constexpr int64_t lines = (F::kBytes + 63) / 64, per_part = (lines + kParts - 1) / kParts;
  const int64_t end = std::min(lines, per_part * (part + 1));
  for (int64_t line = per_part * part; line < end; ++line)
    _mm_prefetch(reinterpret_cast<const char*>(block) + kPrefetchBytes + 64 * line, _MM_HINT_T0);
}

// whether a format's passes of several tokens ask for the lines ahead themselves (`prefetch_part_ahead`); one-token
// steps keep the block's lines at once (Q6_K's both ways measured level)
template <typename F>
constexpr bool spreads_prefetch = requires { requires F::kSpreadsPrefetch; };

// A token's activations from its first block on: int8 values, sums of 16, scales.
struct TokenRow {
  const int8_t* q;
  const int16_t* sums;
  const float* d;
};

template <typename F, int G>
inline void dot_tokens(const uint8_t* block, const TokenRow* rows, int64_t offset, __m256* acc) {
  TokenBlock blocks[G];
  for (int g = 0; g < G; ++g) blocks[g] = {rows[g].q + offset, rows[g].sums + offset / 16, rows[g].d[offset / F::kActBlock]};
  F::template dot<G>(block, blocks, acc);
}

template <typename F>
void qlinear_impl(const uint8_t* weight, int64_t N, int64_t K, const QuantizedRows& x, const float* bias,
                  float* out) {
  const int64_t blocks = K / F::kWeights, row_bytes = blocks * F::kBytes;
  const int64_t T = x.T;
  std::vector<TokenRow> token_rows(T);
  for (int64_t t = 0; t < T; ++t) token_rows[t] = {x.row(t), x.sums(t), x.d.data() + t * x.blocks};
  // Threads take the rows in chunks (`parallel_chunks`); a row's arithmetic is the same whoever computes it.
  parallel_chunks(N, row_bytes, [&](ChunkQueue& queue) {
    __m256 acc[kTokenTile];
    for (int64_t begin, end; queue.take(begin, end);)
      for (int64_t n = begin; n < end; ++n) {
        const uint8_t* row = weight + n * row_bytes;
        for (int64_t t0 = 0; t0 < T; t0 += kTokenTile) {
          const int64_t tile = std::min(kTokenTile, T - t0);
          const TokenRow* rows = token_rows.data() + t0;
          for (int64_t t = 0; t < tile; ++t) acc[t] = _mm256_setzero_ps();
          for (int64_t b = 0; b < blocks; ++b) {
            const uint8_t* block = row + b * F::kBytes;
            prefetch_ahead(block);
            const int64_t offset = b * F::kWeights;
            int64_t t = 0;
            for (; t + kGroup <= tile; t += kGroup) dot_tokens<F, kGroup>(block, rows + t, offset, acc + t);
            switch (tile - t) {
              case 1: dot_tokens<F, 1>(block, rows + t, offset, acc + t); break;
              case 2: dot_tokens<F, 2>(block, rows + t, offset, acc + t); break;
              case 3: dot_tokens<F, 3>(block, rows + t, offset, acc + t); break;
              default: break;
            }
          }
          for (int64_t t = 0; t < tile; ++t) {
            float v = hsum_f32(acc[t]);
            if (bias) v += bias[n];
            out[(t0 + t) * N + n] = v;
          }
        }
      }
  });
}

// ----------------------------------------- interleaved row groups (Q2_K .. Q6_K, Q8_0, Q5_0, Q4_0, IQ4_NL, IQ4_XS)
// For passes of several tokens the k-quant matrices are repacked at load into groups of 8 rows whose blocks interleave
// 4 bytes at a time (Q4_K's 512-bit loop: 8, see Q4Kx8): one 32-byte load holds 4 consecutive weights of each of the 8
// rows, a broadcast of a token's 4 activation bytes meets all of them in one `vpmaddubsw`, and int16 lanes 2r and
// 2r + 1 are row r's. A sub-block's products add up in int16 (in range: shown per format), one `vpmaddwd` with the
// rows' sub-block scales leaves row r in int32 lane r (with VNNI: `vpdpbusd` sums in int32 lane r, a `vpmulld` or a
// `vpdpwssd` scales them, the same integers), and the float part works on 8 lanes that are 8 rows: per (8 rows, token,
// super-block) a few float instructions, and no horizontal sum at all. This is what makes a token of a pass cheap:
// about 10 multiply instructions per (row, super-block) against 17 plus a float reduction in the row-by-row layout. The
// arithmetic of a token is the same whatever the other tokens of the call (batch invariance), and the same in every
// build (integer sums exact, one float sequence).

constexpr int64_t kRowGroup = 8;

inline __m256i broadcast4(const void* p) {  // 4 bytes into every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
#if SPECDRAFT_WIDE_K
inline __m512i broadcast8(const void* p) {  // 8 bytes into every 64-bit lane
  int64_t v;
  std::memcpy(&v, p, 8);
  return _mm512_set1_epi64(v);
}

// The 512-bit loops' scale step (Q4Kx8::wide_dots, Q6Kx8's 512-bit dot): `vpackssdw` of two sub-blocks' sums (int32
// lanes 2r and 2r + 1: row r) puts, in 128-bit chunk c, the first sub-block's lanes of rows 2c and 2c + 1, then the
// second's. `scale_words(halves)` lays 16 int16 scales (the first sub-block's 8 rows, then the second's) out to
// match, each twice, for the `vpdpwssd` that scales both; `row_sums(sums)` then adds each row's lanes: int32 lane r
// = row r.
inline __m512i scale_words(__m512i halves) {
  const __m512i words = _mm512_setr_epi64(0x0001000100000000, 0x0009000900080008, 0x0003000300020002,
                                          0x000B000B000A000A, 0x0005000500040004, 0x000D000D000C000C,
                                          0x0007000700060006, 0x000F000F000E000E);
  return _mm512_permutexvar_epi16(words, halves);
}
inline __m256i row_sums(__m512i sums) {  // chunk c's lanes 0 and 1: rows 2c, 2c + 1; then chunk 0's to 3's in order
  const __m512i rows = _mm512_add_epi32(sums, _mm512_shuffle_epi32(sums, _MM_PERM_BADC));
  return _mm512_castsi512_si256(_mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 0, 2, 4, 6), rows));
}
#endif

// 8 bytes (one per row) as int16 lane pairs (2r, 2r + 1) both holding byte r: unsigned, or signed. The signed
// ones (Q6_K's scales, 32 per block and token group) double each byte and widen it: two instructions, not four;
// Zen 3, 2026-12-06, one process, alternated 30 times: Q6_K passes of 4 and 8 tokens 0.96-0.98x, one token 0.98-
// 1.00x. The same for the unsigned ones (Q4_K's, 8 per block) measured 0.99-1.03x: kept as it was.
inline __m256i row_pairs_u8(const uint8_t* p) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_or_si256(v, _mm256_slli_epi32(v, 16));
}
inline __m256i row_pairs_s8(const uint8_t* p) {
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(v, v));
}

// 8 bytes (one per row) as int32 lane r holding byte r: unsigned, or signed.
inline __m256i row_u8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i row_s8(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// One token's view of a super-block column: int8 values, sums of 16 and of 32, and its activation scales from
// this block on (scales[0] is the block's; a unit of several 32-weight blocks reads one per block).
struct TokenSuper {
  const int8_t* q;
  const int16_t* sums16;
  const int16_t* sums32;
  const float* scales;
};

// A group of consecutive tokens at one block of BlockMajorRows (Q4_K's loops, but the amx build's; Q6_K's 512-bit
// loop): token g's values at fixed strides from the first's, so that a loop over the blocks steps one pointer per
// array and the loop's addresses are that pointer plus constants.
struct TokenGroup {
  const int8_t* q;         // token g: q + 256 g
  const int16_t* sums32;   // + 8 g
  const float* scales;     // + g: the block's scale of each token
  const int32_t* offsets;  // + 32 g (QuantizedRows::offsets, where the rows have them)
  const int8_t* q_of(int g) const { return q + 256 * g; }
  const int32_t* offsets_of(int g) const { return offsets + 32 * g; }
};

// Token g's values, sums of 32 and scale at the block, from either view
inline const int8_t* token_q(const TokenSuper* x, int g) { return x[g].q; }
inline const int8_t* token_q(const TokenGroup& x, int g) { return x.q_of(g); }
inline const int16_t* token_sums32(const TokenSuper* x, int g) { return x[g].sums32; }
inline float token_scale(const TokenSuper* x, int g) { return x[g].scales[0]; }
inline const int16_t* token_sums32(const TokenGroup& x, int g) { return x.sums32 + 8 * g; }
inline float token_scale(const TokenGroup& x, int g) { return x.scales[g]; }

// A pass's activations (256-weight blocks) block by block, for the formats whose loops take TokenGroups
// (kBlockMajor): QuantizedRows quantized `by_block`, or a single token's (the same order). Stepping a TokenSuper per
// token from block to block instead (stored in the tile's array, loaded back by the loop with the other tokens'
// pointers) cost Q4_K's 512-bit loop 15-20 % of a pass of 8 tokens (Zen 4, 2026-12-07, one thread, 128 x 1536
// random blocks in cache, `bash scripts/pass_loop_cycles.sh`: 55.3-55.8 -> 45.8-46.5 cycles per (8 rows, 256
// weights, token); Q6_K 60.0 -> 52.4-52.9); Q4_K's 256-bit loop (AVX2 builds) 3 % (T8 66.0 -> 64.1, same harness),
// the 1.5B's passes of 8 tokens in the avx2 build, in lockstep, 0.954-0.968x (same tree 0.999x), of 16 0.99x, one
// token level. Which tokens share a group changes no token's arithmetic.
struct BlockMajorRows {
  int64_t T = 0;
  const int8_t* q;         // [blocks, T, 256]
  const int16_t* s32;      // [blocks, T, 8]
  const float* d;          // [blocks, T]
  const int32_t* offsets;  // [blocks, T, 32], where the rows have them (else null)

  explicit BlockMajorRows(const QuantizedRows& x)
      : T(x.T), q(x.q.data()), s32(x.s32.data()), d(x.d.data()), offsets(x.offsets_of(0)) {}
  TokenGroup group(int64_t b, int64_t t) const {  // tokens t, t + 1, .. at block b
    const int64_t i = b * T + t;
    return {q + 256 * i, s32 + 8 * i, d + i, offsets ? offsets + 32 * i : nullptr};
  }
};

// whether a format's loops take TokenGroups of BlockMajorRows
template <typename F>
constexpr bool block_major = requires { requires F::kBlockMajor; };

// The float part of a group whose d and dmin halves of rows 0-7 are its first 32 bytes (Q4Kx8, Q2Kx8):
// acc += d dx dots - dmin dx mins, lane r row r.
template <int G, typename Tokens>
inline void scaled_dots_minus_mins(const uint8_t* block, const Tokens& x, const __m256i* dots, const __m256i* mins,
                                   __m256* acc) {
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
  const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16)));
  for (int g = 0; g < G; ++g) {
    const __m256 dx = _mm256_set1_ps(token_scale(x, g));
    acc[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[g]), _mm256_mul_ps(d, dx), acc[g]);
    acc[g] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins[g]), _mm256_mul_ps(dmin, dx), acc[g]);
  }
}

// Q4_K, 8 rows x 256 weights in 1184 bytes:
//   [0, 16) d of rows 0-7 (halves), [16, 32) dmin, [32, 96) byte 8c + r: scale of sub-block c of row r (6 bits),
//   [96, 160) byte 16p + 2r + e: min of sub-block 2p + e of row r,
//   [160, 1184) byte 256j + 32k + 4r + i: qs[32j + 4k + i] of row r (its nibble s: weight 64j + 32s + 4k + i);
//   in kWideK builds 8 bytes of a row side by side instead: byte 160 + 256j + 64m + 8r + i: qs[32j + 8m + i] of
//   row r (i < 8; nibble s: weight 64j + 32s + 8m + i), so that a 512-bit vector holds 8 rows x 8 bytes.
struct Q4Kx8 {
  static constexpr int64_t kWeights = 256, kBytes = 1184, kActBlock = 256;
  static constexpr int kQsRun = kWideK ? 8 : 4;  // bytes of a row side by side in qs
  static constexpr bool kSpreadsPrefetch = kWideK;  // the 512-bit loop's passes ask for the lines ahead a few at a time
  // it reads the activations as TokenGroups (BlockMajorRows), as the 256-bit loops do in the builds without AMX
  // tiles (the tiles read the rows token by token)
  static constexpr bool kBlockMajor = !kAmxBuild;
  // tokens that share one unpacking of a block: 8 in the wide loop (32 registers hold the sums of 8 tokens)
  static constexpr int kGroupsTokens = kWideK ? 8 : kGroup;
  // A pass of 4n + 1 tokens unpacks its last 5 together (AVX2: one unpacking fewer for a lone token; Zen 3,
  // 2026-12-06, one process, 30 alternations, a cached 8960 x 1536 matrix, two threads: 5 tokens 0.92x, 9 0.99x;
  // the 1.5B's passes of 5 tokens 0.95x, twice; a tail of 2 joining, 6 tokens, 1.03x: not done). VNNI builds: not
  // measured, unchanged.
  static constexpr int kTailJoins = kVnni ? 0 : 1;

  static void scales_mins(const uint8_t* block, int scale[8], int min[8]) {
    const uint8_t* p = block + 4;
    for (int c = 0; c < 8; ++c) {
      scale[c] = c < 4 ? p[c] & 63 : (p[c + 4] & 0x0F) | ((p[c - 4] >> 6) << 4);
      min[c] = c < 4 ? p[c + 4] & 63 : (p[c + 4] >> 4) | ((p[c] >> 6) << 4);
    }
  }

  // kRun: Q5Kx8 packs its low four bits with 4 in every build
  template <int kRun = kQsRun>
  static void pack(const uint8_t* const rows[8], uint8_t* out) {
    for (int r = 0; r < 8; ++r) {
      std::memcpy(out + 2 * r, rows[r], 2);
      std::memcpy(out + 16 + 2 * r, rows[r] + 2, 2);
      int scale[8], min[8];
      scales_mins(rows[r], scale, min);
      for (int c = 0; c < 8; ++c) {
        out[32 + 8 * c + r] = static_cast<uint8_t>(scale[c]);
        out[96 + 16 * (c / 2) + 2 * r + c % 2] = static_cast<uint8_t>(min[c]);
      }
      for (int j = 0; j < 4; ++j)
        for (int k = 0; k < 32 / kRun; ++k)
          std::memcpy(out + 160 + 256 * j + 8 * kRun * k + kRun * r, rows[r] + 16 + 32 * j + kRun * k, kRun);
    }
  }

  template <int kRun = kQsRun>
  static void unpack(const uint8_t* in, uint8_t* const rows[8]) {
    for (int r = 0; r < 8; ++r) {
      uint8_t* b = rows[r];
      std::memcpy(b, in + 2 * r, 2);
      std::memcpy(b + 2, in + 16 + 2 * r, 2);
      int scale[8], min[8];
      for (int c = 0; c < 8; ++c) scale[c] = in[32 + 8 * c + r], min[c] = in[96 + 16 * (c / 2) + 2 * r + c % 2];
      for (int c = 0; c < 4; ++c) {  // the inverse of scales_mins
        b[4 + c] = static_cast<uint8_t>(scale[c] | ((scale[c + 4] >> 4) << 6));
        b[8 + c] = static_cast<uint8_t>(min[c] | ((min[c + 4] >> 4) << 6));
        b[12 + c] = static_cast<uint8_t>((scale[c + 4] & 0x0F) | ((min[c + 4] & 0x0F) << 4));
      }
      for (int j = 0; j < 4; ++j)
        for (int k = 0; k < 32 / kRun; ++k)
          std::memcpy(b + 16 + 32 * j + kRun * k, in + 160 + 256 * j + 8 * kRun * k + kRun * r, kRun);
    }
  }

  // sum_i w_ri x_i = d_r dx sum_c scale_rc (sum_{i in c} q_ri xq_i) - dmin_r dx sum_c min_rc (sum_{i in c} xq_i).
  // int16: a lane adds 8 vpmaddubsw lanes of 2 products each, |q x| <= 15 * 127: at most 30480.
  // Tokens: a TokenSuper array (the amx build's rows) or a TokenGroup; kPrefetch: as the 512-bit loop's (unused)
  template <int G, bool kPrefetch = true, typename Tokens>
  static void dot(const uint8_t* block, const Tokens& x, __m256* acc) {
    __m256i dots[G];
    for (int g = 0; g < G; ++g) dots[g] = _mm256_setzero_si256();
    if constexpr (kVnni) {
      vnni_dots<G>(block, x, dots);
      return finish<G>(block, x, dots, acc);
    }
    const uint8_t* qs = block + 160;
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int j = 0; j < 4; ++j) {
      __m256i even[G], odd[G];  // sub-blocks 2j and 2j + 1
      // the first 4 weights' products start the sums (not zeros plus an add: one add in 8 fewer; Zen 3, one
      // thread, a cached 8960 x 1536 matrix, 2026-12-06: 8 tokens 25.2 -> 23.2 ns per (8 rows, 256 weights,
      // token), 4 tokens 28.8 -> 26.7)
      const auto products = [&](int k, bool start) __attribute__((always_inline)) {
        const __m256i bytes = load256(qs + 256 * j + 32 * k);
        const __m256i w_even = _mm256_and_si256(bytes, low), w_odd = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
        for (int g = 0; g < G; ++g) {
          const __m256i p_even = _mm256_maddubs_epi16(w_even, broadcast4(token_q(x, g) + 64 * j + 4 * k));
          const __m256i p_odd = _mm256_maddubs_epi16(w_odd, broadcast4(token_q(x, g) + 64 * j + 32 + 4 * k));
          even[g] = start ? p_even : add_i16_into(even[g], p_even);
          odd[g] = start ? p_odd : add_i16_into(odd[g], p_odd);
        }
      };
      products(0, true);
      for (int k = 1; k < 8; ++k) products(k, false);
      const __m256i scale_even = row_pairs_u8(block + 32 + 8 * (2 * j)), scale_odd = row_pairs_u8(block + 40 + 16 * j);
      for (int g = 0; g < G; ++g)
        dots[g] = add_i32_into(dots[g], _mm256_add_epi32(_mm256_madd_epi16(even[g], scale_even),
                                                         _mm256_madd_epi16(odd[g], scale_odd)));
    }
    finish<G>(block, x, dots, acc);
  }

  // With VNNI: a `vpdpbusd` replaces each vpmaddubsw and its int16 add (a sub-block's 32 products per row in int32
  // lane r), a `vpmulld` the scale's vpmaddwd: the same integers. Zen 4, one thread, a cached 1536 x 1536 matrix,
  // 2026-12-04: 16 tokens 107 -> 128 GMAC/s, 2 tokens 80 -> 87.
  template <int G, typename Tokens>
  static void vnni_dots(const uint8_t* block, const Tokens& x, __m256i* dots) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int j = 0; j < 4; ++j) {
      __m256i even[G], odd[G];  // sub-blocks 2j and 2j + 1
      for (int g = 0; g < G; ++g) even[g] = odd[g] = _mm256_setzero_si256();
      for (int k = 0; k < 8; ++k) {
        const __m256i bytes = load256(block + 160 + 256 * j + 32 * k);
        const __m256i w_even = _mm256_and_si256(bytes, low), w_odd = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
        for (int g = 0; g < G; ++g) {
          even[g] = dot_u8s8(even[g], w_even, broadcast4(token_q(x, g) + 64 * j + 4 * k));
          odd[g] = dot_u8s8(odd[g], w_odd, broadcast4(token_q(x, g) + 64 * j + 32 + 4 * k));
        }
      }
      const __m256i scale_even = row_u8(block + 32 + 16 * j), scale_odd = row_u8(block + 40 + 16 * j);
      for (int g = 0; g < G; ++g)
        dots[g] = add_i32_into(dots[g], _mm256_add_epi32(_mm256_mullo_epi32(even[g], scale_even),
                                                         _mm256_mullo_epi32(odd[g], scale_odd)));
    }
  }

#if SPECDRAFT_WIDE_K
  // The 512-bit loop (kWideK): a vpdpbusd meets 8 bytes of each of the 8 rows (int32 lanes 2r and 2r + 1: row r's
  // two halves) with a token's 8 activations broadcast, so each vector instruction does twice the work of the 256-
  // bit loop and one broadcast serves 64 products. A lane sums 16 products of a sub-block, |q x| <= 15 * 127: at
  // most 30480, an int16. `vpackssdw` (exact: no value saturates) puts a 128-bit chunk's lanes of sub-blocks 2j and
  // 2j + 1 side by side as int16, and one `vpdpwssd` against the rows' scales (each twice) adds both sub-blocks'
  // scaled sums: int32 lanes (e(2c), e(2c + 1), o(2c), o(2c + 1)) in chunk c, rows 2c and 2c + 1. At the block's end
  // the even and odd lanes of a row add up, in int32 lane r: the integers of the 256-bit loop, so the same bits.
  // Zen 4 (2026-12-07, a neighbour on the host): the 256-bit loop issued about 4 instructions a cycle for 2
  // `vpdpbusd` (a C copy in cache: 11.9 ns per (8 rows, 256 weights, token) at 4 tokens, the multiply unit's floor
  // 8.7); this one 10.7 at 8 tokens. `scripts/format_speed.py --formats Q6_K,Q4_K --rows 4864 --cols 1536`, builds
  // alternated twice, Q4_K's time over Q6_K's in the same rounds: 4 / 8 / 16 tokens 0.62-0.67 -> 0.56-0.57 /
  // 0.74 -> 0.64-0.67 / 0.68-0.69 -> 0.60-0.62; one token level (0.71 and 0.74 at 8960 x 1536, both builds). The
  // 1.5B's passes after 64 cached tokens (/tmp script, 2 threads, 6 alternations, medians): 4 tokens 43.7 -> 41.4 ms,
  // 8 71.3 -> 69.6, 16 124.9 -> 117.3, one token level. Q5_K the same way measured no faster (its lane sums fit
  // int16 for 8 products, so it takes twice the scale steps; with its sums started from an offset as Q6_K's, no
  // clear gain either: docs/performance.md); Q6_K's sums start from an offset that keeps 8 products in int16
  // (Q6Kx8's 512-bit dot).
  // kPrefetch: whether this call asks for the lines ahead (the first group of a tile's tokens; kSpreadsPrefetch)
  template <int G, bool kPrefetch = true>
  static void dot(const uint8_t* block, const TokenGroup& x, __m256* acc) {
    __m256i dots[G];
    wide_dots<G, kPrefetch>(block, x, dots);
    finish<G>(block, x, dots, acc);
  }

  template <int G, bool kPrefetch>
  static void wide_dots(const uint8_t* block, const TokenGroup& x, __m256i* dots) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512i sums[G];
    for (int g = 0; g < G; ++g) sums[g] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      if constexpr (G > 1 && kPrefetch) prefetch_part_ahead<Q4Kx8, 4>(block, j);
      __m512i even[G], odd[G];  // sub-blocks 2j and 2j + 1
      for (int g = 0; g < G; ++g) even[g] = odd[g] = _mm512_setzero_si512();
      for (int m = 0; m < 4; ++m) {
        const __m512i bytes = _mm512_loadu_si512(block + 160 + 256 * j + 64 * m);
        const __m512i w_even = _mm512_and_si512(bytes, low);
        const __m512i w_odd = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
        for (int g = 0; g < G; ++g) {
          even[g] = _mm512_dpbusd_epi32(even[g], w_even, broadcast8(x.q_of(g) + 64 * j + 8 * m));
          odd[g] = _mm512_dpbusd_epi32(odd[g], w_odd, broadcast8(x.q_of(g) + 64 * j + 32 + 8 * m));
        }
      }
      // the block's bytes 32 + 16j ..: 8 rows' scales of sub-block 2j, then of 2j + 1
      const __m128i scale_bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 32 + 16 * j));
      const __m512i scales = scale_words(_mm512_castsi256_si512(_mm256_cvtepu8_epi16(scale_bytes)));
      for (int g = 0; g < G; ++g)
        sums[g] = _mm512_dpwssd_epi32(sums[g], _mm512_packs_epi32(even[g], odd[g]), scales);
    }
    for (int g = 0; g < G; ++g) dots[g] = row_sums(sums[g]);
  }
#endif

  // the mins' part and the float part: acc += d dx dots - dmin dx mins
  template <int G, typename Tokens>
  static void finish(const uint8_t* block, const Tokens& x, const __m256i* dots, __m256* acc) {
    __m256i mins[G];
    for (int g = 0; g < G; ++g) mins[g] = _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {
      const __m256i min_pairs = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 96 + 16 * p)));
      for (int g = 0; g < G; ++g)
        mins[g] = dot_s16(mins[g], min_pairs, broadcast4(token_sums32(x, g) + 2 * p));
    }
    scaled_dots_minus_mins<G>(block, x, dots, mins, acc);
  }
};

// Q5_K, 8 rows x 256 weights in 1440 bytes: [0, 1184) as Q4Kx8's (the low four bits in qs), then
//   [1184, 1440) byte 1184 + 32k + 4r + i: qh[4k + i] of row r (its bit 2j + s: the fifth bit of weight 64j + 32s +
//   4k + i), so the fifth bits of a qs vector come from the qh vector of the same k and the same byte.
struct Q5Kx8 {
  static constexpr int64_t kWeights = 256, kBytes = 1440, kActBlock = 256;
  static constexpr int kGroupsTokens = kGroup;

  // Through Q4Kx8's packing: each row's block as a Q4_K block (d, dmin, scales, qs), and its qh beside.
  static void pack(const uint8_t* const rows[8], uint8_t* out) {
    uint8_t as_q4k[8][144];
    const uint8_t* q4k_rows[8];
    for (int r = 0; r < 8; ++r) {
      std::memcpy(as_q4k[r], rows[r], 16);
      std::memcpy(as_q4k[r] + 16, rows[r] + 48, 128);
      q4k_rows[r] = as_q4k[r];
      for (int k = 0; k < 8; ++k) std::memcpy(out + 1184 + 32 * k + 4 * r, rows[r] + 16 + 4 * k, 4);
    }
    Q4Kx8::pack<4>(q4k_rows, out);
  }

  static void unpack(const uint8_t* in, uint8_t* const rows[8]) {
    uint8_t as_q4k[8][144];
    uint8_t* q4k_rows[8];
    for (int r = 0; r < 8; ++r) q4k_rows[r] = as_q4k[r];
    Q4Kx8::unpack<4>(in, q4k_rows);
    for (int r = 0; r < 8; ++r) {
      std::memcpy(rows[r], as_q4k[r], 16);
      std::memcpy(rows[r] + 48, as_q4k[r] + 16, 128);
      for (int k = 0; k < 8; ++k) std::memcpy(rows[r] + 16 + 4 * k, in + 1184 + 32 * k + 4 * r, 4);
    }
  }

  // As Q4Kx8::dot with q in 0..31: a sub-block's int16 sums take 4 vpmaddubsw lanes of 2 products each (at most
  // 4 * 2 * 31 * 128 = 31744) before a vpmaddwd with the scales, so each sub-block has two (k = 0-3, 4-7). With
  // VNNI and two tokens or more, as Q4Kx8::vnni_dots: a sub-block's 32 products per row in one int32 lane, times its
  // scale (`vpmulld`); a lone token keeps this loop (a step is bound by memory, and it measured no faster).
  template <int G>
  static void dot(const uint8_t* block, const TokenSuper* x, __m256* acc) {
    if constexpr (kVnni && G >= 2) return vnni_dot<G>(block, x, acc);
    __m256i dots[G];
    for (int g = 0; g < G; ++g) dots[g] = _mm256_setzero_si256();
    const uint8_t* qs = block + 160;
    const uint8_t* qh = block + 1184;
    const __m256i low = _mm256_set1_epi8(0x0F);
    unrolled<4>([&](auto chunk) __attribute__((always_inline)) {
      constexpr int j = chunk;  // sub-blocks 2j and 2j + 1
      const __m256i scale_even = row_pairs_u8(block + 32 + 16 * j), scale_odd = row_pairs_u8(block + 40 + 16 * j);
      for (int half = 0; half < 2; ++half) {
        __m256i even[G], odd[G];
        for (int k = 4 * half; k < 4 * half + 4; ++k) {
          const __m256i bytes = load256(qs + 256 * j + 32 * k), high = load256(qh + 32 * k);
          const __m256i w_even = _mm256_or_si256(_mm256_and_si256(bytes, low), fifth_bits<2 * j>(high));
          const __m256i w_odd = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), low),
                                                fifth_bits<2 * j + 1>(high));
          for (int g = 0; g < G; ++g) {
            const __m256i p_even = _mm256_maddubs_epi16(w_even, broadcast4(x[g].q + 64 * j + 4 * k));
            const __m256i p_odd = _mm256_maddubs_epi16(w_odd, broadcast4(x[g].q + 64 * j + 32 + 4 * k));
            even[g] = k == 4 * half ? p_even : add_i16_into(even[g], p_even);
            odd[g] = k == 4 * half ? p_odd : add_i16_into(odd[g], p_odd);
          }
        }
        for (int g = 0; g < G; ++g)
          dots[g] = add_i32_into(dots[g], _mm256_add_epi32(_mm256_madd_epi16(even[g], scale_even),
                                                           _mm256_madd_epi16(odd[g], scale_odd)));
      }
    });
    Q4Kx8::finish<G>(block, x, dots, acc);
  }

  template <int G>
  static void vnni_dot(const uint8_t* block, const TokenSuper* x, __m256* acc) {
    __m256i dots[G];
    for (int g = 0; g < G; ++g) dots[g] = _mm256_setzero_si256();
    const uint8_t* qs = block + 160;
    const uint8_t* qh = block + 1184;
    const __m256i low = _mm256_set1_epi8(0x0F);
    unrolled<4>([&](auto chunk) __attribute__((always_inline)) {
      constexpr int j = chunk;  // sub-blocks 2j and 2j + 1
      // few tokens: two sums per sub-block and token (k even, k odd), so that the chains of dependent vpdpbusd
      // (4-5 cycles each) are half as long
      constexpr int kChains = G <= 4 ? 2 : 1;
      __m256i even[kChains][G], odd[kChains][G];
      for (int c = 0; c < kChains; ++c)
        for (int g = 0; g < G; ++g) even[c][g] = odd[c][g] = _mm256_setzero_si256();
      unrolled<8>([&](auto step) __attribute__((always_inline)) {
        constexpr int k = step, c = k % kChains;
        const __m256i bytes = load256(qs + 256 * j + 32 * k), high = load256(qh + 32 * k);
        const __m256i w_even = _mm256_or_si256(_mm256_and_si256(bytes, low), fifth_bits<2 * j>(high));
        const __m256i w_odd = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), low),
                                              fifth_bits<2 * j + 1>(high));
        for (int g = 0; g < G; ++g) {
          even[c][g] = dot_u8s8(even[c][g], w_even, broadcast4(x[g].q + 64 * j + 4 * k));
          odd[c][g] = dot_u8s8(odd[c][g], w_odd, broadcast4(x[g].q + 64 * j + 32 + 4 * k));
        }
      });
      const __m256i scale_even = row_u8(block + 32 + 16 * j), scale_odd = row_u8(block + 40 + 16 * j);
      for (int g = 0; g < G; ++g) {
        __m256i e = even[0][g], o = odd[0][g];
        if constexpr (kChains == 2) e = _mm256_add_epi32(e, even[1][g]), o = _mm256_add_epi32(o, odd[1][g]);
        dots[g] = add_i32_into(dots[g], _mm256_add_epi32(_mm256_mullo_epi32(e, scale_even),
                                                         _mm256_mullo_epi32(o, scale_odd)));
      }
    });
    Q4Kx8::finish<G>(block, x, dots, acc);
  }
};

// Q6_K, 8 rows x 256 weights in 1680 bytes (8 x 210):
//   [0, 16) d of rows 0-7 (halves), [16, 144) byte 16 + 8s + r: scale of sub-block s (16 weights) of row r (int8),
//   [144, 1680) for half h and m = 0..7, 96 bytes at 144 + 96 (8h + m): three vectors whose byte 4r + i is, for
//   row r, ql[64h + 4m + i], ql[64h + 32 + 4m + i] and qh[32h + 4m + i] (the weights 128h + 32k + 4m + i, k = 0..3);
//   in kWideK builds runs of 8 bytes instead, in the order the 512-bit loop reads them: for half h and m = 0..3,
//   64-byte vectors at 144 + 768h + 64m, + 256 and + 512 whose byte 8r + i is ql[64h + 8m + i], qh[32h + 8m + i] and
//   ql[64h + 32 + 8m + i] of row r (the weights 128h + 32k + 8m + i, k = 0..3, of sub-block 8h + 2k + m / 2).
struct Q6Kx8 {
  static constexpr int64_t kWeights = 256, kBytes = 1680, kActBlock = 256;
  static constexpr int kQsRun = kWideK ? 8 : 4;  // bytes of a row side by side
  // the 512-bit loop's passes ask for the lines ahead a few at a time, and it reads the activations as TokenGroups
  // (BlockMajorRows), its sums starting from QuantizedRows::offsets
  static constexpr bool kSpreadsPrefetch = kWideK;
  static constexpr bool kBlockMajor = kWideK;
  // 8 tokens per unpacking in every build: with 16 registers (AVX2) GCC keeps 3 of the 8 sums in memory, yet the
  // six-bit unpacking costs more. Zen 3, 2026-12-06, one process, against 4 per unpacking alternated 30 times, a
  // cached 1536 x 8960 matrix, two threads: 5 / 6 / 7 / 8 / 16 tokens 0.78 / 0.85 / 0.89 / 0.93-0.94 / 0.95-0.97x;
  // the 1.5B's passes of 5, 6 and 8 tokens 0.93, 0.93 and 0.98x, one token 1.00x.
  static constexpr int kGroupsTokens = 8;

  // where vector v (0, 1: ql's first and second 32 bytes of a half, 2: qh's) of half h and run m starts, and where
  // in a row's block its bytes come from
  static constexpr int64_t vector_at(int h, int m, int v) {
    return kWideK ? 144 + 768 * h + 256 * (v == 0 ? 0 : v == 2 ? 1 : 2) + 64 * m : 144 + 96 * (8 * h + m) + 32 * v;
  }
  static constexpr int64_t source_at(int h, int m, int v) {  // in a row's block: ql[64h + 32v + ..] or qh[32h + ..]
    return (v == 2 ? 128 + 32 * h : 64 * h + 32 * v) + kQsRun * m;
  }

  static void pack(const uint8_t* const rows[8], uint8_t* out) {
    for (int r = 0; r < 8; ++r) {
      const uint8_t* b = rows[r];
      std::memcpy(out + 2 * r, b + 208, 2);
      for (int s = 0; s < 16; ++s) out[16 + 8 * s + r] = b[192 + s];
      for (int h = 0; h < 2; ++h)
        for (int m = 0; m < 32 / kQsRun; ++m)
          for (int v = 0; v < 3; ++v)  // ql's first and second 32 bytes of the half, its qh
            std::memcpy(out + vector_at(h, m, v) + kQsRun * r, b + source_at(h, m, v), kQsRun);
    }
  }

  static void unpack(const uint8_t* in, uint8_t* const rows[8]) {
    for (int r = 0; r < 8; ++r) {
      uint8_t* b = rows[r];
      std::memcpy(b + 208, in + 2 * r, 2);
      for (int s = 0; s < 16; ++s) b[192 + s] = in[16 + 8 * s + r];
      for (int h = 0; h < 2; ++h)
        for (int m = 0; m < 32 / kQsRun; ++m)
          for (int v = 0; v < 3; ++v)
            std::memcpy(b + source_at(h, m, v), in + vector_at(h, m, v) + kQsRun * r, kQsRun);
    }
  }

  // sum_i w_ri x_i = d_r dx (sum_s scale_rs sum_{i in s} (q_ri + 32) xq_i - 32 sum_s scale_rs sum_{i in s} xq_i), with
  // q + 32 in 0..63. int16: a lane adds 2 vpmaddubsw lanes of 2 products each, |(q + 32) x| <= 63 * 127: at most
  // 32004 (a sub-block's 4 weights per row and m, 2 values of m per vpmaddwd).
  template <int G>
  static void dot(const uint8_t* block, const TokenSuper* x, __m256* acc) {
    const __m256i low = _mm256_set1_epi8(0x0F), high = _mm256_set1_epi8(0x30);
    __m256i dots[G];
    for (int g = 0; g < G; ++g) dots[g] = _mm256_setzero_si256();
    // q + 32 of 4 weights per row, chunk k of l and hi (inlined, so that k is a constant in the unrolled loops)
    const auto six = [&](__m256i l, __m256i hi, int k) __attribute__((always_inline)) {
      const __m256i nibble = k < 2 ? _mm256_and_si256(l, low) : _mm256_and_si256(_mm256_srli_epi16(l, 4), low);
      const __m256i top = k == 0 ? _mm256_slli_epi16(hi, 4) : k == 1 ? _mm256_slli_epi16(hi, 2)
                          : k == 2 ? hi : _mm256_srli_epi16(hi, 2);
      return _mm256_or_si256(nibble, _mm256_and_si256(top, high));
    };
    // With VNNI a sub-block's 16 products per row in int32 lane r (vpdpbusd), times its scale (vpmulld): Zen 4, one
    // thread, a cached 1536 x 8960 matrix, 8 tokens a group, 2026-12-04: 8 tokens 74 -> 85 GMAC/s, 16 74 -> 85.
    if constexpr (kVnni) {
      for (int h = 0; h < 2; ++h)
        for (int m = 0; m < 8; m += 4) {  // sub-blocks 8h + 2k + m / 4
          const uint8_t* v = block + 144 + 96 * (8 * h + m);
          for (int k = 0; k < 4; ++k) {
            __m256i sub[G];
            for (int g = 0; g < G; ++g) sub[g] = _mm256_setzero_si256();
            for (int i = 0; i < 4; ++i) {
              const __m256i w = six(load256(v + 96 * i + 32 * (k % 2)), load256(v + 96 * i + 64), k);
              const int64_t at = 128 * h + 32 * k + 4 * (m + i);
              for (int g = 0; g < G; ++g) sub[g] = dot_u8s8(sub[g], w, broadcast4(x[g].q + at));
            }
            const __m256i scale = row_s8(block + 16 + 8 * (8 * h + 2 * k + m / 4));
            for (int g = 0; g < G; ++g) dots[g] = add_i32_into(dots[g], _mm256_mullo_epi32(sub[g], scale));
          }
        }
    } else {
      for (int h = 0; h < 2; ++h) {
        for (int m = 0; m < 8; m += 2) {  // weights 128h + 32k + 4m .. + 7: sub-block 8h + 2k + m / 4
          const uint8_t* v0 = block + 144 + 96 * (8 * h + m);
          const uint8_t* v1 = v0 + 96;
          const __m256i l0a = load256(v0), l1a = load256(v0 + 32), ha = load256(v0 + 64);
          const __m256i l0b = load256(v1), l1b = load256(v1 + 32), hb = load256(v1 + 64);
          // k a constant (`unrolled`): GCC had kept this loop rolled, testing k in `six`, and spilled its values;
          // unrolled, Zen 3, 2026-12-06, one process, old and new alternated 30 times: a cached 1536 x 8960
          // matrix at 4, 8 and 16 tokens 0.88-0.90x (one and two threads), one token 0.96-1.00x
          unrolled<4>([&](auto chunk) __attribute__((always_inline)) {
            constexpr int k = chunk;
            const __m256i wa = six(k % 2 ? l1a : l0a, ha, k), wb = six(k % 2 ? l1b : l0b, hb, k);
            const __m256i scale = row_pairs_s8(block + 16 + 8 * (8 * h + 2 * k + m / 4));
            const int64_t at = 128 * h + 32 * k + 4 * m;
            for (int g = 0; g < G; ++g) {
              const __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(wa, broadcast4(x[g].q + at)),
                                                    _mm256_maddubs_epi16(wb, broadcast4(x[g].q + at + 4)));
              dots[g] = add_i32_into(dots[g], _mm256_madd_epi16(pair, scale));
            }
          });
        }
      }
    }
    finish<G>(block, x, dots, acc);
  }

#if SPECDRAFT_WIDE_K
  // The 512-bit loop (kWideK), as Q4Kx8's: a vpdpbusd meets 8 bytes of each of the 8 rows (int32 lanes 2r and 2r +
  // 1) with a token's 8 activations broadcast. A lane's sum of q x over its 8 products of a sub-block reaches 64008
  // (q in 0..63), no int16; but it starts from the token's -32 times the sum of the same 8 activations
  // (QuantizedRows::offsets), so it ends as the sum of (q - 32) x: |(q - 32) x| <= 32 * 127, at most 32512 over 8
  // products (the activations are at most 127 in size), an int16. `vpackssdw` (exact) then puts a 128-bit chunk's
  // lanes of sub-blocks 2k and 2k + 1 of a half side by side, and one `vpdpwssd` against the rows' scales (each
  // twice) adds both scaled: lanes (s(2c), s(2c + 1), s'(2c), s'(2c + 1)) in chunk c, rows 2c and 2c + 1, as in
  // Q4Kx8::wide_dots, whose reduction follows. The offsets' products of `finish` are in the sums already: the row's
  // integer total is the 256-bit loop's, the float part the same, so the same bits. Its passes ask for the lines
  // ahead a few per step (`prefetch_part_ahead`), and it reads the block's bytes in order (k = 0, 2, 1, 3: the low
  // nibbles' vectors serve k and k + 2).
  // Zen 4, 2026-12-07, a neighbour on the host; one thread, ns per (8 rows, 256 weights) block, 4096 x 1536 random
  // blocks, the 256-bit loop -> this one: in cache, 1 / 8 / 16 tokens 51-63 / 164-174 / 327-344 -> 50-56 / 140-156
  // / 272-299; streamed from memory (40 such matrices) 75-80 / 200-219 / 366-387 -> 78-84 / 164-191 / 274-276.
  // Before the prefetch was spread and the bytes read in order, 8 tokens from memory took 263-335 (in cache
  // 137-161): the same as with no prefetch at all. The 1.5B's Q6_K matrices, 2 threads, each product alternated with
  // the 256-bit build's in a second process (docs/performance.md): the head 151,936 x 1536 at 8 and 16 tokens
  // 0.65-0.82x and 0.69x the time, the down projections (Q4_K's among them) at 8 tokens 0.80x; one token 1.03-1.06x,
  // as the unchanged Q4_K matrices measured in that setup (1.03-1.04x).
  template <int G, bool kPrefetch = true>  // kPrefetch: as Q4Kx8's
  static void dot(const uint8_t* block, const TokenGroup& x, __m256* acc) {
    const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(0x30);
    __m512i sums[G];
    for (int g = 0; g < G; ++g) sums[g] = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h)
      unrolled<4>([&](auto step) __attribute__((always_inline)) {
        constexpr int k = (step % 2) * 2 + step / 2;  // 0, 2, 1, 3: the block's bytes in order
        // weights 128h + 32k .. + 31: sub-blocks 8h + 2k and 8h + 2k + 1
        __m512i w[4];  // q of the weights 128h + 32k + 8m .. + 7 of each row
        for (int m = 0; m < 4; ++m) {
          const __m512i l = _mm512_loadu_si512(block + vector_at(h, m, k % 2));
          const __m512i hi = _mm512_loadu_si512(block + vector_at(h, m, 2));
          const __m512i nibble = k < 2 ? _mm512_and_si512(l, low) : _mm512_and_si512(_mm512_srli_epi16(l, 4), low);
          const __m512i top = k == 0 ? _mm512_slli_epi16(hi, 4) : k == 1 ? _mm512_slli_epi16(hi, 2)
                              : k == 2 ? hi : _mm512_srli_epi16(hi, 2);
          w[m] = _mm512_or_si512(nibble, _mm512_and_si512(top, high));
        }
        if constexpr (G > 1 && kPrefetch) prefetch_part_ahead<Q6Kx8, 8>(block, 4 * h + step);
        const int s = 8 * h + 2 * k;
        const __m128i scale_bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16 + 8 * s));
        const __m512i scales = scale_words(_mm512_castsi256_si512(_mm256_cvtepi8_epi16(scale_bytes)));
        const int64_t at = 16 * s;
        for (int g = 0; g < G; ++g) {
          const int8_t* q = x.q_of(g) + at;
          __m512i first = broadcast8(x.offsets_of(g) + 2 * s), second = broadcast8(x.offsets_of(g) + 2 * s + 2);
          first = _mm512_dpbusd_epi32(first, w[0], broadcast8(q));
          first = _mm512_dpbusd_epi32(first, w[1], broadcast8(q + 8));
          second = _mm512_dpbusd_epi32(second, w[2], broadcast8(q + 16));
          second = _mm512_dpbusd_epi32(second, w[3], broadcast8(q + 24));
          sums[g] = _mm512_dpwssd_epi32(sums[g], _mm512_packs_epi32(first, second), scales);
        }
      });
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
    for (int g = 0; g < G; ++g)
      acc[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(row_sums(sums[g])), _mm256_mul_ps(d, _mm256_set1_ps(x.scales[g])),
                               acc[g]);
  }
#endif

  // the offsets' part and the float part: acc += d dx (dots - 2^shift offsets): Q6_K's offset 32, Q3_K's 4
  template <int G, int shift = 5>
  static void finish(const uint8_t* block, const TokenSuper* x, const __m256i* dots, __m256* acc) {
    __m256i offsets[G];
    for (int g = 0; g < G; ++g) offsets[g] = _mm256_setzero_si256();
    for (int p = 0; p < 8; ++p) {  // int16 lanes (2r, 2r + 1): scales of sub-blocks 2p and 2p + 1 of row r
      const __m128i a = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 16 + 16 * p));
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 24 + 16 * p));
      const __m256i scale_pairs = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a, b));
      for (int g = 0; g < G; ++g)
        offsets[g] = dot_s16(offsets[g], scale_pairs, broadcast4(x[g].sums16 + 2 * p));
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
    for (int g = 0; g < G; ++g) {  // total lane r = sum_i scale_ri (q_ri - 2^shift) xq_i over the block
      const __m256i total = _mm256_sub_epi32(dots[g], _mm256_slli_epi32(offsets[g], shift));
      acc[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, _mm256_set1_ps(x[g].scales[0])), acc[g]);
    }
  }
};

// Q2_K, 8 rows x 256 weights in 672 bytes (8 x 84): [0, 16) d of rows 0-7 (halves), [16, 32) dmin, [32, 160) byte
//   32 + 8s + r: the scale (low nibble) and min (high) of sub-block s of row r, [160, 672) byte 160 + 32(8n + k) +
//   4r + i: qs[32n + 4k + i] of row r (its bits 2j..2j + 1: weight 128n + 32j + 4k + i, of sub-block 8n + 2j + k / 4).
struct Q2Kx8 {
  static constexpr int64_t kWeights = 256, kBytes = 672, kActBlock = 256;
  static constexpr int kGroupsTokens = kGroup;

  static void pack(const uint8_t* const rows[8], uint8_t* out) {
    for (int r = 0; r < 8; ++r) {
      const uint8_t* b = rows[r];
      std::memcpy(out + 2 * r, b + 80, 2);
      std::memcpy(out + 16 + 2 * r, b + 82, 2);
      for (int s = 0; s < 16; ++s) out[32 + 8 * s + r] = b[s];
      for (int v = 0; v < 16; ++v) std::memcpy(out + 160 + 32 * v + 4 * r, b + 16 + 4 * v, 4);  // v = 8n + k
    }
  }

  static void unpack(const uint8_t* in, uint8_t* const rows[8]) {
    for (int r = 0; r < 8; ++r) {
      uint8_t* b = rows[r];
      std::memcpy(b + 80, in + 2 * r, 2);
      std::memcpy(b + 82, in + 16 + 2 * r, 2);
      for (int s = 0; s < 16; ++s) b[s] = in[32 + 8 * s + r];
      for (int v = 0; v < 16; ++v) std::memcpy(b + 16 + 4 * v, in + 160 + 32 * v + 4 * r, 4);
    }
  }

  // sum_i w_ri x_i = d_r dx sum_s scale_rs sum_{i in s} q_ri xq_i - dmin_r dx sum_s min_rs sum_{i in s} xq_i, q in
  // 0..3. int16: a lane adds the 4 vpmaddubsw lanes of a sub-block's 16 weights (2 products each): at most 3048.
  // With VNNI: 4 `vpdpbusd` put a sub-block's 16 products per row in int32 lane r (at most 16 * 3 * 127 = 6096, an
  // int16), and one `vpdpwssd` against the scale (int32 lane r: the scale, its upper int16 zero) adds scale x sum:
  // the same integers. Zen 4, 2026-12-07, `scripts/format_speed.py --formats Q4_K,Q2_K --rows 4864 --cols 1536`,
  // builds alternated twice, Q2_K's time over Q4_K's: 2 / 4 / 8 / 16 tokens 0.82-0.83 / 1.20-1.21 / 1.27-1.28 /
  // 1.42-1.44 -> 0.76-0.80 / 1.08-1.17 / 1.13-1.19 / 1.32-1.33, one token level (0.63-0.64 -> 0.64-0.66).
  template <int G>
  static void dot(const uint8_t* block, const TokenSuper* x, __m256* acc) {
    const __m256i crumb = _mm256_set1_epi8(3);
    const __m128i nibble = _mm_set1_epi8(0x0F);
    __m256i dots[G], mins[G];
    for (int g = 0; g < G; ++g) dots[g] = mins[g] = _mm256_setzero_si256();
    // the 4 vectors of a sub-block column (n, p) loaded once, each of the 4 sub-blocks (j) shifted out of them:
    // Zen 3, 2026-12-06, one process, against a vector loaded per sub-block, 16 alternations, 8960 x 1536, 2 threads:
    // 4 / 8 / 16 tokens 0.85 / 0.82 / 0.84x the time, one token 0.99x
    unrolled<2>([&](auto half) __attribute__((always_inline)) {
      constexpr int n = half;
      for (int p = 0; p < 2; ++p) {  // chunks k = 4p .. 4p + 3: sub-blocks 8n + 2j + p
        const uint8_t* base = block + 160 + 32 * (8 * n + 4 * p);
        const __m256i v0 = load256(base), v1 = load256(base + 32), v2 = load256(base + 64), v3 = load256(base + 96);
        unrolled<4>([&](auto shift) __attribute__((always_inline)) {
          constexpr int j = shift;
          const int64_t at = 128 * n + 32 * j + 16 * p;
          const __m256i w0 = move_bits<2 * j, 0>(v0, crumb), w1 = move_bits<2 * j, 0>(v1, crumb);
          const __m256i w2 = move_bits<2 * j, 0>(v2, crumb), w3 = move_bits<2 * j, 0>(v3, crumb);
          const uint8_t* packed_bytes = block + 32 + 8 * (8 * n + 2 * j + p);
          const __m128i low = _mm_and_si128(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(packed_bytes)), nibble);
          if constexpr (kVnni) {
            const __m256i scale = _mm256_cvtepu8_epi32(low);
            for (int g = 0; g < G; ++g) {
              __m256i sum = dot_u8s8(_mm256_setzero_si256(), w0, broadcast4(x[g].q + at));
              sum = dot_u8s8(sum, w1, broadcast4(x[g].q + at + 4));
              sum = dot_u8s8(sum, w2, broadcast4(x[g].q + at + 8));
              sum = dot_u8s8(sum, w3, broadcast4(x[g].q + at + 12));
              dots[g] = dot_s16(dots[g], sum, scale);
            }
            return;
          }
          const __m256i scale = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(low, low));
          for (int g = 0; g < G; ++g) {
            const __m256i s01 = _mm256_add_epi16(_mm256_maddubs_epi16(w0, broadcast4(x[g].q + at)),
                                                 _mm256_maddubs_epi16(w1, broadcast4(x[g].q + at + 4)));
            const __m256i s23 = _mm256_add_epi16(_mm256_maddubs_epi16(w2, broadcast4(x[g].q + at + 8)),
                                                 _mm256_maddubs_epi16(w3, broadcast4(x[g].q + at + 12)));
            dots[g] = add_i32_into(dots[g], _mm256_madd_epi16(_mm256_add_epi16(s01, s23), scale));
          }
        });
      }
    });
    for (int p = 0; p < 8; ++p) {  // int16 lanes (2r, 2r + 1): mins of sub-blocks 2p and 2p + 1 of row r
      const __m128i a = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 32 + 16 * p));
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 40 + 16 * p));
      const __m256i min_pairs = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(_mm_unpacklo_epi8(a, b), 4), nibble));
      for (int g = 0; g < G; ++g) mins[g] = dot_s16(mins[g], min_pairs, broadcast4(x[g].sums16 + 2 * p));
    }
    scaled_dots_minus_mins<G>(block, x, dots, mins, acc);
  }
};

// Q3_K, 8 rows x 256 weights in 1168 bytes: [0, 16) d of rows 0-7 (halves), [16, 144) byte 16 + 8s + r: scale s of
//   row r as int8 (s - 32, as Q6Kx8's), [144, 1168) byte 144 + 128c + 32k + 4r + i: row r's q (0..7, its low
//   three bits and high bit joined) of weight 32c + 4k + i in the low nibble, of weight 32c + 16 + 4k + i in the
//   high one. Four bits a weight where the file has 3.44 (a Q4_K's unpacking: one vector of each sub-block's 4
//   weights per row from a mask, or a shift and a mask), 1.33x the file's bytes. Zen 3, 2026-12-06, 8960 x 1536,
//   2 threads, `scripts/format_speed.py --formats Q3_K,Q6_K,Q4_K --tokens 1,4,8,16`: 1.46 / 1.33 / 1.24 / 1.24x
//   faster than the Q6_K blocks Q3_K was rewritten in before (1, 4, 8, 16 tokens), as fast as Q4_K at one token,
//   1.14-1.16x slower in passes (88 multiplies a unit against 76). Kept as the file's crumbs and high bits (912
//   bytes), the unpacking took 5 instructions a vector: 1.34x faster than Q6_K at one token, 0.79x at 4.
struct Q3Kx8 {
  static constexpr int64_t kWeights = 256, kBytes = 1168, kActBlock = 256;
  static constexpr int kGroupsTokens = kGroup;

  // q (0..7) of row b's weight w, from the file's block
  static int q_of(const uint8_t* b, int w) {
    const int n = w / 128, j = w % 128 / 32, p = w % 32 / 16, l = w % 16;
    return ((b[32 + 32 * n + 16 * p + l] >> (2 * j)) & 3) | (((b[16 * p + l] >> (4 * n + j)) & 1) << 2);
  }

  static void pack(const uint8_t* const rows[8], uint8_t* out) {
    for (int r = 0; r < 8; ++r) {
      const uint8_t* b = rows[r];
      std::memcpy(out + 2 * r, b + 108, 2);
      for (int s = 0; s < 16; ++s) out[16 + 8 * s + r] = static_cast<uint8_t>(q3_k_scale(b + 96, s));
      for (int c = 0; c < 8; ++c)
        for (int k = 0; k < 4; ++k)
          for (int i = 0; i < 4; ++i)
            out[144 + 128 * c + 32 * k + 4 * r + i] =
                static_cast<uint8_t>(q_of(b, 32 * c + 4 * k + i) | (q_of(b, 32 * c + 16 + 4 * k + i) << 4));
    }
  }

  static void unpack(const uint8_t* in, uint8_t* const rows[8]) {
    for (int r = 0; r < 8; ++r) {
      uint8_t* b = rows[r];
      std::memset(b, 0, 108);
      std::memcpy(b + 108, in + 2 * r, 2);
      for (int s = 0; s < 16; ++s) {  // the inverse of q3_k_scale
        const int six = static_cast<int8_t>(in[16 + 8 * s + r]) + 32;
        b[96 + s % 8] |= static_cast<uint8_t>((six & 0x0F) << (4 * (s / 8)));
        b[104 + s % 4] |= static_cast<uint8_t>((six >> 4) << (2 * (s / 4)));
      }
      for (int w = 0; w < 256; ++w) {  // the inverse of q_of
        const int c = w / 32, half = w % 32 / 16, k = w % 16 / 4, i = w % 4;
        const int q = (in[144 + 128 * c + 32 * k + 4 * r + i] >> (4 * half)) & 0x0F;
        const int n = w / 128, j = w % 128 / 32, p = w % 32 / 16, l = w % 16;
        b[32 + 32 * n + 16 * p + l] |= static_cast<uint8_t>((q & 3) << (2 * j));
        b[16 * p + l] |= static_cast<uint8_t>((q >> 2) << (4 * n + j));
      }
    }
  }

  // sum_i w_ri x_i = d_r dx (sum_s scale_rs sum_{i in s} q_ri xq_i - 4 sum_s scale_rs sum_{i in s} xq_i), q in 0..7.
  // int16: a lane adds the 4 vpmaddubsw lanes of a sub-block's 16 weights (2 products each): at most 7112. With
  // VNNI and two tokens or more, a sub-block's 16 products per row in one int32 lane by `vpdpbusd`, times its scale
  // (`vpmulld`): the same integers (a lone token keeps this loop, as Q5Kx8's).
  template <int G>
  static void dot(const uint8_t* block, const TokenSuper* x, __m256* acc) {
    if constexpr (kVnni && G >= 2) return vnni_dot<G>(block, x, acc);
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i dots[G];
    for (int g = 0; g < G; ++g) dots[g] = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {  // sub-blocks 2c (low nibbles) and 2c + 1 (high)
      __m256i even[G], odd[G];
      for (int k = 0; k < 4; ++k) {
        const __m256i bytes = load256(block + 144 + 128 * c + 32 * k);
        const __m256i w_even = _mm256_and_si256(bytes, low), w_odd = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
        for (int g = 0; g < G; ++g) {
          const __m256i p_even = _mm256_maddubs_epi16(w_even, broadcast4(x[g].q + 32 * c + 4 * k));
          const __m256i p_odd = _mm256_maddubs_epi16(w_odd, broadcast4(x[g].q + 32 * c + 16 + 4 * k));
          even[g] = k ? add_i16_into(even[g], p_even) : p_even;
          odd[g] = k ? add_i16_into(odd[g], p_odd) : p_odd;
        }
      }
      const __m256i scale_even = row_pairs_s8(block + 16 + 16 * c), scale_odd = row_pairs_s8(block + 24 + 16 * c);
      for (int g = 0; g < G; ++g)
        dots[g] = add_i32_into(dots[g], _mm256_add_epi32(_mm256_madd_epi16(even[g], scale_even),
                                                         _mm256_madd_epi16(odd[g], scale_odd)));
    }
    Q6Kx8::finish<G, 2>(block, x, dots, acc);
  }

  // Q4Kx8::vnni_dots's loop over 16-weight sub-blocks (one helper for both, inlined, ran passes of 4 tokens 5-6 %
  // slower in both formats: Zen 4, 2026-12-07, builds alternated twice)
  template <int G>
  static void vnni_dot(const uint8_t* block, const TokenSuper* x, __m256* acc) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i dots[G];
    for (int g = 0; g < G; ++g) dots[g] = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {  // sub-blocks 2c (low nibbles) and 2c + 1 (high)
      __m256i even[G], odd[G];
      for (int g = 0; g < G; ++g) even[g] = odd[g] = _mm256_setzero_si256();
      for (int k = 0; k < 4; ++k) {
        const __m256i bytes = load256(block + 144 + 128 * c + 32 * k);
        const __m256i w_even = _mm256_and_si256(bytes, low), w_odd = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
        for (int g = 0; g < G; ++g) {
          even[g] = dot_u8s8(even[g], w_even, broadcast4(x[g].q + 32 * c + 4 * k));
          odd[g] = dot_u8s8(odd[g], w_odd, broadcast4(x[g].q + 32 * c + 16 + 4 * k));
        }
      }
      const __m256i scale_even = row_s8(block + 16 + 16 * c), scale_odd = row_s8(block + 24 + 16 * c);
      for (int g = 0; g < G; ++g)
        dots[g] = add_i32_into(dots[g], _mm256_add_epi32(_mm256_mullo_epi32(even[g], scale_even),
                                                         _mm256_mullo_epi32(odd[g], scale_odd)));
    }
    Q6Kx8::finish<G, 2>(block, x, dots, acc);
  }
};

// The layout of the 32-weight formats whose blocks are a half d and kColumns * 4 bytes (Q8_0: 8, Q4_0 and IQ4_NL: 4),
// 8 rows in 16 + 32 kColumns bytes (the file's 8 blocks): [0, 16) d of rows 0-7 (halves), then byte 16 + 32k + 4r + i:
// byte 4k + i of row r's block after its d.
template <int kColumns>
struct HalfAndColumnsx8 {
  static constexpr int64_t kWeights = 32, kBytes = 16 + 32 * kColumns, kActBlock = 32;
  static constexpr int kGroupsTokens = kGroup;

  static void pack(const uint8_t* const rows[8], uint8_t* out) {
    for (int r = 0; r < 8; ++r) {
      std::memcpy(out + 2 * r, rows[r], 2);
      for (int k = 0; k < kColumns; ++k) std::memcpy(out + 16 + 32 * k + 4 * r, rows[r] + 2 + 4 * k, 4);
    }
  }

  static void unpack(const uint8_t* in, uint8_t* const rows[8]) {
    for (int r = 0; r < 8; ++r) {
      std::memcpy(rows[r], in + 2 * r, 2);
      for (int k = 0; k < kColumns; ++k) std::memcpy(rows[r] + 2 + 4 * k, in + 16 + 32 * k + 4 * r, 4);
    }
  }
};

// Q8_0, 8 rows x 32 weights in 272 bytes (8 x 34), HalfAndColumnsx8<8>: byte 16 + 32k + 4r + i is q[4k + i] of row r.
// Signed weights: |q| as unsigned bytes against x carrying q's sign; a vpmaddubsw lane (2 products, at most 2 * 128 *
// 127 = 32512) goes to int32 at once. With VNNI, q + 128 (0..255, the sign bit flipped) against x in `vpdpbusd`, then
// - 128 * (sum of x): the same integers without a sign transfer per product (a lane's 4 products at most 4 * 255 *
// 127, 8 of them 1,036,320).
struct Q80x8 : HalfAndColumnsx8<8> {
  template <int G>
  static void dot(const uint8_t* block, const TokenSuper* x, __m256* acc) {
    if constexpr (kVnni) return vnni_dot<G>(block, x, acc);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i sums[G];
    const auto products = [&](int k, bool start) __attribute__((always_inline)) {
      const __m256i w = load256(block + 16 + 32 * k);
      const __m256i magnitude = _mm256_sign_epi8(w, w);
      for (int g = 0; g < G; ++g) {  // the first products start the sums (as in Q4Kx8::dot)
        const __m256i xs = _mm256_sign_epi8(broadcast4(x[g].q + 4 * k), w);
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, xs), ones);
        sums[g] = start ? p : add_i32_into(sums[g], p);
      }
    };
    products(0, true);
    for (int k = 1; k < 8; ++k) products(k, false);
    finish<G>(block, x, sums, acc);
  }

  template <int G>
  static void vnni_dot(const uint8_t* block, const TokenSuper* x, __m256* acc) {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    __m256i sums[G];
    for (int g = 0; g < G; ++g) sums[g] = _mm256_set1_epi32(-128 * x[g].sums32[0]);
    for (int k = 0; k < 8; ++k) {
      const __m256i offset = _mm256_xor_si256(load256(block + 16 + 32 * k), flip);  // q + 128 as unsigned bytes
      for (int g = 0; g < G; ++g) sums[g] = dot_u8s8(sums[g], offset, broadcast4(x[g].q + 4 * k));
    }
    finish<G>(block, x, sums, acc);
  }

  template <int G>
  static void finish(const uint8_t* block, const TokenSuper* x, const __m256i* sums, __m256* acc) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
    for (int g = 0; g < G; ++g)
      acc[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[g]), _mm256_mul_ps(d, _mm256_set1_ps(x[g].scales[0])), acc[g]);
  }
};

// The 32-weight groups of unsigned weights, Q5_0's (0..31) and Q4_0's (0..15), both d * (q - kOffset):
// `weights(k, w0, w1)` (k a std::integral_constant 0..3) gives the vectors of weights 4k.. and 16 + 4k.. of the 8 rows
// (4 each), which meet x in vpmaddubsw; int16 lanes add the 4 vectors' (with VNNI: vpdpbusd into int32), then
// - kOffset * (sum of x) and the float part.
template <int G, int kOffset, typename Weights>
inline void unsigned_nibbles_dot(const uint8_t* block, const TokenSuper* x, __m256* acc, const Weights& weights) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i first[G], second[G];  // weights 0-15 and 16-31
  if constexpr (kVnni)
    for (int g = 0; g < G; ++g) first[g] = second[g] = _mm256_setzero_si256();
  unrolled<4>([&](auto chunk) __attribute__((always_inline)) {
    constexpr int k = chunk;
    __m256i w0, w1;
    weights(chunk, w0, w1);
    for (int g = 0; g < G; ++g) {
      if constexpr (kVnni) {  // int32 lanes at once
        first[g] = dot_u8s8(first[g], w0, broadcast4(x[g].q + 4 * k));
        second[g] = dot_u8s8(second[g], w1, broadcast4(x[g].q + 16 + 4 * k));
      } else {  // the first products start the sums (as in Q4Kx8::dot)
        const __m256i p0 = _mm256_maddubs_epi16(w0, broadcast4(x[g].q + 4 * k));
        const __m256i p1 = _mm256_maddubs_epi16(w1, broadcast4(x[g].q + 16 + 4 * k));
        first[g] = k == 0 ? p0 : add_i16_into(first[g], p0);
        second[g] = k == 0 ? p1 : add_i16_into(second[g], p1);
      }
    }
  });
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
  for (int g = 0; g < G; ++g) {
    const __m256i sums = kVnni ? _mm256_add_epi32(first[g], second[g])
                               : _mm256_add_epi32(_mm256_madd_epi16(first[g], ones),
                                                  _mm256_madd_epi16(second[g], ones));
    const __m256i total = _mm256_sub_epi32(sums, _mm256_set1_epi32(kOffset * x[g].sums32[0]));
    acc[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, _mm256_set1_ps(x[g].scales[0])), acc[g]);
  }
}

// Q5_0, 8 rows x 32 weights in 176 bytes (8 x 22): [0, 16) d of rows 0-7 (halves), [16, 48) the fifth bits,
// [48, 176) byte 48 + 32k + 4r + i: qs[4k + i] of row r (low nibble: weight 4k + i, high nibble: weight 16 + 4k + i).
// The fifth bits as bit planes (kBitPlanes): byte 16 + 4r + i, bit 4h + k, is bit 16h + 4k + i of row r's qh, the
// fifth bit of the weight in byte 4r + i of vector k's nibble h, so one 16-bit shift and a mask put a vector's bits
// in place (two instructions against a shuffle, two masks and a compare). The amx build keeps the rows' 32-bit qh
// (row r at 16 + 4r), which its tile unpacking reads. Unsigned q in 0..31 against x, then - 16 * (sum of x): int16
// lanes add 4 vpmaddubsw lanes of 2 products, at most 4 * 2 * 31 * 127 = 31496 (with VNNI: vpdpbusd into int32).
struct Q50x8 {
  static constexpr int64_t kWeights = 32, kBytes = 176, kActBlock = 32;
  static constexpr int kGroupsTokens = kGroup;
  static constexpr bool kBitPlanes = !kAmxBuild;

  static void pack(const uint8_t* const rows[8], uint8_t* out) {
    for (int r = 0; r < 8; ++r) {
      std::memcpy(out + 2 * r, rows[r], 2);
      if constexpr (kBitPlanes) {
        uint32_t qh;
        std::memcpy(&qh, rows[r] + 2, 4);
        for (int i = 0; i < 4; ++i) {
          uint8_t planes = 0;
          for (int h = 0; h < 2; ++h)
            for (int k = 0; k < 4; ++k) planes |= ((qh >> (16 * h + 4 * k + i)) & 1u) << (4 * h + k);
          out[16 + 4 * r + i] = planes;
        }
      } else {
        std::memcpy(out + 16 + 4 * r, rows[r] + 2, 4);
      }
      for (int k = 0; k < 4; ++k) std::memcpy(out + 48 + 32 * k + 4 * r, rows[r] + 6 + 4 * k, 4);
    }
  }

  static void unpack(const uint8_t* in, uint8_t* const rows[8]) {
    for (int r = 0; r < 8; ++r) {
      std::memcpy(rows[r], in + 2 * r, 2);
      if constexpr (kBitPlanes) {
        uint32_t qh = 0;
        for (int i = 0; i < 4; ++i)
          for (int h = 0; h < 2; ++h)
            for (int k = 0; k < 4; ++k) qh |= ((in[16 + 4 * r + i] >> (4 * h + k)) & 1u) << (16 * h + 4 * k + i);
        std::memcpy(rows[r] + 2, &qh, 4);
      } else {
        std::memcpy(rows[r] + 2, in + 16 + 4 * r, 4);
      }
      for (int k = 0; k < 4; ++k) std::memcpy(rows[r] + 6 + 4 * k, in + 48 + 32 * k + 4 * r, 4);
    }
  }

  // 0x10 in byte 4r + i where the fifth bit of that byte's weight in vector k's nibble h is set
  static __m256i fifth(__m256i qh, int k, int h) {
    if constexpr (kBitPlanes) {
      const int plane = 4 * h + k;  // to bit 4 of each byte: a 16-bit shift moves a byte's bits across its
      // neighbour's only outside bit 4, which the mask keeps
      const __m256i moved = plane < 4 ? _mm256_slli_epi16(qh, 4 - plane)
                            : plane > 4 ? _mm256_srli_epi16(qh, plane - 4) : qh;
      return _mm256_and_si256(moved, _mm256_set1_epi8(0x10));
    } else {
      return fifth_bits(qh, 16 * h + 4 * k);
    }
  }

  // 0x10 in byte 4r + i where bit `first + i` of row r's qh is set (first = 4k or 16 + 4k: byte first / 8 of qh,
  // bits 4(k % 2) ..)
  static __m256i fifth_bits(__m256i qh, int first) {
    const int byte = first / 8, shift = first % 8;
    const int m = byte * 0x01010101;  // in each 32-bit lane, its own qh byte `byte` copied to all 4 bytes
    const __m256i spread = _mm256_shuffle_epi8(
        qh, _mm256_setr_epi32(m, m + 0x04040404, m + 0x08080808, m + 0x0C0C0C0C, m, m + 0x04040404, m + 0x08080808,
                              m + 0x0C0C0C0C));
    const __m256i bits = _mm256_set1_epi32(static_cast<int>(0x08040201u << shift));
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bits), bits), _mm256_set1_epi8(0x10));
  }

  template <int G>
  static void dot(const uint8_t* block, const TokenSuper* x, __m256* acc) {
    const __m256i low = _mm256_set1_epi8(0x0F), qh = load256(block + 16);
    const auto weights = [&](auto chunk, __m256i& w0, __m256i& w1) __attribute__((always_inline)) {
      constexpr int k = chunk;  // a constant: the bit planes' shifts
      const __m256i bytes = load256(block + 48 + 32 * k);
      w0 = _mm256_or_si256(_mm256_and_si256(bytes, low), fifth(qh, k, 0));
      w1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), low), fifth(qh, k, 1));
    };
    unsigned_nibbles_dot<G, 16>(block, x, acc, weights);
  }
};

// Q4_0, 8 rows x 32 weights in 144 bytes, HalfAndColumnsx8<4> (low nibble of byte 4k + i: weight 4k + i, high: 16 + 4k
// + i). Q50x8 without the fifth bits: unsigned q in 0..15 against x, minus 8 * (sum of x): int16 lanes add 4 vpmaddubsw
// lanes of 2 products, at most 4 * 2 * 15 * 127 = 15240 (with VNNI: vpdpbusd into int32). The integers of Q4_0 read as
// Q5_0 (q + 8 against 16), so the same bits as when Q4_0 files were rewritten at load.
struct Q40x8 : HalfAndColumnsx8<4> {
  template <int G>
  static void dot(const uint8_t* block, const TokenSuper* x, __m256* acc) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const auto weights = [&](auto chunk, __m256i& w0, __m256i& w1) __attribute__((always_inline)) {
      const __m256i bytes = load256(block + 16 + 32 * chunk);
      w0 = _mm256_and_si256(bytes, low);
      w1 = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
    };
    unsigned_nibbles_dot<G, 8>(block, x, acc, weights);
  }
};

// IQ4_NL, 8 rows x 32 weights in 144 bytes, as Q4_0's. The looked-up values are signed: as Q80x8's, |value| against x
// carrying its sign, each vpmaddubsw lane (at most 2 * 127 * 127) to int32 at once; with VNNI, value + 128 against x in
// `vpdpbusd` and the sum started at -128 * (sum of x), as Q80x8's (no tile path of its own yet).
struct IQ4NLx8 : HalfAndColumnsx8<4> {
  template <int G>
  static void dot(const uint8_t* block, const TokenSuper* x, __m256* acc) {
    if constexpr (kVnni) return vnni_dot<G>(block, x, acc);
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256i sums[G];
    const auto products = [&](int k, bool start) __attribute__((always_inline)) {
      const __m256i bytes = load256(block + 16 + 32 * k);
      const __m256i w0 = iq4_values(_mm256_and_si256(bytes, low));
      const __m256i w1 = iq4_values(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), low));
      const __m256i m0 = _mm256_sign_epi8(w0, w0), m1 = _mm256_sign_epi8(w1, w1);
      for (int g = 0; g < G; ++g) {
        const __m256i p0 = _mm256_maddubs_epi16(m0, _mm256_sign_epi8(broadcast4(x[g].q + 4 * k), w0));
        const __m256i p1 = _mm256_maddubs_epi16(m1, _mm256_sign_epi8(broadcast4(x[g].q + 16 + 4 * k), w1));
        const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(p0, ones), _mm256_madd_epi16(p1, ones));
        sums[g] = start ? p : add_i32_into(sums[g], p);
      }
    };
    products(0, true);
    for (int k = 1; k < 4; ++k) products(k, false);
    Q80x8::finish<G>(block, x, sums, acc);
  }

  template <int G>
  static void vnni_dot(const uint8_t* block, const TokenSuper* x, __m256* acc) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i sums[G];
    for (int g = 0; g < G; ++g) sums[g] = _mm256_set1_epi32(-128 * x[g].sums32[0]);
    for (int k = 0; k < 4; ++k) {
      const __m256i bytes = load256(block + 16 + 32 * k);
      const __m256i w0 = iq4_values_plus_128(_mm256_and_si256(bytes, low));
      const __m256i w1 = iq4_values_plus_128(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), low));
      for (int g = 0; g < G; ++g) {
        sums[g] = dot_u8s8(sums[g], w0, broadcast4(x[g].q + 4 * k));
        sums[g] = dot_u8s8(sums[g], w1, broadcast4(x[g].q + 16 + 4 * k));
      }
    }
    Q80x8::finish<G>(block, x, sums, acc);
  }
};

// IQ4_XS, 8 rows x 256 weights in 1104 bytes: [0, 16) d of rows 0-7 (halves), [16, 80) byte 16 + 8c + r: the scale
// of sub-block c of row r (ls - 32, int8), [80, 1104) byte 80 + 128c + 32k + 4r + i: qs[16c + 4k + i] of row r (low
// nibble: weight 32c + 4k + i, high nibble: weight 32c + 16 + 4k + i). Per vector and token a vpmaddubsw of the
// signed values (as IQ4NLx8's) and a vpmaddwd by the rows' sub-block scales (int16 pairs 2r, 2r + 1 both row r's):
// row r's int32 lane sums 256 products times scales, at most 256 * 127 * 127 * 32. With VNNI, a sub-block's values +
// 128 against x in `vpdpbusd` from -128 * (its sum of x), then times its scale (`vpmulld`): the same integers.
struct IQ4XSx8 {
  static constexpr int64_t kWeights = 256, kBytes = 1104, kActBlock = 256;
  static constexpr int kGroupsTokens = kGroup;

  static void pack(const uint8_t* const rows[8], uint8_t* out) {
    for (int r = 0; r < 8; ++r) {
      std::memcpy(out + 2 * r, rows[r], 2);
      for (int c = 0; c < 8; ++c) {
        out[16 + 8 * c + r] = static_cast<uint8_t>(iq4_xs_scale(rows[r], c));
        for (int k = 0; k < 4; ++k) std::memcpy(out + 80 + 128 * c + 32 * k + 4 * r, rows[r] + 8 + 16 * c + 4 * k, 4);
      }
    }
  }

  static void unpack(const uint8_t* in, uint8_t* const rows[8]) {
    for (int r = 0; r < 8; ++r) {
      uint8_t* b = rows[r];
      std::memcpy(b, in + 2 * r, 2);
      uint16_t high = 0;
      for (int c = 0; c < 8; ++c) {  // the inverse of iq4_xs_scale
        const int six = static_cast<int8_t>(in[16 + 8 * c + r]) + 32;
        high = static_cast<uint16_t>(high | ((six >> 4) << (2 * c)));
        if (c % 2 == 0) b[4 + c / 2] = static_cast<uint8_t>(six & 0x0F);
        else b[4 + c / 2] = static_cast<uint8_t>(b[4 + c / 2] | ((six & 0x0F) << 4));
        for (int k = 0; k < 4; ++k) std::memcpy(b + 8 + 16 * c + 4 * k, in + 80 + 128 * c + 32 * k + 4 * r, 4);
      }
      b[2] = static_cast<uint8_t>(high & 0xFF), b[3] = static_cast<uint8_t>(high >> 8);
    }
  }

  template <int G>
  static void dot(const uint8_t* block, const TokenSuper* x, __m256* acc) {
    if constexpr (kVnni) return vnni_dot<G>(block, x, acc);
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i sums[G];
    for (int c = 0; c < 8; ++c) {
      const __m256i scale = row_pairs_s8(block + 16 + 8 * c);
      for (int k = 0; k < 4; ++k) {
        const __m256i bytes = load256(block + 80 + 128 * c + 32 * k);
        const __m256i w0 = iq4_values(_mm256_and_si256(bytes, low));
        const __m256i w1 = iq4_values(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), low));
        const __m256i m0 = _mm256_sign_epi8(w0, w0), m1 = _mm256_sign_epi8(w1, w1);
        for (int g = 0; g < G; ++g) {
          const __m256i p0 = _mm256_maddubs_epi16(m0, _mm256_sign_epi8(broadcast4(x[g].q + 32 * c + 4 * k), w0));
          const __m256i p1 = _mm256_maddubs_epi16(m1, _mm256_sign_epi8(broadcast4(x[g].q + 32 * c + 16 + 4 * k), w1));
          const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(p0, scale), _mm256_madd_epi16(p1, scale));
          sums[g] = c == 0 && k == 0 ? p : add_i32_into(sums[g], p);  // the first products start the sums
        }
      }
    }
    Q80x8::finish<G>(block, x, sums, acc);
  }

  template <int G>
  static void vnni_dot(const uint8_t* block, const TokenSuper* x, __m256* acc) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i sums[G];
    for (int g = 0; g < G; ++g) sums[g] = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      __m256i part[G];  // sub-block c's sums, lane r row r
      for (int g = 0; g < G; ++g) part[g] = _mm256_set1_epi32(-128 * x[g].sums32[c]);
      for (int k = 0; k < 4; ++k) {
        const __m256i bytes = load256(block + 80 + 128 * c + 32 * k);
        const __m256i w0 = iq4_values_plus_128(_mm256_and_si256(bytes, low));
        const __m256i w1 = iq4_values_plus_128(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), low));
        for (int g = 0; g < G; ++g) {
          part[g] = dot_u8s8(part[g], w0, broadcast4(x[g].q + 32 * c + 4 * k));
          part[g] = dot_u8s8(part[g], w1, broadcast4(x[g].q + 32 * c + 16 + 4 * k));
        }
      }
      const __m256i scale = row_s8(block + 16 + 8 * c);
      for (int g = 0; g < G; ++g) sums[g] = _mm256_add_epi32(sums[g], _mm256_mullo_epi32(part[g], scale));
    }
    Q80x8::finish<G>(block, x, sums, acc);
  }
};

template <typename F, int G, typename Tokens>
inline void dot_super(const uint8_t* block, const Tokens& x, __m256* acc) {
  F::template dot<G>(block, x, acc);
}

// n (at most G) tokens in one call; Tokens: a TokenSuper array or a TokenGroup
template <typename F, int G, typename Tokens>
inline void dot_fewer(int64_t n, const uint8_t* block, const Tokens& x, __m256* acc) {
  if constexpr (G > 0) {
    if (n == G) return dot_super<F, G>(block, x, acc);
    dot_fewer<F, G - 1>(n, block, x, acc);
  }
}

// kBlocks consecutive blocks of a 32-weight format as one unit of the pass loop: the loop's work per unit (the
// tokens' pointers, the prefetch) is paid once per 128 weights rather than per 32, where it had cost as much as
// the block's own products (per (8 rows, block, token), one thread, Zen 3, 2026-12-03: Q5_0 55 -> 38 cycles at one
// token a pass, 36 -> 22 at four; Q8_0 48 -> 30 and 34 -> 23). The 0.5B draft's passes, in one process with a
// switch: 2 tokens 27.2 -> 24.9 ms, 4 tokens 39.4 -> 31.8, 8 tokens 61.9 -> 51.2; but a one-token step 22.3 ->
// 23.1 (bound by memory, not by the loop), so one-token passes keep the block-by-block loop. The blocks add to a
// token's accumulators in the same order as one by one, so the sums are the same either way.
template <typename F, int kBlocks>
struct Consecutive {
  static constexpr int64_t kWeights = kBlocks * F::kWeights, kBytes = kBlocks * F::kBytes, kActBlock = F::kActBlock;
  static constexpr int kGroupsTokens = F::kGroupsTokens;

  template <int G>
  static void dot(const uint8_t* block, const TokenSuper* x, __m256* acc) {
    for (int i = 0; i < kBlocks; ++i) {
      TokenSuper part[G];
      for (int g = 0; g < G; ++g)
        part[g] = {x[g].q + i * F::kWeights, x[g].sums16 + i * F::kWeights / 16, x[g].sums32 + i * F::kWeights / 32,
                   x[g].scales + i};
      F::template dot<G>(block + i * F::kBytes, part, acc);
    }
  }
};

// A pass over more than kTilesOuterTokens tokens (prefill) goes in tiles of tokens whose int8 activations fit
// kTileActivationBytes (64 tokens at K = 1536, 20 at 8960; a multiple of kGroup), and a tile meets every group of
// the thread's rows before the next one: its activations stay in L2 and the weights are read once per tile, which
// a compute-bound pass affords. A shorter pass (a step, a verify pass, a server's batch of them: bound by reading
// the weights) lets each row group meet all its tokens, kTokenTile at a time, and reads the weights once.
// Measured on the 1.5B target (Zen 3, 2 threads, 2026-12-03): prefill of 1500 tokens 51 -> 73 tok/s, of 426
// tokens 76 -> 81 (192 KiB against row groups meeting all tokens; 384 and 768 KiB: 67 and 68 at 1500).
// Which tokens share a tile changes no token's arithmetic.
constexpr int64_t kTilesOuterTokens = 2 * kTokenTile;
constexpr int64_t kTileActivationBytes = 192 * 1024;
static_assert(kTokenTile % kGroup == 0, "tiles hold whole groups of tokens");
inline int64_t tile_tokens_for(int64_t K) {  // at most kTokenTile: the accumulators a tile keeps
  return std::max<int64_t>(kGroup, std::min<int64_t>(kTokenTile, kTileActivationBytes / K / kGroup * kGroup));
}

// One token over a small-block format (Q8_0, Q5_0: 32 weights a block): a row group's blocks in a row, the token's
// activations stepping along with them, without the token tiles' bookkeeping per block (the same `dot<1>`, so the
// same bits). The 0.5B draft's one-token passes, Zen 3, 2026-12-06, one process, a switch per call, 40 alternations,
// twice: 0.96-0.97x; the 1.5B's (Q4_K, Q6_K: 256-weight blocks) 0.97-1.03x, left as they were.
template <typename F>
void one_token_small_blocks(const uint8_t* weight, int64_t groups, int64_t blocks, const QuantizedRows& x,
                            const float* bias, float* out) {
  const int64_t group_bytes = blocks * F::kBytes;
  parallel_chunks(groups, group_bytes, [&](ChunkQueue& queue) {
    for (int64_t begin, end; queue.take(begin, end);)
      for (int64_t group = begin; group < end; ++group) {
        const uint8_t* block = weight + group * group_bytes;
        TokenSuper token = {x.row(0), x.sums(0), x.sums32(0), x.d.data()};
        __m256 acc = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; ++b, block += F::kBytes) {
          prefetch_block_ahead<F>(block);
          F::template dot<1>(block, &token, &acc);
          token.q += F::kWeights, token.sums16 += F::kWeights / 16, token.sums32 += F::kWeights / 32;
          token.scales += F::kWeights / F::kActBlock;
        }
        const __m256 bias8 = bias ? _mm256_loadu_ps(bias + group * kRowGroup) : _mm256_setzero_ps();
        _mm256_storeu_ps(out + group * kRowGroup, bias ? _mm256_add_ps(acc, bias8) : acc);
      }
  });
}

// One matrix of the products over one input that a pass runs together (`qlinear_x8_shared`): its interleaved row
// groups, its rows, its bias (or null) and its output [T, N]
struct ProductPart {
  const uint8_t* weight;
  int64_t N;
  const float* bias;
  float* out;
};

// The products of `parts` (one format, K wide each) over the same activations, their row groups one after another
// in one parallel region: one fork and one join for all, and no thread idles at one matrix's end while another
// waits to start. A group's arithmetic is that of the matrix alone, so the same bits.
template <typename F>
void qlinear_x8_impl(const ProductPart* parts, int n_parts, int64_t K, const QuantizedRows& x) {
  const int64_t blocks = K / F::kWeights, group_bytes = blocks * F::kBytes, T = x.T;
  const bool tiles_outer = T > kTilesOuterTokens;
  const int64_t tile_tokens = tiles_outer ? tile_tokens_for(K) : kTokenTile;
  const int64_t span = tiles_outer ? tile_tokens : T;  // tokens that meet each row group in turn
  // Threads take the (span, group) units in chunks (`parallel_chunks`); a group's arithmetic is the same whoever
  // computes it.
  int64_t groups = 0;  // of all parts
  for (int p = 0; p < n_parts; ++p) groups += parts[p].N / kRowGroup;
  const int64_t spans = T ? (T + span - 1) / span : 0;  // no tokens: nothing to do
  if constexpr (F::kWeights == 32) {
    if (T == 1) {
      for (int p = 0; p < n_parts; ++p)
        one_token_small_blocks<F>(parts[p].weight, parts[p].N / kRowGroup, blocks, x, parts[p].bias, parts[p].out);
      return;
    }
  }
  static_assert(!spreads_prefetch<F> || block_major<F>, "the loops that spread their prefetch take TokenGroups");
  // the activations block by block, for a format that reads them so (quantized in that order: qlinear_x8)
  TORCH_CHECK(block_major<F> ? x.by_block || x.T <= 1 : !x.by_block, "rows quantized in the wrong order for this loop");
  const BlockMajorRows by_block(x);
  parallel_chunks(spans * groups, group_bytes, [&](ChunkQueue& queue) {
    __m256 acc[kTokenTile];
    TokenSuper tokens[kTokenTile];
    for (int64_t begin, end; queue.take(begin, end);)
      for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t span_start = unit / groups * span;
        const int64_t span_end = std::min(T, span_start + span);
        int64_t group = unit % groups;  // of its part's matrix
        const ProductPart* part = parts;
        while (group >= part->N / kRowGroup) group -= part->N / kRowGroup, ++part;
        const uint8_t* columns = part->weight + group * group_bytes;
        const float* bias = part->bias;
        const int64_t N = part->N;
        for (int64_t t0 = span_start; t0 < span_end; t0 += tile_tokens) {
          const int64_t tile = std::min(tile_tokens, span_end - t0);
          for (int64_t t = 0; t < tile; ++t) {
            acc[t] = _mm256_setzero_ps();
            const int64_t row = t0 + t;
            if constexpr (!block_major<F>)
              tokens[t] = {x.row(row), x.sums(row), x.sums32(row), x.d.data() + row * x.blocks};
          }
          // the other formats' token views step from block to block: recomputed per block (a multiply-add per field
          // and token, which GCC vectorizes into 512-bit vpmullq), they took 5-9 % of a pass of 8 tokens when Q4_K
          // and Q6_K still read them (Zen 4, one thread, a cached 1536 x 1536 matrix, 2026-12-07: Q4_K 15.0-15.7 ->
          // 14.5-14.7 ns per (8 rows, 256 weights, token), Q6_K 22.3-22.7 -> 20.3-20.6)
          for (int64_t b = 0; b < blocks; ++b) {
            const uint8_t* block = columns + b * F::kBytes;
            if (!spreads_prefetch<F> || tile == 1) prefetch_block_ahead<F>(block);
            if constexpr (!block_major<F>) {
              if (b)
                for (int64_t t = 0; t < tile; ++t) {
                  tokens[t].q += F::kWeights, tokens[t].sums16 += F::kWeights / 16;
                  tokens[t].sums32 += F::kWeights / 32, tokens[t].scales += F::kWeights / F::kActBlock;
                }
            }
            constexpr int G = F::kGroupsTokens;
            // the last group takes a tail of up to kTailJoins tokens (where a format sets it)
            constexpr int kJoins = [] {
              if constexpr (requires { F::kTailJoins; }) return F::kTailJoins;
              return 0;
            }();
            const int64_t tail = tile % G;
            const int64_t grouped = tile > G && tail && tail <= kJoins ? tile - G - tail : tile - tail;
            int64_t t = 0;
            if constexpr (block_major<F>) {
              for (; t < grouped; t += G) {  // the first group asks for the lines ahead, the others not
                if (t == 0) F::template dot<G, true>(block, by_block.group(b, t0), acc);
                else F::template dot<G, false>(block, by_block.group(b, t0 + t), acc + t);
              }
              dot_fewer<F, kJoins ? G + kJoins : G - 1>(tile - t, block, by_block.group(b, t0 + t), acc + t);
            } else {
              for (; t < grouped; t += G) dot_super<F, G>(block, tokens + t, acc + t);
              dot_fewer<F, kJoins ? G + kJoins : G - 1>(tile - t, block, tokens + t, acc + t);
            }
          }
          const __m256 bias8 = bias ? _mm256_loadu_ps(bias + group * kRowGroup) : _mm256_setzero_ps();
          for (int64_t t = 0; t < tile; ++t)
            _mm256_storeu_ps(part->out + (t0 + t) * N + group * kRowGroup,
                             bias ? _mm256_add_ps(acc[t], bias8) : acc[t]);
        }
      }
  });
}

// One matrix's product: x [T, K] quantized, weight [N / 8, ...] interleaved -> out [T, N] (+ bias)
template <typename F>
void qlinear_x8_impl(const uint8_t* weight, int64_t N, int64_t K, const QuantizedRows& x, const float* bias,
                     float* out) {
  const ProductPart part{weight, N, bias, out};
  qlinear_x8_impl<F>(&part, 1, K, x);
}

// ------------------------------------------------------------------------------------------- AMX tiles
// Where the CPU has AMX-INT8 (Intel Xeon since Sapphire Rapids), passes of several tokens over Q4_K, Q6_K, Q8_0 and
// Q5_0 take their integer sums from tile multiplies (`tdpbsud`/`tdpbssd`: signed int8 A times unsigned or signed B,
// summed in int32 C). A tile multiply costs about the same whatever its shape (Xeon model 207, 2026-12-05: 15 ns alone,
// 34-39 ns with its loads and store, for 1 to 16 rows and 16 to 64 bytes of K), so each one is made as full as
// the format allows, over 16 weight rows (two interleaved groups of 8) and K = 64 weights:
// - Q4_K (passes of 5 to 31 tokens): A's rows are (token, sub-block) pairs: a token's 64 activations with the
//   other sub-block's zeroed ("expanded" once per call, shared by every row pair). C's row (t, j) then holds token
//   t's sums over sub-block j of the 16 weight rows, which AVX-512 multiplies by the rows' sub-block scales exactly
//   as the VNNI path multiplies its `vpdpbusd` sums.
// - Q6_K: its 16-weight sub-blocks would take 4 A rows per token, so the scales go into B instead: a block's
//   weights are unpacked once per pass as v = scale * (q - 32) (int16, |v| <= 4096) split into a signed high byte
//   and an unsigned low byte, v = 256 hi + lo, two B tiles; A's rows are 16 tokens' activations (copied once per
//   call into tiles of 1 KiB), and C_hi, C_lo sum the block's 4 chunks. 256 C_hi + C_lo is the block's integer
//   total of the VNNI path. Q4_K passes of 32 or more tokens take the same layout (v = scale * q, 0..945).
// - Q8_0, Q5_0 (rows of a multiple of 64 weights): two blocks of 32 weights are one B tile, A's rows (token,
//   block) pairs as Q4_K's; C's rows are the VNNI path's per-block sums (`AmxSmallBlocks`).
// Either way the same integers, then the float operations of the VNNI path's `finish` on 16 lanes (both row groups
// of a pair) in the same order: a token's result is the same bits with or without tiles, alone or with others.
// One-token steps keep the VNNI path.

// Whether this process may use the tiles: Linux hands out their 8 KiB of state on request (arch_prctl).
bool amx_granted() {
  if constexpr (!kAmxBuild) return false;
  static const bool granted = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return granted;
}

// Passes of fewer tokens keep the VNNI path. Measured 2026-12-05 (Xeon model 207, one process with the switch,
// alternated): a cached 8960 x 1536 Q4_K matrix, one thread, VNNI -> AMX ms: 2 tokens 0.46 -> 0.59, 4 0.74 -> 0.67,
// 8 1.64 -> 0.80, 16 2.87 -> 1.44; the 1.5B's whole pass after 64 tokens, 2 threads, 3 rounds: 4 tokens 79.2 ->
// 81.6, 5 88.8 -> 83.8, 6 106.1 -> 87.6, 8 134.8 -> 113.3, 16 231.6 -> 221.9. Q6_K's tiles cost about the same
// for 1 to 16 tokens (the unpacking into high and low bytes dominates): the 1.5B's 29 Q6_K matrices (the head, 14
// down and 14 v projections) in one process, each product alternated with the switch, 2 threads, VNNI -> AMX ms:
// 5 tokens 22.9 -> 28.8, 6 24.3 -> 28.5, 8 33.2 -> 29.8, 9 40.2 -> 34.2, 12 46.7 -> 30.6, 16 59.4 -> 34.3.
constexpr int64_t kAmxMinTokensQ4K = 5;
constexpr int64_t kAmxMinTokensQ6K = 8;
// Q8_0 and Q5_0 (the 0.5B draft's matrices): its Q5_0 and Q8_0 products in a row (the full head among them), 2
// threads, 6 rounds alternated with the switch, least ms, VNNI -> AMX (2026-12-06): 4 tokens 18.3 -> 18.7, 5 22.3 ->
// 20.6, 8 37.9 -> 21.7, 16 61.3 -> 29.5, 32 108.0 -> 46.9 (2 and 3 tokens 1.08x slower on the tiles).
constexpr int64_t kAmxMinTokensSmallBlocks = 5;
// Q4_K passes of 32 or more tokens (prefill; a full server batch) put the scales into B as Q6_K does: its unpacking
// costs more than it saves below that. The 1.5B's 168 Q4_K matrices, 2 threads, alternated in one process, ms
// (sub-block rows -> scales in B): 16 tokens 148.6 -> 148.4, 24 201 -> 206, 32 254 -> 190, 64 485 -> 394; its
// prefill of 426 tokens 111-121 -> 125-126 tok/s, of 64 tokens 122 -> 144.
constexpr int64_t kAmxScaledQ4KTokens = 32;
std::atomic<bool> amx_allowed{true};    // set_quant_amx: the VNNI path for every pass (A/B in one process, tests)

#if SPECDRAFT_AMX
// Every tile 16 rows of 64 bytes (A: 16 rows of 64 int8; B: 16 rows of K / 4, 4 consecutive weights of each of 16
// weight rows; C: 16 int32 per row of A).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) rows[t] = 16, colsb[t] = 64;
  }
};

inline __m512i join256(const uint8_t* first, const uint8_t* second) {  // 32 bytes of each, one vector
  return _mm512_inserti64x4(_mm512_castsi256_si512(load256(first)), load256(second), 1);
}
inline __m128i join64(const uint8_t* first, const uint8_t* second) {  // 8 bytes of each
  return _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(first)),
                            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(second)));
}

// The loops of a tile pass, any format: threads take pairs of row groups in chunks (`parallel_chunks`). A pass
// of up to kAmxSpanTokens tokens lets each pair meet all of them with one unpacking of each block; a longer one
// (prefill) goes in token tiles as the VNNI path's (tiles outermost), in whole A tiles of `Kernel::kTokensPerTile`
// tokens. `make_kernel()` builds a thread's kernel (its scratch), whose `block(block0, block1, b, t0, tile, acc)`
// adds block b of both row groups to tokens t0 .. t0 + tile - 1 (acc[t]: token t0 + t's 16 rows, the first
// group's in lanes 0-7).
// kAmxSpanTokens: 64 before 2026-12-06 (as the VNNI path's kTokenTile), which unpacked each block twice for a pass
// of 65-128 tokens; 256 measured on the 1.5B's prefill (Xeon model 207, 2 threads, one process with a switch, 10
// alternated rounds, median tok/s): 80 tokens 141.7 -> 148.3, 100 152.0 -> 176.2, 128 159.4 -> 173.6, 192 157.9 ->
// 167.8 (token tiles outermost before, from 129 tokens), 48 tokens alike; at 426 and 1500 tokens one unpacking per
// 256 or 512 tokens gained nothing over the token tiles (146.9 -> 149.4, 122.1 -> 117.2).
constexpr int64_t kAmxSpanTokens = 256;
template <typename Kernel, typename MakeKernel>
void amx_pass(const uint8_t* weight, int64_t N, int64_t K, int64_t T, const float* bias, float* out,
              MakeKernel make_kernel) {
  using F = typename Kernel::Format;
  constexpr int64_t kTokensPerTile = Kernel::kTokensPerTile;
  static_assert(kAmxSpanTokens % kTokensPerTile == 0 && kAmxSpanTokens >= kTokenTile, "whole A tiles");
  const int64_t blocks = K / F::kWeights, group_bytes = blocks * F::kBytes;
  const bool tiles_outer = T > kAmxSpanTokens;
  const int64_t tile_tokens =
      tiles_outer ? (tile_tokens_for(K) + kTokensPerTile - 1) / kTokensPerTile * kTokensPerTile : kAmxSpanTokens;
  const int64_t span = tiles_outer ? tile_tokens : T;
  const int64_t pairs = N / (2 * kRowGroup), spans = (T + span - 1) / span;
  parallel_chunks(spans * pairs, 2 * group_bytes, [&](ChunkQueue& queue) {
    Kernel kernel = make_kernel();
    __m512 acc[kAmxSpanTokens];  // 16 KiB
    const TileConfig config;
    _tile_loadconfig(&config);
    for (int64_t begin, end; queue.take(begin, end);)
      for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t span_start = unit / pairs * span, pair = unit % pairs;
        const int64_t span_end = std::min(T, span_start + span);
        const uint8_t* first = weight + 2 * pair * group_bytes;
        const uint8_t* second = first + group_bytes;
        for (int64_t t0 = span_start; t0 < span_end; t0 += tile_tokens) {
          const int64_t tile = std::min(tile_tokens, span_end - t0);
          for (int64_t t = 0; t < tile; ++t) acc[t] = _mm512_setzero_ps();
          for (int64_t b = 0; b < blocks; ++b) {
            const uint8_t* block0 = first + b * F::kBytes;
            const uint8_t* block1 = second + b * F::kBytes;
            for (int64_t at = 0; at < F::kBytes; at += 64) {
              _mm_prefetch(reinterpret_cast<const char*>(block0) + kPrefetchBytes + at, _MM_HINT_T0);
              _mm_prefetch(reinterpret_cast<const char*>(block1) + kPrefetchBytes + at, _MM_HINT_T0);
            }
            kernel.block(block0, block1, b, t0, tile, acc);
          }
          const int64_t first_row = 2 * pair * kRowGroup;
          const __m512 bias16 = bias ? _mm512_loadu_ps(bias + first_row) : _mm512_setzero_ps();
          for (int64_t t = 0; t < tile; ++t)
            _mm512_storeu_ps(out + (t0 + t) * N + first_row, bias ? _mm512_add_ps(acc[t], bias16) : acc[t]);
        }
      }
    _tile_release();
  });
}

// A token's view of block b for `finish`
inline TokenSuper token_at(const QuantizedRows& x, int64_t row, int64_t b, int64_t block_weights, int64_t act_block) {
  const int64_t at = block_weights * b;
  return {x.row(row) + at, x.sums(row) + at / 16, x.sums32(row) + at / 32,
          x.d.data() + row * x.blocks + at / act_block};
}

// Activations as A tiles of (token, 32-weight part) rows, for Q4_K (the parts its sub-blocks) and Q8_0/Q5_0 (its
// blocks): [token tile][K / 64][16 rows][64 bytes], row 2t + j of a tile holding token (tile's first) + t's 64
// activations of that K / 64 chunk with all but part j zeroed; rows past the last token are zero. Written into `out`
// (the calling thread's buffer: it only grows).
void expand_activations(const QuantizedRows& x, std::vector<int8_t>& out) {
  const int64_t chunks = x.K / 64, tiles = (x.T + 7) / 8;
  if (out.size() < static_cast<size_t>(tiles * chunks * 1024)) out.resize(tiles * chunks * 1024);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile)
      for (int64_t c = 0; c < chunks; ++c)
        for (int row = 0; row < 16; ++row) {
          const int64_t t = tile * 8 + row / 2;
          const __mmask64 part = 0xFFFFFFFFULL << (32 * (row % 2));
          const __m512i v = t < x.T ? _mm512_maskz_loadu_epi8(part, x.row(t) + 64 * c) : _mm512_setzero_si512();
          _mm512_storeu_si512(out.data() + ((tile * chunks + c) * 16 + row) * 64, v);
        }
  });
}

// The activations as A tiles of 16 tokens: [token tile][K / 64][16 rows][64 bytes], row t of a tile holding token
// (tile's first) + t's 64 activations of that K / 64 chunk; rows past the last token are zero. One tile's loads then
// read 1 KiB in a row, not 16 rows K bytes apart. Written into `out` (the calling thread's buffer: it only grows).
const int8_t* tiled_activations(const QuantizedRows& x, std::vector<int8_t>& out) {
  const int64_t chunks = x.K / 64, tiles = (x.T + 15) / 16;
  if (out.size() < static_cast<size_t>(tiles * chunks * 1024)) out.resize(tiles * chunks * 1024);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile)
      for (int row = 0; row < 16; ++row) {
        const int64_t t = tile * 16 + row;
        int8_t* to = out.data() + tile * chunks * 1024 + 64 * row;
        for (int64_t c = 0; c < chunks; ++c)
          _mm512_storeu_si512(to + 1024 * c, t < x.T ? _mm512_loadu_si512(x.row(t) + 64 * c) : _mm512_setzero_si512());
      }
  });
  return out.data();
}

inline __m256i join128(const uint8_t* first, const uint8_t* second) {  // 16 bytes of each
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(first))),
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(second)), 1);
}

inline __m512i dot_s16_x16(__m512i acc, __m512i a, __m512i b) {  // int16 pairs into int32 lanes, as dot_s16
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

// The formats' float tails (`Q4Kx8::finish`, the end of `Q6Kx8::finish`) for both row groups of a pair at once: 16
// lanes, lane r the pair's row r (the first group's rows 0-7). Each lane does the operations of the 8-lane code in
// the same order, so a token's result is the same bits; what depends only on the block (scales, mins) is read
// once per block instead of once per token.
struct Q4KFinish16 {
  __m512i min_pairs[4];  // int16 lanes (2r, 2r + 1): mins of sub-blocks 2p and 2p + 1 of row r
  __m512 d, dmin;
  Q4KFinish16(const uint8_t* block0, const uint8_t* block1) {
    for (int p = 0; p < 4; ++p)
      min_pairs[p] = _mm512_cvtepu8_epi16(join128(block0 + 96 + 16 * p, block1 + 96 + 16 * p));
    d = _mm512_cvtph_ps(join128(block0, block1));
    dmin = _mm512_cvtph_ps(join128(block0 + 16, block1 + 16));
  }
  // acc += d dx dots - dmin dx mins
  void add(const TokenSuper& x, __m512i dots, __m512& acc) const {
    __m512i mins = _mm512_setzero_si512();
    for (int p = 0; p < 4; ++p) {
      int32_t pair;
      std::memcpy(&pair, x.sums32 + 2 * p, 4);
      mins = dot_s16_x16(mins, min_pairs[p], _mm512_set1_epi32(pair));
    }
    const __m512 dx = _mm512_set1_ps(x.scales[0]);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(d, dx), acc);
    acc = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins), _mm512_mul_ps(dmin, dx), acc);
  }
};

struct Q6KFinish16 {
  __m512 d;
  Q6KFinish16(const uint8_t* block0, const uint8_t* block1) : d(_mm512_cvtph_ps(join128(block0, block1))) {}
  // acc += d dx totals
  void add(const TokenSuper& x, __m512i totals, __m512& acc) const {
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(totals), _mm512_mul_ps(d, _mm512_set1_ps(x.scales[0])), acc);
  }
};

// One chunk of 64 weights for 16 rows of A: A tile `a` from `activations`, B tile `b` from `weights`, C tile `c`
// stored at `sums` ([row of A][16 weight rows] int32). Tiles are named by literal numbers (GCC's tile intrinsics
// paste them into the instruction text); callers take turns over them so that a chunk's loads and multiply need
// not wait for the previous chunk's store.
#define SPECDRAFT_AMX_CHUNK(a, b, c, activations, weights, sums) \
  do {                                                           \
    _tile_loadd(a, activations, 64);                             \
    _tile_loadd(b, weights, 64);                                 \
    _tile_zero(c);                                               \
    _tile_dpbsud(c, a, b);                                       \
    _tile_stored(c, sums, 64);                                   \
  } while (0)

// Q4_K: B tiles of a block (both groups): sub-block s's 8 rows of 64 bytes at 512 s, byte 4r + i of its row k =
// weight 32 (s % 2) + 4k + i of chunk s / 2, weight row r (rows 0-7 from the first group, 8-15 from the second).
struct AmxQ4K {
  using Format = Q4Kx8;
  static constexpr int64_t kTokensPerTile = 8;  // A rows: (token, sub-block) pairs
  const QuantizedRows& x;
  const int8_t* expanded;  // expand_activations
  alignas(64) uint8_t tiles[4 * 1024];   // B tiles of a block: 4 chunks of 16 rows x 64 bytes
  alignas(64) int32_t sums[4][16][16];  // C tiles: [chunk][row of A][weight row]

  static void unpack(const uint8_t* first, const uint8_t* second, uint8_t* out) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < 4; ++j)
      for (int k = 0; k < 8; ++k) {  // weights 64j + 32s + 4k + i: nibble s of byte 256j + 32k + 4r + i
        const __m512i bytes = join256(first + 160 + 256 * j + 32 * k, second + 160 + 256 * j + 32 * k);
        _mm512_store_si512(out + (2 * j) * 512 + 64 * k, _mm512_and_si512(bytes, low));
        _mm512_store_si512(out + (2 * j + 1) * 512 + 64 * k, _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low));
      }
  }

  void block(const uint8_t* block0, const uint8_t* block1, int64_t b, int64_t t0, int64_t tile, __m512* acc) {
    unpack(block0, block1, tiles);
    const Q4KFinish16 finish(block0, block1);
    __m512i scale[8];  // sub-block s's scales of the 16 rows as int32
    for (int s = 0; s < 8; ++s) scale[s] = _mm512_cvtepu8_epi32(join64(block0 + 32 + 8 * s, block1 + 32 + 8 * s));
    for (int64_t m0 = 0; m0 < tile; m0 += kTokensPerTile) {
      const int8_t* a = expanded + ((t0 + m0) / kTokensPerTile * (x.K / 64) + 4 * b) * 1024;
      SPECDRAFT_AMX_CHUNK(0, 2, 4, a, tiles, sums[0][0]);
      SPECDRAFT_AMX_CHUNK(1, 3, 5, a + 1024, tiles + 1024, sums[1][0]);
      SPECDRAFT_AMX_CHUNK(0, 2, 6, a + 2048, tiles + 2048, sums[2][0]);
      SPECDRAFT_AMX_CHUNK(1, 3, 7, a + 3072, tiles + 3072, sums[3][0]);
      const int64_t m = std::min<int64_t>(kTokensPerTile, tile - m0);
      for (int64_t i = 0; i < m; ++i) {
        const int64_t t = m0 + i;
        __m512i dots = _mm512_setzero_si512();
        for (int s = 0; s < 8; ++s)  // sub-block s: chunk s / 2, row 2i + s % 2 of A
          dots = _mm512_add_epi32(dots, _mm512_mullo_epi32(_mm512_load_si512(sums[s / 2][2 * i + s % 2]), scale[s]));
        finish.add(token_at(x, t0 + t, b, Format::kWeights, Format::kActBlock), dots, acc[t]);
      }
    }
  }
};
#undef SPECDRAFT_AMX_CHUNK

// A chunk with the scales in B: 64 weights of 16 tokens' activations (A tile `a`, a 1 KiB tile of
// tiled_activations) times the high and the low bytes of the weights (B tiles `bh`, `bl`), added to C tiles 5
// (high: `high_op`, signed or unsigned B) and 4 (low).
#define SPECDRAFT_AMX_SCALED_CHUNK(high_op, a, bh, bl, activations, high, low) \
  do {                                                                        \
    _tile_loadd(a, activations, 64);                                          \
    _tile_loadd(bh, high, 64);                                                \
    _tile_loadd(bl, low, 64);                                                 \
    high_op(5, a, bh);                                                        \
    _tile_dpbsud(4, a, bl);                                                   \
  } while (0)
#define SPECDRAFT_AMX_SCALED_BLOCK(high_op, a, high, low)                                    \
  do {                                                                                      \
    _tile_zero(4);                                                                          \
    _tile_zero(5);                                                                          \
    SPECDRAFT_AMX_SCALED_CHUNK(high_op, 0, 2, 3, a, high, low);                             \
    SPECDRAFT_AMX_SCALED_CHUNK(high_op, 1, 6, 7, a + 1024, high + 1024, low + 1024);        \
    SPECDRAFT_AMX_SCALED_CHUNK(high_op, 0, 2, 3, a + 2048, high + 2048, low + 2048);        \
    SPECDRAFT_AMX_SCALED_CHUNK(high_op, 1, 6, 7, a + 3072, high + 3072, low + 3072);        \
  } while (0)

// Weights as int16 lanes times a per-row scale, split into high and low bytes: q holds row r's 4 weights in bytes
// 4r .. 4r + 3 (unsigned, below 64), `even` / `odd` its scale in the even / odd bytes of each int16 lane of row
// r's int32 lane, `offset` (kOffset) what to subtract from each product (int16); v = scale q - offset = 256 high
// + low.
template <bool kOffset>
inline void scale_split(__m512i q, __m512i even, __m512i odd, __m512i offset, uint8_t* high, uint8_t* low) {
  constexpr __mmask64 kOddBytes = 0xAAAAAAAAAAAAAAAAULL;
  __m512i v_even = _mm512_maddubs_epi16(q, even), v_odd = _mm512_maddubs_epi16(q, odd);
  if constexpr (kOffset) v_even = _mm512_sub_epi16(v_even, offset), v_odd = _mm512_sub_epi16(v_odd, offset);
  _mm512_store_si512(high, _mm512_mask_mov_epi8(_mm512_srli_epi16(v_even, 8), kOddBytes, v_odd));
  _mm512_store_si512(low, _mm512_mask_mov_epi8(v_even, kOddBytes, _mm512_slli_epi16(v_odd, 8)));
}

// 16 rows' scales (int32 lanes, any sign, |scale| < 128) as scale_split's `even` and `odd`
inline void scale_bytes(__m512i scale, __m512i& even, __m512i& odd) {
  const __m512i byte = _mm512_and_si512(scale, _mm512_set1_epi32(0xFF));
  even = _mm512_or_si512(byte, _mm512_slli_epi32(byte, 16));
  odd = _mm512_slli_epi16(even, 8);
}

// Q4_K with the scales in B (passes of kAmxScaledQ4KTokens or more): v = scale * q, 0..945, high byte 0..3; 256
// C_hi + C_lo is the VNNI path's `dots` (before the mins, which `finish` adds as there). B tiles: chunk j's 16 rows
// of 64 bytes at 1024 j, row k (low nibbles, sub-block 2j) and 8 + k (high nibbles, sub-block 2j + 1): byte 4r + i
// = weight 64j + 32s + 4k + i of row r.
struct AmxQ4KScaled {
  using Format = Q4Kx8;
  static constexpr bool kSignedHigh = false;
  static void unpack(const uint8_t* first, const uint8_t* second, uint8_t* high, uint8_t* low) {
    const __m512i nibble = _mm512_set1_epi8(0x0F), none = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      __m512i even[2], odd[2];
      for (int s = 0; s < 2; ++s)
        scale_bytes(_mm512_cvtepu8_epi32(join64(first + 32 + 8 * (2 * j + s), second + 32 + 8 * (2 * j + s))),
                    even[s], odd[s]);
      for (int k = 0; k < 8; ++k) {
        const __m512i bytes = join256(first + 160 + 256 * j + 32 * k, second + 160 + 256 * j + 32 * k);
        const int64_t row = 1024 * j + 64 * k;
        scale_split<false>(_mm512_and_si512(bytes, nibble), even[0], odd[0], none, high + row, low + row);
        scale_split<false>(_mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble), even[1], odd[1], none,
                           high + row + 512, low + row + 512);
      }
    }
  }
  using Finish = Q4KFinish16;
};

// Q6_K: v = scale * (q - 32), |v| <= 4096, high byte signed; 256 C_hi + C_lo is the block's integer total of the
// VNNI path. B tiles: chunk c's 16 rows of 64 bytes at 1024 c, row 8k' + m: byte 4r + i = weight 32k' + 4m + i of
// chunk c (weight 128h + 32k + 4m + i of the block, h = c / 2, k = 2 (c % 2) + k') of row r, whose sub-block is
// 8h + 2k + m / 4.
struct AmxQ6KScaled {
  using Format = Q6Kx8;
  static constexpr bool kSignedHigh = true;
  static void unpack(const uint8_t* first, const uint8_t* second, uint8_t* high, uint8_t* low) {
    const __m512i nibble = _mm512_set1_epi8(0x0F), top_bits = _mm512_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h)
      for (int quarter = 0; quarter < 2; ++quarter) {  // m / 4: sub-blocks 8h + 2k + quarter, k = 0..3
        __m512i even[4], odd[4], offset[4];  // offset: 32 scale in both int16 lanes of row r's int32 lane
        for (int k = 0; k < 4; ++k) {
          const int s = 8 * h + 2 * k + quarter;
          const __m512i scale = _mm512_cvtepi8_epi32(join64(first + 16 + 8 * s, second + 16 + 8 * s));
          scale_bytes(scale, even[k], odd[k]);
          const __m512i word = _mm512_and_si512(_mm512_slli_epi32(scale, 5), _mm512_set1_epi32(0xFFFF));
          offset[k] = _mm512_or_si512(word, _mm512_slli_epi32(word, 16));
        }
        for (int m = 4 * quarter; m < 4 * quarter + 4; ++m) {
          const int64_t at = 144 + 96 * (8 * h + m);
          const __m512i l0 = join256(first + at, second + at), l1 = join256(first + at + 32, second + at + 32);
          const __m512i hb = join256(first + at + 64, second + at + 64);
          for (int k = 0; k < 4; ++k) {
            const __m512i l = k % 2 ? l1 : l0;
            const __m512i bits = _mm512_and_si512(k < 2 ? l : _mm512_srli_epi16(l, 4), nibble);
            const __m512i top = k == 0 ? _mm512_slli_epi16(hb, 4) : k == 1 ? _mm512_slli_epi16(hb, 2)
                                : k == 2 ? hb : _mm512_srli_epi16(hb, 2);
            const __m512i q = _mm512_or_si512(bits, _mm512_and_si512(top, top_bits));  // q + 32, 0..63
            const int64_t row = 1024 * (2 * h + k / 2) + 64 * (8 * (k % 2) + m);
            scale_split<true>(q, even[k], odd[k], offset[k], high + row, low + row);
          }
        }
      }
  }
  using Finish = Q6KFinish16;
};

// A pass with the scales in B: each block unpacked once into high and low B tiles, then per 16 tokens 8 tile
// multiplies (4 chunks, high and low), and per token 256 C_hi + C_lo to the format's `finish`.
template <typename S>
struct AmxScaled {
  using Format = typename S::Format;
  static constexpr int64_t kTokensPerTile = 16;  // A rows: tokens
  const QuantizedRows& x;
  const int8_t* activations;  // tiled_activations
  alignas(64) uint8_t high[4 * 1024], low[4 * 1024];
  alignas(64) int32_t sums_high[16][16], sums_low[16][16];  // C tiles: [token][weight row]

  void block(const uint8_t* block0, const uint8_t* block1, int64_t b, int64_t t0, int64_t tile, __m512* acc) {
    S::unpack(block0, block1, high, low);
    const typename S::Finish finish(block0, block1);
    for (int64_t m0 = 0; m0 < tile; m0 += kTokensPerTile) {
      const int8_t* a = activations + ((t0 + m0) / kTokensPerTile * (x.K / 64) + 4 * b) * 1024;
      if constexpr (S::kSignedHigh) SPECDRAFT_AMX_SCALED_BLOCK(_tile_dpbssd, a, high, low);
      else SPECDRAFT_AMX_SCALED_BLOCK(_tile_dpbsud, a, high, low);
      _tile_stored(5, sums_high[0], 64);
      _tile_stored(4, sums_low[0], 64);
      const int64_t m = std::min<int64_t>(kTokensPerTile, tile - m0);
      for (int64_t i = 0; i < m; ++i) {
        const int64_t t = m0 + i;
        const __m512i totals = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(sums_high[i]), 8),
                                                _mm512_load_si512(sums_low[i]));
        finish.add(token_at(x, t0 + t, b, Format::kWeights, Format::kActBlock), totals, acc[t]);
      }
    }
  }
};
#undef SPECDRAFT_AMX_SCALED_BLOCK
#undef SPECDRAFT_AMX_SCALED_CHUNK

// Q8_0 and Q5_0 (32-weight blocks, one scale each): a unit of 64 weights (two blocks of both row groups) is one B
// tile as it comes (Q8_0: the signed bytes, `tdpbssd`) or unpacked to q in 0..31 (Q5_0: nibble and fifth bit,
// `tdpbsud`), B row 8i + k: weights 32i + 4k .. 32i + 4k + 3 of the 16 rows (4 bytes each). A's rows are (token,
// block) pairs as Q4_K's (`expand_activations`: a token's 64 activations with the other block's zeroed), so C's
// row (t, i) holds token t's integer sum over block i of the 16 rows: the VNNI path's `sums` (Q5_0: before the
// -16 sum(x) it subtracts as there); then the same float operations per block, in the same order.
template <typename F>
struct AmxSmallBlocks {
  using Format = Consecutive<F, 2>;
  static constexpr int64_t kTokensPerTile = 8;  // A rows: (token, block) pairs
  static constexpr bool kFifthBit = std::is_same_v<F, Q50x8>;
  const QuantizedRows& x;
  const int8_t* expanded;  // expand_activations
  alignas(64) uint8_t tile[1024];     // B: 16 rows x 64 bytes
  alignas(64) int32_t sums[16][16];  // C: [row of A][weight row]

  // 0x10 in byte 4r + i where bit `first + i` of row r's qh is set (Q50x8::fifth_bits on 16 rows)
  static __m512i fifth_bits(__m512i qh, int first) {
    const int byte = first / 8, shift = first % 8;
    const int m = byte * 0x01010101;
    const __m512i spread = _mm512_shuffle_epi8(
        qh, _mm512_set4_epi32(m + 0x0C0C0C0C, m + 0x08080808, m + 0x04040404, m));
    const __m512i bits = _mm512_set1_epi32(static_cast<int>(0x08040201u << shift));
    return _mm512_maskz_mov_epi8(_mm512_cmpeq_epi8_mask(_mm512_and_si512(spread, bits), bits),
                                 _mm512_set1_epi8(0x10));
  }

  void unpack(const uint8_t* first, const uint8_t* second) {
    for (int i = 0; i < 2; ++i) {
      const uint8_t* a = first + i * F::kBytes;
      const uint8_t* b = second + i * F::kBytes;
      if constexpr (kFifthBit) {
        const __m512i low = _mm512_set1_epi8(0x0F), qh = join256(a + 16, b + 16);
        for (int k = 0; k < 4; ++k) {
          const __m512i bytes = join256(a + 48 + 32 * k, b + 48 + 32 * k);
          _mm512_store_si512(tile + 64 * (8 * i + k),
                             _mm512_or_si512(_mm512_and_si512(bytes, low), fifth_bits(qh, 4 * k)));
          _mm512_store_si512(tile + 64 * (8 * i + 4 + k),
                             _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(bytes, 4), low),
                                             fifth_bits(qh, 16 + 4 * k)));
        }
      } else {
        for (int k = 0; k < 8; ++k)
          _mm512_store_si512(tile + 64 * (8 * i + k), join256(a + 16 + 32 * k, b + 16 + 32 * k));
      }
    }
  }

  void block(const uint8_t* block0, const uint8_t* block1, int64_t b, int64_t t0, int64_t tile_tokens, __m512* acc) {
    unpack(block0, block1);
    const __m512 d[2] = {_mm512_cvtph_ps(join128(block0, block1)),
                         _mm512_cvtph_ps(join128(block0 + F::kBytes, block1 + F::kBytes))};
    _tile_loadd(1, tile, 64);
    for (int64_t m0 = 0; m0 < tile_tokens; m0 += kTokensPerTile) {
      _tile_loadd(0, expanded + ((t0 + m0) / kTokensPerTile * (x.K / 64) + b) * 1024, 64);
      _tile_zero(2);
      if constexpr (kFifthBit) _tile_dpbsud(2, 0, 1);
      else _tile_dpbssd(2, 0, 1);
      _tile_stored(2, sums[0], 64);
      const int64_t m = std::min<int64_t>(kTokensPerTile, tile_tokens - m0);
      for (int64_t j = 0; j < m; ++j) {
        const int64_t t = m0 + j;
        const TokenSuper token = token_at(x, t0 + t, b, Format::kWeights, Format::kActBlock);
        for (int i = 0; i < 2; ++i) {
          __m512i total = _mm512_load_si512(sums[2 * j + i]);
          if constexpr (kFifthBit) total = _mm512_sub_epi32(total, _mm512_set1_epi32(16 * token.sums32[i]));
          acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(d[i], _mm512_set1_ps(token.scales[i])),
                                   acc[t]);
        }
      }
    }
  }
};

constexpr size_t kKeptActivationBytes = 8 << 20;  // a calling thread keeps its A-tile buffer up to this size

// The calling thread's buffer for A tiles (a lambda run by another thread would see its own).
std::vector<int8_t>& activation_buffer() {
  thread_local std::vector<int8_t> buffer;
  return buffer;
}

// A pass whose A tiles are (token, 32-weight part) rows (`expand_activations`): Q4_K below kAmxScaledQ4KTokens
// (AmxQ4K), Q8_0 and Q5_0 (AmxSmallBlocks<F>).
template <typename Kernel>
void qlinear_expanded_amx(const uint8_t* weight, int64_t N, int64_t K, const QuantizedRows& x, const float* bias,
                          float* out) {
  std::vector<int8_t>& buffer = activation_buffer();
  expand_activations(x, buffer);
  const int8_t* expanded = buffer.data();
  amx_pass<Kernel>(weight, N, K, x.T, bias, out, [&] { return Kernel{x, expanded}; });
  if (buffer.size() > kKeptActivationBytes) std::vector<int8_t>().swap(buffer);  // a long prefill's: not kept
}

template <typename S>
void qlinear_scaled_amx(const uint8_t* weight, int64_t N, int64_t K, const QuantizedRows& x, const float* bias,
                        float* out) {
  std::vector<int8_t>& buffer = activation_buffer();
  const int8_t* activations = tiled_activations(x, buffer);
  amx_pass<AmxScaled<S>>(weight, N, K, x.T, bias, out, [&] { return AmxScaled<S>{x, activations}; });
  if (buffer.size() > kKeptActivationBytes) std::vector<int8_t>().swap(buffer);
}

#endif

// Whether a pass of T tokens over an N-row matrix goes to the tiles (passes of at least `min_tokens`).
bool use_amx(int64_t T, int64_t N, int64_t min_tokens) {
  return kAmxBuild && T >= min_tokens && N % (2 * kRowGroup) == 0 && amx_allowed && amx_granted();
}

// A 32-weight format: passes of kAmxMinTokensSmallBlocks or more tokens over rows of a multiple of 64 weights take
// the AMX tiles where the build has them (N a multiple of 16), other passes of several tokens over rows of a multiple
// of 128 weights 4 blocks at a time (Consecutive), one-token steps and other rows block by block; the same sums
// every way.
template <typename F>
void qlinear_x8_small_blocks(const uint8_t* weight, int64_t N, int64_t K, const QuantizedRows& x, const float* bias,
                             float* out) {
#if SPECDRAFT_AMX
  if constexpr (std::is_same_v<F, Q80x8> || std::is_same_v<F, Q50x8>)  // the formats with tiles of their own
    if (K % 64 == 0 && use_amx(x.T, N, kAmxMinTokensSmallBlocks))
      return qlinear_expanded_amx<AmxSmallBlocks<F>>(weight, N, K, x, bias, out);
#endif
  if (x.T > 1 && K % Consecutive<F, 4>::kWeights == 0) qlinear_x8_impl<Consecutive<F, 4>>(weight, N, K, x, bias, out);
  else qlinear_x8_impl<F>(weight, N, K, x, bias, out);
}

int64_t block_weights(int64_t type) {
  switch (type) {
    case kQ2_K: return Q2K::kWeights;
    case kQ3_K: return Q3K::kWeights;
    case kQ4_K: return Q4K::kWeights;
    case kQ5_K: return Q5K::kWeights;
    case kQ6_K: return Q6K::kWeights;
    case kQ8_0: return Q80::kWeights;
    case kQ5_0: return Q50::kWeights;
    case kQ4_0: return Q40::kWeights;
    case kQ4_1: return Q41::kWeights;
    case kIQ4_NL: return IQ4NL::kWeights;
    case kIQ4_XS: return IQ4XS::kWeights;
    default: return 0;
  }
}

int64_t block_bytes(int64_t type) {
  switch (type) {
    case kQ2_K: return Q2K::kBytes;
    case kQ3_K: return Q3K::kBytes;
    case kQ4_K: return Q4K::kBytes;
    case kQ5_K: return Q5K::kBytes;
    case kQ6_K: return Q6K::kBytes;
    case kQ8_0: return Q80::kBytes;
    case kQ5_0: return Q50::kBytes;
    case kQ4_0: return Q40::kBytes;
    case kQ4_1: return Q41::kBytes;
    case kIQ4_NL: return IQ4NL::kBytes;
    case kIQ4_XS: return IQ4XS::kBytes;
    default: return 0;
  }
}

// ----------------------------------------------------------------------------------- dequantization (scalar)
// Q4_K and Q5_K: d, dmin and the six-bit scales and mins at the block's start, the low four bits in qs, the fifth
// bits in qh (Q5_K) or none (nullptr, Q4_K).
void dequantize_k_block(const uint8_t* block, const uint8_t* qs, const uint8_t* qh, float* y) {
  const float d = half_to_float(block), dmin = half_to_float(block + 2);
  int scale[8], min[8];
  Q4Kx8::scales_mins(block, scale, min);
  for (int j = 0; j < 4; ++j)
    for (int s = 0; s < 2; ++s) {
      const int c = 2 * j + s;
      for (int l = 0; l < 32; ++l) {
        const int q = ((qs[32 * j + l] >> (4 * s)) & 0x0F) | (qh ? ((qh[l] >> c) & 1) << 4 : 0);
        y[64 * j + 32 * s + l] = d * scale[c] * q - dmin * min[c];
      }
    }
}

void dequantize_block(int64_t type, const uint8_t* block, float* y) {
  switch (type) {
    case kQ2_K: {
      const float d = half_to_float(block + 80), dmin = half_to_float(block + 82);
      for (int i = 0; i < 256; ++i) {
        const int q = (block[16 + 32 * (i / 128) + i % 32] >> (2 * (i % 128 / 32))) & 3, s = i / 16;
        y[i] = d * (block[s] & 0x0F) * q - dmin * (block[s] >> 4);
      }
      break;
    }
    case kQ3_K: {
      const float d = half_to_float(block + 108);
      for (int i = 0; i < 256; ++i) {  // weight 128n + 32j + 16p + l
        const int n = i / 128, j = i % 128 / 32, l = i % 32;  // l here: 16p + l
        const int q = ((block[32 + 32 * n + l] >> (2 * j)) & 3) | (((block[l] >> (4 * n + j)) & 1) << 2);
        y[i] = d * q3_k_scale(block + 96, i / 16) * (q - 4);
      }
      break;
    }
    case kQ4_K: dequantize_k_block(block, block + 16, nullptr, y); break;
    case kQ5_K: dequantize_k_block(block, block + 48, block + 16, y); break;
    case kQ6_K: {
      const uint8_t* ql = block;
      const uint8_t* qh = block + 128;
      const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
      const float d = half_to_float(block + 208);
      for (int h = 0; h < 2; ++h)
        for (int k = 0; k < 4; ++k)
          for (int l = 0; l < 32; ++l) {
            const int i = 128 * h + 32 * k + l;
            const int low = (ql[64 * h + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0x0F;
            const int high = (qh[32 * h + l] >> (2 * k)) & 3;
            y[i] = d * scales[i / 16] * ((low | (high << 4)) - 32);
          }
      break;
    }
    case kQ8_0: {
      const float d = half_to_float(block);
      for (int i = 0; i < 32; ++i) y[i] = d * static_cast<int8_t>(block[2 + i]);
      break;
    }
    case kQ5_0: {
      const float d = half_to_float(block);
      uint32_t high_bits;
      std::memcpy(&high_bits, block + 2, 4);
      for (int j = 0; j < 16; ++j) {
        const int q0 = (block[6 + j] & 0x0F) | (((high_bits >> j) & 1) << 4);
        const int q1 = (block[6 + j] >> 4) | (((high_bits >> (j + 16)) & 1) << 4);
        y[j] = d * (q0 - 16);
        y[j + 16] = d * (q1 - 16);
      }
      break;
    }
    case kQ4_0: {
      const float d = half_to_float(block);
      for (int j = 0; j < 16; ++j) {
        y[j] = d * ((block[2 + j] & 0x0F) - 8);
        y[j + 16] = d * ((block[2 + j] >> 4) - 8);
      }
      break;
    }
    case kQ4_1: {
      const float d = half_to_float(block), m = half_to_float(block + 2);
      for (int j = 0; j < 16; ++j) {
        y[j] = d * (block[4 + j] & 0x0F) + m;
        y[j + 16] = d * (block[4 + j] >> 4) + m;
      }
      break;
    }
    case kIQ4_NL: {
      const float d = half_to_float(block);
      alignas(32) int8_t values[32];
      _mm256_store_si256(reinterpret_cast<__m256i*>(values), iq4_values(nibbles32(block + 2)));
      for (int i = 0; i < 32; ++i) y[i] = d * values[i];
      break;
    }
    case kIQ4_XS: {
      const float d = half_to_float(block);
      alignas(32) int8_t values[32];
      for (int c = 0; c < 8; ++c) {
        const float dl = d * iq4_xs_scale(block, c);  // the gguf package's order: (d * scale) * value
        _mm256_store_si256(reinterpret_cast<__m256i*>(values), iq4_values(nibbles32(block + 8 + 16 * c)));
        for (int i = 0; i < 32; ++i) y[32 * c + i] = dl * values[i];
      }
      break;
    }
    default: TORCH_CHECK(false, "unsupported block type ", type);
  }
}

void check_weight(const torch::Tensor& weight, int64_t type, int64_t K) {
  TORCH_CHECK(block_weights(type) > 0, "unsupported block type ", type,
              " (supported: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_0, Q5_0, Q4_0, Q4_1, IQ4_NL, IQ4_XS)");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kUInt8 && weight.is_contiguous(),
              "quantized weight must be [N, row_bytes] uint8");
  TORCH_CHECK(K % block_weights(type) == 0, "row length ", K, " is not a multiple of the block size");
  TORCH_CHECK(weight.size(1) == K / block_weights(type) * block_bytes(type), "row bytes do not match the type");
}

}  // namespace

// x: [T, K] float32, weight: [N, K / block * block_bytes] uint8 blocks of `type`, bias: [N] float32 or None
// -> [T, N] float32
torch::Tensor qlinear(torch::Tensor x, torch::Tensor weight, int64_t type, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x must be [T, K] float32");
  const int64_t T = x.size(0), K = x.size(1), N = weight.size(0);
  check_weight(weight, type, K);
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->numel() == N && bias->is_contiguous(), "bad bias");
    bias_ptr = bias->data_ptr<float>();
  }
  const int64_t act_block = block_weights(type);  // the k-quants' 256, the others' 32
  const QuantizedRows rows = quantize_rows(x.data_ptr<float>(), T, K, act_block);
  auto out = torch::empty({T, N}, x.options());
  const uint8_t* w = weight.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  switch (type) {
    case kQ2_K: qlinear_impl<Q2K>(w, N, K, rows, bias_ptr, o); break;
    case kQ3_K: qlinear_impl<Q3K>(w, N, K, rows, bias_ptr, o); break;
    case kQ4_K: qlinear_impl<Q4K>(w, N, K, rows, bias_ptr, o); break;
    case kQ5_K: qlinear_impl<Q5K>(w, N, K, rows, bias_ptr, o); break;
    case kQ6_K: qlinear_impl<Q6K>(w, N, K, rows, bias_ptr, o); break;
    case kQ8_0: qlinear_impl<Q80>(w, N, K, rows, bias_ptr, o); break;
    case kQ5_0: qlinear_impl<Q50>(w, N, K, rows, bias_ptr, o); break;
    case kQ4_0: qlinear_impl<Q40>(w, N, K, rows, bias_ptr, o); break;
    case kQ4_1: qlinear_impl<Q41>(w, N, K, rows, bias_ptr, o); break;
    case kIQ4_NL: qlinear_impl<IQ4NL>(w, N, K, rows, bias_ptr, o); break;
    case kIQ4_XS: qlinear_impl<IQ4XS>(w, N, K, rows, bias_ptr, o); break;
  }
  return out;
}

// weight as in qlinear, rows: [n] int64  ->  [n, K] float32, the rows dequantized (embedding lookups, tests)
torch::Tensor qdequantize_rows(torch::Tensor weight, int64_t type, int64_t K, torch::Tensor rows) {
  check_weight(weight, type, K);
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == torch::kLong, "rows must be [n] int64");
  auto ids = rows.contiguous();
  const int64_t n = ids.size(0), N = weight.size(0), per_block = block_weights(type), bytes = block_bytes(type);
  auto out = torch::empty({n, K}, torch::kFloat);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < N, "row ", id[i], " out of range");
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* row = weight.data_ptr<uint8_t>() + id[i] * weight.size(1);
      for (int64_t b = 0; b < K / per_block; ++b)
        dequantize_block(type, row + b * bytes, out.data_ptr<float>() + i * K + b * per_block);
    }
  });
  return out;
}

// ------------------------------------------------------------------------------ formats read as another one
// IQ3_XXS and IQ3_S have no kernel: a sub-block's 32 values are d' (2s + 1) q, q a signed integer of at most
// 31 (d' = d with q = +-g for IQ3_S's odd grid values g <= 15; d' = d / 2 with q = +-g / 2 for IQ3_XXS's even ones
// <= 62), which is a Q6_K block's d * scale * (q6 - 32) with the scale on both 16-weight halves. The numpy twin in
// gguf_weights.py (`iq3_as_q6_k`) derives q from the gguf package's dequantization and the tests hold this to it.
constexpr int64_t kIQ3_XXS = 18, kIQ3_S = 21;

// One block -> a Q6_K block; false where d' is no half float (an IQ3_XXS d whose half is not one) or d is not finite.
// grid: [entries][4] values (IQ3_XXS 256 entries, IQ3_S 512); ksigns: IQ3_XXS's 128 sign bytes (8 signs each).
static bool iq3_as_q6_k_block(int64_t type, const uint8_t* in, const uint8_t* grid, const uint8_t* ksigns,
                              uint8_t* out) {
  const float d = half_to_float(in);
  const float d_scaled = type == kIQ3_XXS ? d * 0.5f : d;
  const uint16_t d_bits = _cvtss_sh(d_scaled, 0);  // round to nearest: checked exact below
  uint8_t d_out[2];
  std::memcpy(d_out, &d_bits, 2);
  if (!std::isfinite(d) || half_to_float(d_out) != d_scaled) return false;
  int q[256];
  int scale[8];
  const uint8_t* qs = in + 2;
  if (type == kIQ3_XXS) {
    for (int c = 0; c < 8; ++c) {  // sub-block c: a 32-bit word, four 7-bit sign indices and the scale on top
      uint32_t word;
      std::memcpy(&word, in + 66 + 4 * c, 4);
      scale[c] = 2 * static_cast<int>(word >> 28) + 1;
      for (int w = 0; w < 32; ++w) {  // weight w of the sub-block: grid entry qs[8c + w / 4], sign byte w / 8
        const int g = grid[4 * qs[8 * c + w / 4] + w % 4];
        if (g % 2) return false;
        const bool negative = (ksigns[(word >> (7 * (w / 8))) & 127] >> (w % 8)) & 1;
        q[32 * c + w] = negative ? -g / 2 : g / 2;
      }
    }
  } else {
    const uint8_t* qh = in + 66;
    const uint8_t* signs = in + 74;
    for (int c = 0; c < 8; ++c) scale[c] = 2 * ((in[106 + c / 2] >> (4 * (c % 2))) & 0x0F) + 1;
    for (int i = 0; i < 256; ++i) {  // group i / 4: a 9-bit grid index, its ninth bit in qh; signs one bit a weight
      const int group = i / 4;
      const int index = qs[group] | (((qh[group / 8] >> (group % 8)) & 1) << 8);
      const int g = grid[4 * index + i % 4];
      q[i] = (signs[i / 8] >> (i % 8)) & 1 ? -g : g;
    }
  }
  // Q6_K: weight 128h + 32k + l has its low four bits in nibble k / 2 of ql[64h + 32(k % 2) + l], its top two in bits
  // 2k.. of qh[32h + l]
  uint8_t* ql = out;
  uint8_t* qh = out + 128;
  std::memset(out, 0, 192);
  for (int i = 0; i < 256; ++i) {
    if (q[i] < -32 || q[i] > 31) return false;
    const int v = q[i] + 32, h = i / 128, k = i % 128 / 32, l = i % 32;
    ql[64 * h + 32 * (k % 2) + l] |= static_cast<uint8_t>((v & 0x0F) << (4 * (k / 2)));
    qh[32 * h + l] |= static_cast<uint8_t>((v >> 4) << (2 * k));
  }
  for (int c = 0; c < 16; ++c) out[192 + c] = static_cast<uint8_t>(static_cast<int8_t>(scale[c / 2]));
  std::memcpy(out + 208, d_out, 2);
  return true;
}

// raw [N, K / 256 * 98 or 110] uint8 rows of IQ3_XXS or IQ3_S, grid [entries, 4] uint8, ksigns [128] uint8 (IQ3_XXS;
// any for IQ3_S) -> [N, K / 256 * 210], the same rows as Q6_K; an empty tensor where a block does not fit
torch::Tensor qconvert_iq3_rows(torch::Tensor raw, int64_t type, int64_t K, torch::Tensor grid, torch::Tensor ksigns) {
  TORCH_CHECK(type == kIQ3_XXS || type == kIQ3_S, "only IQ3_XXS and IQ3_S rows become Q6_K, not type ", type);
  const int64_t in_bytes = type == kIQ3_XXS ? 98 : 110, entries = type == kIQ3_XXS ? 256 : 512;
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == torch::kUInt8 && raw.is_contiguous() && K % 256 == 0 &&
              raw.size(1) == K / 256 * in_bytes, "raw must be [N, row bytes] uint8 blocks of the type");
  TORCH_CHECK(grid.scalar_type() == torch::kUInt8 && grid.is_contiguous() && grid.numel() == 4 * entries,
              "grid must hold ", entries, " entries of 4 uint8 values");
  TORCH_CHECK(type == kIQ3_S || (ksigns.scalar_type() == torch::kUInt8 && ksigns.is_contiguous() &&
                                 ksigns.numel() == 128), "ksigns must be 128 uint8 sign bytes");
  const int64_t N = raw.size(0), blocks = K / 256;
  auto out = torch::empty({N, blocks * 210}, torch::kUInt8);
  const uint8_t* in = raw.data_ptr<uint8_t>();
  const uint8_t* table = grid.data_ptr<uint8_t>();
  const uint8_t* signs = type == kIQ3_XXS ? ksigns.data_ptr<uint8_t>() : nullptr;
  uint8_t* o = out.data_ptr<uint8_t>();
  std::atomic<bool> fits{true};
  at::parallel_for(0, N * blocks, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end && fits.load(std::memory_order_relaxed); ++b)
      if (!iq3_as_q6_k_block(type, in + b * in_bytes, table, signs, o + b * 210)) fits = false;
  });
  return fits ? out : torch::empty({0}, torch::kUInt8);
}

// Interleaved row groups (rows a multiple of 8): weight [N, row_bytes] -> [N / 8, blocks per row * group block
// bytes], a copy whose block columns of 8 rows are repacked as Q2Kx8 .. Q6Kx8, Q80x8, Q50x8, Q40x8, IQ4NLx8 and
// IQ4XSx8 describe.
int64_t x8_bytes(int64_t type) {
  switch (type) {
    case kQ2_K: return Q2Kx8::kBytes;
    case kQ3_K: return Q3Kx8::kBytes;
    case kQ4_K: return Q4Kx8::kBytes;
    case kQ5_K: return Q5Kx8::kBytes;
    case kQ6_K: return Q6Kx8::kBytes;
    case kQ8_0: return Q80x8::kBytes;
    case kQ5_0: return Q50x8::kBytes;
    case kQ4_0: return Q40x8::kBytes;
    case kIQ4_NL: return IQ4NLx8::kBytes;
    case kIQ4_XS: return IQ4XSx8::kBytes;
    default: return 0;
  }
}

void pack_x8(int64_t type, const uint8_t* const rows[8], uint8_t* out) {
  switch (type) {
    case kQ2_K: Q2Kx8::pack(rows, out); break;
    case kQ3_K: Q3Kx8::pack(rows, out); break;
    case kQ4_K: Q4Kx8::pack(rows, out); break;
    case kQ5_K: Q5Kx8::pack(rows, out); break;
    case kQ6_K: Q6Kx8::pack(rows, out); break;
    case kQ8_0: Q80x8::pack(rows, out); break;
    case kQ5_0: Q50x8::pack(rows, out); break;
    case kQ4_0: Q40x8::pack(rows, out); break;
    case kIQ4_NL: IQ4NLx8::pack(rows, out); break;
    case kIQ4_XS: IQ4XSx8::pack(rows, out); break;
  }
}

void unpack_x8(int64_t type, const uint8_t* in, uint8_t* const rows[8]) {
  switch (type) {
    case kQ2_K: Q2Kx8::unpack(in, rows); break;
    case kQ3_K: Q3Kx8::unpack(in, rows); break;
    case kQ4_K: Q4Kx8::unpack(in, rows); break;
    case kQ5_K: Q5Kx8::unpack(in, rows); break;
    case kQ6_K: Q6Kx8::unpack(in, rows); break;
    case kQ8_0: Q80x8::unpack(in, rows); break;
    case kQ5_0: Q50x8::unpack(in, rows); break;
    case kQ4_0: Q40x8::unpack(in, rows); break;
    case kIQ4_NL: IQ4NLx8::unpack(in, rows); break;
    case kIQ4_XS: IQ4XSx8::unpack(in, rows); break;
  }
}

void check_packed(const torch::Tensor& packed, int64_t type, int64_t K) {
  TORCH_CHECK(x8_bytes(type) > 0, "only Q2_K to Q6_K, Q8_0, Q5_0, Q4_0, IQ4_NL and IQ4_XS matrices interleave rows");
  TORCH_CHECK(K % block_weights(type) == 0, "row length ", K, " is not a multiple of the block size");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
              packed.size(1) == K / block_weights(type) * x8_bytes(type),
              "packed weight must be [N / 8, blocks per row * group block bytes] uint8");
}

// weight [N, row_bytes] -> out [N / 8, ...] (written in place: a slice of a larger interleaved matrix)
void qinterleave_into(torch::Tensor weight, int64_t type, int64_t K, torch::Tensor out) {
  check_weight(weight, type, K);
  TORCH_CHECK(x8_bytes(type) > 0, "only Q2_K to Q6_K, Q8_0, Q5_0, Q4_0, IQ4_NL and IQ4_XS matrices interleave rows");
  const int64_t N = weight.size(0), blocks = K / block_weights(type), row_bytes = weight.size(1);
  TORCH_CHECK(N % kRowGroup == 0, "rows (", N, ") must be a multiple of ", kRowGroup, " to interleave");
  check_packed(out, type, K);
  TORCH_CHECK(out.size(0) == N / kRowGroup, "out must hold ", N / kRowGroup, " groups of rows");
  const uint8_t* w = weight.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, N / kRowGroup, 16, [&](int64_t begin, int64_t end) {
    for (int64_t group = begin; group < end; ++group)
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* rows[kRowGroup];
        for (int r = 0; r < kRowGroup; ++r) rows[r] = w + (group * kRowGroup + r) * row_bytes + b * block_bytes(type);
        pack_x8(type, rows, o + (group * blocks + b) * x8_bytes(type));
      }
  });
}

// packed: [N / 8, ...] from qinterleave_into, rows: [n] int64 -> [n, row_bytes] uint8, those rows in the file's layout
torch::Tensor qdeinterleave_rows(torch::Tensor packed, int64_t type, int64_t K, torch::Tensor rows) {
  check_packed(packed, type, K);
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == torch::kLong, "rows must be [n] int64");
  auto ids = rows.contiguous();
  const int64_t n = ids.size(0), N = packed.size(0) * kRowGroup, blocks = K / block_weights(type);
  const int64_t bytes = block_bytes(type);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < N, "row ", id[i], " out of range");
  auto out = torch::empty({n, blocks * bytes}, torch::kUInt8);
  const uint8_t* p = packed.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> scratch(kRowGroup * bytes);
    uint8_t* targets[kRowGroup];
    for (int s = 0; s < kRowGroup; ++s) targets[s] = scratch.data() + s * bytes;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t group = id[i] / kRowGroup, r = id[i] % kRowGroup;
      for (int64_t b = 0; b < blocks; ++b) {
        unpack_x8(type, p + (group * blocks + b) * x8_bytes(type), targets);
        std::memcpy(o + i * blocks * bytes + b * bytes, targets[r], bytes);
      }
    }
  });
  return out;
}

// Whether a format's loops read a pass's activations block by block (BlockMajorRows: quantized so)
bool reads_by_block(int64_t type) {
  return (type == kQ4_K && block_major<Q4Kx8>) || (type == kQ6_K && block_major<Q6Kx8>);
}

// Several matrices of one format over the same activations in one parallel region (qlinear_x8_impl over parts),
// where the format's passes of T tokens take the 256-weight loops; false where they take other paths (AMX tiles,
// the 32-weight formats' own loops), which go one matrix at a time (`qlinear_x8_rows`).
bool qlinear_x8_parts(int64_t type, const ProductPart* parts, int n_parts, int64_t K, const QuantizedRows& rows) {
  const int64_t tiles_from = type == kQ4_K ? kAmxMinTokensQ4K : type == kQ6_K ? kAmxMinTokensQ6K : 0;
  for (int p = 0; p < n_parts; ++p)
    if (tiles_from && use_amx(rows.T, parts[p].N, tiles_from)) return false;  // the tiles take them
  switch (type) {
    case kQ4_K: qlinear_x8_impl<Q4Kx8>(parts, n_parts, K, rows); return true;
    case kQ6_K: qlinear_x8_impl<Q6Kx8>(parts, n_parts, K, rows); return true;
    case kQ5_K: qlinear_x8_impl<Q5Kx8>(parts, n_parts, K, rows); return true;  // no tiles of its own (yet)
    case kQ3_K: qlinear_x8_impl<Q3Kx8>(parts, n_parts, K, rows); return true;  // nor have Q3_K
    case kQ2_K: qlinear_x8_impl<Q2Kx8>(parts, n_parts, K, rows); return true;  // and Q2_K
    case kIQ4_XS: qlinear_x8_impl<IQ4XSx8>(parts, n_parts, K, rows); return true;
    default: return false;
  }
}

// One matrix's product where qlinear_x8_parts declines it: the AMX tiles, the 32-weight formats
void qlinear_x8_rows(const uint8_t* w, int64_t type, int64_t N, int64_t K, const QuantizedRows& rows,
                     const float* bias_ptr, float* o) {
  switch (type) {
#if SPECDRAFT_AMX
    case kQ4_K:
      if (use_amx(rows.T, N, kAmxScaledQ4KTokens)) qlinear_scaled_amx<AmxQ4KScaled>(w, N, K, rows, bias_ptr, o);
      else qlinear_expanded_amx<AmxQ4K>(w, N, K, rows, bias_ptr, o);
      break;
    case kQ6_K: qlinear_scaled_amx<AmxQ6KScaled>(w, N, K, rows, bias_ptr, o); break;
#endif
    case kQ8_0: qlinear_x8_small_blocks<Q80x8>(w, N, K, rows, bias_ptr, o); break;
    case kQ5_0: qlinear_x8_small_blocks<Q50x8>(w, N, K, rows, bias_ptr, o); break;
    case kQ4_0: qlinear_x8_small_blocks<Q40x8>(w, N, K, rows, bias_ptr, o); break;
    case kIQ4_NL: qlinear_x8_small_blocks<IQ4NLx8>(w, N, K, rows, bias_ptr, o); break;
    default: TORCH_CHECK(false, "no interleaved product for GGUF type ", type);
  }
}

const float* checked_bias(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->numel() == N && bias->is_contiguous(), "bad bias");
  return bias->data_ptr<float>();
}

// The products of several interleaved matrices (packed, type, bias or None each, all K wide) over one input x [T, K]
// (a layer's q, k and v; its gate and up; qlinear_x8: one matrix): each output [T, N] the bits of its matrix's
// product alone, x quantized once per layout the formats read, and the matrices of one format over their row
// groups in one parallel region. The 1.5B's q, k and v so (Zen 4, 2026-12-07, random Q4_K blocks of their shapes
// streamed, 2 threads): 0.84x the time of three calls at one token, 0.82x at 8; its gate and up level with two.
std::vector<torch::Tensor> qlinear_x8_shared(
    torch::Tensor x, const std::vector<std::tuple<torch::Tensor, int64_t, c10::optional<torch::Tensor>>>& matrices) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x must be [T, K] float32");
  const int64_t T = x.size(0), K = x.size(1), n = static_cast<int64_t>(matrices.size());
  std::vector<torch::Tensor> outs;
  std::vector<ProductPart> parts;
  for (const auto& [packed, type, bias] : matrices) {
    check_packed(packed, type, K);
    const int64_t N = packed.size(0) * kRowGroup;
    outs.push_back(torch::empty({T, N}, x.options()));
    parts.push_back({packed.data_ptr<uint8_t>(), N, checked_bias(bias, N), outs.back().data_ptr<float>()});
  }
  std::vector<bool> done(n, false);
  for (int64_t i = 0; i < n; ++i) {  // the matrices whose formats read x in the layout of matrix i's
    if (done[i]) continue;
    const int64_t block = block_weights(std::get<1>(matrices[i]));
    const bool by_block = reads_by_block(std::get<1>(matrices[i]));
    std::vector<int64_t> layout;
    bool offsets = false;  // Q6_K's 512-bit loop reads them (the other formats' loops do not)
    for (int64_t j = i; j < n; ++j) {
      const int64_t type = std::get<1>(matrices[j]);
      if (done[j] || block_weights(type) != block || reads_by_block(type) != by_block) continue;
      layout.push_back(j);
      offsets = offsets || (kWideK && type == kQ6_K);
    }
    QuantizedRows rows = quantize_rows(x.data_ptr<float>(), T, K, block, by_block);
#if SPECDRAFT_WIDE_K
    if (offsets) add_offsets(rows);
#endif
    for (int64_t j : layout) {  // format by format, in order of first appearance
      if (done[j]) continue;
      const int64_t format = std::get<1>(matrices[j]);
      std::vector<ProductPart> same;
      for (int64_t m : layout)
        if (!done[m] && std::get<1>(matrices[m]) == format) same.push_back(parts[m]), done[m] = true;
      if (!qlinear_x8_parts(format, same.data(), static_cast<int>(same.size()), K, rows))
        for (const auto& part : same) qlinear_x8_rows(part.weight, format, part.N, K, rows, part.bias, part.out);
    }
  }
  return outs;
}

// x: [T, K] float32, packed: [N / 8, ...] from qinterleave_into, bias: [N] float32 or None -> [T, N] float32
torch::Tensor qlinear_x8(torch::Tensor x, torch::Tensor packed, int64_t type, c10::optional<torch::Tensor> bias) {
  return qlinear_x8_shared(x, {{packed, type, bias}})[0];
}

// The activations as the kernels see them: x [T, K] float32 -> (int8 [T, K], scales [T, K / block] float32), for
// tests that recompute a product from the quantized operands.
std::vector<torch::Tensor> quantize_activations(torch::Tensor x, int64_t block) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x must be [T, K] float32");
  TORCH_CHECK((block == 32 || block == 256) && x.size(1) % block == 0, "block must be 32 or 256 and divide K");
  const QuantizedRows rows = quantize_rows(x.data_ptr<float>(), x.size(0), x.size(1), block);
  auto q = torch::from_blob(const_cast<int8_t*>(rows.q.data()), {x.size(0), x.size(1)}, torch::kChar).clone();
  auto d = torch::from_blob(const_cast<float*>(rows.d.data()), {x.size(0), x.size(1) / block}, torch::kFloat).clone();
  return {q, d};
}

bool quant_vnni() { return kVnni; }

// Whether passes of several tokens over Q4_K, Q6_K, Q8_0 and Q5_0 matrices use AMX tiles (an amx build, the OS lets
// it, allowed).
bool quant_amx() { return amx_granted() && amx_allowed; }

// Allow or forbid the tiles (the results are the same bits either way); returns the previous setting.
bool set_quant_amx(bool allowed) { return amx_allowed.exchange(allowed); }
