/* A batch-1 decode step's kernels: what one token's forward multiplies, read once from memory.
 *
 * moekit_rows_bf16: y[m, n] = sum_k x[m, k] * w[n, k] for M rows x [M, K] and a bf16 weight w [N, K]
 * stored row-major (nn.Linear's layout, and the output-major layout inference keeps 16-bit experts in),
 * summed in fp32 and rounded to bf16 once. Each thread takes an equal contiguous part of the weight's
 * rows and streams it in order; a call pays one parallel region. One or two rows of x meet each weight
 * row as it streams by. From three (a serving step's several sequences) the AVX2 build widens x to fp32
 * once and takes the weight in chunks that stay in L2, each met by every three rows of x from L1
 * while the next chunk is prefetched: the same sums in the same order, so a row gets the same bits
 * whatever rows come with it (up to the 32 rows experts.matmul.plain_linear gives it on AVX2). For one row oneDNN's prepacked kernel reads its own copy of the weight at
 * about 0.9x this speed, for two about as fast (AVX-512 build): moekit.kernels has the figures.
 *
 * moekit_rows_f32: the same for fp32 rows and an fp32 weight [N, K], the sums in fp32, for CPUs without
 * AVX-512, where oneDNN's fp32 kernels read a weight for a few rows slower than this does (moekit.kernels
 * has the figures); every count of rows sums each output in the same order.
 *
 * moekit_rms_norm_bf16: RMSNorm of bf16 rows in fp32, one C loop where torch's composite pays about ten
 * ops (37-60 us a call for one row of 1024 on a Zen 3, ad hoc; 17 calls a d1024 decode step).
 *
 * moekit_one_query_bf16: one query per head against a sequence's cached bf16 keys and values (its
 * decode step's attention, every key visible): scores in fp32, softmax in fp32 (exp by its Taylor
 * series around a power of two), the weights times the values in fp32, the output rounded to bf16 once;
 * the heads split between the threads.
 *
 * moekit_moe_token_bf16, moekit_attention_token_bf16: one token through a MoE layer's routed experts
 * and through a block's attention half, each with its residual, in one call: the products by rows(),
 * the attention by one_head(), the rest in scalar C rounded to bf16 where torch's ops round (built with
 * -ffp-contract=off, so no product and sum written apart is fused into one FMA; rounded() where the
 * vectorizer would fuse them anyway). moekit_blocks_token_bf16: both, block after block, for every
 * block of a decode step at once.
 *
 * Two builds of this one source, by the instructions the compiler is given (moekit.kernels picks the
 * best this CPU runs): AVX512-BF16, whose pairwise dot products take bf16 as it is; AVX2 with FMA,
 * which widens bf16 to fp32 (exact: a shift) and sums with fp32 FMAs, for CPUs without native bf16,
 * where torch has no fast 16-bit kernel. Products of bf16 values are exact in fp32 either way; only the
 * order of the fp32 sums differs.
 *
 * Built at first use by moekit.kernels; callers check moekit_rows_supported() first. The thread count is
 * the caller's (torch's), the OpenMP runtime the one torch loaded (same soname).
 */
#include <immintrin.h>
#include <omp.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16;

#define CHUNK_BYTES (128 << 10) /* the weight rows a chunk of the many-row kernels holds: half a Zen 3's L2 */

static inline bf16 to_bf16(float v) { /* round to nearest even; a NaN stays a (quiet) NaN */
    uint32_t b;
    memcpy(&b, &v, 4);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (bf16)((b >> 16) | 0x40);
    b += 0x7fffu + ((b >> 16) & 1u);
    return (bf16)(b >> 16);
}

static inline float from_bf16(bf16 v) {
    uint32_t b = (uint32_t)v << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

#if defined(__AVX512BF16__)

int moekit_rows_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("fma");
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

/* One head: query qh [d] over S keys kg and values vg (position strides kps, vps): oh [d]; sc: S floats. */
static void one_head(int64_t S, int64_t d, float scale, const bf16* qh, const bf16* kg, int64_t kps,
                     const bf16* vg, int64_t vps, float* sc, bf16* oh) {
    float top = -INFINITY;
    for (int64_t s = 0; s < S; s++) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t j = 0; j < d; j += 32)
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(kg + s * kps + j),
                                   (__m512bh)_mm512_loadu_si512(qh + j));
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
        for (int i = 0; i < 16; i++) oh[j * 16 + i] = to_bf16(tmp[i]);
    }
}

#elif defined(__AVX2__) && defined(__FMA__)

