// y[rows, n] = x[rows, k] . W^T for 1-32 rows of bf16, with W the plain row-major bf16 weight
// of the dense-bf16 plan (CPUs where oneDNN has no bf16: AVX2 with FMA, no AVX512-BF16).
// vcfslm.engine.dense_gemv builds this file and checks it against F.linear first.
//
// Without bf16 instructions a bf16 value is the top half of an fp32 one, so the loop widens
// the weight with integer ops and multiplies in fp32: one 32-byte load holds 16 bf16 of a
// weight row; shifted left by 16 its 32-bit lanes are the 8 even elements as fp32, masked to
// the high half they are the 8 odd ones. The input rows are widened once per call into the
// same even/odd order (`split`), so each load feeds two FMAs per input row, and every output
// is the horizontal sum of its accumulator at the end. ATen's bf16 GEMV on the same plain
// weight reads it at ~0.55 of the read probe on a 2-core AVX2 EPYC, and a few rows one row at
// a time; this loop reads it at ~0.95 for one row (benchmarks/gemv_hypotheses.py), without a
// copy or a repack of the weight.
//
// 8-16 rows (batch-16 decode) are bound by the FMAs, and there the dot-product form above
// costs a load per FMA (the input rows do not fit in registers beside the accumulators) and
// reaches ~0.63 of the FMA peak. They take a broadcast form instead: one 32-bit broadcast of
// a weight row's bf16 pair (k, k+1) and one byte shuffle give [w_k x4 | w_k+1 x4] in fp32,
// which multiplies four input rows at k and k+1 at once; the inputs are laid out that way
// once per call (`quads`). A tile of 3 weight rows by 16 input rows holds 12 accumulators
// and 4 input vectors in registers, one weight load per 4 FMAs, and runs at the FMA peak in
// L1. On 4 Phi-3-mini layers' weights (benchmarks/gemv_rows.py --dense --base, a 2-core AVX2
// EPYC) it takes 0.80 of the dot form's time at 16 rows, 0.82 at 12 and 0.90 at 8. Each tile
// of weight rows runs it on the whole groups of four (at most 16 rows) and then takes the rest
// from cache: 24-32 rows by the broadcast form again (0.81-0.87 of the dot form's time at 24,
// 28 and 32 rows), the 1-7 rows left at 9-23 by the dot form, which needs no padding to a
// group of four (see Rest). Below 8 rows the dot form is as fast or faster, so it keeps them.
//
// Built with -mavx2 -mfma and run only where the CPU has both. OpenMP: the same libgomp.so.1
// PyTorch loaded, so one thread pool serves both.
#include <immintrin.h>
#include <stdint.h>

#include <vector>

