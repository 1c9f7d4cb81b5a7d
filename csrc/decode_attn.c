/* Single-query GQA attention for the fused decode step.
 *
 * One task = (row, KV head, a block of its query heads). Keys and values are read slot by slot and used by
 * every query head of the block while the row is in L1, so a KV head's cache is streamed once per block
 * (GQA: 4 query heads per KV head in 2B4T). With few rows the query heads of a KV head are split into two
 * blocks so both threads of a small machine get work (5 KV heads on 2 threads would leave one idle 1/3 of
 * the time). Scores and softmax in fp32.
 *
 * The dot / axpy kernels come in a portable version (vectorised by the compiler, no FMA) and an AVX2+FMA
 * one used when the library's instruction-set path is AVX2 or AVX-512 (bn_get_isa: BITNETLM_CPU_ISA=scalar
 * selects the portable one).
 */
#include <math.h>

#include "bn_internal.h"
#include "decode_internal.h"

#define LANES 8
#define HEAD_BLOCK 8 /* query heads per task at most (accumulators on the stack) */
#define BN_ALWAYS_INLINE static inline __attribute__((always_inline))

typedef struct {
    const bn_decode_config *c;
    const void *kc, *vc;
    const uint8_t *valid;
    const int64_t *slot;
    const float *q;
    int64_t q_ld;
    float *out, *scores;
    int64_t rep, per_task, tasks_per_row_group; /* query heads per KV head, per task; tasks per (row, KV head) */
} attn_ctx;

/* ---- portable kernels ----------------------------------------------------------------------------------- */
BN_ALWAYS_INLINE float lanes_sum(const float *acc) {
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

BN_ALWAYS_INLINE float dot_f32(const float *a, const float *b, int64_t n) {
    float acc[LANES] = {0};
    int64_t d = 0;
    for (; d + LANES <= n; d += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[d + l] * b[d + l];
    float s = lanes_sum(acc);
    for (; d < n; d++) s += a[d] * b[d];
    return s;
}

BN_ALWAYS_INLINE float dot_bf16(const float *a, const uint16_t *b, int64_t n) {
    float acc[LANES] = {0};
    int64_t d = 0;
    for (; d + LANES <= n; d += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[d + l] * bn_bf16_to_f32(b[d + l]);
    float s = lanes_sum(acc);
    for (; d < n; d++) s += a[d] * bn_bf16_to_f32(b[d]);
    return s;
}

BN_ALWAYS_INLINE void axpy_f32(float *acc, float w, const float *v, int64_t n) {
    for (int64_t d = 0; d < n; d++) acc[d] += w * v[d];
}

BN_ALWAYS_INLINE void axpy_bf16(float *acc, float w, const uint16_t *v, int64_t n) {
    for (int64_t d = 0; d < n; d++) acc[d] += w * bn_bf16_to_f32(v[d]);
}

/* ---- the task, written once for both kernel sets --------------------------------------------------------- */
typedef float (*dot_f32_fn)(const float *, const float *, int64_t);
typedef float (*dot_bf16_fn)(const float *, const uint16_t *, int64_t);
typedef void (*axpy_f32_fn)(float *, float, const float *, int64_t);
typedef void (*axpy_bf16_fn)(float *, float, const uint16_t *, int64_t);

BN_ALWAYS_INLINE void attn_task(const attn_ctx *A, int64_t task, dot_f32_fn df, dot_bf16_fn db, axpy_f32_fn af,
                                axpy_bf16_fn ab) {
    const bn_decode_config *c = A->c;
    int64_t D = c->head_dim, S = c->max_seq, H = c->n_heads;
    int64_t i = task / (c->n_kv * A->tasks_per_row_group);
    int64_t g = task / A->tasks_per_row_group % c->n_kv;
    int64_t h0 = g * A->rep + task % A->tasks_per_row_group * A->per_task;
    int64_t nh = A->per_task < g * A->rep + A->rep - h0 ? A->per_task : g * A->rep + A->rep - h0;
    int64_t pos = A->slot[i];
    float scale = 1.0f / sqrtf((float)D);
    int bf16 = c->kv_dtype == BN_KV_BF16;
    const uint8_t *ok = A->valid + i * S;
    int64_t base = (i * c->n_kv + g) * S * D; /* element offset of (row i, KV head g, slot 0) */
    const float *q = A->q + i * A->q_ld + h0 * D;
    float *sc = A->scores + (i * H + h0) * S; /* nh rows of S */
    float mx[HEAD_BLOCK], inv[HEAD_BLOCK];
    for (int64_t h = 0; h < nh; h++) mx[h] = -INFINITY;
    for (int64_t j = 0; j <= pos; j++) {
        /* key j is visible if it holds a real token at or before this slot; a padding query sees itself */
        if (!ok[j] && j != pos) {
            for (int64_t h = 0; h < nh; h++) sc[h * S + j] = -INFINITY;
            continue;
        }
        for (int64_t h = 0; h < nh; h++) {
            float s = bf16 ? db(q + h * D, (const uint16_t *)A->kc + base + j * D, D)
                           : df(q + h * D, (const float *)A->kc + base + j * D, D);
            s *= scale;
            sc[h * S + j] = s;
            if (s > mx[h]) mx[h] = s;
        }
    }
    for (int64_t h = 0; h < nh; h++) {
        float sum = 0.0f, *row = sc + h * S;
        for (int64_t j = 0; j <= pos; j++) {
            float e = row[j] == -INFINITY ? 0.0f : expf(row[j] - mx[h]);
            row[j] = e;
            sum += e;
        }
        inv[h] = 1.0f / sum;
    }
    float acc[HEAD_BLOCK][BN_DECODE_MAX_HEAD_DIM];
    for (int64_t h = 0; h < nh; h++)
        for (int64_t d = 0; d < D; d++) acc[h][d] = 0.0f;
    for (int64_t j = 0; j <= pos; j++)
        for (int64_t h = 0; h < nh; h++) {
            float w = sc[h * S + j];
            if (w == 0.0f) continue;
            if (bf16) ab(acc[h], w, (const uint16_t *)A->vc + base + j * D, D);
            else af(acc[h], w, (const float *)A->vc + base + j * D, D);
        }
    for (int64_t h = 0; h < nh; h++) {
        float *o = A->out + i * H * D + (h0 + h) * D;
        for (int64_t d = 0; d < D; d++) o[d] = acc[h][d] * inv[h];
    }
}

static void attn_range_portable(void *p, int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; t++) attn_task(p, t, dot_f32, dot_bf16, axpy_f32, axpy_bf16);
}

/* ---- AVX2 + FMA kernels ------------------------------------------------------------------------------------ */
#ifdef BN_X86
#include <immintrin.h>
#define AVX2_INLINE static inline __attribute__((always_inline, target("avx2,fma")))

AVX2_INLINE __m256 load_bf16x8(const uint16_t *p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

AVX2_INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

AVX2_INLINE float dot_f32_avx2(const float *a, const float *b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 16 <= n; d += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), s1);
    }
    float s = hsum8(_mm256_add_ps(s0, s1));
    for (; d < n; d++) s += a[d] * b[d];
    return s;
}

