/* A batch-1 decode step's kernels: what one token's forward multiplies, read once from memory.
 *
 * moekit_rows_bf16: y[m, n] = sum_k x[m, k] * w[n, k] for M rows x [M, K] and a bf16 weight w [N, K]
 * stored row-major (nn.Linear's layout, and the output-major layout inference keeps 16-bit experts in),
 * summed in fp32 by AVX512-BF16's pairwise dot products and rounded to bf16 once. Each thread takes an
 * equal contiguous part of the weight's rows and streams it in order, each weight row multiplied by
 * every row of x (two at a time); a call pays one parallel region. For one row oneDNN's prepacked
 * kernel reads its own copy of the weight at about 0.9x this speed, for two about as fast, for four
 * 1.7x faster (each row of x here meets each weight chunk apart): moekit.kernels has the figures.
 *
 * moekit_one_query_bf16: one query per head against a sequence's cached bf16 keys and values (its
 * decode step's attention, every key visible): scores in fp32 (bf16 pairs' dot products), softmax in
 * fp32 (exp by its Taylor series around a power of two), the weights times the values in fp32, the
 * output rounded to bf16 once; the heads split between the threads.
 *
 * Built at first use by moekit.kernels; callers check moekit_rows_supported() first. The thread count is
 * the caller's (torch's), the OpenMP runtime the one torch loaded (same soname).
 */
#include <immintrin.h>
#include <omp.h>
#include <math.h>
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

static inline __m512 widen_bf16(const bf16* p) { /* 16 bf16 -> fp32, exact */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

/* e^x for x <= 0 (scores less their maximum): 2^(x log2 e) = 2^n 2^f with |f| <= 1/2, 2^f by its Taylor
 * series to degree 7 (relative error under 1e-8 before fp32's rounding), 2^n by scalef; below 2^-150, 0.
 * A NaN stays NaN (max_ps returns its second operand when either is NaN), as torch's softmax keeps it. */
static inline __m512 exp_nonpositive(__m512 x) {
    __m512 y = _mm512_max_ps(_mm512_set1_ps(-150.f), _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)));
    __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_mul_ps(_mm512_sub_ps(y, n), _mm512_set1_ps(0.69314718055994531f));
    static const float c[8] = {1.f / 5040, 1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};
    __m512 p = _mm512_set1_ps(c[0]);
    for (int i = 1; i < 8; i++) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
    return _mm512_scalef_ps(p, n);
}

/* q [H, d]; group g's key s at k + g * kgs + s * kps (values likewise); scores: H * S floats of scratch;
 * out [H, d]. d a multiple of 32, at most 128; H a multiple of G (query heads per key/value head). */
void moekit_one_query_bf16(int threads, int64_t H, int64_t G, int64_t S, int64_t d, float scale, const bf16* q,
                           const bf16* k, int64_t kgs, int64_t kps, const bf16* v, int64_t vgs, int64_t vps,
                           float* scores, bf16* out) {
    int64_t per_group = H / G;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t h = 0; h < H; h++) {
        const bf16* kg = k + (h / per_group) * kgs;
        const bf16* vg = v + (h / per_group) * vgs;
        float* sc = scores + h * S;
        float top = -INFINITY;
        for (int64_t s = 0; s < S; s++) {
            __m512 acc = _mm512_setzero_ps();
            for (int64_t j = 0; j < d; j += 32)
                acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(kg + s * kps + j),
                                       (__m512bh)_mm512_loadu_si512(q + h * d + j));
            sc[s] = _mm512_reduce_add_ps(acc) * scale;
            top = sc[s] > top ? sc[s] : top;
        }
        __m512 vtop = _mm512_set1_ps(top), vsum = _mm512_setzero_ps();
        for (int64_t s = 0; s < S; s += 16) {
            __mmask16 m = S - s >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (S - s)) - 1);
            __m512 e = _mm512_maskz_mov_ps(m, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sc + s), vtop)));
            _mm512_mask_storeu_ps(sc + s, m, e);
            vsum = _mm512_add_ps(vsum, e);
        }
        float inv = 1.f / _mm512_reduce_add_ps(vsum);
        __m512 o[8];
        for (int64_t j = 0; j < d / 16; j++) o[j] = _mm512_setzero_ps();
        for (int64_t s = 0; s < S; s++) {
            __m512 p = _mm512_set1_ps(sc[s] * inv);
            for (int64_t j = 0; j < d / 16; j++) o[j] = _mm512_fmadd_ps(p, widen_bf16(vg + s * vps + j * 16), o[j]);
        }
        for (int64_t j = 0; j < d / 16; j++) {
            float tmp[16];
            _mm512_storeu_ps(tmp, o[j]);
            for (int i = 0; i < 16; i++) out[h * d + j * 16 + i] = to_bf16(tmp[i]);
        }
    }
}