namespace {

constexpr int64_t kStep = 16;       // bf16 of a weight row per load
constexpr int kGroup = 4;           // the most input rows per pass of the chunked loop
constexpr int kAccumulators = 12;   // per pass of the chunked loop: rows x weight rows
constexpr int64_t kChunk = 1024;    // k per chunk: 3-4 weight rows x 2 KiB stay in L1 for every group
constexpr int kChunkedRows = 7;     // the most rows the chunked loop takes (5-7)
constexpr int64_t kLine = 32;       // bf16 per 64-byte cache line

inline __m256 even_half(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
inline __m256 odd_half(__m256i v) {
  return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// x [rows, k] bf16 -> xs [rows, k] fp32, each run of 16 as its 8 even then its 8 odd elements.
void split(const uint16_t* x, float* xs, int64_t rows, int64_t k) {
  for (int64_t i = 0; i < rows * k; i += kStep) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
    _mm256_store_ps(xs + i, even_half(v));
    _mm256_store_ps(xs + i + 8, odd_half(v));
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// fp32 -> bf16, rounding to nearest even (a NaN stays a NaN), as PyTorch rounds.
inline uint16_t to_bf16(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

// The next group's rows when `left` rows go to `groups` groups as even as they can be, the
// larger first (5 rows: 3 + 2, not 4 + 1). Both loops that take rows in groups split them so:
// the chunked loop at 5 rows, the dot passes after the broadcast at 21 and 22 rows.
inline int64_t next_group(int64_t left, int64_t groups) { return (left + groups - 1) / groups; }

// k in [c0, c1) of weight rows j0..j0+J into M input rows' accumulators: the step both loops
// below repeat. x loads come from L1 (each run of xs serves J weight rows). With `ahead` (the
// next tile's first row, or null), each 64-byte line of a row also asks L2 for the line at the
// same k of the row J further on.
template <int M, int J>
__attribute__((always_inline)) inline void accumulate(const uint16_t* w, const float* xs, int64_t k, int64_t j0,
                                                      int64_t c0, int64_t c1, __m256 (&acc)[M][J],
                                                      const uint16_t* ahead = nullptr) {
  for (int64_t c = c0; c < c1; c += kStep) {
    for (int j = 0; j < J; ++j) {
      if (ahead && c % kLine == 0) _mm_prefetch(reinterpret_cast<const char*>(ahead + j * k + c), _MM_HINT_T1);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (j0 + j) * k + c));
      const __m256 we = even_half(v), wo = odd_half(v);
      for (int m = 0; m < M; ++m) {
        acc[m][j] = _mm256_fmadd_ps(we, _mm256_load_ps(xs + m * k + c), acc[m][j]);
        acc[m][j] = _mm256_fmadd_ps(wo, _mm256_load_ps(xs + m * k + c + 8), acc[m][j]);
      }
    }
  }
}

// 1-4 rows: J weight rows stream side by side through one pass over k (1 row: 8 streams, 8
// independent accumulators to cover the FMA latency; 2-3 rows: 4; 4 rows: 3). The read is the
// bound at one row. From two rows the FMAs take about as long as the read, and the two no
// longer overlap in full: 4 rows ran at ~0.7 of the rate the same loop reaches on weights in L3.
// So 2-4 rows ask L2 for the next tile's rows a tile ahead (0.87-0.92 of the time without, at
// 2-4 rows on a 2-core AVX2 EPYC, benchmarks/gemv_rows.py --dense --base; at one row it gained
// nothing, and in the chunked loop below, at 5-7 rows, it lost).
template <int M, int J>
void stream_tile(const uint16_t* w, const float* xs, int64_t k, uint16_t* y, int64_t n, int64_t j0, bool prefetch) {
  __m256 acc[M][J];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < J; ++j) acc[m][j] = _mm256_setzero_ps();
  accumulate<M, J>(w, xs, k, j0, 0, k, acc, prefetch && j0 + 2 * J <= n ? w + (j0 + J) * k : nullptr);
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < J; ++j) y[m * n + j0 + j] = to_bf16(hsum(acc[m][j]));
}

template <int M, int J>
void stream(const uint16_t* w, const float* xs, int64_t k, uint16_t* y, int64_t n, int threads) {
  const int64_t tiles = n / J;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < tiles; ++t) stream_tile<M, J>(w, xs, k, y, n, t * J, M >= 2);
  for (int64_t j = tiles * J; j < n; ++j) stream_tile<M, 1>(w, xs, k, y, n, j, M >= 2);
}

// 5-7 rows: bound by the FMAs (two per input row per load), so each weight byte must
// serve every row from L1. A tile of J weight rows is cut into kChunk runs of k; each run is
// taken by the rows in two groups of at most 12 / J (12 accumulators), the first group reading
// it from memory and the other from L1, with partial sums kept in `part` between runs. On a
// 2-core AVX2 EPYC, when it also took 8-32 rows: 1.5x the streaming loop at 8 rows, 3.5x at 16
// (which cannot hold 16 rows' accumulators in registers); at 4 rows, one group, the two are
// even. The groups are as even as they can be (3 + 2 rows, not 4 + 1), and 5-6 rows take
// tiles of 4 weight rows (3 + 2 and 3 + 3 rows) where 7 take tiles of 3 (4 + 3). At 5 rows
// that takes 0.89 of the time of 4 + 1 rows on tiles of 3 (benchmarks/gemv_rows.py --dense
// --base; the even groups alone, on tiles of 3: ~0.95); at 6 rows the two are even, and
// tiles of 4 at 7 rows (3 + 2 + 2) were no faster. Two accumulators per output (even and odd
// halves) in the smaller group gained nothing, nor did other chunk lengths (512-3072), and
// software prefetches of the next run, spread over the groups or issued at once before the
// group that reads L1, lost (0.75-0.95 of the rate).
template <int M, int J>
__attribute__((always_inline)) inline void chunk_pass(const uint16_t* w, const float* xs, int64_t k, int64_t j0,
                                                      int64_t c0, int64_t c1, __m256* part, bool first) {
  __m256 acc[M][J];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < J; ++j) acc[m][j] = first ? _mm256_setzero_ps() : part[m * J + j];
  accumulate<M, J>(w, xs, k, j0, c0, c1, acc);
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < J; ++j) part[m * J + j] = acc[m][j];
}

