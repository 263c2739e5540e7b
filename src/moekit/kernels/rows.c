/* Products of a row or two with a bf16 weight read once from memory: a batch-1 decode step's work.
 *
 * y[m, n] = sum_k x[m, k] * w[n, k] for M rows x [M, K] and a weight w [N, K] stored row-major (nn.Linear's
 * layout, and the output-major layout inference keeps 16-bit experts in), summed in fp32 by AVX512-BF16's
 * pairwise dot products and rounded to bf16 once. Each thread takes an equal contiguous part of the
 * weight's rows and streams it in order, each weight row multiplied by every row of x (two at a time);
 * a call pays one parallel region. For one row oneDNN's prepacked kernel reads its own copy of the
 * weight at about 0.9x this speed, for two about as fast, for four 1.7x faster (each row of x here
 * meets each weight chunk apart): moekit.kernels has the figures and says where it is used.
 *
 * Built at first use by moekit.kernels; callers check moekit_rows_supported() first. The thread count is
 * the caller's (torch's), the OpenMP runtime the one torch loaded (same soname).
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

typedef uint16_t bf16;

int moekit_rows_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

static inline bf16 to_bf16(float v) { /* round to nearest even; a NaN stays a (quiet) NaN */
    uint32_t b;
    memcpy(&b, &v, 4);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (bf16)((b >> 16) | 0x40);
    b += 0x7fffu + ((b >> 16) & 1u);
    return (bf16)(b >> 16);
}

/* R rows of x (1 or 2) against O weight rows (1 or 4), both constants once inlined: R * O accumulators.
 * NOTE: masked loads only for the last K % 32 columns: masking every load halved the speed. */
static inline __attribute__((always_inline)) void
block(const int R, const int O, int64_t K, const bf16* x, const bf16* w, bf16* y, int64_t ldy) {
    __m512 acc[2][4];
    for (int r = 0; r < R; r++)
        for (int o = 0; o < O; o++) acc[r][o] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512bh wv[4];
        for (int o = 0; o < O; o++) wv[o] = (__m512bh)_mm512_loadu_si512(w + o * K + k);
        for (int r = 0; r < R; r++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * K + k);
            for (int o = 0; o < O; o++) acc[r][o] = _mm512_dpbf16_ps(acc[r][o], wv[o], xv);
        }
    }
    if (k < K) { /* masked loads read zeros past the row's end */
        __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
        __m512bh wv[4];
        for (int o = 0; o < O; o++) wv[o] = (__m512bh)_mm512_maskz_loadu_epi16(m, w + o * K + k);
        for (int r = 0; r < R; r++) {
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + r * K + k);
            for (int o = 0; o < O; o++) acc[r][o] = _mm512_dpbf16_ps(acc[r][o], wv[o], xv);
        }
    }
    for (int r = 0; r < R; r++)
        for (int o = 0; o < O; o++) y[r * ldy + o] = to_bf16(_mm512_reduce_add_ps(acc[r][o]));
}

/* Rows r0..r0+R-1 of x (R: 1 or 2) against weight rows n0..n1-1, four at a time, the rest one by one. */
#define SWEEP(R)                                                                                \
    do {                                                                                        \
        int64_t n = n0;                                                                         \
        for (; n + 4 <= n1; n += 4) block(R, 4, K, x + r0 * K, w + n * K, y + r0 * N + n, N);    \
        for (; n < n1; n++) block(R, 1, K, x + r0 * K, w + n * K, y + r0 * N + n, N);           \
    } while (0)

static void rows(int64_t M, int64_t N, int64_t K, const bf16* x, const bf16* w, bf16* y, int64_t n0, int64_t n1) {
    int64_t r0 = 0;
    for (; r0 + 2 <= M; r0 += 2) SWEEP(2);
    if (r0 < M) SWEEP(1);
}

/* x [M, K], w [N, K], y [M, N], all contiguous bf16. */
void moekit_rows_bf16(int threads, int64_t M, int64_t N, int64_t K, const bf16* x, const bf16* w, bf16* y) {
#pragma omp parallel num_threads(threads)
    {
        /* equal contiguous parts of the weight's rows, each a multiple of 16 rows */
        int64_t T = omp_get_num_threads(), t = omp_get_thread_num();
        int64_t blocks = (N + 15) / 16, per = blocks / T, extra = blocks % T;
        int64_t b0 = t * per + (t < extra ? t : extra), b1 = b0 + per + (t < extra ? 1 : 0);
        int64_t n0 = b0 * 16 < N ? b0 * 16 : N, n1 = b1 * 16 < N ? b1 * 16 : N;
        rows(M, N, K, x, w, y, n0, n1);
    }
}
