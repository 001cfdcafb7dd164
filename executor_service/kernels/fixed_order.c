/* Deterministic mode's CPU kernels: every floating-point sum here is added in one order, written in this file.
 *
 * A library picks its blocking, its vector width and its thread split from the shape, the thread count and the
 * CPU, and each choice may add a dot product's terms in another order. Here the order is the code's:
 *
 * - GEMM: each output is one accumulator walking K from 0 upwards (float32: one fmaf per term; bfloat16: the
 *   pairs of VDPBF16PS, odd term then even, each a fused multiply-add with denormals flushed). Threads and
 *   vector lanes split the *outputs*, never a sum, so a row's bits do not depend on the rows beside it, the
 *   thread count, a tensor-parallel rank's slice of the columns, or the vector width.
 * - Sums over a row (a norm's squares, an attention dot product over the head dim): 16 lane accumulators,
 *   lane i taking terms i, i+16, ..., then a fixed pairwise tree over the lanes.
 * - exp and log: our own polynomials (fixed_exp, fixed_log), not the C library's or a vector library's, whose
 *   bits differ; the sampler's softmax and its noise's log are here too, so a seeded token is the same bits.
 *
 * Built with -ffp-contract=off and without -ffast-math: the compiler may not fuse or reorder what is written.
 * fmaf and the IEEE basic operations are correctly rounded, so AVX-512, AVX2 and plain C give the same bits.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>     /* elsewhere (aarch64) the plain C paths below, which give the same bits */
#endif

#define NR 16      /* output columns per packed weight panel */
#define LANES 16   /* accumulators of a row sum */

static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bf16_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

static inline uint16_t f32_bf16(float f) {   /* round to nearest even; NaN stays a quiet NaN */
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float flush(float x) {   /* a denormal becomes a zero of its sign, as VDPBF16PS does */
    return fabsf(x) < 1.17549435e-38f ? copysignf(0.0f, x) : x;
}

/* ---- packing: [N, K] weights -> panels of NR columns, zero padded ------------------------------------- */

/* float32: panel p holds w[p*NR + j][k] at out[(p*K + k)*NR + j]. */
void pack_f32(const float *w, int64_t n, int64_t k, float *out) {
    int64_t panels = (n + NR - 1) / NR;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int j = 0; j < NR; j++) {
                int64_t r = p * NR + j;
                out[(p * k + kk) * NR + j] = r < n ? w[r * k + kk] : 0.0f;
            }
}

/* bfloat16: K in pairs, each lane a pair (k, k+1), the layout VDPBF16PS reads; k2 = ceil(K/2). Denormal weights
 * are flushed here, as the instruction would flush them. */
void pack_bf16(const uint16_t *w, int64_t n, int64_t k, uint16_t *out) {
    int64_t panels = (n + NR - 1) / NR, k2 = (k + 1) / 2;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kk = 0; kk < k2; kk++)
            for (int j = 0; j < NR; j++)
                for (int e = 0; e < 2; e++) {
                    int64_t r = p * NR + j, c = 2 * kk + e;
                    uint16_t v = (r < n && c < k) ? w[r * k + c] : 0;
                    if ((v & 0x7f80) == 0) v &= 0x8000;
                    out[((p * k2 + kk) * NR + j) * 2 + e] = v;
                }
}

/* ---- GEMM tiles ------------------------------------------------------------------------------------------ */

#if defined(__AVX512F__)
#define MR_MAX 8
#else
#define MR_MAX 4
#endif

typedef struct { float v[NR]; } acc_t;

/* rows [MR] of x (float32, row stride ldx) times one panel: acc[r][j] = sum over k, k ascending. */
static inline __attribute__((always_inline)) void tile_f32(int MR, const float *x, int64_t ldx, const float *wp,
                                                            int64_t k, acc_t *acc) {
#if defined(__AVX512F__)
    __m512 a[MR_MAX];
    for (int r = 0; r < MR; r++) a[r] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k; kk++) {
        __m512 w = _mm512_loadu_ps(wp + kk * NR);
        for (int r = 0; r < MR; r++) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + kk]), w, a[r]);
    }
    for (int r = 0; r < MR; r++) _mm512_storeu_ps(acc[r].v, a[r]);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 lo[MR_MAX], hi[MR_MAX];
    for (int r = 0; r < MR; r++) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t kk = 0; kk < k; kk++) {
        __m256 wl = _mm256_loadu_ps(wp + kk * NR), wh = _mm256_loadu_ps(wp + kk * NR + 8);
        for (int r = 0; r < MR; r++) {
            __m256 b = _mm256_set1_ps(x[r * ldx + kk]);
            lo[r] = _mm256_fmadd_ps(b, wl, lo[r]);
            hi[r] = _mm256_fmadd_ps(b, wh, hi[r]);
        }
    }
    for (int r = 0; r < MR; r++) { _mm256_storeu_ps(acc[r].v, lo[r]); _mm256_storeu_ps(acc[r].v + 8, hi[r]); }
#else
    for (int r = 0; r < MR; r++) for (int j = 0; j < NR; j++) acc[r].v[j] = 0.0f;
    for (int64_t kk = 0; kk < k; kk++)
        for (int r = 0; r < MR; r++)
            for (int j = 0; j < NR; j++) acc[r].v[j] = fmaf(x[r * ldx + kk], wp[kk * NR + j], acc[r].v[j]);
#endif
}

#if defined(__AVX512F__)
static inline __m512 flush512(__m512 x) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    __mmask16 tiny = _mm512_cmp_ps_mask(_mm512_andnot_ps(sign, x), _mm512_set1_ps(1.17549435e-38f), _CMP_LT_OQ);
    return _mm512_mask_and_ps(x, tiny, x, sign);
}
#endif
#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 flush256(__m256 x) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 tiny = _mm256_cmp_ps(_mm256_andnot_ps(sign, x), _mm256_set1_ps(1.17549435e-38f), _CMP_LT_OQ);
    return _mm256_blendv_ps(x, _mm256_and_ps(x, sign), tiny);
}
#endif

/* x's pair (k, k+1) as VDPBF16PS reads it, with denormals flushed (the instruction's DAZ). */
static inline uint32_t x_pair(const uint16_t *x, int64_t kk, int64_t k) {
    uint16_t e = x[2 * kk], o = (2 * kk + 1 < k) ? x[2 * kk + 1] : 0;
    if ((e & 0x7f80) == 0) e &= 0x8000;
    if ((o & 0x7f80) == 0) o &= 0x8000;
    return (uint32_t)e | ((uint32_t)o << 16);
}

/* bfloat16 rows times one packed panel: per pair, acc += x[k+1]*w[k+1], then acc += x[k]*w[k], each one
 * rounding with denormal results flushed: VDPBF16PS where the CPU has it, the same steps written out where not. */