template <int J>
void chunked_tile(const uint16_t* w, const float* xs, int64_t rows, int64_t k, uint16_t* y, int64_t n, int64_t j0) {
  constexpr int most = kAccumulators / J < kGroup ? kAccumulators / J : kGroup;   // rows per group
  const int64_t groups = (rows + most - 1) / most;
  __m256 part[kChunkedRows * J];   // every row's partial sums
  for (int64_t c0 = 0; c0 < k; c0 += kChunk) {
    const int64_t c1 = c0 + kChunk < k ? c0 + kChunk : k;
    for (int64_t g = 0, i = 0; i < groups; ++i) {
      const int64_t size = next_group(rows - g, groups - i);
      const float* xg = xs + g * k;
      __m256* pg = part + g * J;
      g += size;
      switch (size) {
        case 1: chunk_pass<1, J>(w, xg, k, j0, c0, c1, pg, c0 == 0); break;
        case 2: chunk_pass<2, J>(w, xg, k, j0, c0, c1, pg, c0 == 0); break;
        case 3: chunk_pass<3, J>(w, xg, k, j0, c0, c1, pg, c0 == 0); break;
        default: chunk_pass<most, J>(w, xg, k, j0, c0, c1, pg, c0 == 0); break;
      }
    }
  }
  for (int64_t m = 0; m < rows; ++m)
    for (int j = 0; j < J; ++j) y[m * n + j0 + j] = to_bf16(hsum(part[m * J + j]));
}

template <int J>
void chunked(const uint16_t* w, const float* xs, int64_t rows, int64_t k, uint16_t* y, int64_t n, int threads) {
  const int64_t tiles = n / J;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < tiles; ++t) chunked_tile<J>(w, xs, rows, k, y, n, t * J);
  for (int64_t j = tiles * J; j < n; ++j) chunked_tile<1>(w, xs, rows, k, y, n, j);
}

// 8-16 rows: the broadcast form (the header). xq [k/2][quads][8] fp32: for each pair of k, each
// group of four input rows as [x_r[2p] for its 4 rows | x_r[2p+1] for its 4 rows], rows past
// `rows` zero.
void quads(const uint16_t* x, float* xq, int64_t rows, int64_t k) {
  const int64_t qs = (rows + 3) / 4;
  for (int64_t p = 0; p < k / 2; ++p)
    for (int64_t q = 0; q < qs; ++q) {
      uint32_t* d = reinterpret_cast<uint32_t*>(xq + (p * qs + q) * 8);
      for (int l = 0; l < 4; ++l) {
        const int64_t m = 4 * q + l;
        d[l] = m < rows ? static_cast<uint32_t>(x[m * k + 2 * p]) << 16 : 0;
        d[4 + l] = m < rows ? static_cast<uint32_t>(x[m * k + 2 * p + 1]) << 16 : 0;
      }
    }
}

// Weight rows j0..j0+J times Q groups of four input rows (Q = quads per pair in xq), over all
// of k. Every loop over the accumulators is unrolled: GCC keeps an array indexed in a loop it
// does not unroll in memory, and then stores all 12 accumulators on every step. With
// `prefetch`, each 64-byte line of the tile's rows (16 pairs) first asks L2 for the line at the
// same k of the rows J further on, as the streaming loop does: 0.94 of the time at 8-12 rows,
// 0.96-1.01 at 13-16 (benchmarks/gemv_rows.py --dense --base); none at 24-32, so their two
// passes go without. Issued from inside the unrolled pair loop, the same prefetch spilled the
// accumulators and halved the rate.
template <int J, int Q>
void quad_tile(const uint16_t* __restrict w, const float* __restrict xq, int64_t rows, int64_t k, uint16_t* y,
               int64_t n, int64_t j0, bool prefetch) {
  __m256 acc[J][Q];
#pragma GCC unroll 16
  for (int j = 0; j < J; ++j)
#pragma GCC unroll 16
    for (int q = 0; q < Q; ++q) acc[j][q] = _mm256_setzero_ps();
  const uint16_t* wr[J];
#pragma GCC unroll 16
  for (int j = 0; j < J; ++j) wr[j] = w + (j0 + j) * k;
  // bytes of the broadcast pair into the high halves of fp32 lanes: w_2p in lanes 0-3, w_2p+1 in 4-7
  const __m256i spread = _mm256_setr_epi8(-128, -128, 0, 1, -128, -128, 0, 1, -128, -128, 0, 1, -128, -128, 0, 1,
                                          -128, -128, 2, 3, -128, -128, 2, 3, -128, -128, 2, 3, -128, -128, 2, 3);
  const uint16_t* ahead = prefetch && j0 + 2 * J <= n ? w + (j0 + J) * k : nullptr;
  for (int64_t p0 = 0; p0 < k / 2; p0 += kLine / 2) {
    if (ahead) {
#pragma GCC unroll 16
      for (int j = 0; j < J; ++j) _mm_prefetch(reinterpret_cast<const char*>(ahead + j * k + 2 * p0), _MM_HINT_T1);
    }
    const int64_t p1 = p0 + kLine / 2 < k / 2 ? p0 + kLine / 2 : k / 2;
    for (int64_t p = p0; p < p1; ++p) {
      __m256 xv[Q];
#pragma GCC unroll 16
      for (int q = 0; q < Q; ++q) xv[q] = _mm256_load_ps(xq + (p * Q + q) * 8);
#pragma GCC unroll 16
      for (int j = 0; j < J; ++j) {
        const __m256i pair = _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(wr[j] + 2 * p)));
        const __m256 wv = _mm256_castsi256_ps(_mm256_shuffle_epi8(pair, spread));
#pragma GCC unroll 16
        for (int q = 0; q < Q; ++q) acc[j][q] = _mm256_fmadd_ps(wv, xv[q], acc[j][q]);
      }
    }
  }
  __m256 sums[J][Q];   // out of registers once, through an unrolled copy (see above)