AVX2_INLINE float dot_bf16_avx2(const float *a, const uint16_t *b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 16 <= n; d += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), load_bf16x8(b + d), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), load_bf16x8(b + d + 8), s1);
    }
    float s = hsum8(_mm256_add_ps(s0, s1));
    for (; d < n; d++) s += a[d] * bn_bf16_to_f32(b[d]);
    return s;
}

AVX2_INLINE void axpy_f32_avx2(float *acc, float w, const float *v, int64_t n) {
    __m256 wv = _mm256_set1_ps(w);
    int64_t d = 0;
    for (; d + 8 <= n; d += 8)
        _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(wv, _mm256_loadu_ps(v + d), _mm256_loadu_ps(acc + d)));
    for (; d < n; d++) acc[d] += w * v[d];
}

AVX2_INLINE void axpy_bf16_avx2(float *acc, float w, const uint16_t *v, int64_t n) {
    __m256 wv = _mm256_set1_ps(w);
    int64_t d = 0;
    for (; d + 8 <= n; d += 8)
        _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(wv, load_bf16x8(v + d), _mm256_loadu_ps(acc + d)));
    for (; d < n; d++) acc[d] += w * bn_bf16_to_f32(v[d]);
}

__attribute__((target("avx2,fma"))) static void attn_range_avx2(void *p, int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; t++) attn_task(p, t, dot_f32_avx2, dot_bf16_avx2, axpy_f32_avx2, axpy_bf16_avx2);
}
#endif

void bn_decode_attention(const bn_decode_config *c, const void *kc, const void *vc, const uint8_t *valid,
                         const int64_t *slot, const float *q, int64_t q_ld, int64_t m, float *out, float *scores) {
    attn_ctx A = {c, kc, vc, valid, slot, q, q_ld, out, scores, c->n_heads / c->n_kv, 0, 0};
    int64_t groups = m * c->n_kv, threads = bn_get_num_threads();
    /* split a KV head's query heads into blocks when there are too few (row, KV head) pairs to share out */
    int64_t split = groups >= 4 * threads ? 1 : (4 * threads + groups - 1) / groups;
    if (split > A.rep) split = A.rep;
    A.per_task = (A.rep + split - 1) / split;
    if (A.per_task > HEAD_BLOCK) A.per_task = HEAD_BLOCK;
    A.tasks_per_row_group = (A.rep + A.per_task - 1) / A.per_task;
    int64_t tasks = groups * A.tasks_per_row_group, macs = 0;
    for (int64_t i = 0; i < m; i++) macs += (slot[i] + 1) * c->n_heads * c->head_dim * 2;
    bn_range_fn fn = attn_range_portable;
#ifdef BN_X86
    int isa = bn_get_isa();
    if (isa == BN_ISA_AVX2 || isa == BN_ISA_AVX512VNNI) fn = attn_range_avx2;
#endif
    /* below ~64k multiply-adds waking the pool costs more than it saves */
    if (macs >= 65536) bn_parallel_for(tasks, fn, &A);
    else fn(&A, 0, tasks);
}
