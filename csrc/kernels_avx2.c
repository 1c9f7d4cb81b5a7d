/* AVX2 path: unsigned 2-bit codes x signed int8 activations with vpmaddubsw, widened by vpmaddwd.
 * Compiled with a target pragma so the file builds without -mavx2; only called when the CPU has AVX2+FMA.
 */
#include "bn_internal.h"

#ifdef BN_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC target("avx2,fma,f16c")
#endif
#include <immintrin.h>
#include <math.h>
#include <string.h>

#define BN_INLINE static inline __attribute__((always_inline))

BN_INLINE int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

BN_INLINE float hsum_f32(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* decode: 32 packed bytes -> codes of elements 0-31, 32-63, 64-95, 96-127 */
#define DECODE(p, c0, c1, c2, c3)                                  \
    __m256i c0 = _mm256_and_si256(p, mask);                        \
    __m256i c1 = _mm256_and_si256(_mm256_srli_epi16(p, 2), mask);  \
    __m256i c2 = _mm256_and_si256(_mm256_srli_epi16(p, 4), mask);  \
    __m256i c3 = _mm256_and_si256(_mm256_srli_epi16(p, 6), mask)

/* prefill: one weight row against NT tokens starting at i0 (NT is a compile-time constant after inlining).
 * The maddubs pair sums (|c0 x0 + c1 x1| <= 2 * 2 * 128 = 512) are added in int16 over up to 16 blocks
 * (64 sums, >= -32768 and <= 32512: no overflow) before one widening vpmaddwd: fewer instructions per
 * multiply, which is what bounds this compute-bound loop. */
#define I16_BLOCKS 16
BN_INLINE void tile_1xT(const bn_gemm_args *g, int64_t r, int64_t i0, const int NT) {
    const __m256i mask = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);
    __m256i acc[4], s16[4];
    for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_si256();
    const uint8_t *w = bn_row(g, r);
    const int8_t *x = g->xq + i0 * g->ldx;
    for (int64_t b0 = 0; b0 < g->nblk; b0 += I16_BLOCKS) {
        int64_t b1 = b0 + I16_BLOCKS < g->nblk ? b0 + I16_BLOCKS : g->nblk;
        for (int t = 0; t < NT; t++) s16[t] = _mm256_setzero_si256();
        for (int64_t b = b0; b < b1; b++) {
            __m256i p = _mm256_loadu_si256((const __m256i *)(w + BN_BSTRIDE * b));
            DECODE(p, c0, c1, c2, c3);
            for (int t = 0; t < NT; t++) {
                const int8_t *xb = x + t * g->ldx + 128 * b;
                __m256i s = _mm256_add_epi16(s16[t], _mm256_maddubs_epi16(c0, _mm256_loadu_si256((const __m256i *)xb)));
                s = _mm256_add_epi16(s, _mm256_maddubs_epi16(c1, _mm256_loadu_si256((const __m256i *)(xb + 32))));
                s = _mm256_add_epi16(s, _mm256_maddubs_epi16(c2, _mm256_loadu_si256((const __m256i *)(xb + 64))));
                s16[t] = _mm256_add_epi16(s, _mm256_maddubs_epi16(c3, _mm256_loadu_si256((const __m256i *)(xb + 96))));
            }
        }
        for (int t = 0; t < NT; t++) acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(s16[t], ones));
    }
    for (int t = 0; t < NT; t++) bn_store(g, i0 + t, r, hsum_i32(acc[t]) - g->xsum[i0 + t]);
}

/* decode: the 4 weight rows of one group (r % 4 == 0) against one token, sharing the activation loads;
 * the group's 128 bytes per block are one sequential stream */
