/* AVX-512 VNNI path: vpdpbusd multiplies the unsigned codes by the signed int8 activations and
 * accumulates straight into int32 (no int16 stage). Only called when the CPU reports avx512f/bw/vl/vnni.
 */
#include "bn_internal.h"

#ifdef BN_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma"))), \
                             apply_to = function)
#elif defined(__GNUC__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")
#endif
#include <immintrin.h>

#define BN_INLINE static inline __attribute__((always_inline))

/* 32 packed bytes -> codes of elements 0-63 (c01) and 64-127 (c23) */
#define DECODE512(ptr, c01, c23)                                                        \
    __m512i pz = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(ptr)));   \
    __m512i c01 = _mm512_and_si512(_mm512_srlv_epi16(pz, sh01), mask);                  \
    __m512i c23 = _mm512_and_si512(_mm512_srlv_epi16(pz, sh23), mask)

#define CONSTS512                                                                                   \
    const __m512i mask = _mm512_set1_epi8(3);                                                       \
    const __m512i sh01 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);       \
    const __m512i sh23 = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1)

BN_INLINE void tile_1xT(const bn_gemm_args *g, int64_t r, int64_t i0, const int NT) {
    CONSTS512;
    __m512i acc[8];
    for (int t = 0; t < NT; t++) acc[t] = _mm512_setzero_si512();
    const uint8_t *w = bn_row(g, r);
    const int8_t *x = g->xq + i0 * g->ldx;
    for (int64_t b = 0; b < g->nblk; b++) {
        DECODE512(w + BN_BSTRIDE * b, c01, c23);
        for (int t = 0; t < NT; t++) {
            const int8_t *xb = x + t * g->ldx + 128 * b;
            acc[t] = _mm512_dpbusd_epi32(acc[t], c01, _mm512_loadu_si512((const void *)xb));
            acc[t] = _mm512_dpbusd_epi32(acc[t], c23, _mm512_loadu_si512((const void *)(xb + 64)));
        }
    }
    for (int t = 0; t < NT; t++) bn_store(g, i0 + t, r, _mm512_reduce_add_epi32(acc[t]) - g->xsum[i0 + t]);
}