static inline __attribute__((always_inline)) void tile_bf16(int MR, const uint16_t *x, int64_t ldx,
                                                             const uint16_t *wp, int64_t k, acc_t *acc) {
    int64_t k2 = (k + 1) / 2;
#if defined(__AVX512BF16__)
    __m512 a[MR_MAX];
    for (int r = 0; r < MR; r++) a[r] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k2; kk++) {
        __m512bh w = (__m512bh)_mm512_loadu_si512(wp + kk * 2 * NR);
        /* The instruction flushes denormal inputs itself: x's pair is read as it lies. */
        for (int r = 0; r < MR; r++) {
            uint32_t p;
            if (2 * kk + 1 < k) memcpy(&p, x + r * ldx + 2 * kk, 4);
            else p = x_pair(x + r * ldx, kk, k);
            a[r] = _mm512_dpbf16_ps(a[r], w, (__m512bh)_mm512_set1_epi32((int)p));
        }
    }
    for (int r = 0; r < MR; r++) _mm512_storeu_ps(acc[r].v, a[r]);
#elif defined(__AVX512F__)
    __m512 a[MR_MAX];
    const __m512i himask = _mm512_set1_epi32((int)0xffff0000u);
    for (int r = 0; r < MR; r++) a[r] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k2; kk++) {
        __m512i w = _mm512_loadu_si512(wp + kk * 2 * NR);
        __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), wo = _mm512_castsi512_ps(_mm512_and_si512(w, himask));
        for (int r = 0; r < MR; r++) {
            uint32_t p = x_pair(x + r * ldx, kk, k);
            a[r] = flush512(_mm512_fmadd_ps(_mm512_set1_ps(bits_f32(p & 0xffff0000u)), wo, a[r]));
            a[r] = flush512(_mm512_fmadd_ps(_mm512_set1_ps(bits_f32(p << 16)), we, a[r]));
        }
    }
    for (int r = 0; r < MR; r++) _mm512_storeu_ps(acc[r].v, a[r]);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 lo[MR_MAX], hi[MR_MAX];
    const __m256i himask = _mm256_set1_epi32((int)0xffff0000u);
    for (int r = 0; r < MR; r++) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t kk = 0; kk < k2; kk++) {
        __m256i wl = _mm256_loadu_si256((const __m256i *)(wp + kk * 2 * NR));
        __m256i wh = _mm256_loadu_si256((const __m256i *)(wp + kk * 2 * NR + NR));
        __m256 wel = _mm256_castsi256_ps(_mm256_slli_epi32(wl, 16)), wol = _mm256_castsi256_ps(_mm256_and_si256(wl, himask));
        __m256 weh = _mm256_castsi256_ps(_mm256_slli_epi32(wh, 16)), woh = _mm256_castsi256_ps(_mm256_and_si256(wh, himask));
        for (int r = 0; r < MR; r++) {
            uint32_t p = x_pair(x + r * ldx, kk, k);
            __m256 xo = _mm256_set1_ps(bits_f32(p & 0xffff0000u)), xe = _mm256_set1_ps(bits_f32(p << 16));
            lo[r] = flush256(_mm256_fmadd_ps(xo, wol, lo[r]));
            hi[r] = flush256(_mm256_fmadd_ps(xo, woh, hi[r]));
            lo[r] = flush256(_mm256_fmadd_ps(xe, wel, lo[r]));
            hi[r] = flush256(_mm256_fmadd_ps(xe, weh, hi[r]));
        }
    }
    for (int r = 0; r < MR; r++) { _mm256_storeu_ps(acc[r].v, lo[r]); _mm256_storeu_ps(acc[r].v + 8, hi[r]); }
#else
    for (int r = 0; r < MR; r++) for (int j = 0; j < NR; j++) acc[r].v[j] = 0.0f;
    for (int64_t kk = 0; kk < k2; kk++)
        for (int r = 0; r < MR; r++) {
            uint32_t p = x_pair(x + r * ldx, kk, k);
            float xo = bits_f32(p & 0xffff0000u), xe = bits_f32(p << 16);
            for (int j = 0; j < NR; j++) {
                float wo = bf16_f32(wp[(kk * NR + j) * 2 + 1]), we = bf16_f32(wp[(kk * NR + j) * 2]);
                acc[r].v[j] = flush(fmaf(xe, we, flush(fmaf(xo, wo, acc[r].v[j]))));
            }
        }
#endif
}

/* One tile's outputs: + bias (one rounding in float32), then the output dtype's rounding. */
static inline void store(int mr, int64_t row0, int64_t col0, int64_t n, const acc_t *acc, const float *bias,
                         void *out, int64_t ldo, int out_bf16) {
    int cols = (int)(n - col0 < NR ? n - col0 : NR);
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < cols; j++) {
            float v = acc[r].v[j];
            if (bias) v = v + bias[col0 + j];
            if (out_bf16) ((uint16_t *)out)[(row0 + r) * ldo + col0 + j] = f32_bf16(v);
            else ((float *)out)[(row0 + r) * ldo + col0 + j] = v;
        }
}

#define DISPATCH(MR_VAR, CALL) \
    switch (MR_VAR) { case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; \
                      default: CALL(4); break; }
#if MR_MAX == 8
#undef DISPATCH
#define DISPATCH(MR_VAR, CALL) \
    switch (MR_VAR) { case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; \
                      case 4: CALL(4); break; case 5: CALL(5); break; case 6: CALL(6); break; \
                      case 7: CALL(7); break; default: CALL(8); break; }
#endif

/* Rows i..i+mr of x times packed panel w (the panel of output columns from col0), stored. */
static inline void tile_rows(const void *x, int64_t ldx, int x_bf16, const void *w, int64_t k, int64_t i, int mr,
                             int64_t col0, int64_t n, const float *bias, void *out, int64_t ldo, int out_bf16) {
    acc_t acc[MR_MAX];
    if (x_bf16) {
        const uint16_t *xs = (const uint16_t *)x + i * ldx;
#define CALL(R) tile_bf16(R, xs, ldx, (const uint16_t *)w, k, acc)
        DISPATCH(mr, CALL)
#undef CALL
    } else {
        const float *xs = (const float *)x + i * ldx;
#define CALL(R) tile_f32(R, xs, ldx, (const float *)w, k, acc)
        DISPATCH(mr, CALL)
#undef CALL
    }
    store(mr, i, col0, n, acc, bias, out, ldo, out_bf16);
}

/* out[m, n] = x[m, k] @ w^T (+ bias): x float32 or bfloat16 (x_bf16), w packed by pack_f32 / pack_bf16 in the
 * same dtype, bias float32 or NULL, out row stride ldo in out's dtype. Threads take whole tiles. */