int moekit_rows_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/* 16 bf16 loaded as 8 pairs: the even ones (low halves) and the odd ones as fp32, exact. */
static inline __m256 even_bf16(__m256i pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }
static inline __m256 odd_bf16(__m256i pairs) {
    return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32((int)0xffff0000u)));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* R rows of x (1 or 2) against one weight row, R a constant once inlined: 2 * R accumulators (even and
 * odd positions apart); the last K % 16 columns in scalar.
 * NOTE: one weight row at a time, streamed in order: four rows side by side as the AVX-512 build reads
 * them ran at 0.74-1.12 ms per 1024 x 4096 weight against 0.70-0.76 (a Zen 3, 2 threads, standalone C,
 * ad hoc). */
static inline __attribute__((always_inline)) void
block(const int R, int64_t K, const bf16* x, const bf16* w, bf16* y, int64_t ldy) {
    __m256 acc[2][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m256i wv = _mm256_loadu_si256((const __m256i*)(w + k));
        __m256 we = even_bf16(wv), wo = odd_bf16(wv);
        for (int r = 0; r < R; r++) {
            __m256i xv = _mm256_loadu_si256((const __m256i*)(x + r * K + k));
            acc[r][0] = _mm256_fmadd_ps(we, even_bf16(xv), acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(wo, odd_bf16(xv), acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        float sum = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
        for (int64_t j = k; j < K; j++) sum += from_bf16(x[r * K + j]) * from_bf16(w[j]);
        y[r * ldy] = to_bf16(sum);
    }
}

/* x's rows widened to fp32 once, each 16 columns as block() splits them: the 8 even ones, then the 8 odd
 * ones (the last K % 16 columns are left out: tile() takes them from x). */
static void widen_rows(int64_t M, int64_t K, const bf16* x, float* xf) {
    for (int64_t r = 0; r < M; r++)
        for (int64_t k = 0; k + 16 <= K; k += 16) {
            __m256i xv = _mm256_loadu_si256((const __m256i*)(x + r * K + k));
            _mm256_storeu_ps(xf + r * K + k, even_bf16(xv));
            _mm256_storeu_ps(xf + r * K + k + 8, odd_bf16(xv));
        }
}

/* R widened rows of x (1 to 3) against W weight rows side by side (1 or 2), constants once inlined: each
 * sum the one block() makes, in the same order (so the same bits), but each weight chunk widened once
 * for R rows, from 2 * R * W accumulators (at most 12 of the 16 registers). */
static inline __attribute__((always_inline)) void
tile(const int R, const int W, int64_t K, const float* xf, const bf16* x, const bf16* w, bf16* y, int64_t ldy,
     const bf16* ahead) {
    __m256 acc[3][2][2];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < W; j++) acc[r][j][0] = acc[r][j][1] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16)
        for (int j = 0; j < W; j++) {
            __m256i wv = _mm256_loadu_si256((const __m256i*)(w + j * K + k));
            __m256 we = even_bf16(wv), wo = odd_bf16(wv);
            if (ahead) _mm_prefetch((const char*)(ahead + j * K + k), _MM_HINT_T1);
            for (int r = 0; r < R; r++) {
                acc[r][j][0] = _mm256_fmadd_ps(we, _mm256_loadu_ps(xf + r * K + k), acc[r][j][0]);
                acc[r][j][1] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(xf + r * K + k + 8), acc[r][j][1]);
            }
        }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < W; j++) {
            float sum = hsum(_mm256_add_ps(acc[r][j][0], acc[r][j][1]));
            for (int64_t i = k; i < K; i++) sum += from_bf16(x[r * K + i]) * from_bf16(w[j * K + i]);
            y[r * ldy + j] = to_bf16(sum);
        }
}

/* R rows of x from r0 against weight rows [c0, c1), two at a time. */
static inline __attribute__((always_inline)) void
sweep(const int R, int64_t r0, int64_t N, int64_t K, const float* xf, const bf16* x, const bf16* w, bf16* y,
      int64_t c0, int64_t c1, int64_t n1) {
    int64_t n = c0, next = c1 - c0;
    for (; n + 2 <= c1; n += 2) {
        const bf16* ahead = r0 == 0 && n + next + 2 <= n1 ? w + (n + next) * K : NULL;
        tile(R, 2, K, xf + r0 * K, x + r0 * K, w + n * K, y + r0 * N + n, N, ahead);
    }
    if (n < c1) tile(R, 1, K, xf + r0 * K, x + r0 * K, w + n * K, y + r0 * N + n, N, NULL);
}

