// y[rows, n] = x[rows, k] . W^T for 1-32 rows of bf16, with W the plain row-major bf16 weight
// of the dense-bf16 plan (CPUs where oneDNN has no bf16: AVX2 with FMA, no AVX512-BF16).
// vcfslm.bench.dense_gemv builds this file and checks it against F.linear first.
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
// Built with -mavx2 -mfma and run only where the CPU has both. OpenMP: the same libgomp.so.1
// PyTorch loaded, so one thread pool serves both.
#include <immintrin.h>
#include <stdint.h>

#include <vector>

namespace {

constexpr int64_t kStep = 16;       // bf16 of a weight row per load
constexpr int kGroup = 4;           // input rows per pass of the chunked loop
constexpr int kChunkOutputs = 3;    // weight rows per tile of the chunked loop (4 x 3 accumulators)
constexpr int64_t kChunk = 1024;    // k per chunk: 3 weight rows x 2 KiB stay in L1 for every group

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

// k in [c0, c1) of weight rows j0..j0+J into M input rows' accumulators: the step both loops
// below repeat. x loads come from L1 (each run of xs serves J weight rows).
template <int M, int J>
__attribute__((always_inline)) inline void accumulate(const uint16_t* w, const float* xs, int64_t k, int64_t j0,
                                                      int64_t c0, int64_t c1, __m256 (&acc)[M][J]) {
  for (int64_t c = c0; c < c1; c += kStep) {
    for (int j = 0; j < J; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (j0 + j) * k + c));
      const __m256 we = even_half(v), wo = odd_half(v);
      for (int m = 0; m < M; ++m) {
        acc[m][j] = _mm256_fmadd_ps(we, _mm256_load_ps(xs + m * k + c), acc[m][j]);
        acc[m][j] = _mm256_fmadd_ps(wo, _mm256_load_ps(xs + m * k + c + 8), acc[m][j]);
      }
    }
  }
}

// 1-3 rows: J weight rows stream side by side through one pass over k (1 row: 8 streams, 8
// independent accumulators to cover the FMA latency; 2-3 rows: 4). The read is the bound.
template <int M, int J>
void stream_tile(const uint16_t* w, const float* xs, int64_t k, uint16_t* y, int64_t n, int64_t j0) {
  __m256 acc[M][J];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < J; ++j) acc[m][j] = _mm256_setzero_ps();
  accumulate<M, J>(w, xs, k, j0, 0, k, acc);
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < J; ++j) y[m * n + j0 + j] = to_bf16(hsum(acc[m][j]));
}

template <int M, int J>
void stream(const uint16_t* w, const float* xs, int64_t k, uint16_t* y, int64_t n, int threads) {
  const int64_t tiles = n / J;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < tiles; ++t) stream_tile<M, J>(w, xs, k, y, n, t * J);
  for (int64_t j = tiles * J; j < n; ++j) stream_tile<M, 1>(w, xs, k, y, n, j);
}

// 4-32 rows: bound by the FMAs (two per input row per load), so each weight byte must serve
// every row from L1. A tile of J weight rows is cut into kChunk runs of k; each run is taken
// by the rows four at a time (12 accumulators), the first group reading it from memory and
// the others from L1, with partial sums kept in `part` between runs. On a 2-core AVX2 EPYC:
// 1.1x the streaming loop at 4 rows, 1.5x at 8, 3.5x at 16 (which cannot hold 16 rows'
// accumulators in registers).
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
  __m256 part[32 * J];
  for (int64_t c0 = 0; c0 < k; c0 += kChunk) {
    const int64_t c1 = c0 + kChunk < k ? c0 + kChunk : k;
    for (int64_t g = 0; g < rows; g += kGroup) {
      const float* xg = xs + g * k;
      __m256* pg = part + g * J;
      switch (rows - g < kGroup ? rows - g : kGroup) {
        case 1: chunk_pass<1, J>(w, xg, k, j0, c0, c1, pg, c0 == 0); break;
        case 2: chunk_pass<2, J>(w, xg, k, j0, c0, c1, pg, c0 == 0); break;
        case 3: chunk_pass<3, J>(w, xg, k, j0, c0, c1, pg, c0 == 0); break;
        default: chunk_pass<4, J>(w, xg, k, j0, c0, c1, pg, c0 == 0); break;
      }
    }
  }
  for (int64_t m = 0; m < rows; ++m)
    for (int j = 0; j < J; ++j) y[m * n + j0 + j] = to_bf16(hsum(part[m * J + j]));
}

void chunked(const uint16_t* w, const float* xs, int64_t rows, int64_t k, uint16_t* y, int64_t n, int threads) {
  const int64_t tiles = n / kChunkOutputs;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < tiles; ++t) chunked_tile<kChunkOutputs>(w, xs, rows, k, y, n, t * kChunkOutputs);
  for (int64_t j = tiles * kChunkOutputs; j < n; ++j) chunked_tile<1>(w, xs, rows, k, y, n, j);
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
  // aligned for the loads above).
  static thread_local std::vector<float> scratch;
  if (static_cast<int64_t>(scratch.size()) < rows * k + 8) scratch.resize(rows * k + 8);
  float* xs = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 31) & ~uintptr_t{31});
  split(x, xs, rows, k);
  switch (rows) {
    case 1: stream<1, 8>(w, xs, k, y, n, threads); break;
    case 2: stream<2, 4>(w, xs, k, y, n, threads); break;
    case 3: stream<3, 4>(w, xs, k, y, n, threads); break;
    default: chunked(w, xs, rows, k, y, n, threads); break;
  }
  return 0;
}

}  // extern "C"