#pragma GCC unroll 16
  for (int j = 0; j < J; ++j)
#pragma GCC unroll 16
    for (int q = 0; q < Q; ++q) sums[j][q] = acc[j][q];
  for (int j = 0; j < J; ++j)
    for (int q = 0; q < Q; ++q) {
      // lanes l and l+4 hold row 4q+l's sums over even and odd k
      alignas(16) float out[4];
      _mm_store_ps(out, _mm_add_ps(_mm256_castps256_ps128(sums[j][q]), _mm256_extractf128_ps(sums[j][q], 1)));
      for (int l = 0; l < 4 && 4 * q + l < rows; ++l) y[(4 * q + l) * n + j0 + j] = to_bf16(out[l]);
    }
}

// How a tile takes the rows past its whole quads (4Q rows), reading the tile again from
// cache: at 24-32 rows by the broadcast form again (their quads in xb, Q2 of them), at 9-23
// by the dot form (their split rows in xb). Each group has inputs of its own, so no pass loads
// another's. The dot form takes the 1-7 rows left without padding them to a group of four:
// 0.86-0.91 of the padded broadcast's time at 9, 13 and 14 rows, even at 10, and 0.78-0.89
// of the chunked loop's at 17-23 (benchmarks/gemv_rows.py --dense --base); its groups split
// as evenly as they can (next_group): 0.89-0.92 of 4 + 1 rows' time at 21, 0.90-1.00 at 22. At 11 and 15 rows
// one row of padding costs less than three rows in the dot form (1.04-1.05), so they stay
// padded.
enum class Rest { none, quads, dot };

template <int J, int Q, Rest R, int Q2>
inline void quad_pass(const uint16_t* w, const float* xa, const float* xb, int64_t rows, int64_t k, uint16_t* y,
                      int64_t n, int64_t j0) {
  constexpr int first = 4 * Q;
  quad_tile<J, Q>(w, xa, R == Rest::none ? rows : first, k, y, n, j0, R != Rest::quads);
  if constexpr (R == Rest::quads) quad_tile<J, Q2>(w, xb, rows - first, k, y + first * n, n, j0, false);
  if constexpr (R == Rest::dot) {
    // rows per dot pass, within 12 accumulators: tiles of 4 and 6 weight rows (9-14 rows) leave
    // at most 2 rows, tiles of 3 (17-23 rows) up to 7, four at a time
    constexpr int per = J <= 3 ? kGroup : 2;
    const int64_t groups = (rows - first + per - 1) / per;
    for (int64_t g = first, i = 0; i < groups; ++i) {
      const float* xg = xb + (g - first) * k;
      uint16_t* yg = y + g * n;
      const int64_t m = next_group(rows - g, groups - i);
      g += m;
      if (m == 1) stream_tile<1, J>(w, xg, k, yg, n, j0, false);
      else if (m == 2) stream_tile<2, J>(w, xg, k, yg, n, j0, false);
      else if constexpr (per == kGroup) {
        if (m == 3) stream_tile<3, J>(w, xg, k, yg, n, j0, false);
        else stream_tile<4, J>(w, xg, k, yg, n, j0, false);
      }
    }
  }
}