/* One or two rows: each weight row streamed once, x read as it is. More: x widened once (widen_rows),
 * then the weight in chunks of CHUNK_BYTES, each read from memory once and kept in L2 while every three
 * rows of x, from L1, meet it two weight rows at a time.
 * NOTE: streaming the whole weight once per pair of x rows, as for two rows, ran at about 47 GFLOP/s at
 * 16 rows (2 threads, a Zen 3), bound by widening x again for every weight row; every row of x against
 * each weight pair in turn, at about 60, by reading x from L2. */
static void rows(int64_t M, int64_t N, int64_t K, const bf16* x, const bf16* w, bf16* y, int64_t n0, int64_t n1) {
    float* xf = M > 2 && K >= 16 ? malloc((size_t)(M * K) * sizeof(float)) : NULL;
    if (xf == NULL) { /* one or two rows, rows too short to tile, or no memory: the same sums either way */
        int64_t r0 = 0;
        for (; r0 + 2 <= M; r0 += 2)
            for (int64_t n = n0; n < n1; n++) block(2, K, x + r0 * K, w + n * K, y + r0 * N + n, N);
        if (r0 < M)
            for (int64_t n = n0; n < n1; n++) block(1, K, x + r0 * K, w + n * K, y + r0 * N + n, N);
        return;
    }
    widen_rows(M, K, x, xf);
    int64_t chunk = CHUNK_BYTES / (K * (int64_t)sizeof(bf16));
    chunk = chunk < 2 ? 2 : chunk & ~(int64_t)1;
    for (int64_t c0 = n0; c0 < n1; c0 += chunk) {
        int64_t c1 = c0 + chunk < n1 ? c0 + chunk : n1, r0 = 0;
        for (; r0 + 3 <= M; r0 += 3) sweep(3, r0, N, K, xf, x, w, y, c0, c1, n1);
        if (M - r0 == 2) sweep(2, r0, N, K, xf, x, w, y, c0, c1, n1);
        if (M - r0 == 1) sweep(1, r0, N, K, xf, x, w, y, c0, c1, n1);
    }
    free(xf);
}

static inline __m256 widen_bf16(const bf16* p) { /* 8 bf16 -> fp32, exact, in order */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

/* e^x for x <= 0, as the AVX-512 build computes it, but 0 below 2^-126 (no subnormal results: a weight
 * under 1e-38 of the largest one is lost in its fp32 sum either way). A NaN stays NaN (max_ps returns its
 * second operand when either is NaN, and a NaN compares false). */
static inline __m256 exp_nonpositive(__m256 x) {
    __m256 y = _mm256_max_ps(_mm256_set1_ps(-150.f), _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)));
    __m256 n = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_mul_ps(_mm256_sub_ps(y, n), _mm256_set1_ps(0.69314718055994531f));
    static const float c[8] = {1.f / 5040, 1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};
    __m256 p = _mm256_set1_ps(c[0]);
    for (int i = 1; i < 8; i++) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c[i]));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
    return _mm256_andnot_ps(_mm256_cmp_ps(n, _mm256_set1_ps(-126.f), _CMP_LT_OQ), e);
}

/* One head: query qh [d] over S keys kg and values vg (position strides kps, vps): oh [d]; sc: S floats. */
static void one_head(int64_t S, int64_t d, float scale, const bf16* qh, const bf16* kg, int64_t kps,
                     const bf16* vg, int64_t vps, float* sc, bf16* oh) {
    float top = -INFINITY;
    for (int64_t s = 0; s < S; s++) {
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        for (int64_t j = 0; j < d; j += 16) {
            __m256i kv = _mm256_loadu_si256((const __m256i*)(kg + s * kps + j));
            __m256i qv = _mm256_loadu_si256((const __m256i*)(qh + j));
            acc0 = _mm256_fmadd_ps(even_bf16(kv), even_bf16(qv), acc0);
            acc1 = _mm256_fmadd_ps(odd_bf16(kv), odd_bf16(qv), acc1);
        }
        sc[s] = hsum(_mm256_add_ps(acc0, acc1)) * scale;
        top = sc[s] > top ? sc[s] : top;
    }
    __m256 vtop = _mm256_set1_ps(top), vsum = _mm256_setzero_ps();
    int64_t s = 0;
    for (; s + 8 <= S; s += 8) {
        __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sc + s), vtop));
        _mm256_storeu_ps(sc + s, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    if (s < S) { /* the last S % 8 scores through a buffer padded with -inf (e^-inf = 0) */
        float tail[8];
        for (int i = 0; i < 8; i++) tail[i] = s + i < S ? sc[s + i] : -INFINITY;
        __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(tail), vtop));
        _mm256_storeu_ps(tail, e);
        for (int i = 0; s + i < S; i++) sc[s + i] = tail[i];
        vsum = _mm256_add_ps(vsum, e);
    }
    float inv = 1.f / hsum(vsum);
    __m256 o[16];
    for (int64_t j = 0; j < d / 8; j++) o[j] = _mm256_setzero_ps();
    for (int64_t t = 0; t < S; t++) {
        __m256 p = _mm256_set1_ps(sc[t] * inv);
        for (int64_t j = 0; j < d / 8; j++) o[j] = _mm256_fmadd_ps(p, widen_bf16(vg + t * vps + j * 8), o[j]);
    }
    for (int64_t j = 0; j < d / 8; j++) {
        float tmp[8];
        _mm256_storeu_ps(tmp, o[j]);
        for (int i = 0; i < 8; i++) oh[j * 8 + i] = to_bf16(tmp[i]);
    }
}

