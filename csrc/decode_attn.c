/* GQA attention for the fused decode / prefill step: each query token attends to its cache row's slots (a paged
 * cache's row: its blocks in table order, each block's keys contiguous, summed in the same order as a static row's).
 *
 * One task = (query token, KV head, a block of up to 8 of its query heads): scores of every key for the block, softmax
 * per head over the visible keys (fp32), then the weighted sum of values. All query heads of a KV head stay in
 * one task even when that leaves a thread idle part of the time (5 KV heads on 2 threads): the work is bound
 * by reading the cache, and splitting the heads over two tasks reads it twice (measured ~10% slower).
 *
 * Kernels: a portable version (compiler-vectorised, no FMA) and an AVX2+FMA one, used when the library's
 * instruction-set path is AVX2 or AVX-512 and head_dim is a multiple of 16 (BITNETLM_CPU_ISA=scalar selects
 * the portable one). AVX2 scores: 4 query heads x 2 keys per pass (8 independent FMA chains; each key row is
 * loaded once for the heads sharing it; one chain per dot product was latency-bound at ~3 multiply-adds per
 * cycle). AVX2 values: 4 heads x 16 columns in registers over blocks of 32 keys held in L1 (accumulating in
 * memory instead was bound by store-to-load forwarding: the whole attention took ~1.3x longer).
 */
#include <math.h>

#include "bn_internal.h"
#include "decode_attn.h"

#define LANES 8
#define HEAD_BLOCK 8 /* query heads per task at most (accumulators on the stack) */

typedef struct {
    const bn_decode_config *c;
    const bn_kv_pages *pages;
    const void *kc, *vc;
    const uint8_t *valid;
    const int64_t *slot;
    const float *q;
    int64_t q_ld, t; /* t: query tokens per cache row (query row i reads cache row i / t) */
    float *out, *scores;
    int64_t rep, per_task, tasks_per_row_group; /* query heads per KV head, per task; tasks per (row, KV head) */
} attn_ctx;

/* ---- portable kernels ----------------------------------------------------------------------------------- */
/* Kernels of one task: nh query heads q [nh, D] against keys / values 0..n-1 of one KV head (rows of D at kb,
 * vb: fp32 or bf16; a paged cache calls them once per block). scores: sc[h * S + j] = scale * q_h . K_j. values:
 * o[h * D + d] += sum_j sc[h * S + j] V_j[d], in key order (so a sum split over blocks is the same sum). */
typedef void (*scores_fn)(const float *q, int64_t nh, const void *kb, int bf16, int64_t n, int64_t D, int64_t S,
                          float scale, float *sc);
/* softmax: row[j] = exp(row[j] - max) in place (masked keys hold -inf and become 0); returns the sum */
typedef float (*softmax_fn)(float *row, int64_t n);
typedef void (*values_fn)(const float *sc, int64_t nh, const void *vb, int bf16, int64_t n, int64_t D, int64_t S,
                          float *o);