static void gemv_4rows(const bn_gemm_args *g, int64_t r, int64_t i) {
    CONSTS512;
    __m512i acc0 = _mm512_setzero_si512(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    const uint8_t *w0 = bn_row(g, r); /* r % 4 == 0: the group's blocks are one stream */
    const int8_t *x = g->xq + i * g->ldx;
    const int64_t pf = BN_PREFETCH_BYTES;
    for (int64_t b = 0; b < g->nblk; b++) {
        if (pf) {
            _mm_prefetch((const char *)(w0 + BN_BSTRIDE * b + pf), _MM_HINT_T0);
            _mm_prefetch((const char *)(w0 + BN_BSTRIDE * b + pf + 64), _MM_HINT_T0);
        }
        __m512i x01 = _mm512_loadu_si512((const void *)(x + 128 * b));
        __m512i x23 = _mm512_loadu_si512((const void *)(x + 128 * b + 64));
#define ROW(j, acc)                                             \
    do {                                                        \
        DECODE512(w0 + 32 * (j) + BN_BSTRIDE * b, c01, c23);    \
        acc = _mm512_dpbusd_epi32(acc, c01, x01);               \
        acc = _mm512_dpbusd_epi32(acc, c23, x23);               \
    } while (0)
        ROW(0, acc0);
        ROW(1, acc1);
        ROW(2, acc2);
        ROW(3, acc3);
#undef ROW
    }
    int32_t xs = g->xsum[i];
    bn_store(g, i, r, _mm512_reduce_add_epi32(acc0) - xs);
    bn_store(g, i, r + 1, _mm512_reduce_add_epi32(acc1) - xs);
    bn_store(g, i, r + 2, _mm512_reduce_add_epi32(acc2) - xs);
    bn_store(g, i, r + 3, _mm512_reduce_add_epi32(acc3) - xs);
}

#define ROW_CHUNK 32

static void gemm_rows_avx512(const bn_gemm_args *g, int64_t r0, int64_t r1) {
    if (g->m < 3) {
        for (int64_t i = 0; i < g->m; i++) {
            int64_t r = r0;
            for (; r + 4 <= r1; r += 4) gemv_4rows(g, r, i);
            for (; r < r1; r++) tile_1xT(g, r, i, 1);
        }
        return;
    }
    for (int64_t rc = r0; rc < r1; rc += ROW_CHUNK) {
        int64_t re = rc + ROW_CHUNK < r1 ? rc + ROW_CHUNK : r1;
        int64_t i0 = 0;
        for (; i0 + 8 <= g->m; i0 += 8)
            for (int64_t r = rc; r < re; r++) tile_1xT(g, r, i0, 8);
        for (; i0 < g->m; i0++)
            for (int64_t r = rc; r < re; r++) tile_1xT(g, r, i0, 1);
    }
}

/* ---- cpu-base3-v1: the unpack of kernels_avx2.c's b3_code (same bytes, same codes), the two compares into masks */
#define B3_CONSTS512                                                                                      \
    const __m512i bias = _mm512_set1_epi8((char)0x80), lo = _mm512_set1_epi8(-43), hi = _mm512_set1_epi8(42), \
                  one = _mm512_set1_epi8(1), two = _mm512_set1_epi8(2)
BN_INLINE __m512i b3_code(__m512i s, __m512i lo, __m512i hi, __m512i one, __m512i two) {
    __m512i c = _mm512_maskz_mov_epi8(_mm512_cmpgt_epi8_mask(s, lo), one);
    return _mm512_mask_mov_epi8(c, _mm512_cmpgt_epi8_mask(s, hi), two);
}
BN_INLINE __m512i b3_next(__m512i s) { return _mm512_add_epi8(s, _mm512_add_epi8(s, s)); }

BN_INLINE void tile_1xT_b3(const bn_gemm_args *g, int64_t r, int64_t i0, const int NT) {
    B3_CONSTS512;
    __m512i acc[8];
    for (int t = 0; t < NT; t++) acc[t] = _mm512_setzero_si512();
    const uint8_t *w = bn3_row(g, r);
    const int8_t *x = g->xq + i0 * g->ldx;
    for (int64_t b = 0; b < g->nblk; b++) {
        __m512i s = _mm512_xor_si512(_mm512_loadu_si512((const void *)(w + BN3_BSTRIDE * b)), bias);
        for (int d = 0; d < 5; d++, s = b3_next(s)) {
            __m512i c = b3_code(s, lo, hi, one, two);
            for (int t = 0; t < NT; t++) {
                const int8_t *xb = x + t * g->ldx + BN3_BLOCK * b + BN3_BYTES * d;
                acc[t] = _mm512_dpbusd_epi32(acc[t], c, _mm512_loadu_si512((const void *)xb));
            }
        }
    }
    for (int t = 0; t < NT; t++) bn_store(g, i0 + t, r, _mm512_reduce_add_epi32(acc[t]) - g->xsum[i0 + t]);
}

static void gemv_4rows_b3(const bn_gemm_args *g, int64_t r, int64_t i) {
    B3_CONSTS512;
    __m512i acc[4];
    for (int q = 0; q < 4; q++) acc[q] = _mm512_setzero_si512();
    const uint8_t *w = bn3_row(g, r); /* r % 4 == 0: the group's blocks are one stream */
    const int8_t *x = g->xq + i * g->ldx;
    const int64_t pf = BN_PREFETCH_BYTES;
    for (int64_t b = 0; b < g->nblk; b++) {
        const uint8_t *wb = w + BN3_BSTRIDE * b;
        for (int l = 0; l < BN3_BSTRIDE; l += 64) _mm_prefetch((const char *)(wb + pf + l), _MM_HINT_T0);
        __m512i xv[5];
        for (int d = 0; d < 5; d++) xv[d] = _mm512_loadu_si512((const void *)(x + BN3_BLOCK * b + BN3_BYTES * d));
        for (int q = 0; q < 4; q++) {
            __m512i s = _mm512_xor_si512(_mm512_loadu_si512((const void *)(wb + BN3_BYTES * q)), bias);
            for (int d = 0; d < 5; d++, s = b3_next(s))
                acc[q] = _mm512_dpbusd_epi32(acc[q], b3_code(s, lo, hi, one, two), xv[d]);
        }
    }
    for (int q = 0; q < 4; q++) bn_store(g, i, r + q, _mm512_reduce_add_epi32(acc[q]) - g->xsum[i]);
}

static void gemm_rows_b3_avx512(const bn_gemm_args *g, int64_t r0, int64_t r1) {
    if (g->m < 3) {
        for (int64_t i = 0; i < g->m; i++) {
            int64_t r = r0;
            for (; r + 4 <= r1; r += 4) gemv_4rows_b3(g, r, i);
            for (; r < r1; r++) tile_1xT_b3(g, r, i, 1);
        }
        return;
    }
    for (int64_t rc = r0; rc < r1; rc += ROW_CHUNK) {
        int64_t re = rc + ROW_CHUNK < r1 ? rc + ROW_CHUNK : r1;
        int64_t i0 = 0;
        for (; i0 + 8 <= g->m; i0 += 8)
            for (int64_t r = rc; r < re; r++) tile_1xT_b3(g, r, i0, 8);
        for (; i0 < g->m; i0++)
            for (int64_t r = rc; r < re; r++) tile_1xT_b3(g, r, i0, 1);
    }
}

/* activation quantization and the float heads are memory-bound: the AVX2 versions are reused */
extern const bn_kernels bn_kernels_avx2;
static void quant_row(const float *x, int64_t k, int8_t *xq, int64_t ldq, float *a, int32_t *xsum) {
    bn_kernels_avx2.quant_row(x, k, xq, ldq, a, xsum);
}
static void head_bf16(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t r0, int64_t r1, float *y,
                      int64_t ldy) {
    bn_kernels_avx2.head_bf16(x, m, k, w, r0, r1, y, ldy);
}
static void head_f32(const float *x, int64_t m, int64_t k, const float *w, int64_t r0, int64_t r1, float *y,
                     int64_t ldy) {
    bn_kernels_avx2.head_f32(x, m, k, w, r0, r1, y, ldy);
}
static void head_i8(const int16_t *xq, const float *sx, int64_t m, int64_t k, const int8_t *w, const float *ws,
                    int64_t r0, int64_t r1, float *y, int64_t ldy) {
    bn_kernels_avx2.head_i8(xq, sx, m, k, w, ws, r0, r1, y, ldy);
}

const bn_kernels bn_kernels_avx512 = {gemm_rows_avx512, gemm_rows_b3_avx512, quant_row, head_bf16, head_f32, head_i8};

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif /* BN_X86 */
