/* Fused decode step (see bitnet_decode.h): the glue between the ternary projections of one layer as plain
 * loops, so a decode step makes one library call instead of ~40 torch ops per layer.
 *
 * The projections go through the public bn_ternary_linear_* API only (the packed layout is private to
 * bitnet_cpu.c). Elementwise steps repeat the torch path's float32 operations in the same order (RoPE,
 * relu2, residuals are bit-identical; SiLU goes through a vector exp, within an ulp or two); reductions
 * (RMSNorm's mean, attention dot products, softmax sums) are summed in a different order, so results differ
 * from the torch path by float rounding only.
 */
#include <math.h>
#include <string.h>

#include "bn_internal.h"
#include "decode_attn.h"

/* relu by clearing negative values' bits: integer ops the compiler vectorizes. The compare-and-select form
 * stayed a scalar branch that mispredicted on every other element (~9% of a prefill). Negative -> +0. */
static inline float relu_bits(float g) {
    uint32_t b;
    memcpy(&b, &g, 4);
    b &= ~(uint32_t)((int32_t)b >> 31);
    float r;
    memcpy(&r, &b, 4);
    return r;
}

static inline float silu1(float x) {
    float t = expf(-fabsf(x));
    return x * ((x >= 0.0f ? 1.0f : t) / (1.0f + t));
}

#ifdef BN_X86
#include "vexp_avx2.h"

/* 8 lanes at a time: libm's scalar expf made the SiLU most of a 0.7B-shape layer's elementwise time */
static __attribute__((target("avx2,fma"))) void silu_mul_avx2(const float *g, const float *u, float *y, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps();
    int64_t e = 0;
    for (; e + 8 <= n; e += 8) {
        __m256 x = _mm256_loadu_ps(g + e);
        __m256 t = bn_exp_neg8(_mm256_or_ps(x, sign)); /* exp(-|x|) */
        __m256 num = _mm256_blendv_ps(t, one, _mm256_cmp_ps(x, zero, _CMP_GE_OQ));
        __m256 s = _mm256_mul_ps(x, _mm256_div_ps(num, _mm256_add_ps(one, t)));
        _mm256_storeu_ps(y + e, _mm256_mul_ps(s, _mm256_loadu_ps(u + e)));
    }
    for (; e < n; e++) y[e] = silu1(g[e]) * u[e];
}
#endif

void bn_silu_mul_f32(const float *g, const float *u, float *y, int64_t n) {
#ifdef BN_X86
    int isa = bn_get_isa();
    if (isa == BN_ISA_AVX2 || isa == BN_ISA_AVX512VNNI) {
        silu_mul_avx2(g, u, y, n);
        return;
    }
#endif
    for (int64_t e = 0; e < n; e++) y[e] = silu1(g[e]) * u[e];
}

/* 8 independent partial sums: the compiler can keep them in vector registers without reassociating */
#define LANES 8

