// y[rows, n] = x[rows, k] . W^T for 1-4 rows of bf16, with W read in place from the buffer
// oneDNN packed it into (vcfslm.bench.gemv builds this file and checks the layout first).
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
    __m512bh wv[4];
    for (int z = 0; z < 4; ++z) wv[z] = (__m512bh)_mm512_loadu_si512(row + 32 * z);
    for (int m = 0; m < M; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[m * pairs + r]));
      for (int z = 0; z < 4; ++z) acc[m][z] = _mm512_dpbf16_ps(acc[m][z], wv[z], xb);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int z = 0; z < 4; ++z)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * n + 16 * z),
                          (__m256i)_mm512_cvtneps_pbh(acc[m][z]));
}

}  // namespace

extern "C" {

// The ABI this file implements; the loader refuses a library that answers otherwise.
int vcfslm_gemv_abi(void) { return 2; }

// 0 on success; -1 when the shape is outside what the layout and the loop cover.
// prefetch: bytes ahead to prefetch (0: none; the benchmark's hypothesis table varies it).
int vcfslm_gemv_bf16(const uint16_t* w, const uint16_t* x, uint16_t* y, int64_t rows, int64_t n,
                     int64_t k, int threads, int64_t prefetch) {
  if (rows < 1 || rows > 4 || n % kBlock != 0 || k % 32 != 0 || threads < 1 || prefetch < 0) return -1;
  const int64_t blocks = n / kBlock;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const uint16_t* wb = w + b * kBlock * k;
    uint16_t* yb = y + b * kBlock;
    switch (rows) {
      case 1: block<1>(wb, x, k, yb, n, prefetch); break;
      case 2: block<2>(wb, x, k, yb, n, prefetch); break;
      case 3: block<3>(wb, x, k, yb, n, prefetch); break;
      default: block<4>(wb, x, k, yb, n, prefetch); break;
    }
  }
  return 0;
}

}  // extern "C"