void gemm(const void *x, int64_t ldx, int x_bf16, const void *wp, const float *bias, void *out, int64_t ldo,
          int out_bf16, int64_t m, int64_t n, int64_t k, int threads) {
    int64_t panels = (n + NR - 1) / NR, row_tiles = (m + MR_MAX - 1) / MR_MAX, tiles = panels * row_tiles;
    int64_t panel_elems = x_bf16 ? ((k + 1) / 2) * 2 * NR : k * NR;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t p = t / row_tiles, i = (t % row_tiles) * MR_MAX;
        int mr = (int)(m - i < MR_MAX ? m - i : MR_MAX);
        const char *w = (const char *)wp + p * panel_elems * (x_bf16 ? 2 : 4);
        tile_rows(x, ldx, x_bf16, w, k, i, mr, p * NR, n, bias, out, ldo, out_bf16);
    }
}

/* ---- GEMM on quantized weights --------------------------------------------------------------------------- */

/* The GGUF block formats kept as they are (every scale and every code the file's), only moved into panels of
 * NR columns: panel p, block b (32 values of K) holds, for the panel's 16 weight rows, the scales d[16] (float16),
 * for Q4_1 the offsets m[16] (float16), then the codes: Q4_0/Q4_1 as 16 bytes per pair of K (low nibble value
 * 2t, high nibble 2t + 1, byte j for row j), Q8_0 as 16 signed bytes per K. qgemm turns a panel into pack_f32's
 * (or pack_bf16's) layout with the values gguf's dequantization gives, Q4_0 d * (q - 8), Q4_1 d * q + m (two
 * roundings), Q8_0 q * d, and runs gemm's tiles on it: its outputs have the bits gemm gives on the dequantized
 * weights, packed. */
#define QK 32
enum { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };

static inline int64_t qblock_bytes(int fmt) { return fmt == Q4_0 ? 32 + 256 : fmt == Q4_1 ? 64 + 256 : 32 + 512; }

int64_t qpanel_bytes(int fmt, int64_t k) { return (k / QK) * qblock_bytes(fmt); }

static inline float f16_f32(uint16_t h) {   /* exact, subnormals and infinities included */
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0x1f) return bits_f32(sign | 0x7f800000u | (m << 13));
    if (e == 0) {
        float v = (float)m * 5.9604644775390625e-08f;   /* m * 2^-24: exact */
        return sign ? -v : v;
    }
    return bits_f32(sign | ((e + 112) << 23) | (m << 13));
}

#if defined(__AVX512F__)
/* Values 2t and 2t + 1 of a block's 16 rows (codes q, scales d, Q4_1 offsets m), as gguf's dequantization
 * gives them. */
static inline __attribute__((always_inline)) void qpair(int fmt, const uint8_t *q, int t, __m512 d, __m512 m,
                                                         __m512 *w0, __m512 *w1) {
    if (fmt == Q8_0) {
        *w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 2 * t * NR)))), d);
        *w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128((const __m128i *)(q + (2 * t + 1) * NR)))), d);
        return;
    }
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + t * NR)));
    __m512i c0 = _mm512_and_si512(v, _mm512_set1_epi32(15)), c1 = _mm512_srli_epi32(v, 4);
    if (fmt == Q4_0) {
        *w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(c0, _mm512_set1_epi32(8))));
        *w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(c1, _mm512_set1_epi32(8))));
    } else {
        *w0 = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(c0)), m);
        *w1 = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(c1)), m);
    }
}

/* A block's scales, Q4_1 offsets (else zeros) and codes. */
static inline __attribute__((always_inline)) const uint8_t *qscales(int fmt, const uint8_t *blk, __m512 *d,
                                                                     __m512 *m) {
    *d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
    *m = fmt == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32))) : _mm512_setzero_ps();
    return blk + (fmt == Q4_1 ? 64 : 32);
}
#endif

/* One block's 32 x 16 weights as float32, at f[kk * NR + j]. */
static inline void dequant_block(int fmt, const uint8_t *b, float *f) {
#if defined(__AVX512F__)
    __m512 d, m, w0, w1;
    const uint8_t *q = qscales(fmt, b, &d, &m);
    for (int t = 0; t < QK / 2; t++) {
        qpair(fmt, q, t, d, m, &w0, &w1);
        _mm512_storeu_ps(f + 2 * t * NR, w0);
        _mm512_storeu_ps(f + (2 * t + 1) * NR, w1);
    }
#else
    const uint16_t *dh = (const uint16_t *)b;
    const uint8_t *q = b + (fmt == Q4_1 ? 64 : 32);
    float d[NR], m[NR];
    for (int j = 0; j < NR; j++) { d[j] = f16_f32(dh[j]); m[j] = fmt == Q4_1 ? f16_f32(dh[NR + j]) : 0.0f; }
    for (int kk = 0; kk < QK; kk++)
        for (int j = 0; j < NR; j++) {
            float w;
            if (fmt == Q8_0) w = (float)(int8_t)q[kk * NR + j] * d[j];
            else {
                int c = (q[(kk / 2) * NR + j] >> (4 * (kk & 1))) & 15;
                w = fmt == Q4_0 ? d[j] * (float)(c - 8) : d[j] * (float)c + m[j];
            }
            f[kk * NR + j] = w;
        }
#endif
}

#if defined(__AVX512F__)
/* Few float32 rows (a decode step) times one quantized panel, each block's weights dequantized into registers and
 * multiplied at once (no panel written and read back): per output, the fmas of tile_f32 in the same k order, on
 * the values dequant_block gives, so the same bits. */
static inline __attribute__((always_inline)) void qtile_f32(int MR, const float *x, int64_t ldx, const uint8_t *qp,
                                                             int fmt, int64_t k, acc_t *acc) {
    __m512 a[MR_MAX];
    for (int r = 0; r < MR; r++) a[r] = _mm512_setzero_ps();
    int64_t bb = qblock_bytes(fmt);
    for (int64_t b = 0; b < k / QK; b++) {
        const float *xb = x + b * QK;
        __m512 d, m, w0, w1;
        const uint8_t *q = qscales(fmt, qp + b * bb, &d, &m);
        for (int t = 0; t < QK / 2; t++) {
            qpair(fmt, q, t, d, m, &w0, &w1);
            for (int r = 0; r < MR; r++) {
                a[r] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * ldx + 2 * t]), w0, a[r]);
                a[r] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * ldx + 2 * t + 1]), w1, a[r]);
            }
        }
    }
    for (int r = 0; r < MR; r++) _mm512_storeu_ps(acc[r].v, a[r]);
}
#endif

#if defined(__AVX512BF16__)
/* A block's pair (w0 = value 2t, w1 = value 2t + 1) of 16 rows as VDPBF16PS reads it: each rounded to bfloat16
 * (to nearest even, as pack_bf16's input was), the even value in the low half of each lane. */
static inline __m512bh bf16_pairs(__m512 w0, __m512 w1) {
    __m512i e = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(w0));
    __m512i o = _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(w1)), 16);
    return (__m512bh)_mm512_or_si512(e, o);
}