static inline uint16_t f32_to_bf16(float f) {
    /* round to nearest even, like torch's .to(torch.bfloat16); NaN stays a (quiet) NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float lanes_sum(const float *acc) {
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

/* y = w * (x * rsqrt(mean(x^2) + eps)), the torch RMSNorm's operations (y may alias x) */
static void rmsnorm(const float *x, const float *w, int64_t n, float eps, float *y) {
    float acc[LANES] = {0};
    int64_t d = 0;
    for (; d + LANES <= n; d += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += x[d + l] * x[d + l];
    float ss = lanes_sum(acc);
    for (; d < n; d++) ss += x[d] * x[d];
    float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) y[i] = w[i] * (x[i] * r);
}

/* x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1), in place on one head */
static void rope(float *x, const float *cos, const float *sin, int64_t d) {
    float tmp[BN_DECODE_MAX_HEAD_DIM];
    int64_t half = d / 2;
    for (int64_t i = 0; i < d; i++) {
        float rh = i < half ? -x[i + half] : x[i - half];
        tmp[i] = x[i] * cos[i] + rh * sin[i];
    }
    memcpy(x, tmp, sizeof(float) * (size_t)d);
}

/* tokens' rotated k, v -> their cache slots (token i: cache row i / t) */
static void cache_write(const bn_decode_config *c, const bn_kv_pages *pages, void *kc, void *vc, const float *qkv,
                        int64_t ld, const int64_t *slot, int64_t m, int64_t t) {
    int64_t D = c->head_dim, qd = c->n_heads * D, kvd = c->n_kv * D;
    for (int64_t i = 0; i < m; i++)
        for (int64_t g = 0; g < c->n_kv; g++) {
            const float *k = qkv + i * ld + qd + g * D, *v = k + kvd;
            int64_t off = bn_kv_offset(c, pages, i / t, g, slot[i]);
            if (c->kv_dtype == BN_KV_BF16) {
                uint16_t *kd = (uint16_t *)kc + off, *vd = (uint16_t *)vc + off;
                for (int64_t d = 0; d < D; d++) {
                    kd[d] = f32_to_bf16(k[d]);
                    vd[d] = f32_to_bf16(v[d]);
                }
            } else {
                memcpy((float *)kc + off, k, sizeof(float) * (size_t)D);
                memcpy((float *)vc + off, v, sizeof(float) * (size_t)D);
            }
        }
}

/* ---- phase timers (off unless a profiler asks: one predictable branch per phase) ---------------------- */
static int g_timers;
static int64_t g_phase_ns[BN_PHASES];

static int64_t now_ns(void) { return g_timers ? bn_now_ns() : 0; }

/* the time since *t goes to phase id; *t moves to now */
static void phase(int id, int64_t *t) {
    if (!g_timers) return;
    int64_t n = bn_now_ns();
    g_phase_ns[id] += n - *t;
    *t = n;
}

void bn_decode_phase_timers(int on, int64_t *out, int n) {
    for (int i = 0; i < BN_PHASES; i++) {
        if (out && i < n) out[i] = g_phase_ns[i];
        g_phase_ns[i] = 0;
    }
    g_timers = on != 0;
}

/* ---- one layer ---------------------------------------------------------------------------------------- */
typedef struct {
    float *xn, *qkv, *att, *o, *gu, *y, *scores;
} work_t;

static work_t carve(const bn_decode_config *c, int64_t m, float *w) {
    int64_t qd = c->n_heads * c->head_dim, kvd = c->n_kv * c->head_dim;
    work_t W;
    W.xn = w;
    W.qkv = W.xn + m * c->hidden;
    W.att = W.qkv + m * (qd + 2 * kvd);
    W.o = W.att + m * qd;
    W.gu = W.o + m * c->hidden;
    W.y = W.gu + m * 2 * c->inter;
    W.scores = W.y + m * c->inter;
    return W;
}

int64_t bn_decode_work_floats(const bn_decode_config *c, int64_t m) {
    int64_t qd = c->n_heads * c->head_dim, kvd = c->n_kv * c->head_dim;
    return m * (c->hidden + (qd + 2 * kvd) + qd + c->hidden + 3 * c->inter + c->n_heads * c->max_seq);
}

/* y [m, n] = projection j of layer L applied to x [m, k] */
static int linear1(const float *x, int64_t m, int64_t k, const bn_decode_layer *L, int j, int64_t n, float *y) {
    return bn_ternary_linear_multi_f32_layout(x, m, k, 1, &L->w[j], &n, &L->scale[j], &y, n, L->layout);
}

/* ---- the elementwise steps, row by row: a prefill's rows shared out over the pool ---------------------- */
#define ROWS_PARALLEL 16 /* rows below which a step's elementwise work stays on the calling thread */

typedef struct rows_job rows_job;
struct rows_job {
    void (*row)(const rows_job *J, int64_t i);
    const bn_decode_config *c;
    const bn_decode_layer *L;
    const work_t *W;
    float *h;
    const float *cos, *sin;
};

static void rows_range(void *p, int64_t lo, int64_t hi) {
    const rows_job *J = p;
    for (int64_t i = lo; i < hi; i++) J->row(J, i);
}

static void for_rows(const rows_job *J, void (*row)(const rows_job *, int64_t), int64_t m) {
    rows_job job = *J;
    job.row = row;
    if (m >= ROWS_PARALLEL) bn_parallel_for(m, rows_range, &job);
    else rows_range(&job, 0, m);
}

static void in_norm_row(const rows_job *J, int64_t i) {
    int64_t H = J->c->hidden;
    rmsnorm(J->h + i * H, J->L->in_norm, H, J->c->eps, J->W->xn + i * H);
}

static void rope_row(const rows_job *J, int64_t i) {
    const bn_decode_config *c = J->c;
    int64_t D = c->head_dim, ld = (c->n_heads + 2 * c->n_kv) * D;
    for (int64_t hd = 0; hd < c->n_heads + c->n_kv; hd++) /* q heads then k heads: contiguous in a row */
        rope(J->W->qkv + i * ld + hd * D, J->cos + i * D, J->sin + i * D, D);
}

static void sub_norm_row(const rows_job *J, int64_t i) {
    int64_t qd = J->c->n_heads * J->c->head_dim;
    rmsnorm(J->W->att + i * qd, J->L->attn_sub_norm, qd, J->c->eps, J->W->att + i * qd);
}

static void residual_row(const rows_job *J, int64_t i) {
    int64_t H = J->c->hidden;
    float *h = J->h + i * H;
    const float *o = J->W->o + i * H;
    for (int64_t e = 0; e < H; e++) h[e] = h[e] + o[e];
}

/* h += o, then the MLP's input norm */
static void post_norm_row(const rows_job *J, int64_t i) {
    int64_t H = J->c->hidden;
    residual_row(J, i);
    rmsnorm(J->h + i * H, J->L->post_norm, H, J->c->eps, J->W->xn + i * H);
}

static void act_row(const rows_job *J, int64_t i) {
    int64_t I = J->c->inter;
    const float *g = J->W->gu + i * 2 * I, *u = g + I;
    float *y = J->W->y + i * I;
    if (J->c->act == BN_ACT_RELU2) {
        for (int64_t e = 0; e < I; e++) {
            float r = relu_bits(g[e]);
            y[e] = (r * r) * u[e];
        }
    } else {
        bn_silu_mul_f32(g, u, y, I);
    }
    if (J->L->ffn_sub_norm) rmsnorm(y, J->L->ffn_sub_norm, I, J->c->eps, y);
}

static int layer_step(const bn_decode_config *c, const bn_kv_pages *pages, const bn_decode_layer *L, void *kc, void *vc,
                      const uint8_t *valid, const int64_t *slot, const float *cos, const float *sin, int64_t m,
                      int64_t t, float *h, const work_t *W) {
    int64_t H = c->hidden, I = c->inter, D = c->head_dim;
    int64_t qd = c->n_heads * D, kvd = c->n_kv * D, ld = qd + 2 * kvd;
    rows_job J = {NULL, c, L, W, h, cos, sin};
    int rc;
    int64_t t0 = now_ns();
    /* attention */
    for_rows(&J, in_norm_row, m);
    phase(BN_PHASE_NORM, &t0);
    {
        const uint8_t *w[3] = {L->w[BN_DEC_Q], L->w[BN_DEC_K], L->w[BN_DEC_V]};
        const float *s[3] = {L->scale[BN_DEC_Q], L->scale[BN_DEC_K], L->scale[BN_DEC_V]};
        int64_t n[3] = {qd, kvd, kvd};
        float *y[3] = {W->qkv, W->qkv + qd, W->qkv + qd + kvd};
        if ((rc = bn_ternary_linear_multi_f32_layout(W->xn, m, H, 3, w, n, s, y, ld, L->layout)) != 0) return rc;
    }
    phase(BN_PHASE_QKV, &t0);
    for_rows(&J, rope_row, m);
    cache_write(c, pages, kc, vc, W->qkv, ld, slot, m, t); /* every token's k, v first, then the attention */
    phase(BN_PHASE_ROPE, &t0);
    bn_decode_attention(c, pages, kc, vc, valid, slot, W->qkv, ld, m, t, W->att, W->scores);
    phase(BN_PHASE_ATTN, &t0);
    if (L->attn_sub_norm) for_rows(&J, sub_norm_row, m);
    phase(BN_PHASE_NORM, &t0);
    if ((rc = linear1(W->att, m, qd, L, BN_DEC_O, H, W->o)) != 0) return rc;
    phase(BN_PHASE_O, &t0);
    /* MLP */
    for_rows(&J, post_norm_row, m);
    phase(BN_PHASE_NORM, &t0);
    {
        const uint8_t *w[2] = {L->w[BN_DEC_GATE], L->w[BN_DEC_UP]};
        const float *s[2] = {L->scale[BN_DEC_GATE], L->scale[BN_DEC_UP]};
        int64_t n[2] = {I, I};
        float *y[2] = {W->gu, W->gu + I};
        if ((rc = bn_ternary_linear_multi_f32_layout(W->xn, m, H, 2, w, n, s, y, 2 * I, L->layout)) != 0) return rc;
    }
    phase(BN_PHASE_GATE_UP, &t0);
    for_rows(&J, act_row, m);
    phase(BN_PHASE_ACT, &t0);
    if ((rc = linear1(W->y, m, I, L, BN_DEC_DOWN, H, W->o)) != 0) return rc;
    phase(BN_PHASE_DOWN, &t0);
    for_rows(&J, residual_row, m);
    phase(BN_PHASE_NORM, &t0);
    return 0;
}

static int forward(const bn_decode_config *c, const bn_kv_pages *pages, const bn_decode_layer *layers,
                   int64_t n_layers, void *const *k_cache, void *const *v_cache, const uint8_t *valid,
                   const int64_t *slot, const float *cos, const float *sin, int64_t b, int64_t t, float *h,
                   float *work) {
    int64_t m = b * t;
    if (!c || !layers || b <= 0 || t <= 0 || c->n_kv <= 0 || c->n_heads % c->n_kv != 0 || c->head_dim <= 0 ||
        c->head_dim % 2 != 0 || c->head_dim > BN_DECODE_MAX_HEAD_DIM ||
        (c->act != BN_ACT_RELU2 && c->act != BN_ACT_SILU) ||
        (c->kv_dtype != BN_KV_F32 && c->kv_dtype != BN_KV_BF16))
        return -1;
    for (int64_t i = 0; i < m; i++)
        if (slot[i] < 0 || slot[i] >= c->max_seq) return -1;
    work_t W = carve(c, m, work);
    for (int64_t l = 0; l < n_layers; l++) {
        int rc = layer_step(c, pages, &layers[l], k_cache[l], v_cache[l], valid, slot, cos, sin, m, t, h, &W);
        if (rc != 0) return rc;
    }
    return 0;
}

int bn_decode_forward_f32(const bn_decode_config *c, const bn_decode_layer *layers, int64_t n_layers,
                          void *const *k_cache, void *const *v_cache, const uint8_t *valid, const int64_t *slot,
                          const float *cos, const float *sin, int64_t b, int64_t t, float *h, float *work) {
    if (!c) return -1;
    bn_kv_pages pages = {NULL, c->max_seq, 1};
    return forward(c, &pages, layers, n_layers, k_cache, v_cache, valid, slot, cos, sin, b, t, h, work);
}

int bn_decode_forward_paged_f32(const bn_decode_config *c, const bn_decode_layer *layers, int64_t n_layers,
                                void *const *k_pool, void *const *v_pool, const int32_t *table, int64_t block_size,
                                int64_t n_blocks, const uint8_t *valid, const int64_t *slot, const float *cos,
                                const float *sin, int64_t b, int64_t t, float *h, float *work) {
    if (!c || !table || block_size <= 0 || c->max_seq % block_size != 0 || b <= 0 || t <= 0) return -1;
    bn_kv_pages pages = {table, block_size, c->max_seq / block_size};
    /* every block a token writes or reads (slots 0..its own) must be one of the pool's */
    for (int64_t i = 0; i < b * t; i++) {
        if (slot[i] < 0 || slot[i] >= c->max_seq) return -1;
        for (int64_t j = 0; j <= slot[i] / block_size; j++) {
            int32_t blk = table[i / t * pages.max_blocks + j];
            if (blk < 0 || blk >= n_blocks) return -1;
        }
    }
    return forward(c, &pages, layers, n_layers, k_pool, v_pool, valid, slot, cos, sin, b, t, h, work);
}

int bn_decode_step_f32(const bn_decode_config *c, const bn_decode_layer *layers, int64_t n_layers,
                       void *const *k_cache, void *const *v_cache, const uint8_t *valid, const int64_t *slot,
                       const float *cos, const float *sin, int64_t m, float *h, float *work) {
    return bn_decode_forward_f32(c, layers, n_layers, k_cache, v_cache, valid, slot, cos, sin, m, 1, h, work);
}