static void gemv_4rows(const bn_gemm_args *g, int64_t r, int64_t i) {
    const __m256i mask = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);
    __m256i acc0 = _mm256_setzero_si256(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    const uint8_t *w = bn_row(g, r);
    const int8_t *x = g->xq + i * g->ldx;
    const int64_t pf = BN_PREFETCH_BYTES;
    /* int16 sums over up to I16_BLOCKS blocks before one widening vpmaddwd (bounds: see tile_1xT): fewer
     * instructions per weight byte, which is what bounds this loop when the cores, not memory, are slow */
    for (int64_t b0 = 0; b0 < g->nblk; b0 += I16_BLOCKS) {
        int64_t b1 = b0 + I16_BLOCKS < g->nblk ? b0 + I16_BLOCKS : g->nblk;
        __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
        for (int64_t b = b0; b < b1; b++) {
            const int8_t *xb = x + 128 * b;
            const uint8_t *wb = w + BN_BSTRIDE * b;
            if (pf) {
                /* software prefetch ahead of the stream keeps more misses in flight than the hardware does */
                _mm_prefetch((const char *)(wb + pf), _MM_HINT_T0);
                _mm_prefetch((const char *)(wb + pf + 64), _MM_HINT_T0);
            }
            __m256i x0 = _mm256_loadu_si256((const __m256i *)xb);
            __m256i x1 = _mm256_loadu_si256((const __m256i *)(xb + 32));
            __m256i x2 = _mm256_loadu_si256((const __m256i *)(xb + 64));
            __m256i x3 = _mm256_loadu_si256((const __m256i *)(xb + 96));
#define ROW(j, s)                                                                                          \
    do {                                                                                                   \
        __m256i p = _mm256_loadu_si256((const __m256i *)(wb + 32 * (j)));                                  \
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(_mm256_and_si256(p, mask), x0));                      \
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(p, 2), mask), x1)); \
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(p, 4), mask), x2)); \
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(p, 6), mask), x3)); \
    } while (0)
            ROW(0, s0);
            ROW(1, s1);
            ROW(2, s2);
            ROW(3, s3);
#undef ROW
        }
        acc0 = _mm256_add_epi32(acc0, _mm256_madd_epi16(s0, ones));
        acc1 = _mm256_add_epi32(acc1, _mm256_madd_epi16(s1, ones));
        acc2 = _mm256_add_epi32(acc2, _mm256_madd_epi16(s2, ones));
        acc3 = _mm256_add_epi32(acc3, _mm256_madd_epi16(s3, ones));
    }
    int32_t xs = g->xsum[i];
    bn_store(g, i, r, hsum_i32(acc0) - xs);
    bn_store(g, i, r + 1, hsum_i32(acc1) - xs);
    bn_store(g, i, r + 2, hsum_i32(acc2) - xs);
    bn_store(g, i, r + 3, hsum_i32(acc3) - xs);
}

/* 8 int32 vectors -> one vector of their 8 horizontal sums (element t = sum of v[t]) */
BN_INLINE __m256i hsum8_i32(const __m256i v[8]) {
    __m256i s01 = _mm256_hadd_epi32(v[0], v[1]), s23 = _mm256_hadd_epi32(v[2], v[3]);
    __m256i s45 = _mm256_hadd_epi32(v[4], v[5]), s67 = _mm256_hadd_epi32(v[6], v[7]);
    __m256i s0123 = _mm256_hadd_epi32(s01, s23), s4567 = _mm256_hadd_epi32(s45, s67);
    /* lanes: s0123 = [t0 t1 t2 t3 | t0 t1 t2 t3] halves, s4567 likewise */
    __m256i lo = _mm256_permute2x128_si256(s0123, s4567, 0x20), hi = _mm256_permute2x128_si256(s0123, s4567, 0x31);
    return _mm256_add_epi32(lo, hi);
}

/* prefill main tile: one weight row against 8 tokens over blocks [b0, b1) (at most I16_BLOCKS, so the int16
 * pair sums cannot overflow); adds the 8 partial dot products to part[0..7]. Eight tokens share each decoded
 * block, which halves the decode work per multiply against the 4-token tile. */