/* Few bfloat16 rows times one quantized panel, dequantized in registers: tile_bf16's dot products on the
 * weights a bfloat16 model holds, so the same bits. */
static inline __attribute__((always_inline)) void qtile_bf16(int MR, const uint16_t *x, int64_t ldx,
                                                              const uint8_t *qp, int fmt, int64_t k, acc_t *acc) {
    __m512 a[MR_MAX];
    for (int r = 0; r < MR; r++) a[r] = _mm512_setzero_ps();
    int64_t bb = qblock_bytes(fmt);
    for (int64_t b = 0; b < k / QK; b++) {
        const uint16_t *xb = x + b * QK;
        __m512 d, m, w0, w1;
        const uint8_t *q = qscales(fmt, qp + b * bb, &d, &m);
        for (int t = 0; t < QK / 2; t++) {
            qpair(fmt, q, t, d, m, &w0, &w1);
            __m512bh w = bf16_pairs(w0, w1);
            for (int r = 0; r < MR; r++) {
                uint32_t p2;
                memcpy(&p2, xb + r * ldx + 2 * t, 4);
                a[r] = _mm512_dpbf16_ps(a[r], w, (__m512bh)_mm512_set1_epi32((int)p2));
            }
        }
    }
    for (int r = 0; r < MR; r++) _mm512_storeu_ps(acc[r].v, a[r]);
}
#endif

#if defined(__AVX512BF16__)
#define QTILE_BF16 1
#else
#define QTILE_BF16 0
#endif

/* Panel p of a quantized weight as gemm's packed panel: float32 (pack_f32's layout) or, for bfloat16 rows, each
 * value rounded to bfloat16 as a bfloat16 model would hold it, denormals flushed (pack_bf16's layout). */
static void dequant_panel(int fmt, const uint8_t *qp, int64_t k, int bf16, float *tmp, void *panel) {
    int64_t nb = k / QK, bb = qblock_bytes(fmt);
    for (int64_t b = 0; b < nb; b++) {
        float *f = bf16 ? tmp : (float *)panel + b * QK * NR;
        dequant_block(fmt, qp + b * bb, f);
        if (!bf16) continue;
        uint16_t *o = (uint16_t *)panel + b * QK * NR;   /* pairs (k, k+1) of row j at ((kk/2) * NR + j) * 2 */
#if defined(__AVX512BF16__)
        for (int t = 0; t < QK / 2; t++)     /* the instruction flushes denormals as the loop below does */
            _mm512_storeu_si512(o + t * 2 * NR, (__m512i)bf16_pairs(_mm512_loadu_ps(f + 2 * t * NR),
                                                                    _mm512_loadu_ps(f + (2 * t + 1) * NR)));
        continue;
#endif
        for (int kk = 0; kk < QK; kk++)
            for (int j = 0; j < NR; j++) {
                uint16_t v = f32_bf16(f[kk * NR + j]);
                if ((v & 0x7f80) == 0) v &= 0x8000;
                o[((kk / 2) * NR + j) * 2 + (kk & 1)] = v;
            }
    }
}

/* out[m, n] = x[m, k] @ w^T (+ bias) for w quantized (fmt) and arranged by panels (qpanel_bytes each); K a
 * multiple of 32. Threads take whole panels: each is dequantized once, into memory of its own, for all rows. */
void qgemm(const void *x, int64_t ldx, int x_bf16, const uint8_t *qw, int fmt, const float *bias, void *out,
           int64_t ldo, int out_bf16, int64_t m, int64_t n, int64_t k, int threads) {
    int64_t panels = (n + NR - 1) / NR, pb = qpanel_bytes(fmt, k);
#pragma omp parallel num_threads(threads)
    {
        void *panel = malloc(sizeof(float) * (size_t)(k * NR));
        float *tmp = (float *)malloc(sizeof(float) * QK * NR);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
#if defined(__AVX512F__)
            /* a decode: dequantized in registers, no panel (bfloat16 rows where the CPU has its dot product) */
            if (m <= MR_MAX && (!x_bf16 || QTILE_BF16)) {
                int mr = (int)m;
                acc_t acc[MR_MAX];
#if QTILE_BF16
                if (x_bf16) {
#define CALL(R) qtile_bf16(R, (const uint16_t *)x, ldx, qw + p * pb, fmt, k, acc)
                    DISPATCH(mr, CALL)
#undef CALL
                } else
#endif
                {
#define CALL(R) qtile_f32(R, (const float *)x, ldx, qw + p * pb, fmt, k, acc)
                    DISPATCH(mr, CALL)
#undef CALL
                }
                store(mr, 0, p * NR, n, acc, bias, out, ldo, out_bf16);
                continue;
            }
#endif
            dequant_panel(fmt, qw + p * pb, k, x_bf16, tmp, panel);
            for (int64_t i = 0; i < m; i += MR_MAX)
                tile_rows(x, ldx, x_bf16, panel, k, i, (int)(m - i < MR_MAX ? m - i : MR_MAX), p * NR, n, bias, out,
                          ldo, out_bf16);
        }
        free(panel);
        free(tmp);
    }
}

/* Rows `ids` of a quantized weight (an embedding table) as float32 or bfloat16 rows of k: the values qgemm
 * multiplies, rounded as a bfloat16 model holds them. */
void qrows(const uint8_t *qw, int fmt, int64_t k, const int64_t *ids, int64_t count, void *out, int out_bf16) {
    int64_t pb = qpanel_bytes(fmt, k), bb = qblock_bytes(fmt);
    float f[QK * NR];
    for (int64_t i = 0; i < count; i++) {
        int64_t p = ids[i] / NR, j = ids[i] % NR;
        for (int64_t b = 0; b < k / QK; b++) {
            dequant_block(fmt, qw + p * pb + b * bb, f);
            for (int kk = 0; kk < QK; kk++) {
                float v = f[kk * NR + j];
                if (out_bf16) ((uint16_t *)out)[i * k + b * QK + kk] = f32_bf16(v);
                else ((float *)out)[i * k + b * QK + kk] = v;
            }
        }
    }
}

/* ---- row sums and exp ------------------------------------------------------------------------------------ */

static inline float load(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline float tree16(float *a) {
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) a[i] = a[i] + a[i + w];
    return a[0];
}

/* e^x to about 1 ulp: x = n ln2 + r, |r| <= ln2/2, a degree-7 polynomial in r, times 2^n. Every step is
 * written out, so every CPU gives these bits. Below -87.3 (where e^x is no longer a normal float) it is 0. */
