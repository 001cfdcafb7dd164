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
 * - exp: our own polynomial (fixed_exp), not the C library's or a vector library's, whose bits differ.
 *
 * Built with -ffp-contract=off and without -ffast-math: the compiler may not fuse or reorder what is written.
 * fmaf and the IEEE basic operations are correctly rounded, so AVX-512, AVX2 and plain C give the same bits.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

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
        acc_t acc[MR_MAX];
        if (x_bf16) {
            const uint16_t *xs = (const uint16_t *)x + i * ldx, *w = (const uint16_t *)wp + p * panel_elems;
#define CALL(R) tile_bf16(R, xs, ldx, w, k, acc)
            DISPATCH(mr, CALL)
#undef CALL
        } else {
            const float *xs = (const float *)x + i * ldx, *w = (const float *)wp + p * panel_elems;
#define CALL(R) tile_f32(R, xs, ldx, w, k, acc)
            DISPATCH(mr, CALL)
#undef CALL
        }
        store(mr, i, p * NR, n, acc, bias, out, ldo, out_bf16);
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
    if (x != x) return x;
    if (x > 88.7f) x = 88.7f;
    if (x < -87.3f) return 0.0f;
    float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;   /* round to nearest */
    float r = fmaf(-n, 0.693145752f, x);
    r = fmaf(-n, 1.42860677e-06f, r);
    float p = 1.98412701e-04f;
    p = fmaf(p, r, 1.38888889e-03f);
    p = fmaf(p, r, 8.33333377e-03f);
    p = fmaf(p, r, 4.16666679e-02f);
    p = fmaf(p, r, 1.66666672e-01f);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    return p * bits_f32((uint32_t)((int32_t)n + 127) << 23);
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

/* ---- attention ------------------------------------------------------------------------------------------- */

/* Causal attention over a paged cache, one query token at a time. Query token t belongs to the sequence whose
 * block ids are tables[seq[t]] (stride table_stride) and sits at pos[t]: it sees keys 0..pos[t]. For each of
 * its heads the keys are visited in ascending order with an online softmax (the running max, the running sum
 * and the output rescaled when the max rises), the dot products over the head dim in LANES lanes and a tree.
 * Nothing depends on the other tokens of the step. q [T, H, D] (row stride ldq), out likewise (ldo); the caches
 * are addressed by element strides (block, slot, head), the head dim contiguous. */
void attention(const void *q, int64_t ldq, const void *kc, const void *vc, int64_t s_block, int64_t s_slot,
               int64_t s_head, int64_t block_size, const int32_t *tables, int64_t table_stride, const int32_t *seq,
               const int32_t *pos, void *out, int64_t ldo, int64_t t, int64_t heads, int64_t kv_heads, int64_t d,
               float scale, int bf16, int threads) {
    int64_t g = heads / kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t job = 0; job < t * heads; job++) {
        int64_t ti = job / heads, hq = job % heads, hk = hq / g;
        const int32_t *blocks = tables + (int64_t)seq[ti] * table_stride;
        float qv[512], o[512];      /* head dim <= 512, checked by the caller */
        for (int64_t c = 0; c < d; c++) { qv[c] = load(q, ti * ldq + hq * d + c, bf16); o[c] = 0.0f; }
        float mx = -INFINITY, l = 0.0f;
        for (int64_t j = 0; j <= pos[ti]; j++) {
            int64_t base = (int64_t)blocks[j / block_size] * s_block + (j % block_size) * s_slot + hk * s_head;
            float a[LANES] = {0};
            for (int64_t c = 0; c < d; c += LANES)
                for (int ln = 0; ln < LANES; ln++)
                    if (c + ln < d) a[ln] = fmaf(qv[c + ln], load(kc, base + c + ln, bf16), a[ln]);
            float s = tree16(a) * scale;
            if (s > mx) {
                float shrink = fixed_exp(mx - s);   /* 0 for the first key */
                l = l * shrink;
                for (int64_t c = 0; c < d; c++) o[c] = o[c] * shrink;
                mx = s;
            }
            float p = fixed_exp(s - mx);
            l = l + p;
            for (int64_t c = 0; c < d; c++) o[c] = fmaf(p, load(vc, base + c, bf16), o[c]);
        }
        for (int64_t c = 0; c < d; c++) {
            float v = o[c] / l;
            if (bf16) ((uint16_t *)out)[ti * ldo + hq * d + c] = f32_bf16(v);
            else ((float *)out)[ti * ldo + hq * d + c] = v;
        }
    }
}
