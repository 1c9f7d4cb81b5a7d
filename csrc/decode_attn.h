/* The attention of the fused decode step (decode_attn.c), called by decode.c. */
#ifndef BN_DECODE_ATTN_H
#define BN_DECODE_ATTN_H

#include <stdint.h>

#include "bitnet_decode.h"

/* Where slot s of cache row r lives: a static cache has one block of max_seq slots per row (table NULL: row r's
 * block is r); a paged one gives each row max_blocks block ids of block_size slots (pool [blocks, n_kv,
 * block_size, head_dim]). */
typedef struct {
    const int32_t *table; /* [rows, max_blocks] or NULL */
    int64_t block_size, max_blocks;
} bn_kv_pages;

/* element offset of (cache row r, KV head g, slot s) */
static inline int64_t bn_kv_offset(const bn_decode_config *c, const bn_kv_pages *p, int64_t r, int64_t g, int64_t s) {
    int64_t bs = p->block_size, blk = p->table ? p->table[r * p->max_blocks + s / bs] : r;
    return ((blk * c->n_kv + g) * bs + s % bs) * c->head_dim;
}

/* Attention of m query tokens over their cache slots 0..slot[i] (see bitnet_decode.h): query token i reads
 * cache row i / t (t tokens per row); q [m, q_ld] rotated query heads, out [m, n_heads * head_dim], scores:
 * m * n_heads * max_seq floats of scratch. */
void bn_decode_attention(const bn_decode_config *c, const bn_kv_pages *pages, const void *kc, const void *vc,
                         const uint8_t *valid, const int64_t *slot, const float *q, int64_t q_ld, int64_t m,
                         int64_t t, float *out, float *scores);

#endif