static inline float lanes_sum(const float *acc) {
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

static void scores_portable(const float *q, int64_t nh, const void *kb, int bf16, int64_t n, int64_t D, int64_t S,
                            float scale, float *sc) {
    for (int64_t j = 0; j < n; j++)
        for (int64_t h = 0; h < nh; h++) {
            const float *qh = q + h * D;
            float acc[LANES] = {0}, s;
            int64_t d = 0;
            if (bf16) {
                const uint16_t *k = (const uint16_t *)kb + j * D;
                for (; d + LANES <= D; d += LANES)
                    for (int l = 0; l < LANES; l++) acc[l] += qh[d + l] * bn_bf16_to_f32(k[d + l]);
                s = lanes_sum(acc);
                for (; d < D; d++) s += qh[d] * bn_bf16_to_f32(k[d]);
            } else {
                const float *k = (const float *)kb + j * D;
                for (; d + LANES <= D; d += LANES)
                    for (int l = 0; l < LANES; l++) acc[l] += qh[d + l] * k[d + l];
                s = lanes_sum(acc);
                for (; d < D; d++) s += qh[d] * k[d];
            }
            sc[h * S + j] = s * scale;
        }
}

static void values_portable(const float *sc, int64_t nh, const void *vb, int bf16, int64_t n, int64_t D, int64_t S,
                            float *o) {
    for (int64_t h = 0; h < nh; h++) {
        float acc[BN_DECODE_MAX_HEAD_DIM];
        for (int64_t d = 0; d < D; d++) acc[d] = o[h * D + d];
        for (int64_t j = 0; j < n; j++) {
            float w = sc[h * S + j];
            if (w == 0.0f) continue; /* masked key */
            if (bf16) {
                const uint16_t *v = (const uint16_t *)vb + j * D;
                for (int64_t d = 0; d < D; d++) acc[d] += w * bn_bf16_to_f32(v[d]);
            } else {
                const float *v = (const float *)vb + j * D;
                for (int64_t d = 0; d < D; d++) acc[d] += w * v[d];
            }
        }
        for (int64_t d = 0; d < D; d++) o[h * D + d] = acc[d];
    }
}

static float softmax_portable(float *row, int64_t n) {
    float mx = -INFINITY, sum = 0.0f;
    for (int64_t j = 0; j < n; j++) mx = row[j] > mx ? row[j] : mx;
    for (int64_t j = 0; j < n; j++) {
        float e = row[j] == -INFINITY ? 0.0f : expf(row[j] - mx);
        row[j] = e;
        sum += e;
    }
    return sum;
}

/* ---- the task ---------------------------------------------------------------------------------------------- */
/* The keys before a row's first visible one (a left-padded prompt's padding) are left out, not masked: the sums
 * then run over the same keys in the same order (the vector lanes counted from the first visible key) as for the
 * same tokens without padding, so a prompt's result does not depend on the other prompts it is batched with. */
static void attn_task(const attn_ctx *A, int64_t task, scores_fn scores, softmax_fn softmax, values_fn values) {
    const bn_decode_config *c = A->c;
    int64_t D = c->head_dim, S = c->max_seq, H = c->n_heads, bs = A->pages->block_size;
    int64_t i = task / (c->n_kv * A->tasks_per_row_group);
    int64_t g = task / A->tasks_per_row_group % c->n_kv;
    int64_t h0 = g * A->rep + task % A->tasks_per_row_group * A->per_task;
    int64_t nh = A->per_task < g * A->rep + A->rep - h0 ? A->per_task : g * A->rep + A->rep - h0;
    int64_t pos = A->slot[i], r = i / A->t;
    int bf16 = c->kv_dtype == BN_KV_BF16;
    size_t esz = bf16 ? 2 : 4;
    const uint8_t *ok = A->valid + r * S;
    int64_t j0 = 0; /* key j is visible if it holds a real token at or before this slot; a padding query sees itself */
    while (j0 < pos && !ok[j0]) j0++;
    int64_t n = pos + 1 - j0;
    float *sc = A->scores + (i * H + h0) * S; /* nh rows of S: key j0 + j's score at [j] */
    float *o = A->out + i * H * D + h0 * D;
    const float *q = A->q + i * A->q_ld + h0 * D;
    float inv[HEAD_BLOCK];
    /* keys j0..pos block by block (a static cache: one block); each segment's rows are contiguous */
    for (int64_t j = j0; j <= pos; j = (j / bs + 1) * bs) {
        int64_t end = (j / bs + 1) * bs < pos + 1 ? (j / bs + 1) * bs : pos + 1;
        int64_t base = bn_kv_offset(c, A->pages, r, g, j);
        scores(q, nh, (const char *)A->kc + base * esz, bf16, end - j, D, S, 1.0f / sqrtf((float)D), sc + (j - j0));
    }
    for (int64_t j = 0; j < n; j++)
        if (!ok[j0 + j] && j0 + j != pos)
            for (int64_t h = 0; h < nh; h++) sc[h * S + j] = -INFINITY;
    for (int64_t h = 0; h < nh; h++) inv[h] = 1.0f / softmax(sc + h * S, n);
    for (int64_t e = 0; e < nh * D; e++) o[e] = 0.0f;
    for (int64_t j = j0; j <= pos; j = (j / bs + 1) * bs) {
        int64_t end = (j / bs + 1) * bs < pos + 1 ? (j / bs + 1) * bs : pos + 1;
        int64_t base = bn_kv_offset(c, A->pages, r, g, j);
        values(sc + (j - j0), nh, (const char *)A->vc + base * esz, bf16, end - j, D, S, o);
    }
    for (int64_t h = 0; h < nh; h++)
        for (int64_t d = 0; d < D; d++) o[h * D + d] *= inv[h];
}

static void attn_range_portable(void *p, int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; t++) attn_task(p, t, scores_portable, softmax_portable, values_portable);
}