#else
#error "decode.c is built for AVX512-BF16 or for AVX2 with FMA (moekit.kernels.ISAS)"
#endif

/* This thread's equal contiguous part [n0, n1) of N weight rows, a multiple of 16 rows. */
static void thread_part(int64_t N, int64_t* n0, int64_t* n1) {
    int64_t T = omp_get_num_threads(), t = omp_get_thread_num();
    int64_t blocks = (N + 15) / 16, per = blocks / T, extra = blocks % T;
    int64_t b0 = t * per + (t < extra ? t : extra), b1 = b0 + per + (t < extra ? 1 : 0);
    *n0 = b0 * 16 < N ? b0 * 16 : N;
    *n1 = b1 * 16 < N ? b1 * 16 : N;
}

/* x [M, K], w [N, K], y [M, N], all contiguous bf16. */
void moekit_rows_bf16(int threads, int64_t M, int64_t N, int64_t K, const bf16* x, const bf16* w, bf16* y) {
#pragma omp parallel num_threads(threads)
    {
        int64_t n0, n1;
        thread_part(N, &n0, &n1);
        rows(M, N, K, x, w, y, n0, n1);
    }
}

/* fp32 rows (both builds: AVX2 with FMA, which AVX-512 includes). Each output one 8-lane fp32 accumulator
 * over K in order, its horizontal sum and the scalar tail: the same sums for any count of rows. */
static inline float hsum_f32(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* R rows of x (1 to 4) against W weight rows side by side (1 or 3), constants once inlined: R * W
 * accumulators (at most 12), x read from L1, each weight vector loaded once for R rows; ``ahead``: rows
 * to prefetch into L2 as these stream by (or NULL). */
static inline __attribute__((always_inline)) void
tile_f32(const int R, const int W, int64_t K, const float* x, const float* w, float* y, int64_t ldy,
         const float* ahead) {
    __m256 acc[4][3];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < W; j++) acc[r][j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8)
        for (int j = 0; j < W; j++) {
            __m256 wv = _mm256_loadu_ps(w + j * K + k);
            if (ahead && (k & 15) == 0) _mm_prefetch((const char*)(ahead + j * K + k), _MM_HINT_T1);
            for (int r = 0; r < R; r++) acc[r][j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * K + k), acc[r][j]);
        }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < W; j++) {
            float sum = hsum_f32(acc[r][j]);
            for (int64_t i = k; i < K; i++) sum += x[r * K + i] * w[j * K + i];
            y[r * ldy + j] = sum;
        }
}

/* R rows of x from r0 against weight rows [c0, c1), three at a time; the first rows prefetch the next
 * chunk (up to n1). */
static inline __attribute__((always_inline)) void
sweep_f32(const int R, int64_t r0, int64_t N, int64_t K, const float* x, const float* w, float* y, int64_t c0,
          int64_t c1, int64_t n1) {
    int64_t n = c0, next = c1 - c0;
    for (; n + 3 <= c1; n += 3) {
        const float* ahead = r0 == 0 && n + next + 3 <= n1 ? w + (n + next) * K : NULL;
        tile_f32(R, 3, K, x + r0 * K, w + n * K, y + r0 * N + n, N, ahead);
    }
    for (; n < c1; n++) tile_f32(R, 1, K, x + r0 * K, w + n * K, y + r0 * N + n, N, NULL);
}

