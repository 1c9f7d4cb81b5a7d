/* cpu-base3-v1 packing (bitnet_cpu.h): from int8 ternary values, back, and straight from cpu-2bit-v2. */
#include <string.h>

#include "bn_internal.h"

int64_t bn3_padded_k(int64_t k) { return (k + BN3_BLOCK - 1) / BN3_BLOCK * BN3_BLOCK; }
int64_t bn3_packed_row_bytes(int64_t k) { return bn3_padded_k(k) / 5; }

/* five codes (most significant first) -> the byte ceil(v * 256 / 243) */
static inline uint8_t encode5(const int c[5]) {
    int v = (((c[0] * 3 + c[1]) * 3 + c[2]) * 3 + c[3]) * 3 + c[4];
    return (uint8_t)((v * 256 + 242) / 243);
}

/* codes of one row of a block, c(e) giving the code of element e of the row (padding: 1) */
#define FILL_BLOCK(out, b, code_of)                                          \
    for (int j = 0; j < BN3_BYTES; j++) {                                   \
        int c[5];                                                           \
        for (int i = 0; i < 5; i++) {                                       \
            int64_t e = (b) * BN3_BLOCK + i * BN3_BYTES + j;                \
            c[i] = code_of(e);                                              \
        }                                                                   \
        (out)[j] = encode5(c);                                              \
    }

void bn3_pack(const int8_t *t, int64_t n, int64_t k, uint8_t *out) {
    int64_t rb = bn3_packed_row_bytes(k), nblk = bn3_padded_k(k) / BN3_BLOCK, np = bn_packed_rows(n);
    for (int64_t r = 0; r < np; r++)
        for (int64_t b = 0; b < nblk; b++) {
            uint8_t *o = out + bn3_block_offset(r, b, rb);
#define CODE(e) ((r < n && (e) < k) ? t[r * k + (e)] + 1 : 1)
            FILL_BLOCK(o, b, CODE)
#undef CODE
        }
}

void bn3_unpack(const uint8_t *p, int64_t n, int64_t k, int8_t *out) {
    int64_t rb = bn3_packed_row_bytes(k);
    for (int64_t r = 0; r < n; r++)
        for (int64_t e = 0; e < k; e++) {
            int64_t b = e / BN3_BLOCK, off = e % BN3_BLOCK;
            uint8_t q = p[bn3_block_offset(r, b, rb) + off % BN3_BYTES];
            for (int64_t i = off / BN3_BYTES; i > 0; i--) q = (uint8_t)(q * 3);
            out[r * k + e] = (int8_t)(bn3_code(q) - 1);
        }
}

typedef struct {
    const uint8_t *src;
    int64_t n, k, rb2, rb3;
    uint8_t *out;
} repack3_ctx;

static void repack3_range(void *c, int64_t g0, int64_t g1) {
    const repack3_ctx *q = c;
    int64_t nblk = bn3_padded_k(q->k) / BN3_BLOCK;
    for (int64_t r = g0 * BN_GROUP; r < g1 * BN_GROUP; r++)
        for (int64_t b = 0; b < nblk; b++) {
            uint8_t *o = q->out + bn3_block_offset(r, b, q->rb3);
            /* cpu-2bit-v2: element e of row r at byte (e % 128) % 32 of its block, bits 2 * ((e % 128) / 32) */
#define CODE(e)                                                                                            \
    ((e) < q->k ? (q->src[bn_block_offset(r, (e) / BN_BLOCK, q->rb2) + ((e) % BN_BLOCK) % 32] >>            \
                   (2 * (((e) % BN_BLOCK) / 32))) & 3                                                      \
                : 1)
            FILL_BLOCK(o, b, CODE)
#undef CODE
        }
}

void bn3_repack_2bit(const uint8_t *src, int64_t n, int64_t k, uint8_t *out) {
    repack3_ctx q = {src, n, k, bn_packed_row_bytes(k), bn3_packed_row_bytes(k), out};
    bn_locked_parallel_for(bn_packed_rows(n) / BN_GROUP, repack3_range, &q);
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
