/* The attention of the fused decode step (decode_attn.c), called by decode.c. */
#ifndef BN_DECODE_INTERNAL_H
#define BN_DECODE_INTERNAL_H

#include <stdint.h>

#include "bitnet_decode.h"

/* Attention of m query tokens over their cache slots 0..slot[i] (see bitnet_decode.h): query token i reads
 * cache row i / t (t tokens per row); q [m, q_ld] rotated query heads, out [m, n_heads * head_dim], scores:
 * m * n_heads * max_seq floats of scratch. */
void bn_decode_attention(const bn_decode_config *c, const void *kc, const void *vc, const uint8_t *valid,
                         const int64_t *slot, const float *q, int64_t q_ld, int64_t m, int64_t t, float *out,
                         float *scores);

#endif