/* x [M, K], w [N, K], y [M, N], all contiguous fp32: the weight in chunks of CHUNK_BYTES that stay in L2,
 * each met by every four rows of x in turn. */
void moekit_rows_f32(int threads, int64_t M, int64_t N, int64_t K, const float* x, const float* w, float* y) {
#pragma omp parallel num_threads(threads)
    {
        int64_t n0, n1;
        thread_part(N, &n0, &n1);
        int64_t chunk = K > 0 ? CHUNK_BYTES / (K * (int64_t)sizeof(float)) : 3;
        chunk = chunk < 3 ? 3 : chunk - chunk % 3;
        for (int64_t c0 = n0; c0 < n1; c0 += chunk) {
            int64_t c1 = c0 + chunk < n1 ? c0 + chunk : n1, r0 = 0;
            for (; r0 + 4 <= M; r0 += 4) sweep_f32(4, r0, N, K, x, w, y, c0, c1, n1);
            if (M - r0 == 3) sweep_f32(3, r0, N, K, x, w, y, c0, c1, n1);
            if (M - r0 == 2) sweep_f32(2, r0, N, K, x, w, y, c0, c1, n1);
            if (M - r0 == 1) sweep_f32(1, r0, N, K, x, w, y, c0, c1, n1);
        }
    }
}

/* q [H, d]; group g's key s at k + g * kgs + s * kps (values likewise); scores: H * S floats of scratch;
 * out [H, d]. d a multiple of 32, at most 128; H a multiple of G (query heads per key/value head). */
void moekit_one_query_bf16(int threads, int64_t H, int64_t G, int64_t S, int64_t d, float scale, const bf16* q,
                           const bf16* k, int64_t kgs, int64_t kps, const bf16* v, int64_t vgs, int64_t vps,
                           float* scores, bf16* out) {
    int64_t per_group = H / G;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t h = 0; h < H; h++)
        one_head(S, d, scale, q + h * d, k + (h / per_group) * kgs, kps, v + (h / per_group) * vgs, vps,
                 scores + h * S, out + h * d);
}

/* x [M, D] -> y [M, D], all bf16, w [D]: y = x / sqrt(mean(x^2) + eps) * w per row, in fp32 (the squares
 * summed in order), rounded to bf16 once; rows split between the threads from 16 rows on. */
static void rms_norm_row(int64_t D, float eps, const bf16* x, const bf16* w, bf16* y) {
    float squares = 0.f;
    for (int64_t j = 0; j < D; j++) squares += from_bf16(x[j]) * from_bf16(x[j]);
    float rstd = 1.f / sqrtf(squares / (float)D + eps);
    for (int64_t j = 0; j < D; j++) y[j] = to_bf16(from_bf16(x[j]) * rstd * from_bf16(w[j]));
}

void moekit_rms_norm_bf16(int threads, int64_t M, int64_t D, float eps, const bf16* x, const bf16* w, bf16* y) {
#pragma omp parallel for num_threads(threads) schedule(static) if (M >= 16)
    for (int64_t m = 0; m < M; m++) rms_norm_row(D, eps, x + m * D, w, y + m * D);
}

/* R rows of fp32 x (1 or 2, a constant once inlined) against one int8 weight row q [K] with its scale:
 * int8 widened to fp32 (exact), fp32 FMAs in two chains, the sum times the scale rounded to bf16 once;
 * the last K % 16 columns in scalar. AVX2 with FMA, which both builds ask for. */
static inline __attribute__((always_inline)) void
block_int8(const int R, int64_t K, const float* x, const int8_t* q, float scale, bf16* y, int64_t ldy) {
    __m256 acc[2][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(q + k))));
        __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(q + k + 8))));
        for (int r = 0; r < R; r++) {
            acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * K + k), acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * K + k + 8), acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        __m256 s = _mm256_add_ps(acc[r][0], acc[r][1]);
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        float sum = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
        for (int64_t j = k; j < K; j++) sum += x[r * K + j] * (float)q[j];
        y[r * ldy] = to_bf16(sum * scale);
    }
}

/* x [M, K] fp32 (the rows widened by the caller), q [N, K] int8, scale [N] fp32, y [M, N] bf16: each
 * thread streams an equal contiguous part of q's rows once, for every row of x (two at a time). */
