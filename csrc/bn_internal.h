/* Internal declarations shared by the dispatcher and the per-ISA kernel files. */
#ifndef BN_INTERNAL_H
#define BN_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "bitnet_cpu.h"

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#define BN_X86 1
#endif
#if defined(__aarch64__)
#define BN_ARM 1
#endif

/* One ternary GEMM problem: rows [r0, r1) of the packed weights against all m tokens of xq. */
typedef struct {
    const int8_t *xq;    /* [m, ldx] int8, zero padded to ldx = Kp */
    int64_t ldx;
    const int32_t *xsum; /* [m] row sums of xq */
    int64_t m;
    const uint8_t *w;    /* packed cpu-2bit-v2: [Np/4][nblk][4][32] bytes, Np = n rounded up to 4 */
    int64_t rb;          /* bytes per packed row = Kp / 4 */
    int64_t nblk;        /* Kp / 128 */
    int32_t *out_i32;    /* [m, ldo] exact products, or NULL */
    float *out_f32;      /* [m, ldo] float(acc) * (scale / a[i]), or NULL */
    int64_t ldo;
    const float *a;      /* [m] activation scales (for out_f32) */
    float scale;         /* weight scale s */
    int layout;          /* BN_LAYOUT_*: w, rb and nblk are in this layout (ldx: its padded K) */
} bn_gemm_args;

typedef void (*bn_gemm_rows_fn)(const bn_gemm_args *g, int64_t r0, int64_t r1);
typedef void (*bn_quant_fn)(const float *x, int64_t k, int8_t *xq, int64_t ldq, float *a, int32_t *xsum);
/* float heads: y[i * ldy + r] = x[i, :] . w[r, :] for rows r in [r0, r1), each summed in an order that depends on k
 * only (never on m or the row range), so a token's logits do not depend on the other tokens of the call */
typedef void (*bn_head_bf16_fn)(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t r0, int64_t r1,
                                float *y, int64_t ldy);
typedef void (*bn_head_f32_fn)(const float *x, int64_t m, int64_t k, const float *w, int64_t r0, int64_t r1, float *y,
                               int64_t ldy);
/* int8 head: activations pre-quantized per row to int16 (xq, scale sx), weights int8 with row scales ws;
 * y = (sum over 4096-element chunks of float(exact int32 chunk sum)) * (ws[r] * sx[i]): the same on every path */
#define BN_I8_CHUNK 4096
typedef void (*bn_head_i8_fn)(const int16_t *xq, const float *sx, int64_t m, int64_t k, const int8_t *w,
                              const float *ws, int64_t r0, int64_t r1, float *y, int64_t ldy);

typedef struct {
    bn_gemm_rows_fn gemm_rows;    /* cpu-2bit-v2 weights */
    bn_gemm_rows_fn gemm_rows_b3; /* cpu-base3-v1 weights */
    bn_quant_fn quant_row;
    bn_head_bf16_fn head_bf16;
    bn_head_f32_fn head_f32;
    bn_head_i8_fn head_i8;
} bn_kernels;

/* bf16 bits -> float32 (exact) */
static inline float bn_bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* cpu-2bit-v2 addressing: rows come in groups of 4 whose blocks are interleaved, so the 4-row decode kernel
 * reads one sequential stream (the hardware prefetcher follows it; four separate row streams it did not).
 * Row r's block b starts at bn_row(g, r) + b * BN_BSTRIDE. */
#define BN_GROUP 4
#define BN_BSTRIDE (32 * BN_GROUP)
/* byte offset of row r's block b in a matrix with rb bytes per row: the one definition of the layout */
static inline int64_t bn_block_offset(int64_t r, int64_t b, int64_t rb) {
    return (r / BN_GROUP) * BN_GROUP * rb + b * BN_BSTRIDE + (r % BN_GROUP) * 32;
}
static inline const uint8_t *bn_row(const bn_gemm_args *g, int64_t r) { return g->w + bn_block_offset(r, 0, g->rb); }

/* cpu-base3-v1 addressing (see bitnet_cpu.h): blocks of BN3_BYTES bytes hold BN3_BLOCK elements, rows in groups
 * of 4 interleaved by block like cpu-2bit-v2 */
#define BN3_BSTRIDE (BN3_BYTES * BN_GROUP)
static inline int64_t bn3_padk(int64_t k) { return (k + BN3_BLOCK - 1) / BN3_BLOCK * BN3_BLOCK; }
static inline int64_t bn3_block_offset(int64_t r, int64_t b, int64_t rb) {
    return (r / BN_GROUP) * BN_GROUP * rb + b * BN3_BSTRIDE + (r % BN_GROUP) * BN3_BYTES;
}
static inline const uint8_t *bn3_row(const bn_gemm_args *g, int64_t r) {
    return g->w + bn3_block_offset(r, 0, g->rb);
}
/* the code (t + 1) of trit n of a base-3 byte: the top base-3 digit of the fraction q / 256, q = byte * 3^n mod 256 */
static inline int bn3_code(uint8_t q) { return (q * 3) >> 8; }

/* Epilogue shared by every path: write one result. acc already has the activation sum subtracted. */
static inline void bn_store(const bn_gemm_args *g, int64_t i, int64_t r, int32_t acc) {
    if (g->out_f32) {
        /* same float32 operations, in the same order, as the torch reference: acc * (s / a) */
        float sa = g->scale / g->a[i];
        g->out_f32[i * g->ldo + r] = (float)acc * sa;
    } else {
        g->out_i32[i * g->ldo + r] = acc;
    }
}

/* per-ISA tables; a table is only defined when the file is compiled for a matching architecture */
extern const bn_kernels bn_kernels_scalar;
#ifdef BN_X86
extern const bn_kernels bn_kernels_avx2;
extern const bn_kernels bn_kernels_avx512;
#endif
#ifdef BN_ARM
extern const bn_kernels bn_kernels_neon;
#endif

/* scalar pieces reused by vector paths for tails */
void bn_gemm_rows_b3_scalar(const bn_gemm_args *g, int64_t r0, int64_t r1);
void bn_quant_row_scalar(const float *x, int64_t k, int8_t *xq, int64_t ldq, float *a, int32_t *xsum);
void bn_head_bf16_scalar(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t r0, int64_t r1, float *y,
                         int64_t ldy);
void bn_head_f32_scalar(const float *x, int64_t m, int64_t k, const float *w, int64_t r0, int64_t r1, float *y,
                        int64_t ldy);
void bn_head_i8_scalar(const int16_t *xq, const float *sx, int64_t m, int64_t k, const int8_t *w, const float *ws,
                       int64_t r0, int64_t r1, float *y, int64_t ldy);

/* software prefetch distance in bytes for the streaming (decode) kernels: the best of 1-16 KiB for decode on the
 * 2-core EPYC (benchmarks/cpu.py) */
#define BN_PREFETCH_BYTES 8192

/* thread pool (threads.c) */
typedef void (*bn_range_fn)(void *ctx, int64_t begin, int64_t end);
void bn_parallel_for(int64_t n, bn_range_fn fn, void *ctx);
int bn_pool_set_threads(int n);
void bn_locked_parallel_for(int64_t n, bn_range_fn fn, void *ctx); /* as one library call (bitnet_cpu.c) */
int bn_pool_threads(void);
int64_t bn_now_ns(void); /* CLOCK_MONOTONIC in ns (threads.c) */

#endif