static inline float fixed_exp(float x) {
    /* Branch-free, so that a loop of them vectorizes: clamp, compute, then select. NaN passes through. */
    float xc = x > 88.7f ? 88.7f : x;
    xc = xc < -87.3f ? -87.3f : xc;
    float n = (xc * 1.44269504f + 12582912.0f) - 12582912.0f;   /* round to nearest */
    float r = fmaf(-n, 0.693145752f, xc);
    r = fmaf(-n, 1.42860677e-06f, r);
    float p = 1.98412701e-04f;
    p = fmaf(p, r, 1.38888889e-03f);
    p = fmaf(p, r, 8.33333377e-03f);
    p = fmaf(p, r, 4.16666679e-02f);
    p = fmaf(p, r, 1.66666672e-01f);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    int32_t ni = (int32_t)n;
    float y = p * bits_f32((uint32_t)(ni + 127) << 23);
    return x < -87.3f ? 0.0f : y;
}

/* RMSNorm, as the model writes it: y = round(x * 1/sqrt(mean(x^2) + eps)) * w, each product rounded to the
 * dtype; the mean's sum in LANES lanes and a tree. */
void rms_norm(const void *x, int64_t ldx, const void *w, void *out, int64_t ldo, int64_t m, int64_t h, float eps,
              int bf16, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < m; i++) {
        float a[LANES] = {0};
        for (int64_t c = 0; c < h; c += LANES)
            for (int l = 0; l < LANES; l++)
                if (c + l < h) { float v = load(x, i * ldx + c + l, bf16); a[l] = fmaf(v, v, a[l]); }
        float inv = 1.0f / sqrtf(tree16(a) / (float)h + eps);
        for (int64_t c = 0; c < h; c++) {
            float v = load(x, i * ldx + c, bf16) * inv;
            if (bf16) {
                v = bf16_f32(f32_bf16(v)) * load(w, c, 1);
                ((uint16_t *)out)[i * ldo + c] = f32_bf16(v);
            } else {
                ((float *)out)[i * ldo + c] = v * load(w, c, 0);
            }
        }
    }
}

/* out = silu(gate) * up, gate and up the two halves of x's rows: silu(g) = g / (1 + e^-g), rounded to the
 * dtype, then the product rounded. */
void silu_mul(const void *x, int64_t ldx, void *out, int64_t ldo, int64_t m, int64_t f, int bf16, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < m; i++)
        for (int64_t c = 0; c < f; c++) {
            float g = load(x, i * ldx + c, bf16), u = load(x, i * ldx + f + c, bf16);
            float s = g / (1.0f + fixed_exp(-g));
            if (bf16) ((uint16_t *)out)[i * ldo + c] = f32_bf16(bf16_f32(f32_bf16(s)) * u);
            else ((float *)out)[i * ldo + c] = s * u;
        }
}

/* Rotary embedding in place on the first `heads` heads of each row of x (q and k heads side by side, as the
 * fused qkv projection leaves them): (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) with cos and sin the rows
 * of the tables [positions, d/2] at pos[i]. Each product and each sum rounded to the dtype as torch's
 * elementwise ops round them (rope.py), so the bits are torch's; one pass over the rows instead of six. */
void rotary(void *x, int64_t ldx, int64_t m, int64_t heads, int64_t d, const void *cos, const void *sin,
            int64_t ldc, const int64_t *pos, int bf16, int threads) {
    int64_t half = d / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (m * heads * d > 32768)
    for (int64_t i = 0; i < m; i++)
        for (int64_t h = 0; h < heads; h++)
            for (int64_t c = 0; c < half; c++) {
                int64_t a = i * ldx + h * d + c, b = a + half, t = pos[i] * ldc + c;
                float co = load(cos, t, bf16), si = load(sin, t, bf16), x1 = load(x, a, bf16), x2 = load(x, b, bf16);
                if (bf16) {
                    uint16_t *y = (uint16_t *)x;
                    float p1 = bf16_f32(f32_bf16(x1 * co)), p2 = bf16_f32(f32_bf16(x2 * si));
                    float p3 = bf16_f32(f32_bf16(x2 * co)), p4 = bf16_f32(f32_bf16(x1 * si));
                    y[a] = f32_bf16(p1 - p2);
                    y[b] = f32_bf16(p3 + p4);
                } else {
                    float *y = (float *)x;
                    y[a] = x1 * co - x2 * si;
                    y[b] = x2 * co + x1 * si;
                }
            }
}

/* K and V rows [m, width] (row strides ldk and ldv, elements of `elem` bytes) into their caches at flat slots: slot s is row
 * s % block_size of block s / block_size, at element offsets (block * s_block + row * s_slot) of each cache. A
 * token's heads are contiguous in both, so each is one copy; negative slots (padding) are skipped. */
void store_kv(const void *k, int64_t ldk, const void *v, int64_t ldv, void *kc, void *vc, int64_t s_block, int64_t s_slot,
              int64_t block_size, const int64_t *slots, int64_t m, int64_t width, int64_t elem) {
    for (int64_t i = 0; i < m; i++) {
        if (slots[i] < 0) continue;
        int64_t at = ((slots[i] / block_size) * s_block + (slots[i] % block_size) * s_slot) * elem;
        memcpy((char *)kc + at, (const char *)k + i * ldk * elem, (size_t)(width * elem));
        memcpy((char *)vc + at, (const char *)v + i * ldv * elem, (size_t)(width * elem));
    }
}

/* ---- attention ------------------------------------------------------------------------------------------- */

#define KB 16        /* keys per block: a query's keys are visited in blocks at absolute positions 0, 16, 32, ... */
#define ROWS 48      /* query rows (tokens x the query heads of one KV head) computed together */

/* sc[kk] = sum over c of q[c] * kt[c][kk], c ascending, one fmaf each: the KB scores of one key block. */
static inline void scores16(const float *qr, const float *kt, int64_t d, float *sc) {
#if defined(__AVX512F__)
    __m512 a = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c++) a = _mm512_fmadd_ps(_mm512_set1_ps(qr[c]), _mm512_loadu_ps(kt + c * KB), a);
    _mm512_storeu_ps(sc, a);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; c++) {
        __m256 b = _mm256_set1_ps(qr[c]);
        lo = _mm256_fmadd_ps(b, _mm256_loadu_ps(kt + c * KB), lo);
        hi = _mm256_fmadd_ps(b, _mm256_loadu_ps(kt + c * KB + 8), hi);
    }
    _mm256_storeu_ps(sc, lo);
    _mm256_storeu_ps(sc + 8, hi);
#else
    for (int kk = 0; kk < KB; kk++) sc[kk] = 0.0f;
    for (int64_t c = 0; c < d; c++)
        for (int kk = 0; kk < KB; kk++) sc[kk] = fmaf(qr[c], kt[c * KB + kk], sc[kk]);
#endif
}

/* This block's keys, transposed (kt[c * KB + kk]), and values (vb[kk * d + c]), as float32; keys past nk are
 * zeros. Only moves data: the bits are the cache's, however they are moved. The AVX-512 path (d a multiple of
 * 16) copies the values only if asked (copy_v): otherwise rows4_block reads them in place. */
#if defined(__AVX512F__)
static inline __m512 load16(const void *p, int64_t i, int bf16) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i))), 16));
    return _mm512_loadu_ps((const float *)p + i);
}