void moekit_rows_int8(int threads, int64_t M, int64_t N, int64_t K, const float* x, const int8_t* q,
                      const float* scale, bf16* y) {
#pragma omp parallel num_threads(threads)
    {
        int64_t n0, n1, r0 = 0;
        thread_part(N, &n0, &n1);
        for (; r0 + 2 <= M; r0 += 2)
            for (int64_t n = n0; n < n1; n++) block_int8(2, K, x + r0 * K, q + n * K, scale[n], y + r0 * N + n, N);
        if (r0 < M)
            for (int64_t n = n0; n < n1; n++) block_int8(1, K, x + r0 * K, q + n * K, scale[n], y + r0 * N + n, N);
    }
}

/* A weight of the one-token calls: bf16 [N, K], or int8 [N, K] with fp32 per-output scales (scale not
 * NULL; each rounded to bf16 first, as infer.quant's int8 product hands them to its kernels). */
typedef struct {
    const void* data;
    const float* scale;
} weight;

/* Matrix e of a stack of E [N, K] weights. */
static inline weight nth(weight w, int64_t e, int64_t N, int64_t K) {
    if (!w.scale) return (weight){(const bf16*)w.data + e * N * K, NULL};
    return (weight){(const int8_t*)w.data + e * N * K, w.scale + e * N};
}

/* Outputs [n0, n1) of one row's product with w: x [K] in bf16 for a bf16 weight, xf the same in fp32 for
 * an int8 one (block_int8's input). */
static void product_part(int64_t N, int64_t K, const bf16* x, const float* xf, weight w, bf16* y, int64_t n0,
                         int64_t n1) {
    if (!w.scale) {
        rows(1, N, K, x, (const bf16*)w.data, y, n0, n1);
        return;
    }
    for (int64_t n = n0; n < n1; n++)
        block_int8(1, K, xf, (const int8_t*)w.data + n * K, from_bf16(to_bf16(w.scale[n])), y + n, N);
}

/* One row's product with w in a parallel region of its own, plus a bias (bf16, or NULL) rounded once
 * more; xf: x widened to fp32 here for an int8 weight. */
static void row_product(int threads, int64_t N, int64_t K, const bf16* x, float* xf, weight w, const bf16* bias,
                        bf16* y) {
    if (w.scale)
        for (int64_t k = 0; k < K; k++) xf[k] = from_bf16(x[k]);
#pragma omp parallel num_threads(threads)
    {
        int64_t n0, n1;
        thread_part(N, &n0, &n1);
        product_part(N, K, x, xf, w, y, n0, n1);
    }
    if (bias)
        for (int64_t n = 0; n < N; n++) y[n] = to_bf16(from_bf16(y[n]) + from_bf16(bias[n]));
}

/* The router of one token: fp32 logits of x [D] against router [E, D] (plus bias), softmax, the top_k
 * experts by score (plus selection_bias, which picks but does not weigh), their scores renormalised to
 * sum to 1 when normalize, times route_scale: picked [top_k] in ascending order, weights [top_k] beside. */
static void route(int64_t D, int64_t E, int64_t top_k, const bf16* x, const float* router, const float* router_bias,
                  const float* selection_bias, int normalize, float route_scale, int64_t* picked, float* weights) {
    float scores[E], top = -INFINITY, sum = 0.f;
    for (int64_t e = 0; e < E; e++) {
        float part[8] = {0};
        int64_t j = 0;
        for (; j + 8 <= D; j += 8)
            for (int i = 0; i < 8; i++) part[i] += from_bf16(x[j + i]) * router[e * D + j + i];
        float logit = router_bias ? router_bias[e] : 0.f;
        for (int i = 0; i < 8; i++) logit += part[i];
        for (; j < D; j++) logit += from_bf16(x[j]) * router[e * D + j];
        scores[e] = logit;
        top = logit > top ? logit : top;
    }
    for (int64_t e = 0; e < E; e++) sum += scores[e] = expf(scores[e] - top);
    for (int64_t e = 0; e < E; e++) scores[e] /= sum;
    int taken[E];
    memset(taken, 0, sizeof taken);
    float total = 0.f;
    for (int64_t k = 0; k < top_k; k++) { /* the best untaken expert; a tie goes to the lower index */
        int64_t best = -1;
        float best_score = -INFINITY;
        for (int64_t e = 0; e < E; e++) {
            float s = scores[e] + (selection_bias ? selection_bias[e] : 0.f);
            if (!taken[e] && (best < 0 || s > best_score)) best = e, best_score = s;
        }
        taken[best] = 1;
        total += scores[best];
    }
    for (int64_t e = 0, k = 0; e < E; e++)
        if (taken[e]) {
            picked[k] = e;
            weights[k++] = (normalize && top_k > 1 ? scores[e] / total : scores[e]) * route_scale;
        }
}