BN_INLINE void tile_1x8_part(const bn_gemm_args *g, int64_t r, int64_t i0, int64_t b0, int64_t b1, int32_t *part) {
    const __m256i mask = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);
    __m256i s16[8];
    for (int t = 0; t < 8; t++) s16[t] = _mm256_setzero_si256();
    const uint8_t *w = bn_row(g, r);
    const int8_t *x = g->xq + i0 * g->ldx;
    const int64_t ldx = g->ldx;
    /* row r + 2's block b lies in the next 64-byte line of this group (or the next group): fetch it while this
     * row computes (prefetching past the last row is harmless: prefetches do not fault) */
    const uint8_t *wn = g->w + bn_block_offset(r + 2, 0, g->rb);
    for (int64_t b = b0; b < b1; b++) {
        __m256i p = _mm256_loadu_si256((const __m256i *)(w + BN_BSTRIDE * b));
        _mm_prefetch((const char *)(wn + BN_BSTRIDE * b), _MM_HINT_T0);
        const int8_t *xb = x + 128 * b;
        /* one code vector at a time, added straight into the 8 accumulators: 8 accumulators + code + packed
         * bytes + mask fit the 16 registers (decoding all four first made the compiler spill accumulators) */
        for (int j = 0; j < 4; j++) {
            __m256i c = _mm256_and_si256(j ? _mm256_srli_epi16(p, 2 * j) : p, mask);
            for (int t = 0; t < 8; t++) {
                s16[t] = _mm256_add_epi16(
                    s16[t], _mm256_maddubs_epi16(c, _mm256_loadu_si256((const __m256i *)(xb + t * ldx + 32 * j))));
                __asm__("" : "+x"(s16[t])); /* keeps the compiler from re-associating the sums into spills */
            }
        }
    }
    for (int t = 0; t < 8; t++) s16[t] = _mm256_madd_epi16(s16[t], ones);
    __m256i sum = _mm256_add_epi32(_mm256_loadu_si256((const __m256i *)part), hsum8_i32(s16));
    _mm256_storeu_si256((__m256i *)part, sum);
}

/* Prefill loop order: an 8-token activation tile of at most I16_BLOCKS blocks (8 x 2 KB) stays in L1 while
 * the rows of a chunk stream past it; the chunk's weights (<= ~192 KB) stay in L2 while all token tiles take
 * their turn. (Rows outer, tokens inner, re-read the activations from L2 for every row.) */
#define CHUNK_BYTES (192 * 1024)
#define TILE_ROWS_MAX 1024

static void gemm_rows_avx2(const bn_gemm_args *g, int64_t r0, int64_t r1) {
    if (g->m < 3) {
        for (int64_t i = 0; i < g->m; i++) {
            int64_t r = r0;
            for (; r + 4 <= r1; r += 4) gemv_4rows(g, r, i);
            for (; r < r1; r++) tile_1xT(g, r, i, 1);
        }
        return;
    }
    int64_t chunk = CHUNK_BYTES / g->rb;
    chunk = chunk < 4 ? 4 : chunk > TILE_ROWS_MAX ? TILE_ROWS_MAX : chunk;
    int32_t part[TILE_ROWS_MAX][8] __attribute__((aligned(32)));
    for (int64_t rc = r0; rc < r1; rc += chunk) {
        int64_t re = rc + chunk < r1 ? rc + chunk : r1;
        int64_t i0 = 0;
        for (; i0 + 8 <= g->m; i0 += 8) {
            memset(part, 0, sizeof(part[0]) * (size_t)(re - rc));
            for (int64_t b0 = 0; b0 < g->nblk; b0 += I16_BLOCKS) {
                int64_t b1 = b0 + I16_BLOCKS < g->nblk ? b0 + I16_BLOCKS : g->nblk;
                for (int64_t r = rc; r < re; r++) tile_1x8_part(g, r, i0, b0, b1, part[r - rc]);
            }
            for (int64_t r = rc; r < re; r++)
                for (int t = 0; t < 8; t++) bn_store(g, i0 + t, r, part[r - rc][t] - g->xsum[i0 + t]);
        }
        for (; i0 + 4 <= g->m; i0 += 4)
            for (int64_t r = rc; r < re; r++) tile_1xT(g, r, i0, 4);
        int64_t rem = g->m - i0;
        for (int64_t r = rc; r < re; r++) {
            if (rem == 3) tile_1xT(g, r, i0, 3);
            else if (rem == 2) tile_1xT(g, r, i0, 2);
            else if (rem == 1) tile_1xT(g, r, i0, 1);
        }
    }
}

