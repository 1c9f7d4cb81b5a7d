/* NEON path (AArch64): codes are turned into signed ternary values t = c - 1 and multiplied with
 * vmull_s8 / vpadalq (or vdotq_s32 with the dotprod extension), so no activation-sum correction is needed.
 */
#include "bn_internal.h"

#if defined(__aarch64__)
#include <arm_neon.h>

/* one 16-byte half of a block (bytes h..h+15) against the matching activations: elements
 * h..h+15, 32+h.., 64+h.., 96+h.. */
static inline int32x4_t half_dot(uint8x16_t p, const int8_t *xb, int32x4_t acc) {
    const uint8x16_t mask = vdupq_n_u8(3);
    const int8x16_t one = vdupq_n_s8(1);
    int8x16_t t0 = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(p, mask)), one);
    int8x16_t t1 = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(vshrq_n_u8(p, 2), mask)), one);
    int8x16_t t2 = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(vshrq_n_u8(p, 4), mask)), one);
    int8x16_t t3 = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(p, 6)), one);
    int8x16_t x0 = vld1q_s8(xb), x1 = vld1q_s8(xb + 32), x2 = vld1q_s8(xb + 64), x3 = vld1q_s8(xb + 96);
#if defined(__ARM_FEATURE_DOTPROD)
    acc = vdotq_s32(acc, t0, x0);
    acc = vdotq_s32(acc, t1, x1);
    acc = vdotq_s32(acc, t2, x2);
    acc = vdotq_s32(acc, t3, x3);
#else
    /* |t*x| <= 128: sums of up to 8 products stay far inside int16 */
    int16x8_t s = vmull_s8(vget_low_s8(t0), vget_low_s8(x0));
    s = vmlal_s8(s, vget_low_s8(t1), vget_low_s8(x1));
    s = vmlal_s8(s, vget_low_s8(t2), vget_low_s8(x2));
    s = vmlal_s8(s, vget_low_s8(t3), vget_low_s8(x3));
    s = vmlal_high_s8(s, t0, x0);
    s = vmlal_high_s8(s, t1, x1);
    s = vmlal_high_s8(s, t2, x2);
    s = vmlal_high_s8(s, t3, x3);
    acc = vpadalq_s16(acc, s);
#endif
    return acc;
}

static void gemm_rows_neon(const bn_gemm_args *g, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *w = bn_row(g, r);
        for (int64_t i = 0; i < g->m; i++) {
            const int8_t *x = g->xq + i * g->ldx;
            int32x4_t acc = vdupq_n_s32(0);
            for (int64_t b = 0; b < g->nblk; b++) {
                acc = half_dot(vld1q_u8(w + BN_BSTRIDE * b), x + 128 * b, acc);
                acc = half_dot(vld1q_u8(w + BN_BSTRIDE * b + 16), x + 128 * b + 16, acc);
            }
            /* signed ternary already: no activation-sum correction */
            bn_store(g, i, r, vaddvq_s32(acc));
        }
    }
}

static void quant_row_neon(const float *x, int64_t k, int8_t *xq, int64_t ldq, float *a, int32_t *xsum) {
    bn_quant_row_scalar(x, k, xq, ldq, a, xsum);
}

static void head_bf16_neon(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t r0, int64_t r1, float *y,
                           int64_t ldy) {
    int64_t k4 = k & ~(int64_t)3;
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *wr = w + r * k;
        for (int64_t i = 0; i < m; i++) {
            const float *xi = x + i * k;
            float32x4_t acc = vdupq_n_f32(0.0f);
            for (int64_t j = 0; j < k4; j += 4) {
                float32x4_t wv = vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(wr + j), 16));
                acc = vfmaq_f32(acc, wv, vld1q_f32(xi + j));
            }
            float s = vaddvq_f32(acc);
            float t = 0.0f;
            if (k4 < k) bn_head_bf16_scalar(xi + k4, 1, k - k4, wr + k4, 0, 1, &t, 1);
            y[i * ldy + r] = s + t;
        }
    }
}

static void head_f32_neon(const float *x, int64_t m, int64_t k, const float *w, int64_t r0, int64_t r1, float *y,
                          int64_t ldy) {
    int64_t k4 = k & ~(int64_t)3;
    for (int64_t r = r0; r < r1; r++) {
        const float *wr = w + r * k;
        for (int64_t i = 0; i < m; i++) {
            const float *xi = x + i * k;
            float32x4_t acc = vdupq_n_f32(0.0f);
            for (int64_t j = 0; j < k4; j += 4) acc = vfmaq_f32(acc, vld1q_f32(wr + j), vld1q_f32(xi + j));
            float s = vaddvq_f32(acc);
            float t = 0.0f;
            if (k4 < k) bn_head_f32_scalar(xi + k4, 1, k - k4, wr + k4, 0, 1, &t, 1);
            y[i * ldy + r] = s + t;
        }
    }
}

static void head_i8_neon(const int16_t *xq, const float *sx, int64_t m, int64_t k, const int8_t *w, const float *ws,
                         int64_t r0, int64_t r1, float *y, int64_t ldy) {
    bn_head_i8_scalar(xq, sx, m, k, w, ws, r0, r1, y, ldy);
}

/* base-3 weights run the scalar kernel here: on NEON the 2-bit layout is the one to use (runtime weights_layout) */
const bn_kernels bn_kernels_neon = {gemm_rows_neon, bn_gemm_rows_b3_scalar, quant_row_neon,
                                    head_bf16_neon, head_f32_neon, head_i8_neon};
#endif