/* A MoE layer of the one-token calls: its RMSNorm (norm [D], eps; the whole-step call's, which normalises
 * the residual stream first), its router (fp32 router [E, D], router_bias [E] or NULL, selection_bias [E]
 * or NULL; route), top_k picks renormalised when normalize, times route_scale, and its SwiGLU experts
 * without biases: w_in [E, 2F, D] (gate rows, then up rows) and w_out [E, D, F] output-major, bf16 or
 * int8 with scales [E, 2F] and [E, D]. picked [top_k] and weights [top_k]: where the call writes its
 * routing. */
typedef struct {
    const bf16* norm;
    float eps;
    const float* router;
    const float* router_bias;
    const float* selection_bias;
    int64_t experts, hidden, top_k;
    int normalize;
    float route_scale;
    weight w_in, w_out;
    int64_t* picked;
    float* weights;
} moe_layer;

/* One token through a MoE layer's routed experts and the residual around it: route x [D] (route), then
 * each picked expert's h = w_in[e] x ([2F]: gate rows, then up rows), a = silu(gate) * up and y_k = w_out[e]
 * a ([D]), each product summed in fp32 and every result rounded to bf16 as torch's ops round it; out =
 * residual + sum_k bf16(w_k) y_k. scratch: 3F + top_k D bf16 and D + F floats. One parallel region: each
 * product split by weight rows as moekit_rows_bf16 splits it, the activation and the sum by position. */
static void moe_token(int threads, int64_t D, const moe_layer* m, const bf16* x, const bf16* residual, bf16* scratch,
                      float* widened, bf16* out) {
    const int64_t F = m->hidden, top_k = m->top_k;
    const int64_t* picked = m->picked;
    const float* weights = m->weights;
    bf16 *h = scratch, *a = h + 2 * F, *y = a + F;
    route(D, m->experts, top_k, x, m->router, m->router_bias, m->selection_bias, m->normalize, m->route_scale,
          m->picked, m->weights);
    float *xf = widened, *af = widened + D; /* the int8 kernel's fp32 inputs */
    for (int64_t j = 0; j < D; j++) xf[j] = from_bf16(x[j]);
#pragma omp parallel num_threads(threads)
    {
        int64_t n0, n1, T = omp_get_num_threads(), t = omp_get_thread_num();
        int64_t f0 = F * t / T, f1 = F * (t + 1) / T, d0 = D * t / T, d1 = D * (t + 1) / T;
        for (int64_t k = 0; k < top_k; k++) {
            thread_part(2 * F, &n0, &n1);
            product_part(2 * F, D, x, xf, nth(m->w_in, picked[k], 2 * F, D), h, n0, n1);
#pragma omp barrier
            for (int64_t f = f0; f < f1; f++) {
                float gate = from_bf16(h[f]);
                a[f] = to_bf16(from_bf16(to_bf16(gate / (1.f + expf(-gate)))) * from_bf16(h[F + f]));
                af[f] = from_bf16(a[f]);
            }
#pragma omp barrier
            thread_part(D, &n0, &n1);
            product_part(D, F, a, af, nth(m->w_out, picked[k], D, F), y + k * D, n0, n1);
        }
#pragma omp barrier
        for (int64_t d = d0; d < d1; d++) {
            float sum = 0.f;
            for (int64_t k = 0; k < top_k; k++)
                sum += from_bf16(to_bf16(from_bf16(y[k * D + d]) * from_bf16(to_bf16(weights[k]))));
            out[d] = to_bf16(from_bf16(residual[d]) + from_bf16(to_bf16(sum)));
        }
    }
}

void moekit_moe_token_bf16(int threads, int64_t D, const moe_layer* m, const bf16* x, const bf16* residual,
                           bf16* scratch, float* widened, bf16* out) {
    moe_token(threads, D, m, x, residual, scratch, widened, out);
}

/* A product kept as rounded: the compiler may neither fuse it into an FMA with the sum it feeds nor
 * vectorize it into one (GCC turns the complex multiply below into vfmaddsub even without contraction). */
static inline float rounded(float v) {
    __asm__("" : "+x"(v));
    return v;
}

/* v rotated pair by pair (v[2j], v[2j+1]) by rope[j] = (cos, sin) in fp32 as torch multiplies complex
 * numbers (each product rounded, then summed), rounded to bf16. */
