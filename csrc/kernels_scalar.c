/* Portable scalar path: the semantics every vector path must reproduce bit for bit. */
#include <math.h>
#include <string.h>

#include "bn_internal.h"

void bn_quant_row_scalar(const float *x, int64_t k, int8_t *xq, int64_t ldq, float *a, int32_t *xsum) {
    float m = 0.0f;
    for (int64_t i = 0; i < k; i++) {
        float v = fabsf(x[i]);
        m = v > m ? v : m;
    }
    if (m < 1e-5f) m = 1e-5f;
    /* torch evaluates `127 / t` as reciprocal(t) * 127: two float32 roundings, reproduced here */
    float r = 1.0f / m;
    float s = r * 127.0f;
    int32_t sum = 0;
    for (int64_t i = 0; i < k; i++) {
        float q = nearbyintf(x[i] * s); /* round half to even, like torch.round */
        if (q > 127.0f) q = 127.0f;
        if (q < -128.0f) q = -128.0f;
        xq[i] = (int8_t)q;
        sum += (int32_t)q;
    }
    for (int64_t i = k; i < ldq; i++) xq[i] = 0;
    if (a) *a = s;
    if (xsum) *xsum = sum;
}

static void gemm_rows_scalar(const bn_gemm_args *g, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = bn_row(g, r);
        for (int64_t i = 0; i < g->m; i++) {
            const int8_t *x = g->xq + i * g->ldx;
            int32_t acc = 0;
            for (int64_t b = 0; b < g->nblk; b++) {
                const uint8_t *p = row + b * BN_BSTRIDE;
                const int8_t *xb = x + b * BN_BLOCK;
                for (int j = 0; j < 32; j++) {
                    int c = p[j];
                    acc += (c & 3) * xb[j] + ((c >> 2) & 3) * xb[j + 32] + ((c >> 4) & 3) * xb[j + 64] +
                           ((c >> 6) & 3) * xb[j + 96];
                }
            }
            bn_store(g, i, r, acc - g->xsum[i]);
        }
    }
}

void bn_head_bf16_scalar(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t r0, int64_t r1, float *y,
                         int64_t ldy) {
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *wr = w + r * k;
        for (int64_t i = 0; i < m; i++) {
            const float *xi = x + i * k;
            float acc = 0.0f;
            for (int64_t j = 0; j < k; j++) acc += xi[j] * bn_bf16_to_f32(wr[j]);
            y[i * ldy + r] = acc;
        }
    }
}

void bn_head_f32_scalar(const float *x, int64_t m, int64_t k, const float *w, int64_t r0, int64_t r1, float *y,
                        int64_t ldy) {
    for (int64_t r = r0; r < r1; r++) {
        const float *wr = w + r * k;
        for (int64_t i = 0; i < m; i++) {
            const float *xi = x + i * k;
            float acc = 0.0f;
            for (int64_t j = 0; j < k; j++) acc += xi[j] * wr[j];
            y[i * ldy + r] = acc;
        }
    }
}

void bn_head_i8_scalar(const int16_t *xq, const float *sx, int64_t m, int64_t k, const int8_t *w, const float *ws,
                       int64_t r0, int64_t r1, float *y, int64_t ldy) {
    for (int64_t r = r0; r < r1; r++) {
        const int8_t *wr = w + r * k;
        for (int64_t i = 0; i < m; i++) {
            const int16_t *xi = xq + i * k;
            float acc = 0.0f;
            for (int64_t c = 0; c < k; c += BN_I8_CHUNK) {
                int64_t e = c + BN_I8_CHUNK < k ? c + BN_I8_CHUNK : k;
                int32_t s = 0; /* |s| <= 4096 * 127 * 32767 < 2^31 */
                for (int64_t j = c; j < e; j++) s += (int32_t)xi[j] * wr[j];
                acc += (float)s;
            }
            y[i * ldy + r] = acc * (ws[r] * sx[i]);
        }
    }
}

const bn_kernels bn_kernels_scalar = {gemm_rows_scalar, bn_gemm_rows_b3_scalar, bn_quant_row_scalar,
                                      bn_head_bf16_scalar, bn_head_f32_scalar, bn_head_i8_scalar};