static void quant_row_avx2(const float *x, int64_t k, int8_t *xq, int64_t ldq, float *a, int32_t *xsum) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 mx = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(x + i), absmask));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    float m = _mm_cvtss_f32(m4);
    for (; i < k; i++) {
        float v = fabsf(x[i]);
        m = v > m ? v : m;
    }
    if (m < 1e-5f) m = 1e-5f;
    float r = 1.0f / m;
    float s = r * 127.0f; /* torch's 127 / t == reciprocal(t) * 127 */
    const __m256 vs = _mm256_set1_ps(s);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i ones16 = _mm256_set1_epi16(1);
    __m256i sum = _mm256_setzero_si256();
    i = 0;
    for (; i + 32 <= k; i += 32) {
        /* cvtps rounds half to even under the default MXCSR mode, as torch.round does */
        __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), vs));
        __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), vs));
        __m256i q2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 16), vs));
        __m256i q3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 24), vs));
        __m256i h01 = _mm256_packs_epi32(q0, q1), h23 = _mm256_packs_epi32(q2, q3);
        __m256i b = _mm256_packs_epi16(h01, h23); /* saturation = clamp to [-128, 127] */
        b = _mm256_permutevar8x32_epi32(b, perm);
        _mm256_storeu_si256((__m256i *)(xq + i), b);
        /* sum of the int8 values: sign-extend to int16 pairs and madd with ones */
        __m256i lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(b));
        __m256i hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(b, 1));
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_add_epi16(lo, hi), ones16));
    }
    int32_t tot = hsum_i32(sum);
    for (; i < k; i++) {
        float q = nearbyintf(x[i] * s);
        if (q > 127.0f) q = 127.0f;
        if (q < -128.0f) q = -128.0f;
        xq[i] = (int8_t)q;
        tot += (int32_t)q;
    }
    for (; i < ldq; i++) xq[i] = 0;
    if (a) *a = s;
    if (xsum) *xsum = tot;
}

static void head_bf16_avx2(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t r0, int64_t r1, float *y,
                           int64_t ldy) {
    int64_t k32 = k & ~(int64_t)31;
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *wr = w + r * k;
        const int64_t pf = BN_PREFETCH_BYTES;
        for (int64_t i = 0; i < m; i++) {
            const float *xi = x + i * k;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t j = 0; j < k32; j += 32) {
                /* rows are contiguous: one stream; 32 bf16 = one 64-byte line per iteration */
                if (pf && i == 0) _mm_prefetch((const char *)(wr + j) + pf, _MM_HINT_T0);
#define BF(off) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(wr + j + off))), 16))
                a0 = _mm256_fmadd_ps(BF(0), _mm256_loadu_ps(xi + j), a0);
                a1 = _mm256_fmadd_ps(BF(8), _mm256_loadu_ps(xi + j + 8), a1);
                a2 = _mm256_fmadd_ps(BF(16), _mm256_loadu_ps(xi + j + 16), a2);
                a3 = _mm256_fmadd_ps(BF(24), _mm256_loadu_ps(xi + j + 24), a3);
#undef BF
            }
            float acc = hsum_f32(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
            for (int64_t j = k32; j < k; j++) acc += xi[j] * bn_bf16_to_f32(wr[j]);
            y[i * ldy + r] = acc;
        }
    }
}

/* rows r .. r + R - 1 of W against one activation row: two 8-lane accumulators per row over 16-float steps, then
 * a scalar tail; R = 4 shares each activation load among four weight streams, R = 1 is the same sum for a row
 * left over (each row's order is the same either way) */
BN_INLINE void head_f32_rows(const float *xi, int64_t k, const float *w, int64_t r, float *y, const int R,
                              int fetch) {
    const int64_t pf = fetch ? BN_PREFETCH_BYTES : 0, k16 = k & ~(int64_t)15;
    __m256 a0[4], a1[4];
    for (int q = 0; q < R; q++) a0[q] = a1[q] = _mm256_setzero_ps();
    for (int64_t j = 0; j < k16; j += 16) {
        __m256 x0 = _mm256_loadu_ps(xi + j), x1 = _mm256_loadu_ps(xi + j + 8);
        for (int q = 0; q < R; q++) {
            const float *wq = w + (r + q) * k + j;
            if (pf) _mm_prefetch((const char *)wq + pf, _MM_HINT_T0); /* 16 floats: one 64-byte line */
            a0[q] = _mm256_fmadd_ps(_mm256_loadu_ps(wq), x0, a0[q]);
            a1[q] = _mm256_fmadd_ps(_mm256_loadu_ps(wq + 8), x1, a1[q]);
        }
    }
    for (int q = 0; q < R; q++) {
        const float *wq = w + (r + q) * k;
        float acc = hsum_f32(_mm256_add_ps(a0[q], a1[q]));
        for (int64_t j = k16; j < k; j++) acc += xi[j] * wq[j];
        y[q] = acc;
    }
}

