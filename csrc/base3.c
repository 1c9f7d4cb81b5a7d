/* cpu-base3-v1 (bitnet_cpu.h): its padded sizes, repacking between it and cpu-2bit-v2, its scalar kernel. */
#include <stdlib.h>
#include <string.h>

#include "bn_internal.h"

int64_t bn3_padded_k(int64_t k) { return bn3_padk(k); }
int64_t bn3_packed_row_bytes(int64_t k) { return bn3_padded_k(k) / 5; }

/* five codes (most significant first) -> the byte ceil(v * 256 / 243) */
static inline uint8_t encode5(const uint8_t *c, int stride) {
    int v = (((c[0] * 3 + c[stride]) * 3 + c[2 * stride]) * 3 + c[3 * stride]) * 3 + c[4 * stride];
    return (uint8_t)((v * 256 + 242) / 243);
}

/* row r's codes (t + 1) from a matrix in `layout` into codes[0, kp) (kp: the layout's padded K) */
static void row_codes(const uint8_t *src, int layout, int64_t r, int64_t k, uint8_t *codes) {
    if (layout == BN_LAYOUT_BASE3) {
        int64_t rb = bn3_packed_row_bytes(k);
        for (int64_t b = 0; b < rb / BN3_BYTES; b++) {
            const uint8_t *p = src + bn3_block_offset(r, b, rb);
            for (int j = 0; j < BN3_BYTES; j++) {
                uint8_t q = p[j];
                for (int i = 0; i < 5; i++, q = (uint8_t)(q * 3)) codes[b * BN3_BLOCK + i * BN3_BYTES + j] = (uint8_t)bn3_code(q);
            }
        }
    } else {
        int64_t rb = bn_packed_row_bytes(k);
        for (int64_t b = 0; b < rb / 32; b++) {
            const uint8_t *p = src + bn_block_offset(r, b, rb);
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 32; j++) codes[b * BN_BLOCK + i * 32 + j] = (p[j] >> (2 * i)) & 3;
        }
    }
}

/* codes[0, kp) of row r into a matrix in `layout` */
static void put_row(const uint8_t *codes, int layout, int64_t r, int64_t k, uint8_t *out) {
    if (layout == BN_LAYOUT_BASE3) {
        int64_t rb = bn3_packed_row_bytes(k);
        for (int64_t b = 0; b < rb / BN3_BYTES; b++) {
            uint8_t *o = out + bn3_block_offset(r, b, rb);
            for (int j = 0; j < BN3_BYTES; j++) o[j] = encode5(codes + b * BN3_BLOCK + j, BN3_BYTES);
        }
    } else {
        int64_t rb = bn_packed_row_bytes(k);
        for (int64_t b = 0; b < rb / 32; b++) {
            uint8_t *o = out + bn_block_offset(r, b, rb);
            const uint8_t *c = codes + b * BN_BLOCK;
            for (int j = 0; j < 32; j++) o[j] = (uint8_t)(c[j] | c[j + 32] << 2 | c[j + 64] << 4 | c[j + 96] << 6);
        }
    }
}

typedef struct {
    const uint8_t *src;
    uint8_t *out;
    int64_t k;
    int from, to;
    int failed; /* a range could not allocate its row buffer */
} repack_ctx;

static void repack_range(void *c, int64_t g0, int64_t g1) {
    const repack_ctx *q = c;
    int64_t len = bn_padded_k(q->k) > bn3_padded_k(q->k) ? bn_padded_k(q->k) : bn3_padded_k(q->k);
    uint8_t *codes = malloc((size_t)len);
    if (!codes) {
        __atomic_store_n(&((repack_ctx *)c)->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    for (int64_t r = g0 * BN_GROUP; r < g1 * BN_GROUP; r++) {
        row_codes(q->src, q->from, r, q->k, codes);
        memset(codes + q->k, 1, (size_t)(len - q->k)); /* padding: t = 0 */
        put_row(codes, q->to, r, q->k, q->out);
    }
    free(codes);
}

int bn_repack(const uint8_t *src, int from, int64_t n, int64_t k, uint8_t *out, int to) {
    int ok = (from == BN_LAYOUT_2BIT || from == BN_LAYOUT_BASE3) && (to == BN_LAYOUT_2BIT || to == BN_LAYOUT_BASE3);
    if (!ok || k <= 0 || n <= 0) return -1;
    repack_ctx q = {src, out, k, from, to, 0};
    bn_locked_parallel_for(bn_packed_rows(n) / BN_GROUP, repack_range, &q);
    return q.failed ? -2 : 0;
}

/* the scalar kernel: the semantics of every vector path's base-3 kernel */
void bn_gemm_rows_b3_scalar(const bn_gemm_args *g, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = bn3_row(g, r);
        for (int64_t i = 0; i < g->m; i++) {
            const int8_t *x = g->xq + i * g->ldx;
            int32_t acc = 0;
            for (int64_t b = 0; b < g->nblk; b++) {
                const uint8_t *p = row + b * BN3_BSTRIDE;
                const int8_t *xb = x + b * BN3_BLOCK;
                for (int j = 0; j < BN3_BYTES; j++) {
                    uint8_t q = p[j];
                    for (int i5 = 0; i5 < 5; i5++, q = (uint8_t)(q * 3)) acc += bn3_code(q) * xb[i5 * BN3_BYTES + j];
                }
            }
            bn_store(g, i, r, acc - g->xsum[i]);
        }
    }
}