template <int J, int Q, Rest R = Rest::none, int Q2 = 0>
void broadcast(const uint16_t* w, const float* xa, const float* xb, int64_t rows, int64_t k, uint16_t* y, int64_t n,
               int threads) {
  const int64_t tiles = n / J;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < tiles; ++t) quad_pass<J, Q, R, Q2>(w, xa, xb, rows, k, y, n, t * J);
  for (int64_t j = tiles * J; j < n; ++j) quad_pass<1, Q, R, Q2>(w, xa, xb, rows, k, y, n, j);
}

}  // namespace

extern "C" {

// The ABI this file implements; the loader refuses a library that answers otherwise.
int vcfslm_gemv_abi(void) { return 1; }

// 0 on success; -1 when the shape is outside what the loop covers (k a multiple of 16, 1-32
// rows). The signature is vcfslm_gemv_bf16's of the AVX512-BF16 loop, so vcfslm::gemv calls
// either; prefetch is accepted and unused.
int vcfslm_gemv_bf16(const uint16_t* w, const uint16_t* x, uint16_t* y, int64_t rows, int64_t n, int64_t k,
                     int threads, int64_t prefetch) {
  if (rows < 1 || rows > 32 || n < 1 || k < kStep || k % kStep != 0 || threads < 1 || prefetch < 0) return -1;
  // The widened input rows, reused across calls of this thread (at most 32 x k fp32, 32-byte
  // aligned for the loads above; as quads, rows rounded up to a multiple of 4).
  static thread_local std::vector<float> scratch;
  const int64_t need = (rows + 3) / 4 * 4 * k + 8;
  if (static_cast<int64_t>(scratch.size()) < need) scratch.resize(need);
  float* xs = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 31) & ~uintptr_t{31});
  if (rows >= 8) {
    // the same scratch: the quads of the first 4Q rows (Q = 2-4, at most 16 rows; 11 and 15
    // padded to 12 and 16), then the rest's quads (24-32 rows) or split rows (9, 10, 13, 14
    // and 17-23)
    const bool pad = rows < 16 && rows % 4 == 3;   // one row of padding (see Rest)
    const int64_t first = rows >= 16 ? 16 : pad ? rows : rows / 4 * 4;
    float* second = xs + first * k;
    quads(x, xs, first, k);
    if (rows >= 24) {
      quads(x + first * k, second, rows - first, k);
      switch ((rows - first + 3) / 4) {
        case 2: broadcast<3, 4, Rest::quads, 2>(w, xs, second, rows, k, y, n, threads); break;
        case 3: broadcast<3, 4, Rest::quads, 3>(w, xs, second, rows, k, y, n, threads); break;
        default: broadcast<3, 4, Rest::quads, 4>(w, xs, second, rows, k, y, n, threads); break;
      }
    } else if (rows > first) {
      split(x + first * k, second, rows - first, k);
      switch (first / 4) {
        case 2: broadcast<6, 2, Rest::dot>(w, xs, second, rows, k, y, n, threads); break;
        case 3: broadcast<4, 3, Rest::dot>(w, xs, second, rows, k, y, n, threads); break;
        default: broadcast<3, 4, Rest::dot>(w, xs, second, rows, k, y, n, threads); break;
      }
    } else {
      switch ((first + 3) / 4) {
        case 2: broadcast<6, 2>(w, xs, nullptr, rows, k, y, n, threads); break;   // 12 accumulators each
        case 3: broadcast<4, 3>(w, xs, nullptr, rows, k, y, n, threads); break;
        default: broadcast<3, 4>(w, xs, nullptr, rows, k, y, n, threads); break;
      }
    }
    return 0;
  }
  split(x, xs, rows, k);
  switch (rows) {
    case 1: stream<1, 8>(w, xs, k, y, n, threads); break;
    case 2: stream<2, 4>(w, xs, k, y, n, threads); break;
    case 3: stream<3, 4>(w, xs, k, y, n, threads); break;
    case 4: stream<4, 3>(w, xs, k, y, n, threads); break;
    case 5:
    case 6: chunked<4>(w, xs, rows, k, y, n, threads); break;
    default: chunked<3>(w, xs, rows, k, y, n, threads); break;   // 7 rows
  }
  return 0;
}

}  // extern "C"