/* r[i] <- column i of the 16 x 16 matrix whose rows are r[0..15]. */
static inline void transpose16(__m512 *r) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {   /* within each 128-bit lane L: r[i + c] = column 4L + c of rows i..i+3 */
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    }
    for (int h = 0; h < 16; h += 8)
        for (int c = 0; c < 4; c++) {
            t[h + c] = _mm512_shuffle_f32x4(r[h + c], r[h + 4 + c], 0x88);
            t[h + 4 + c] = _mm512_shuffle_f32x4(r[h + c], r[h + 4 + c], 0xdd);
        }
    for (int c = 0; c < 8; c++) {
        r[c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0x88);
        r[8 + c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0xdd);
    }
}
#endif

/* Key j's slot in the cache, as an element offset (its heads follow at s_head each). */
static inline int64_t slot_at(const int32_t *blocks, int64_t j, int64_t block_size, int64_t s_block, int64_t s_slot) {
    return (int64_t)blocks[j / block_size] * s_block + (j % block_size) * s_slot;
}

/* The block's first nk keys sit at slot[kk] (slot_at), this head at head_off from there. */
static inline void load_block(const void *kc, const void *vc, const int64_t *slot, int nk, int64_t head_off,
                              int64_t d, int bf16, float *kt, float *vb, int copy_v) {
    int64_t base[KB];
    for (int kk = 0; kk < nk; kk++) base[kk] = slot[kk] + head_off;
#if defined(__AVX512F__)
    if (d % 16 == 0) {
        for (int64_t c0 = 0; c0 < d; c0 += 16) {
            __m512 r[KB];
            for (int kk = 0; kk < KB; kk++) {
                r[kk] = kk < nk ? load16(kc, base[kk] + c0, bf16) : _mm512_setzero_ps();
                if (copy_v)
                    _mm512_storeu_ps(vb + kk * d + c0, kk < nk ? load16(vc, base[kk] + c0, bf16) : _mm512_setzero_ps());
            }
            transpose16(r);
            for (int i = 0; i < KB; i++) _mm512_storeu_ps(kt + (c0 + i) * KB, r[i]);
        }
        return;
    }
#endif
    for (int kk = 0; kk < KB; kk++) {
        if (kk < nk) {
            for (int64_t c = 0; c < d; c++) { kt[c * KB + kk] = load(kc, base[kk] + c, bf16); vb[kk * d + c] = load(vc, base[kk] + c, bf16); }
        } else {
            for (int64_t c = 0; c < d; c++) { kt[c * KB + kk] = 0.0f; vb[kk * d + c] = 0.0f; }
        }
    }
}

/* Asks for a later block's keys and values (`width` elements of each slot from head_off: the job's heads) while
 * this one is computed. A sequence's blocks lie anywhere in the cache, a few KB per layer each, too short for the
 * hardware's prefetchers to pick up in time; asked for two blocks ahead, 32 decodes' attention ran about 1.1x faster.
 * always_inline: GCC otherwise judges a function of prefetches alone to have no effect and drops its calls. */
#define PF 2
static inline __attribute__((always_inline)) void prefetch_block(const void *kc, const void *vc,
                                                                 const int32_t *blocks, int64_t j0, int64_t last,
                                                                 int64_t block_size, int64_t s_block, int64_t s_slot,
                                                                 int64_t head_off, int64_t width, int bf16) {
#if defined(__x86_64__) || defined(__i386__)
    int64_t elem = bf16 ? 2 : 4;
    for (int64_t j = j0; j < j0 + KB && j <= last; j++) {
        int64_t off = (slot_at(blocks, j, block_size, s_block, s_slot) + head_off) * elem;
        for (int64_t b = 0; b < width * elem; b += 64) {
            _mm_prefetch((const char *)kc + off + b, _MM_HINT_T1);
            _mm_prefetch((const char *)vc + off + b, _MM_HINT_T1);
        }
    }
#endif
}

/* One query row over one block of keys (the first `seen` of them visible): the running max *mx, sum *l and output
 * orow move on by this block, in the order the comment on `attention` gives. The AVX-512 path computes the
 * same operations per lane as the plain one (fixed_exp16 is fixed_exp lane by lane; the max ignores NaN as the
 * scalar comparison does), so both give the same bits. */
#if defined(__AVX512F__)
static inline __m512 fixed_exp16(__m512 x) {
    __m512 hi = _mm512_set1_ps(88.7f), lo = _mm512_set1_ps(-87.3f), big = _mm512_set1_ps(12582912.0f);
    __m512 xc = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ), x, hi);
    xc = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(xc, lo, _CMP_LT_OQ), xc, lo);
    __m512 n = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504f)), big), big);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), xc);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-06f), r);
    __m512 p = _mm512_set1_ps(1.98412701e-04f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.38888889e-03f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.33333377e-03f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.16666679e-02f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.66666672e-01f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    __m512 y = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), y, _mm512_setzero_ps());
}
#endif

#if defined(__AVX512F__)
/* The online softmax's step for one row and one block, from its raw scores: scale them, hide the unseen keys,
 * raise the running max *mx (scaling *l and orow [d] down when it rises), and leave the block's weights in p
 * (unseen keys 0) with their sum added to *l in key order. The scalar path of row_block, lane by lane. */
static inline void softmax_step16(__m512 raw, int seen, float scale, float *mx, float *l, float *orow, int64_t d,
                                  float *p) {
    __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512 s = _mm512_mask_blend_ps((__mmask16)((1u << seen) - 1u), ninf, _mm512_mul_ps(raw, _mm512_set1_ps(scale)));
    float top = _mm512_reduce_max_ps(_mm512_mask_blend_ps(_mm512_cmp_ps_mask(s, s, _CMP_ORD_Q), ninf, s));
    float bm = top > *mx ? top : *mx;
    if (bm > *mx) {
        float shrink = fixed_exp(*mx - bm);   /* 0 for the first block */
        *l = *l * shrink;
        for (int64_t c0 = 0; c0 < d; c0 += 16)
            _mm512_storeu_ps(orow + c0, _mm512_mul_ps(_mm512_loadu_ps(orow + c0), _mm512_set1_ps(shrink)));
        *mx = bm;
    }
    _mm512_storeu_ps(p, fixed_exp16(_mm512_sub_ps(s, _mm512_set1_ps(bm))));
    float sum = *l;
    for (int kk = 0; kk < seen; kk++) sum = sum + p[kk];
    *l = sum;
}
#endif

