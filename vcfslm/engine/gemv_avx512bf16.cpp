// y[rows, n] = x[rows, k] . W^T for 1-32 rows of bf16, with W read in place from the buffer
// oneDNN packed it into (vcfslm.engine.gemv builds this file and checks the layout first).
//
// oneDNN's bf16 inner product on AVX512-BF16 CPUs packs a [n, k] weight as AB16b64a2b:
// [n/64][k/32][16][64][2], i.e. for each block of 64 outputs, k/2 rows of 128 bf16 that
// hold 64 outputs x 2 consecutive k. One such row is exactly four vdpbf16ps operands: lane
// i of operand z pairs (W[64b + 16z + i][2r], W[..][2r + 1]) with the broadcast pair
// (x[2r], x[2r + 1]). A block is one contiguous stream of k * 128 bytes, so each thread reads
// its blocks front to back with nothing else in the loop: the weight reads of a decode step.
// oneDNN's own kernel for the same few rows reads this layout at ~0.7 of the read probe on
// the CPUs measured; this loop, at ~0.9 (benchmarks/gemv_hypotheses.py).
//
// Built with -mavx512f -mavx512bf16 and run only where the CPU has both. OpenMP: the same
// libgomp.so.1 PyTorch loaded, so one thread pool serves both.
#include <immintrin.h>
#include <stdint.h>

namespace {

constexpr int64_t kBlock = 64;  // outputs per block
constexpr int64_t kRow = 128;   // bf16 per row of a block: 64 outputs x 2 k

// One k-pair row of a block (64 outputs x 2 k, four vdpbf16ps operands) into M rows'
// accumulators: the step both loops below repeat.
template <int M>
__attribute__((always_inline)) inline void pair_step(const uint16_t* row, const uint32_t* xp, int64_t pairs,
                                                     int64_t r, __m512 (&acc)[M][4]) {
  __m512bh wv[4];
  for (int z = 0; z < 4; ++z) wv[z] = (__m512bh)_mm512_loadu_si512(row + 32 * z);
  for (int m = 0; m < M; ++m) {
    const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[m * pairs + r]));
    for (int z = 0; z < 4; ++z) acc[m][z] = _mm512_dpbf16_ps(acc[m][z], wv[z], xb);
  }
}

template <int M>
inline void block(const uint16_t* w, const uint16_t* x, int64_t k, uint16_t* y, int64_t n, int64_t prefetch) {
  __m512 acc[M][4];
  for (int m = 0; m < M; ++m)
    for (int z = 0; z < 4; ++z) acc[m][z] = _mm512_setzero_ps();
  const int64_t pairs = k / 2;
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x);
  for (int64_t r = 0; r < pairs; ++r) {
    const uint16_t* row = w + r * kRow;
    if (prefetch)  // a software prefetch this many bytes ahead (0 in use: measured slower)
      for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(row) + prefetch + 64 * l, _MM_HINT_T0);
    pair_step<M>(row, xp, pairs, r, acc);
  }
  for (int m = 0; m < M; ++m)
    for (int z = 0; z < 4; ++z)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * n + 16 * z),
                          (__m256i)_mm512_cvtneps_pbh(acc[m][z]));
}

// 7-32 rows: each weight byte now serves more rows than one pass can hold (6 rows x 64
// outputs = 24 accumulators, 4 weight registers and a broadcast: 29 of 32 zmm), so the loop
// is bound by vdpbf16ps more than by the read. A block's k is cut into chunks that stay in L1
// (kChunk pairs x 256 B = 16 KiB), and each chunk is run for the rows six at a time; partial
// sums wait in `part`. The first group's pass reads the chunk from memory; the other groups
// find it in L1. Two software prefetches keep the memory busy meanwhile:
// - into L2, what comes kTiledPrefetch bytes later, so the DRAM read of the next chunks
//   overlaps the compute of this one (the hardware prefetcher alone left ~20% on the table;
//   16-64 KiB ahead measured alike). Every group's pass issues its share of these, row r by
//   group r % groups: issued by the first group alone they came in a burst, and the memory
//   idled through the other groups' passes (spread: 1.05-1.2x at 8-32 rows on AVX512-BF16
//   EPYC);
// - into L1, by the first group, what it reads kNearPrefetch bytes later (2-6% at 8-32 rows;
//   1-4 KiB measured alike).
constexpr int64_t kChunk = 64;
constexpr int kGroup = 6;
constexpr int64_t kTiledPrefetch = 64 * 1024;
constexpr int64_t kNearPrefetch = 2 * 1024;

