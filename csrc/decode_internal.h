/* Pieces of the fused decode step shared between decode.c and decode_attn.c. */
#ifndef BN_DECODE_INTERNAL_H
#define BN_DECODE_INTERNAL_H

#include <stdint.h>
#include <string.h>

#include "bitnet_decode.h"

static inline float bn_bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Attention of m query tokens over their cache slots 0..slot[i] (see bitnet_decode.h): query token i reads
 * cache row i / t (t tokens per row); q [m, q_ld] rotated query heads, out [m, n_heads * head_dim], scores:
 * m * n_heads * max_seq floats of scratch. */
void bn_decode_attention(const bn_decode_config *c, const void *kc, const void *vc, const uint8_t *valid,
                         const int64_t *slot, const float *q, int64_t q_ld, int64_t m, int64_t t, float *out,
                         float *scores);

#endif