static inline void row_block(const float *qr, const float *kt, const float *vb, int64_t d, int seen, float scale,
                             float *mx, float *l, float *orow) {
    float sc[KB], p[KB];
    scores16(qr, kt, d, sc);
#if defined(__AVX512F__)
    if (d % 16 == 0) {
        softmax_step16(_mm512_loadu_ps(sc), seen, scale, mx, l, orow, d, p);
        for (int64_t c0 = 0; c0 < d; c0 += 16) {
            __m512 acc = _mm512_loadu_ps(orow + c0);
            for (int kk = 0; kk < seen; kk++)
                acc = _mm512_fmadd_ps(_mm512_set1_ps(p[kk]), _mm512_loadu_ps(vb + kk * d + c0), acc);
            _mm512_storeu_ps(orow + c0, acc);
        }
        return;
    }
#endif
    for (int kk = 0; kk < KB; kk++) sc[kk] = kk < seen ? sc[kk] * scale : -INFINITY;
    float bm = *mx;
    for (int kk = 0; kk < KB; kk++) bm = sc[kk] > bm ? sc[kk] : bm;
    if (bm > *mx) {
        float shrink = fixed_exp(*mx - bm);   /* 0 for the first block */
        *l = *l * shrink;
        for (int64_t c = 0; c < d; c++) orow[c] = orow[c] * shrink;
        *mx = bm;
    }
    for (int kk = 0; kk < KB; kk++) p[kk] = fixed_exp(sc[kk] - bm);   /* unseen keys: 0 */
    for (int kk = 0; kk < seen; kk++) {
        *l = *l + p[kk];
        const float *vr = vb + kk * d;
        for (int64_t c = 0; c < d; c++) orow[c] = fmaf(p[kk], vr[c], orow[c]);
    }
}

#if defined(__AVX512F__)
/* Four consecutive rows (q4 and o4 [4, d]) over one block, each as row_block computes it (d a multiple of 16),
 * sharing every key and value load among them; a row with seen[r] == 0 is left as it is. Key kk's values are
 * the float32 row vr[kk]: the block's copy, or the cache itself. */
static inline void rows4_block(const float *q4, const float *kt, const float *const *vr, int64_t d, const int *seen,
                               float scale, float *mx, float *l, float *o4) {
    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t c = 0; c < d; c++) {
        __m512 kv = _mm512_loadu_ps(kt + c * KB);
        for (int r = 0; r < 4; r++) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(q4[r * d + c]), kv, a[r]);
    }
    float p[4][KB];
    int most = 0;
    for (int r = 0; r < 4; r++) {
        if (seen[r] <= 0) continue;
        softmax_step16(a[r], seen[r], scale, mx + r, l + r, o4 + r * d, d, p[r]);
        if (seen[r] > most) most = seen[r];
    }
    for (int64_t c0 = 0; c0 < d; c0 += 16) {
        __m512 acc[4];
        for (int r = 0; r < 4; r++) acc[r] = _mm512_loadu_ps(o4 + r * d + c0);
        for (int kk = 0; kk < most; kk++) {
            __m512 vv = _mm512_loadu_ps(vr[kk] + c0);
            for (int r = 0; r < 4; r++)
                if (kk < seen[r]) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(p[r][kk]), vv, acc[r]);
        }
        for (int r = 0; r < 4; r++) _mm512_storeu_ps(o4 + r * d + c0, acc[r]);
    }
}
#endif