static void head_f32_avx2(const float *x, int64_t m, int64_t k, const float *w, int64_t r0, int64_t r1, float *y,
                          int64_t ldy) {
    float out[4];
    int64_t r = r0;
    for (; r + 4 <= r1; r += 4) /* the 4 rows stay in L1 while every activation row passes */
        for (int64_t i = 0; i < m; i++) {
            head_f32_rows(x + i * k, k, w, r, out, 4, i == 0);
            for (int q = 0; q < 4; q++) y[i * ldy + r + q] = out[q];
        }
    for (; r < r1; r++)
        for (int64_t i = 0; i < m; i++) head_f32_rows(x + i * k, k, w, r, y + i * ldy + r, 1, i == 0);
}

static void head_i8_avx2(const int16_t *xq, const float *sx, int64_t m, int64_t k, const int8_t *w, const float *ws,
                         int64_t r0, int64_t r1, float *y, int64_t ldy) {
    const int64_t pf = BN_PREFETCH_BYTES;
    for (int64_t r = r0; r < r1; r++) {
        const int8_t *wr = w + r * k;
        for (int64_t i = 0; i < m; i++) {
            const int16_t *xi = xq + i * k;
            float acc = 0.0f;
            for (int64_t c = 0; c < k; c += BN_I8_CHUNK) {
                int64_t e = c + BN_I8_CHUNK < k ? c + BN_I8_CHUNK : k;
                /* int8 weights widened to int16, vpmaddwd with the int16 activations: exact int32 sums */
                __m256i a0 = _mm256_setzero_si256(), a1 = a0;
                int64_t j = c;
                for (; j + 32 <= e; j += 32) {
                    if (pf && i == 0 && (j & 63) == 0) _mm_prefetch((const char *)(wr + j) + pf, _MM_HINT_T0);
                    __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wr + j)));
                    __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wr + j + 16)));
                    a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)(xi + j))));
                    a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(xi + j + 16))));
                }
                int32_t s = hsum_i32(_mm256_add_epi32(a0, a1));
                for (; j < e; j++) s += (int32_t)xi[j] * wr[j];
                acc += (float)s;
            }
            y[i * ldy + r] = acc * (ws[r] * sx[i]);
        }
    }
}

/* ---- cpu-base3-v1 ------------------------------------------------------------------------------------------------
 * The codes of a base-3 byte's five trits without multiplies: s = byte ^ 0x80 holds q = byte * 3^i mod 256 as the
 * signed byte q - 128, and s * 3 (two adds) moves to the next trit keeping that offset (3(q - 128) + 128 = 3q - 256).
 * code = (q * 3) >> 8 = [q >= 86] + [q >= 171] = |mask(s > -43) + mask(s > 42)|. */
BN_INLINE __m256i b3_code(__m256i s, __m256i lo, __m256i hi) {
    return _mm256_abs_epi8(_mm256_add_epi8(_mm256_cmpgt_epi8(s, lo), _mm256_cmpgt_epi8(s, hi)));
}
BN_INLINE __m256i b3_next(__m256i s) { return _mm256_add_epi8(s, _mm256_add_epi8(s, s)); }
#define B3_CONSTS                                                                                   \
    const __m256i bias = _mm256_set1_epi8((char)0x80), lo = _mm256_set1_epi8(-43), hi = _mm256_set1_epi8(42), \
                  ones = _mm256_set1_epi16(1)
/* a block adds 10 maddubs pair sums (|.| <= 512) to a row's int16 sums: 6 blocks stay inside int16 */
#define B3_I16_BLOCKS 6

/* prefill: one weight row against NT <= 8 tokens; each decoded half block serves every token */
BN_INLINE void tile_1xT_b3(const bn_gemm_args *g, int64_t r, int64_t i0, const int NT) {
    B3_CONSTS;
    __m256i acc[8], s16[8];
    for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_si256();
    const uint8_t *w = bn3_row(g, r);
    const int8_t *x = g->xq + i0 * g->ldx;
    for (int64_t b0 = 0; b0 < g->nblk; b0 += B3_I16_BLOCKS) {
        int64_t b1 = b0 + B3_I16_BLOCKS < g->nblk ? b0 + B3_I16_BLOCKS : g->nblk;
        for (int t = 0; t < NT; t++) s16[t] = _mm256_setzero_si256();
        for (int64_t b = b0; b < b1; b++)
            for (int h = 0; h < 2; h++) {
                __m256i p = _mm256_loadu_si256((const __m256i *)(w + BN3_BSTRIDE * b + 32 * h));
                __m256i s = _mm256_xor_si256(p, bias);
                for (int d = 0; d < 5; d++, s = b3_next(s)) {
                    __m256i c = b3_code(s, lo, hi);
                    for (int t = 0; t < NT; t++) {
                        const int8_t *xb = x + t * g->ldx + BN3_BLOCK * b + BN3_BYTES * d + 32 * h;
                        __m256i xv = _mm256_loadu_si256((const __m256i *)xb);
                        s16[t] = _mm256_add_epi16(s16[t], _mm256_maddubs_epi16(c, xv));
                    }
                }
            }
        for (int t = 0; t < NT; t++) acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(s16[t], ones));
    }
    for (int t = 0; t < NT; t++) bn_store(g, i0 + t, r, hsum_i32(acc[t]) - g->xsum[i0 + t]);
}

