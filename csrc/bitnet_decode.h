/* bitnet_decode: one fused decode step (t = 1 per row; t > 1 tokens per row: bn_decode_forward_f32) through
 * every layer of a BitNet b1.58 / 1bitLLM block.
 *
 * Why: at batch 1 a decode step of a 2B4T-shaped model runs ~40 small torch ops per layer around the ternary
 * projections (norms, RoPE, cache writes, masks, attention, activation, residuals), ~1200 per token, each with
 * microseconds of dispatch. Here they are plain loops between calls of the public ternary linear API, so the
 * packed weight layout stays private to bitnet_cpu.c.
 *
 * Per layer and row i (position in the cache: slot[i]; RoPE tables cos/sin [m, head_dim] given per row):
 *   x = rmsnorm(h, in_norm); q|k|v = ternary(x); rotate q, k (HF rotate-half); cache[slot] = k, v
 *   a = softmax(q.K^T / sqrt(D)) V over slots j <= slot[i] with valid[i, j] (and j = slot[i] itself), per head,
 *       GQA: query head hq reads KV head hq / (n_heads / n_kv); fp32 scores and softmax
 *   h += o_proj(attn_sub_norm?(a)); x = rmsnorm(h, post_norm); h += down(ffn_sub_norm?(act(gate(x)) * up(x)))
 * act: relu2 = relu(g)^2 or silu. KV cache per layer [m, n_kv, S, D] in fp32 or bf16 (round to nearest even).
 * Batch-invariant: every sum of a row (norms, attention from its first visible key, projections, the float heads of
 * bitnet_cpu.h) runs in an order fixed by that row alone, so a row's result is bit-identical whatever the other rows
 * of the call hold, their number, and the left padding of a batched prefill.
 * Calls from several threads are safe, each with its own work buffer: they take turns on the shared thread pool.
 */
#ifndef BITNET_DECODE_H
#define BITNET_DECODE_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { BN_ACT_RELU2 = 0, BN_ACT_SILU = 1 };
enum { BN_KV_F32 = 0, BN_KV_BF16 = 1 };
enum { BN_DEC_Q = 0, BN_DEC_K, BN_DEC_V, BN_DEC_O, BN_DEC_GATE, BN_DEC_UP, BN_DEC_DOWN, BN_DEC_NPROJ };

#define BN_DECODE_MAX_HEAD_DIM 512

typedef struct {
    int64_t hidden, inter, n_heads, n_kv, head_dim;
    int64_t max_seq;  /* S: slots per row of the cache */
    float eps;        /* RMSNorm epsilon */
    int32_t act;      /* BN_ACT_* */
    int32_t kv_dtype; /* BN_KV_* */
} bn_decode_config;

typedef struct {
    const float *in_norm, *post_norm;     /* [hidden] */
    const float *attn_sub_norm;           /* [n_heads * head_dim] or NULL */
    const float *ffn_sub_norm;            /* [inter] or NULL */
    const uint8_t *w[BN_DEC_NPROJ];       /* packed ternary weights (bitnet_cpu.h layout), BN_DEC_* order */
    const float *scale[BN_DEC_NPROJ];     /* their weight scales, read at call time */
    int32_t layout;                       /* the weights' layout, BN_LAYOUT_* */
} bn_decode_layer;

/* floats of scratch bn_decode_step_f32 needs for m rows */
int64_t bn_decode_work_floats(const bn_decode_config *c, int64_t m);

/* Run n_layers layers for m rows. h [m, hidden] fp32 is updated in place. k_cache[l], v_cache[l]: layer l's
 * cache [m, n_kv, max_seq, head_dim] (fp32 or bf16 bits); valid [m, max_seq] bytes (0/1); slot [m];
 * cos, sin [m, head_dim]; work: bn_decode_work_floats(c, m) floats. Returns 0, or a negative code
 * (-1 bad arguments, other: the failing ternary linear's code). */
int bn_decode_step_f32(const bn_decode_config *c, const bn_decode_layer *layers, int64_t n_layers,
                       void *const *k_cache, void *const *v_cache, const uint8_t *valid, const int64_t *slot,
                       const float *cos, const float *sin, int64_t m, float *h, float *work);

/* The same for b rows of t tokens each (prefill or chunked prefill when t > 1): h [b * t, hidden], slot
 * [b, t], cos, sin [b * t, head_dim], work: bn_decode_work_floats(c, b * t) floats. The m = b * t tokens go
 * through each projection as one GEMM; every token's k, v is written to the cache before any attends, and
 * token (r, i) at slot s attends to slots j <= s of cache row r with valid[r, j] (valid as after this step's
 * writes), and to s itself. Slots of one row should differ (a repeated slot keeps the later token's k, v).
 * bn_decode_step_f32(..., m, ...) is this with b = m, t = 1. */
int bn_decode_forward_f32(const bn_decode_config *c, const bn_decode_layer *layers, int64_t n_layers,
                          void *const *k_cache, void *const *v_cache, const uint8_t *valid, const int64_t *slot,
                          const float *cos, const float *sin, int64_t b, int64_t t, float *h, float *work);

/* bn_decode_forward_f32 over a paged KV cache: k_pool[l], v_pool[l] are layer l's blocks [n_blocks, n_kv,
 * block_size, head_dim]; row r's slot s lives in block table[r * (max_seq / block_size) + s / block_size] at
 * offset s % block_size (max_seq: a multiple of block_size, the slots a row may address; valid [b, max_seq] as
 * above). Returns -1 if a token would read or write a block id outside [0, n_blocks). The results equal those of
 * a static cache holding the same keys and values bit for bit. */
int bn_decode_forward_paged_f32(const bn_decode_config *c, const bn_decode_layer *layers, int64_t n_layers,
                                void *const *k_pool, void *const *v_pool, const int32_t *table, int64_t block_size,
                                int64_t n_blocks, const uint8_t *valid, const int64_t *slot, const float *cos,
                                const float *sin, int64_t b, int64_t t, float *h, float *work);

/* The SiLU MLP's middle: y[e] = silu(g[e]) * u[e], silu(x) = x * sigmoid(x) with sigmoid from exp(-|x|) (no
 * overflow for any x). AVX2 + FMA when the library's instruction-set path is AVX2 or AVX-512 (a ~1 ulp vector
 * exp), else libm's expf. */
void bn_silu_mul_f32(const float *g, const float *u, float *y, int64_t n);

/* Phase timers of the fused layer step, for profiling (benchmarks/cpu_profile.py --phases): the calling thread's
 * wall time per phase, summed over layers and calls while on. Writes the sums so far (ns) into out[0..n-1]
 * (out may be NULL), zeroes them and turns the timers on or off. Phases: BN_PHASE_* (the projections include
 * their input's quantization; NORM also holds the residual adds). */
enum { BN_PHASE_NORM, BN_PHASE_QKV, BN_PHASE_ROPE, BN_PHASE_ATTN, BN_PHASE_O, BN_PHASE_GATE_UP, BN_PHASE_ACT,
       BN_PHASE_DOWN, BN_PHASES };
void bn_decode_phase_timers(int on, int64_t *out, int n);

#ifdef __cplusplus
}
#endif
#endif