/* ---- AVX2 + FMA kernels (head_dim a multiple of 16) ---------------------------------------------------------- */
#ifdef BN_X86
#include "vexp_avx2.h"
#define AVX2_INLINE static inline __attribute__((always_inline, target("avx2,fma")))
#define AVX2_FN static __attribute__((target("avx2,fma")))
#define PREFETCH_ROWS 8 /* K / V rows to fetch ahead: the hardware prefetcher alone gave ~4.5 GB/s per thread */

AVX2_INLINE __m256 load8(const void *p, int bf16) {
    if (bf16) {
        __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
        return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    }
    return _mm256_loadu_ps((const float *)p);
}

AVX2_INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* HN query heads x 2 keys per pass: 2 * HN independent FMA chains, each key row loaded once for HN heads */
AVX2_INLINE void scores_heads(const float *q, const char *kb, int bf16, int64_t n, int64_t D, int64_t S,
                              float scale, float *sc, const int HN) {
    size_t row = (size_t)D * (bf16 ? 2 : 4);
    int64_t j = 0;
    for (; j + 2 <= n; j += 2) {
        __m256 a0[4], a1[4];
        for (int h = 0; h < HN; h++) a0[h] = a1[h] = _mm256_setzero_ps();
        const char *k0 = kb + (size_t)j * row, *k1 = k0 + row;
        for (size_t off = 0; off < 2 * row; off += 64) _mm_prefetch(k0 + PREFETCH_ROWS * row + off, _MM_HINT_T0);
        for (int64_t d = 0; d < D; d += 8) {
            __m256 x0 = load8(k0 + d * (bf16 ? 2 : 4), bf16), x1 = load8(k1 + d * (bf16 ? 2 : 4), bf16);
            for (int h = 0; h < HN; h++) {
                __m256 qv = _mm256_loadu_ps(q + h * D + d);
                a0[h] = _mm256_fmadd_ps(qv, x0, a0[h]);
                a1[h] = _mm256_fmadd_ps(qv, x1, a1[h]);
            }
        }
        for (int h = 0; h < HN; h++) {
            sc[h * S + j] = hsum8(a0[h]) * scale;
            sc[h * S + j + 1] = hsum8(a1[h]) * scale;
        }
    }
    for (; j < n; j++) {
        __m256 a0[4];
        for (int h = 0; h < HN; h++) a0[h] = _mm256_setzero_ps();
        const char *k0 = kb + (size_t)j * row;
        for (int64_t d = 0; d < D; d += 8) {
            __m256 x0 = load8(k0 + d * (bf16 ? 2 : 4), bf16);
            for (int h = 0; h < HN; h++) a0[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + d), x0, a0[h]);
        }
        for (int h = 0; h < HN; h++) sc[h * S + j] = hsum8(a0[h]) * scale;
    }
}

AVX2_FN void scores_avx2(const float *q, int64_t nh, const void *kb, int bf16, int64_t n, int64_t D, int64_t S,
                         float scale, float *sc) {
    for (int64_t h = 0; h < nh; h += 4) {
        const float *qh = q + h * D;
        float *s = sc + h * S;
        switch (nh - h < 4 ? nh - h : 4) {
        case 1: scores_heads(qh, kb, bf16, n, D, S, scale, s, 1); break;
        case 2: scores_heads(qh, kb, bf16, n, D, S, scale, s, 2); break;
        case 3: scores_heads(qh, kb, bf16, n, D, S, scale, s, 3); break;
        default: scores_heads(qh, kb, bf16, n, D, S, scale, s, 4); break;
        }
    }
}

/* HN heads x 16 output columns in registers over keys j0..j1-1, added to acc [HN][D] */
AVX2_INLINE void values_tile(const float *sc, const char *vb, int bf16, int64_t j0, int64_t j1, int64_t D, int64_t S,
                             int64_t d0, float *acc, const int HN) {
    size_t es = bf16 ? 2 : 4, row = (size_t)D * es;
    __m256 a0[4], a1[4];
    for (int h = 0; h < HN; h++) {
        a0[h] = _mm256_loadu_ps(acc + h * D + d0);
        a1[h] = _mm256_loadu_ps(acc + h * D + d0 + 8);
    }
    const char *v = vb + (size_t)j0 * row + (size_t)d0 * es;
    for (int64_t j = j0; j < j1; j++, v += row) {
        __m256 x0 = load8(v, bf16), x1 = load8(v + 8 * es, bf16);
        for (int h = 0; h < HN; h++) {
            __m256 w = _mm256_broadcast_ss(sc + h * S + j);
            a0[h] = _mm256_fmadd_ps(w, x0, a0[h]);
            a1[h] = _mm256_fmadd_ps(w, x1, a1[h]);
        }
    }
    for (int h = 0; h < HN; h++) {
        _mm256_storeu_ps(acc + h * D + d0, a0[h]);
        _mm256_storeu_ps(acc + h * D + d0 + 8, a1[h]);
    }
}