/* decode: the 4 rows of one group (r % 4 == 0) against one token; the group's 256 bytes a block are one stream */
static void gemv_4rows_b3(const bn_gemm_args *g, int64_t r, int64_t i) {
    B3_CONSTS;
    __m256i acc[4], s16[4];
    for (int q = 0; q < 4; q++) acc[q] = _mm256_setzero_si256();
    const uint8_t *w = bn3_row(g, r);
    const int8_t *x = g->xq + i * g->ldx;
    const int64_t pf = BN_PREFETCH_BYTES;
    for (int64_t b0 = 0; b0 < g->nblk; b0 += B3_I16_BLOCKS) {
        int64_t b1 = b0 + B3_I16_BLOCKS < g->nblk ? b0 + B3_I16_BLOCKS : g->nblk;
        for (int q = 0; q < 4; q++) s16[q] = _mm256_setzero_si256();
        for (int64_t b = b0; b < b1; b++) {
            const uint8_t *wb = w + BN3_BSTRIDE * b;
            const int8_t *xb = x + BN3_BLOCK * b;
            for (int l = 0; l < BN3_BSTRIDE; l += 64) _mm_prefetch((const char *)(wb + pf + l), _MM_HINT_T0);
            for (int q = 0; q < 4; q++)
                for (int h = 0; h < 2; h++) {
                    __m256i p = _mm256_loadu_si256((const __m256i *)(wb + BN3_BYTES * q + 32 * h));
                    __m256i s = _mm256_xor_si256(p, bias);
                    for (int d = 0; d < 5; d++, s = b3_next(s)) {
                        __m256i xv = _mm256_loadu_si256((const __m256i *)(xb + BN3_BYTES * d + 32 * h));
                        s16[q] = _mm256_add_epi16(s16[q], _mm256_maddubs_epi16(b3_code(s, lo, hi), xv));
                    }
                }
        }
        for (int q = 0; q < 4; q++) acc[q] = _mm256_add_epi32(acc[q], _mm256_madd_epi16(s16[q], ones));
    }
    for (int q = 0; q < 4; q++) bn_store(g, i, r + q, hsum_i32(acc[q]) - g->xsum[i]);
}

#define B3_ROW_CHUNK 32

static void gemm_rows_b3_avx2(const bn_gemm_args *g, int64_t r0, int64_t r1) {
    if (g->m < 3) {
        for (int64_t i = 0; i < g->m; i++) {
            int64_t r = r0;
            for (; r + 4 <= r1; r += 4) gemv_4rows_b3(g, r, i);
            for (; r < r1; r++) tile_1xT_b3(g, r, i, 1);
        }
        return;
    }
    for (int64_t rc = r0; rc < r1; rc += B3_ROW_CHUNK) { /* a chunk's rows stay in L1/L2 while the tokens pass */
        int64_t re = rc + B3_ROW_CHUNK < r1 ? rc + B3_ROW_CHUNK : r1;
        int64_t i0 = 0;
        for (; i0 + 8 <= g->m; i0 += 8)
            for (int64_t r = rc; r < re; r++) tile_1xT_b3(g, r, i0, 8);
        for (; i0 + 4 <= g->m; i0 += 4)
            for (int64_t r = rc; r < re; r++) tile_1xT_b3(g, r, i0, 4);
        for (; i0 < g->m; i0++)
            for (int64_t r = rc; r < re; r++) tile_1xT_b3(g, r, i0, 1);
    }
}

const bn_kernels bn_kernels_avx2 = {gemm_rows_avx2, gemm_rows_b3_avx2, quant_row_avx2,
                                    head_bf16_avx2, head_f32_avx2, head_i8_avx2};

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif /* BN_X86 */