template <int M>
inline void tile(const uint16_t* w, const uint32_t* xp, int64_t pairs, int64_t r0, int64_t rn,
                 float* part, bool first, int64_t group, int64_t groups) {
  __m512 acc[M][4];
  for (int m = 0; m < M; ++m)
    for (int z = 0; z < 4; ++z) acc[m][z] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(part + m * kBlock + 16 * z);
  int64_t mine = r0 + (group - r0 % groups + groups) % groups;   // the first row whose L2 prefetch is this group's
  for (int64_t r = r0; r < r0 + rn; ++r) {
    const char* row = reinterpret_cast<const char*>(w + r * kRow);
    // Past the weight's end is harmless: a prefetch never faults.
    if (r == mine) {
      for (int l = 0; l < 4; ++l) _mm_prefetch(row + kTiledPrefetch + 64 * l, _MM_HINT_T1);
      mine += groups;
    }
    if (group == 0)
      for (int l = 0; l < 4; ++l) _mm_prefetch(row + kNearPrefetch + 64 * l, _MM_HINT_T0);
    pair_step<M>(w + r * kRow, xp, pairs, r, acc);
  }
  for (int m = 0; m < M; ++m)
    for (int z = 0; z < 4; ++z) _mm512_storeu_ps(part + m * kBlock + 16 * z, acc[m][z]);
}

inline void block_tiled(const uint16_t* w, const uint16_t* x, int64_t k, uint16_t* y, int64_t n, int64_t rows) {
  alignas(64) float part[32 * kBlock];
  const int64_t pairs = k / 2;
  const int64_t groups = (rows + kGroup - 1) / kGroup;
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x);
  for (int64_t r0 = 0; r0 < pairs; r0 += kChunk) {
    const int64_t rn = pairs - r0 < kChunk ? pairs - r0 : kChunk;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t m = rows - g * kGroup < kGroup ? rows - g * kGroup : kGroup;
      const uint32_t* xg = xp + g * kGroup * pairs;
      float* pg = part + g * kGroup * kBlock;
      switch (m) {
        case 1: tile<1>(w, xg, pairs, r0, rn, pg, r0 == 0, g, groups); break;
        case 2: tile<2>(w, xg, pairs, r0, rn, pg, r0 == 0, g, groups); break;
        case 3: tile<3>(w, xg, pairs, r0, rn, pg, r0 == 0, g, groups); break;
        case 4: tile<4>(w, xg, pairs, r0, rn, pg, r0 == 0, g, groups); break;
        case 5: tile<5>(w, xg, pairs, r0, rn, pg, r0 == 0, g, groups); break;
        default: tile<6>(w, xg, pairs, r0, rn, pg, r0 == 0, g, groups); break;
      }
    }
  }
  for (int64_t m = 0; m < rows; ++m)
    for (int z = 0; z < 4; ++z)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * n + 16 * z),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(part + m * kBlock + 16 * z)));
}

}  // namespace

extern "C" {



// The ABI this file implements; the loader refuses a library that answers otherwise.
int vcfslm_gemv_abi(void) { return 4; }

// 0 on success; -1 when the shape is outside what the layout and the loop cover.
// 1-6 rows stream each block once (at 5-6 rows 1.25-1.4x the chunked loop: one pass holds
// them all, so nothing is stored and read back); 7-32 rows run the L1-chunked loop above.
// prefetch: bytes ahead to prefetch at 1-6 rows (0: none; the benchmark's hypothesis table
// varies it).
int vcfslm_gemv_bf16(const uint16_t* w, const uint16_t* x, uint16_t* y, int64_t rows, int64_t n,
                     int64_t k, int threads, int64_t prefetch) {
  if (rows < 1 || rows > 32 || n % kBlock != 0 || k % 32 != 0 || threads < 1 || prefetch < 0) return -1;
  const int64_t blocks = n / kBlock;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const uint16_t* wb = w + b * kBlock * k;
    uint16_t* yb = y + b * kBlock;
    if (rows > 6) {
      block_tiled(wb, x, k, yb, n, rows);
      continue;
    }
    switch (rows) {
      case 1: block<1>(wb, x, k, yb, n, prefetch); break;
      case 2: block<2>(wb, x, k, yb, n, prefetch); break;
      case 3: block<3>(wb, x, k, yb, n, prefetch); break;
      case 4: block<4>(wb, x, k, yb, n, prefetch); break;
      case 5: block<5>(wb, x, k, yb, n, prefetch); break;
      default: block<6>(wb, x, k, yb, n, prefetch); break;
    }
  }
  return 0;
}

}  // extern "C"