/* Whether this build's attention has its AVX-512 paths (then it beats SDPA on prompts too, not only decodes). */
int attention_vectorized(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* Causal attention over a paged cache. Query token t belongs to the sequence whose block ids are tables[seq[t]]
 * (stride table_stride) and sits at pos[t]: it sees keys 0..pos[t]. For each query row (a token's head), in this
 * order and nothing else:
 *   score_j = (sum over d = 0..D-1 of q[d] * k_j[d], one fmaf each from 0) * scale;
 *   keys in blocks of KB at absolute positions; per block, the running max rises to the block's largest score
 *   among the keys the row sees (the sum and the output are scaled by e^(old - new) when it does), then for
 *   each key it sees, in order: p = e^(score - max), sum += p, out[d] = fmaf(p, v_j[d], out[d]);
 *   out / sum at the end.
 * Keys past a row's position are never touched, so nothing depends on the other tokens of the step, the length
 * of a neighbour or what the cache holds past the row. A query token's rows are computed beside the rows of the
 * tokens before it in the same sequence (up to ROWS), to read each key once for all of them: that shares loads,
 * not sums. q [T, H, D] (row stride ldq), out likewise; the caches are addressed by element strides (block,
 * slot, head), the head dim contiguous. */
void attention(const void *q, int64_t ldq, const void *kc, const void *vc, int64_t s_block, int64_t s_slot,
               int64_t s_head, int64_t block_size, const int32_t *tables, int64_t table_stride, const int32_t *seq,
               const int32_t *pos, void *out, int64_t ldo, int64_t t, int64_t heads, int64_t kv_heads, int64_t d,
               float scale, int bf16, int threads) {
    int64_t g = heads / kv_heads, per = ROWS / g > 0 ? ROWS / g : 1;
    /* Groups of consecutive tokens of one sequence, at most `per` each. */
    int64_t *starts = (int64_t *)malloc(sizeof(int64_t) * (size_t)(t + 1)), groups = 0;
    for (int64_t i = 0; i < t; i++)
        if (i == 0 || seq[i] != seq[i - 1] || i - starts[groups - 1] >= per) starts[groups++] = i;
    starts[groups] = t;
    /* A job is a group and either every KV head (a block's rows of all heads lie side by side in the cache: one
     * dense read, which the memory system streams far faster than one head's rows every slot stride) or, where
     * there are too few groups to keep the threads busy (one long decode), one head. */
    int64_t hs = groups >= 4 * (int64_t)threads ? kv_heads : 1, njobs = groups * (kv_heads / hs);
#pragma omp parallel num_threads(threads)
    {
        int64_t rows_head = (per * g + 3) / 4 * 4, rows_max = rows_head * hs;
        float *qv = (float *)calloc((size_t)(rows_max * d), sizeof(float)),   /* pad rows: zeros, not garbage */
              *o = (float *)malloc(sizeof(float) * (size_t)(rows_max * d)),
              *kt = (float *)malloc(sizeof(float) * (size_t)(d * KB)),
              *vb = (float *)malloc(sizeof(float) * (size_t)(KB * d + LANES)),
              *mx = (float *)malloc(sizeof(float) * (size_t)rows_max), *l = (float *)malloc(sizeof(float) * (size_t)rows_max);
        int64_t *rpos = (int64_t *)malloc(sizeof(int64_t) * (size_t)rows_max);
#pragma omp for schedule(dynamic, 1)
        for (int64_t job = 0; job < njobs; job++) {
            int64_t gi = job / (kv_heads / hs), h0 = job % (kv_heads / hs) * hs, t0 = starts[gi];
            int64_t rows = (starts[gi + 1] - t0) * g, last = 0;
            const int32_t *blocks = tables + (int64_t)seq[t0] * table_stride;
            /* head h0 + i's rows at i * rows_head */
            for (int64_t i = 0; i < hs; i++)
                for (int64_t r = 0; r < rows; r++) {
                    int64_t ti = t0 + r / g, hq = (h0 + i) * g + r % g, ri = i * rows_head + r;
                    for (int64_t c = 0; c < d; c++) {
                        qv[ri * d + c] = load(q, ti * ldq + hq * d + c, bf16);
                        o[ri * d + c] = 0.0f;
                    }
                    mx[ri] = -INFINITY; l[ri] = 0.0f; rpos[ri] = pos[ti];
                    if (pos[ti] > last) last = pos[ti];
                }
            for (int64_t j0 = 0; j0 <= last; j0 += KB) {
                int nk = (int)(last - j0 + 1 < KB ? last - j0 + 1 : KB);
                prefetch_block(kc, vc, blocks, j0 + PF * KB, last, block_size, s_block, s_slot, h0 * s_head,
                               hs * s_head, bf16);
                int64_t slot[KB];
                for (int kk = 0; kk < nk; kk++) slot[kk] = slot_at(blocks, j0 + kk, block_size, s_block, s_slot);
                for (int64_t i = 0; i < hs; i++) {
                    int64_t hk = h0 + i, ho = i * rows_head;
                    /* many rows (a prompt's) read each value row many times: copied once into vb, dense; a
                     * decode's few rows read float32 values in place (bfloat16 ones are converted in the copy) */
                    int copy_v = rows > 4 || bf16;
                    load_block(kc, vc, slot, nk, hk * s_head, d, bf16, kt, vb, copy_v);
                    int64_t r = 0;
#if defined(__AVX512F__)
                    if (d % 16 == 0) {
                        const float *vr[KB];
                        for (int kk = 0; kk < nk; kk++)
                            vr[kk] = copy_v ? vb + kk * d : (const float *)vc + slot[kk] + hk * s_head;
                        /* the last four padded (a head's rows are rows_head, rows rounded up to 4): a pad row sees
                         * nothing, so it is neither read into a sum nor written */
                        for (; r < rows; r += 4) {
                            int seen4[4];
                            for (int k = 0; k < 4; k++)
                                seen4[k] = r + k >= rows || j0 > rpos[ho + r + k] ? 0
                                           : (int)(rpos[ho + r + k] - j0 + 1 < nk ? rpos[ho + r + k] - j0 + 1 : nk);
                            rows4_block(qv + (ho + r) * d, kt, vr, d, seen4, scale, mx + ho + r,
                                        l + ho + r, o + (ho + r) * d);
                        }
                    }
#endif
                    for (; r < rows; r++) {
                        if (j0 > rpos[ho + r]) continue;
                        int seen = (int)(rpos[ho + r] - j0 + 1 < nk ? rpos[ho + r] - j0 + 1 : nk);
                        row_block(qv + (ho + r) * d, kt, vb, d, seen, scale, mx + ho + r, l + ho + r, o + (ho + r) * d);
                    }
                }
            }
            for (int64_t i = 0; i < hs; i++)
                for (int64_t r = 0; r < rows; r++) {
                    int64_t ti = t0 + r / g, hq = (h0 + i) * g + r % g, ri = i * rows_head + r;
                    for (int64_t c = 0; c < d; c++) {
                        float v = o[ri * d + c] / l[ri];
                        if (bf16) ((uint16_t *)out)[ti * ldo + hq * d + c] = f32_bf16(v);
                        else ((float *)out)[ti * ldo + hq * d + c] = v;
                    }
                }
        }
        free(qv); free(o); free(kt); free(vb); free(mx); free(l); free(rpos);
    }
    free(starts);
}

/* ---- sampling ---------------------------------------------------------------------------------------------- */

/* log x for normal positive x, to about 1 ulp: x = 2^e m with m in [sqrt(1/2), sqrt(2)), log m = 2 atanh(s) with
 * s = (m - 1) / (m + 1), an odd polynomial in s. 0 gives -inf; negatives and NaN give NaN. */
static inline float fixed_log(float x) {
    if (!(x > 0.0f)) return x == 0.0f ? -INFINITY : NAN;
    if (x == INFINITY) return x;
    uint32_t u = f32_bits(x);
    int32_t e = (int32_t)(u >> 23) - 127;
    if ((u >> 23) == 0) return -INFINITY;      /* denormal: never asked for (callers floor at the least normal) */
    float m = bits_f32((u & 0x007fffffu) | 0x3f800000u);
    if (m > 1.41421356f) { m = m * 0.5f; e += 1; }
    float s = (m - 1.0f) / (m + 1.0f), s2 = s * s;
    float p = 0.117647059f;                      /* 2/17 ... 2/3: 2 atanh(s) = 2s + 2s^3/3 + ... */
    p = fmaf(p, s2, 0.133333333f);
    p = fmaf(p, s2, 0.153846154f);
    p = fmaf(p, s2, 0.181818182f);
    p = fmaf(p, s2, 0.222222222f);
    p = fmaf(p, s2, 0.285714286f);
    p = fmaf(p, s2, 0.4f);
    p = fmaf(p, s2, 0.666666667f);
    float lm = fmaf(p * s2, s, 2.0f * s);
    return fmaf((float)e, 0.693145752f, fmaf((float)e, 1.42860677e-06f, lm));
}

/* A row's max, and its sum of e^(x - max) in LANES lanes and a tree; the terms kept in `terms` unless NULL. */
static inline float row_exp_sum(const float *r, int64_t n, float *mx_out, float *terms) {
    float mx = -INFINITY, a[LANES] = {0};
    for (int64_t c = 0; c < n; c++) mx = r[c] > mx ? r[c] : mx;
    for (int64_t c = 0; c < n; c += LANES)
        for (int l = 0; l < LANES; l++)
            if (c + l < n) {
                float e = fixed_exp(r[c + l] - mx);
                if (terms) terms[c + l] = e;
                a[l] = a[l] + e;
            }
    *mx_out = mx;
    return tree16(a);
}

/* Softmax of each row of x [m, n] (float32) into out: e^(x - max) / their sum (row_exp_sum). A row of -inf
 * only gives NaN, as torch's does. */
void softmax_rows(const float *x, float *out, int64_t m, int64_t n, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < m; i++) {
        float mx, *o = out + i * n, sum = row_exp_sum(x + i * n, n, &mx, o);
        for (int64_t c = 0; c < n; c++) o[c] = o[c] / sum;
    }
}

void log_elems(const float *x, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = fixed_log(x[i]);
}

/* log_softmax of each row: (x - max) - log(sum of e^(x - max)), the sum as softmax_rows adds it. */
void log_softmax_rows(const float *x, float *out, int64_t m, int64_t n, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < m; i++) {
        const float *r = x + i * n;
        float mx, *o = out + i * n, lse = fixed_log(row_exp_sum(r, n, &mx, NULL));
        for (int64_t c = 0; c < n; c++) o[c] = (r[c] - mx) - lse;
    }
}