static void rotate(int64_t d, const bf16* v, const float* rope, bf16* out) {
    for (int64_t j = 0; j < d / 2; j++) {
        float a = from_bf16(v[2 * j]), b = from_bf16(v[2 * j + 1]), c = rope[2 * j], s = rope[2 * j + 1];
        out[2 * j] = to_bf16(rounded(a * c) - rounded(b * s));
        out[2 * j + 1] = to_bf16(rounded(a * s) + rounded(b * c));
    }
}

/* A block's attention half of the one-token calls: its RMSNorm (norm [D], eps); qkv [(H + 2G) d, D] laid
 * out per key/value group (its Q = H / G query heads, its key, its value: moekit's Attention), qkv_b its
 * bias or NULL; the cache's keys and values (group g's position s at + g * gs + s * d); out [D, H d],
 * out_b or NULL; scale: the scores' (d^-0.5). The two weights bf16, or int8 with per-output scales. */
typedef struct {
    const bf16* norm;
    float eps;
    weight qkv;
    const bf16* qkv_b;
    bf16* keys;
    bf16* values;
    int64_t gs, heads, groups, head_dim;
    weight out;
    const bf16* out_b;
    float scale;
} attention_layer;

/* One token at position S through a block's attention half, the residual around it: x [D] +
 * out(attend(rope(qkv(norm(x))))), rope [d/2, 2] this position's (cos, sin), this token's key and value
 * written at position S, every position up to it attended (one_head). Each result rounded to bf16 where
 * torch's ops round it. scratch: D + (3H + 2G) d bf16, H (S + 1) + D + H d floats. */
static void attention_token(int threads, int64_t D, int64_t S, const attention_layer* l, const float* rope,
                            const bf16* x, bf16* scratch, float* scores, bf16* out) {
    const int64_t H = l->heads, G = l->groups, d = l->head_dim, Q = H / G, gs = l->gs;
    bf16 *normed = scratch, *qkv = normed + D, *q = qkv + (H + 2 * G) * d, *attended = q + H * d;
    float* widened = scores + H * (S + 1); /* D, then H d: the int8 kernel's fp32 inputs */
    rms_norm_row(D, l->eps, x, l->norm, normed);
    row_product(threads, (H + 2 * G) * d, D, normed, widened, l->qkv, l->qkv_b, qkv);
    for (int64_t g = 0; g < G; g++) {
        const bf16* group = qkv + g * (Q + 2) * d;
        for (int64_t i = 0; i < Q; i++) rotate(d, group + i * d, rope, q + (g * Q + i) * d);
        rotate(d, group + Q * d, rope, l->keys + g * gs + S * d);
        memcpy(l->values + g * gs + S * d, group + (Q + 1) * d, d * sizeof(bf16));
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t h = 0; h < H; h++)
        one_head(S + 1, d, l->scale, q + h * d, l->keys + (h / Q) * gs, d, l->values + (h / Q) * gs, d,
                 scores + h * (S + 1), attended + h * d);
    row_product(threads, D, H * d, attended, widened + D, l->out, l->out_b, out);
    for (int64_t j = 0; j < D; j++) out[j] = to_bf16(from_bf16(x[j]) + from_bf16(out[j]));
}

void moekit_attention_token_bf16(int threads, int64_t D, int64_t S, const attention_layer* l, const float* rope,
                                 const bf16* x, bf16* scratch, float* scores, bf16* out) {
    attention_token(threads, D, S, l, rope, x, scratch, scores, out);
}

/* One token at position S through L blocks: attention[i], then moe[i] on its RMSNorm of the residual
 * stream, block after block; x [D] in, the residual stream after the last block out. scratch: 2D bf16
 * beside the largest layer's scratch (attention_token's, moe_token's); scores: the largest layer's
 * floats. A decode step's blocks in one call: no Python runs between them while their weights stream
 * through the caches. */
void moekit_blocks_token_bf16(int threads, int64_t L, int64_t D, int64_t S, const attention_layer* attention,
                              const moe_layer* moe, const float* rope, bf16* x, bf16* scratch, float* scores) {
    bf16 *mid = scratch, *normed = mid + D, *rest = normed + D;
    for (int64_t i = 0; i < L; i++) {
        attention_token(threads, D, S, &attention[i], rope, x, rest, scores, mid);
        rms_norm_row(D, moe[i].eps, mid, moe[i].norm, normed);
        moe_token(threads, D, &moe[i], normed, mid, rest, scores, x);
    }
}