AVX2_FN float softmax_avx2(float *row, int64_t n) {
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(row + j));
    float t[8], mx = -INFINITY, sum;
    _mm256_storeu_ps(t, m8);
    for (int l = 0; l < 8; l++) mx = t[l] > mx ? t[l] : mx;
    for (int64_t k = j; k < n; k++) mx = row[k] > mx ? row[k] : mx;
    __m256 mv = _mm256_set1_ps(mx), s8 = _mm256_setzero_ps();
    for (j = 0; j + 8 <= n; j += 8) {
        __m256 e = bn_exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(row + j), mv));
        _mm256_storeu_ps(row + j, e);
        s8 = _mm256_add_ps(s8, e);
    }
    sum = hsum8(s8);
    for (; j < n; j++) {
        float e = row[j] == -INFINITY ? 0.0f : expf(row[j] - mx);
        row[j] = e;
        sum += e;
    }
    return sum;
}

#define KEY_BLOCK 32 /* V rows kept in L1 while every 16-column strip of them is used (16 KiB in fp32) */

AVX2_FN void values_avx2(const float *sc, int64_t nh, const void *vb, int bf16, int64_t n, int64_t D, int64_t S,
                         float *o) {
    size_t row = (size_t)D * (bf16 ? 2 : 4);
    for (int64_t j0 = 0; j0 < n; j0 += KEY_BLOCK) {
        int64_t j1 = j0 + KEY_BLOCK < n ? j0 + KEY_BLOCK : n;
        /* the next block's rows while this one is computed */
        for (int64_t j = j1; j < j1 + KEY_BLOCK && j < n; j++)
            for (size_t off = 0; off < row; off += 64) _mm_prefetch((const char *)vb + j * row + off, _MM_HINT_T0);
        for (int64_t h = 0; h < nh; h += 4)
            for (int64_t d = 0; d < D; d += 16) { /* head_dim: a multiple of 16 on this path */
                const float *s = sc + h * S;
                float *oh = o + h * D;
                switch (nh - h < 4 ? nh - h : 4) {
                case 1: values_tile(s, vb, bf16, j0, j1, D, S, d, oh, 1); break;
                case 2: values_tile(s, vb, bf16, j0, j1, D, S, d, oh, 2); break;
                case 3: values_tile(s, vb, bf16, j0, j1, D, S, d, oh, 3); break;
                default: values_tile(s, vb, bf16, j0, j1, D, S, d, oh, 4); break;
                }
            }
    }
}

static void attn_range_avx2(void *p, int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; t++) attn_task(p, t, scores_avx2, softmax_avx2, values_avx2);
}
#endif

void bn_decode_attention(const bn_decode_config *c, const bn_kv_pages *pages, const void *kc, const void *vc,
                         const uint8_t *valid, const int64_t *slot, const float *q, int64_t q_ld, int64_t m,
                         int64_t t, float *out, float *scores) {
    attn_ctx A = {c, pages, kc, vc, valid, slot, q, q_ld, t, out, scores, c->n_heads / c->n_kv, 0, 0};
    int64_t groups = m * c->n_kv;
    A.per_task = A.rep < HEAD_BLOCK ? A.rep : HEAD_BLOCK;
    A.tasks_per_row_group = (A.rep + A.per_task - 1) / A.per_task;
    int64_t tasks = groups * A.tasks_per_row_group, macs = 0;
    for (int64_t i = 0; i < m; i++) macs += (slot[i] + 1) * c->n_heads * c->head_dim * 2;
    bn_range_fn fn = attn_range_portable;
#ifdef BN_X86
    int isa = bn_get_isa();
    if ((isa == BN_ISA_AVX2 || isa == BN_ISA_AVX512VNNI) && c->head_dim % 16 == 0) fn = attn_range_avx2;
#endif
    /* below ~64k multiply-adds waking the pool costs more than it saves */
    if (macs >= 65536) bn_parallel_for(tasks, fn, &A);
    else fn(&A, 0, tasks);
}
