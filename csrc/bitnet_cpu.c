/* Public API: ISA selection, packing, scratch buffers and the split of work across threads. */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "bn_internal.h"

#if defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD) && defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20) /* Linux's arch/arm64 hwcap bit for the dot-product instructions */
#endif
#endif

static int g_isa = -2; /* -2: not initialised */
static const bn_kernels *g_k = &bn_kernels_scalar;
/* one call at a time: the pool and the scratch buffers are shared */
static pthread_mutex_t g_call = PTHREAD_MUTEX_INITIALIZER;

const char *bn_version(void) { return "cpu-2bit-v2"; }

const char *bn_isa_name(int isa) {
    switch (isa) {
    case BN_ISA_SCALAR: return "scalar";
    case BN_ISA_AVX2: return "avx2";
    case BN_ISA_AVX512VNNI: return "avx512vnni";
    case BN_ISA_NEON: return "neon";
    default: return "unknown";
    }
}

int bn_isa_supported(int isa) {
    switch (isa) {
    case BN_ISA_SCALAR: return 1;
#ifdef BN_X86
    case BN_ISA_AVX2:
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case BN_ISA_AVX512VNNI:
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#endif
#ifdef BN_ARM
    case BN_ISA_NEON:
#if defined(__ARM_FEATURE_DOTPROD) && defined(__linux__)
        /* a dotprod build's kernel uses sdot, which ARMv8.0-8.1 CPUs lack: then the scalar path runs */
        return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#else
        return 1; /* baseline on AArch64 */
#endif
#endif
    default: return 0;
    }
}

int bn_isa_best(void) {
    static const int order[] = {BN_ISA_AVX512VNNI, BN_ISA_AVX2, BN_ISA_NEON};
    for (unsigned i = 0; i < sizeof order / sizeof order[0]; i++)
        if (bn_isa_supported(order[i])) return order[i];
    return BN_ISA_SCALAR;
}

static const bn_kernels *table(int isa) {
    switch (isa) {
#ifdef BN_X86
    case BN_ISA_AVX2: return &bn_kernels_avx2;
    case BN_ISA_AVX512VNNI: return &bn_kernels_avx512;
#endif
#ifdef BN_ARM
    case BN_ISA_NEON: return &bn_kernels_neon;
#endif
    default: return &bn_kernels_scalar;
    }
}

int bn_set_isa(int isa) {
    if (isa == BN_ISA_AUTO) {
        isa = bn_isa_best();
        const char *e = getenv("BITNETLM_CPU_ISA");
        if (e && *e) {
            for (int i = BN_ISA_SCALAR; i <= BN_ISA_NEON; i++)
                if (strcmp(e, bn_isa_name(i)) == 0 && bn_isa_supported(i)) isa = i;
        }
    }
    if (!bn_isa_supported(isa)) return -1;
    g_isa = isa;
    g_k = table(isa);
    return isa;
}

int bn_get_isa(void) {
    if (g_isa == -2) bn_set_isa(BN_ISA_AUTO);
    return g_isa;
}

static const bn_kernels *K(void) {
    if (g_isa == -2) bn_set_isa(BN_ISA_AUTO);
    return g_k;
}

int bn_set_num_threads(int n) {
    pthread_mutex_lock(&g_call);
    int r = bn_pool_set_threads(n);
    pthread_mutex_unlock(&g_call);
    return r;
}
int bn_get_num_threads(void) { return bn_pool_threads(); }

/* ---- packing ------------------------------------------------------------------------------------ */
int64_t bn_padded_k(int64_t k) { return (k + BN_BLOCK - 1) / BN_BLOCK * BN_BLOCK; }
int64_t bn_packed_row_bytes(int64_t k) { return bn_padded_k(k) / 4; }

int64_t bn_packed_rows(int64_t n) { return (n + BN_GROUP - 1) / BN_GROUP * BN_GROUP; }

/* byte offset of (row r, element e) in the cpu-2bit-v2 layout, and the shift of its 2-bit code */
static inline int64_t code_at(int64_t r, int64_t e, int64_t rb, int *shift) {
    int64_t off = e % BN_BLOCK;
    *shift = 2 * (int)(off >> 5);
    return bn_block_offset(r, e / BN_BLOCK, rb) + (off & 31);
}

void bn_pack(const int8_t *t, int64_t n, int64_t k, uint8_t *out) {
    int64_t rb = bn_packed_row_bytes(k), kp = bn_padded_k(k), np = bn_packed_rows(n);
    memset(out, 0, (size_t)(np * rb));
    for (int64_t r = 0; r < np; r++)
        for (int64_t e = 0; e < kp; e++) {
            int c = (r < n && e < k) ? t[r * k + e] + 1 : 1; /* padding rows and columns hold t = 0 */
            int sh;
            out[code_at(r, e, rb, &sh)] |= (uint8_t)((c & 3) << sh);
        }
}

void bn_unpack(const uint8_t *p, int64_t n, int64_t k, int8_t *out) {
    int64_t rb = bn_packed_row_bytes(k);
    for (int64_t r = 0; r < n; r++)
        for (int64_t e = 0; e < k; e++) {
            int sh;
            int c = (p[code_at(r, e, rb, &sh)] >> sh) & 3;
            out[r * k + e] = (int8_t)(c - 1);
        }
}

/* HF offline 2-bit layout (transformers pack_weights: hf[r % R, e] holds row r's code t+1 at bits
 * 2 * (r / R), R = ceil(n / 4)) straight into cpu-2bit-v2, without an int8 copy: the codes are the same, only
 * their places change. Threaded over row groups. */
typedef struct {
    const uint8_t *hf;
    int64_t n, k, R, rb;
    uint8_t *out;
} repack_ctx;

static void repack_range(void *c, int64_t g0, int64_t g1) {
    const repack_ctx *q = c;
    int64_t nblk = q->rb / 32;
    for (int64_t g = g0; g < g1; g++)
        for (int i = 0; i < BN_GROUP; i++) {
            int64_t r = g * BN_GROUP + i;
            const uint8_t *src = r < q->n ? q->hf + (r % q->R) * q->k : NULL;
            int sh = (int)(2 * (r / q->R));
            for (int64_t b = 0; b < nblk; b++) {
                uint8_t *o = q->out + bn_block_offset(r, b, q->rb);
                for (int j = 0; j < 32; j++) {
                    uint8_t v = 0;
                    for (int p = 0; p < 4; p++) {
                        int64_t e = b * BN_BLOCK + p * 32 + j;
                        int code = (src && e < q->k) ? (src[e] >> sh) & 3 : 1; /* padding: t = 0 */
                        v |= (uint8_t)(code << (2 * p));
                    }
                    o[j] = v;
                }
            }
        }
}

void bn_locked_parallel_for(int64_t n, bn_range_fn fn, void *ctx) {
    pthread_mutex_lock(&g_call);
    bn_parallel_for(n, fn, ctx);
    pthread_mutex_unlock(&g_call);
}

void bn_repack_hf(const uint8_t *hf, int64_t n, int64_t k, uint8_t *out) {
    repack_ctx q = {hf, n, k, (n + 3) / 4, bn_packed_row_bytes(k), out};
    bn_locked_parallel_for(bn_packed_rows(n) / BN_GROUP, repack_range, &q);
}

/* ---- scratch ------------------------------------------------------------------------------------ */
static void *g_scratch = NULL;
static size_t g_scratch_size = 0;

static void *scratch(size_t bytes) {
    if (bytes > g_scratch_size) {
        free(g_scratch);
        size_t sz = bytes + bytes / 4 + 4096;
        if (posix_memalign(&g_scratch, 64, sz) != 0) {
            g_scratch = NULL;
            g_scratch_size = 0;
            return NULL;
        }
        g_scratch_size = sz;
    }
    return g_scratch;
}

/* ---- activation quantization ---------------------------------------------------------------------- */
typedef struct {
    const float *x;
    int64_t k, ldq;
    int8_t *xq;
    float *a;
    int32_t *xsum;
} quant_ctx;

static void quant_range(void *c, int64_t lo, int64_t hi) {
    quant_ctx *q = c;
    const bn_kernels *k = K();
    for (int64_t i = lo; i < hi; i++)
        k->quant_row(q->x + i * q->k, q->k, q->xq + i * q->ldq, q->ldq, q->a ? q->a + i : NULL, q->xsum + i);
}

static void quantize(const float *x, int64_t m, int64_t k, int8_t *xq, int64_t ldq, float *a, int32_t *xsum) {
    quant_ctx q = {x, k, ldq, xq, a, xsum};
    if (m >= 16) bn_parallel_for(m, quant_range, &q);
    else quant_range(&q, 0, m);
}

void bn_quantize_act(const float *x, int64_t m, int64_t k, int8_t *xq, int64_t ldq, float *a, int32_t *xsum) {
    pthread_mutex_lock(&g_call);
    int32_t *tmp = NULL;
    if (!xsum) tmp = xsum = malloc(sizeof(int32_t) * (size_t)(m > 0 ? m : 1));
    quantize(x, m, k, xq, ldq, a, xsum);
    free(tmp);
    pthread_mutex_unlock(&g_call);
}

/* ---- ternary GEMM over several matrices ----------------------------------------------------------- */
#define MAX_MULTI 8

typedef struct {
    int count;
    bn_gemm_args g[MAX_MULTI];
    int64_t unit_rows;          /* rows per work unit */
    int64_t ustart[MAX_MULTI + 1]; /* first unit of each matrix */
    int64_t n[MAX_MULTI];
} gemm_ctx;

static void gemm_range(void *c, int64_t lo, int64_t hi) {
    gemm_ctx *G = c;
    const bn_kernels *k = K();
    for (int j = 0; j < G->count; j++) {
        int64_t a = lo > G->ustart[j] ? lo : G->ustart[j];
        int64_t b = hi < G->ustart[j + 1] ? hi : G->ustart[j + 1];
        if (a >= b) continue;
        int64_t r0 = (a - G->ustart[j]) * G->unit_rows, r1 = (b - G->ustart[j]) * G->unit_rows;
        if (r1 > G->n[j]) r1 = G->n[j];
        (G->g[j].layout == BN_LAYOUT_BASE3 ? k->gemm_rows_b3 : k->gemm_rows)(&G->g[j], r0, r1);
    }
}

static void run_gemm(gemm_ctx *G, int64_t m) {
    /* units: 4 rows for decode (fine split, the GEMV kernel takes 4 rows), 16 rows for prefill */
    G->unit_rows = m < 3 ? 4 : 16;
    G->ustart[0] = 0;
    for (int j = 0; j < G->count; j++) G->ustart[j + 1] = G->ustart[j] + (G->n[j] + G->unit_rows - 1) / G->unit_rows;
    bn_parallel_for(G->ustart[G->count], gemm_range, G);
}

/* K padded for `layout`; the weights' bytes per row and blocks per row */
static int64_t layout_dims(int layout, int64_t k, int64_t *rb, int64_t *nblk) {
    int64_t kp = layout == BN_LAYOUT_BASE3 ? bn3_padk(k) : bn_padded_k(k);
    *rb = layout == BN_LAYOUT_BASE3 ? kp / 5 : kp / 4;
    *nblk = kp / (layout == BN_LAYOUT_BASE3 ? BN3_BLOCK : BN_BLOCK);
    return kp;
}

int bn_ternary_matmul_i32(const int8_t *xq, int64_t m, int64_t k, const uint8_t *packed, int64_t n, int32_t *out) {
    return bn_ternary_matmul_i32_layout(xq, m, k, packed, n, out, BN_LAYOUT_2BIT);
}

int bn_ternary_matmul_i32_layout(const int8_t *xq, int64_t m, int64_t k, const uint8_t *packed, int64_t n,
                                 int32_t *out, int layout) {
    if (layout != BN_LAYOUT_2BIT && layout != BN_LAYOUT_BASE3) return -2;
    if (m <= 0 || n <= 0) return 0;
    int64_t rb, nblk, kp = layout_dims(layout, k, &rb, &nblk);
    pthread_mutex_lock(&g_call);
    size_t need = (size_t)(m * kp) + sizeof(int32_t) * (size_t)m + 64;
    char *buf = scratch(need);
    if (!buf) {
        pthread_mutex_unlock(&g_call);
        return -1;
    }
    int8_t *xp = (int8_t *)buf;
    int32_t *xsum = (int32_t *)(buf + ((m * kp + 63) / 64) * 64);
    for (int64_t i = 0; i < m; i++) {
        int32_t s = 0;
        memcpy(xp + i * kp, xq + i * k, (size_t)k);
        memset(xp + i * kp + k, 0, (size_t)(kp - k));
        for (int64_t e = 0; e < k; e++) s += xq[i * k + e];
        xsum[i] = s;
    }
    gemm_ctx G = {.count = 1};
    G.g[0] = (bn_gemm_args){xp, kp, xsum, m, packed, rb, nblk, out, NULL, n, NULL, 0.0f, layout};
    G.n[0] = n;
    run_gemm(&G, m);
    pthread_mutex_unlock(&g_call);
    return 0;
}

int bn_ternary_linear_multi_f32(const float *x, int64_t m, int64_t k, int count, const uint8_t *const *packed,
                                const int64_t *n, const float *const *scale, float *const *y) {
    return bn_ternary_linear_multi_f32_ld(x, m, k, count, packed, n, scale, y, 0);
}

int bn_ternary_linear_multi_f32_ld(const float *x, int64_t m, int64_t k, int count, const uint8_t *const *packed,
                                   const int64_t *n, const float *const *scale, float *const *y, int64_t ldy) {
    return bn_ternary_linear_multi_f32_layout(x, m, k, count, packed, n, scale, y, ldy, BN_LAYOUT_2BIT);
}

int bn_ternary_linear_multi_f32_layout(const float *x, int64_t m, int64_t k, int count, const uint8_t *const *packed,
                                       const int64_t *n, const float *const *scale, float *const *y, int64_t ldy,
                                       int layout) {
    if (count < 1 || count > MAX_MULTI || (layout != BN_LAYOUT_2BIT && layout != BN_LAYOUT_BASE3)) return -2;
    if (m <= 0) return 0;
    int64_t rb, nblk, kp = layout_dims(layout, k, &rb, &nblk);
    pthread_mutex_lock(&g_call);
    size_t xq_bytes = (size_t)(((m * kp + 63) / 64) * 64);
    char *buf = scratch(xq_bytes + (sizeof(float) + sizeof(int32_t)) * (size_t)m + 64);
    if (!buf) {
        pthread_mutex_unlock(&g_call);
        return -1;
    }
    int8_t *xq = (int8_t *)buf;
    float *a = (float *)(buf + xq_bytes);
    int32_t *xsum = (int32_t *)(a + m);
    quantize(x, m, k, xq, kp, a, xsum);
    gemm_ctx G = {.count = count};
    for (int j = 0; j < count; j++) {
        G.g[j] = (bn_gemm_args){xq, kp, xsum, m, packed[j], rb, nblk, NULL, y[j], ldy > 0 ? ldy : n[j], a,
                                *scale[j], layout};
        G.n[j] = n[j];
    }
    run_gemm(&G, m);
    pthread_mutex_unlock(&g_call);
    return 0;
}

int bn_ternary_linear_f32(const float *x, int64_t m, int64_t k, const uint8_t *packed, int64_t n, float scale, float *y) {
    const float *sp = &scale;
    return bn_ternary_linear_multi_f32(x, m, k, 1, &packed, &n, &sp, &y);
}

/* ---- float heads ---------------------------------------------------------------------------------- */
typedef struct {
    const float *x;
    int64_t m, k, n;
    const uint16_t *wb;
    const float *wf;
    const int8_t *wi;
    const float *ws;
    float *y;
    const int16_t *xq; /* int8 head: activations as int16, per-row scale sx */
    const float *sx;
} head_ctx;

#define HEAD_UNIT 16

static void head_range(void *c, int64_t lo, int64_t hi) {
    head_ctx *h = c;
    int64_t r0 = lo * HEAD_UNIT, r1 = hi * HEAD_UNIT < h->n ? hi * HEAD_UNIT : h->n;
    if (h->wb) K()->head_bf16(h->x, h->m, h->k, h->wb, r0, r1, h->y, h->n);
    else if (h->wf) K()->head_f32(h->x, h->m, h->k, h->wf, r0, r1, h->y, h->n);
    else K()->head_i8(h->xq, h->sx, h->m, h->k, h->wi, h->ws, r0, r1, h->y, h->n);
}

static int run_head(head_ctx *h) {
    if (h->m <= 0 || h->n <= 0) return 0;
    pthread_mutex_lock(&g_call);
    if (h->wi) {
        /* int8 head: activations to int16 per row, sx = max|x| / 32767 (relative error <= 1.5e-5 of max) */
        size_t xb = (size_t)(((h->m * h->k * 2 + 63) / 64) * 64);
        char *buf = scratch(xb + sizeof(float) * (size_t)h->m);
        if (!buf) {
            pthread_mutex_unlock(&g_call);
            return -1;
        }
        int16_t *xq = (int16_t *)buf;
        float *sx = (float *)(buf + xb);
        for (int64_t i = 0; i < h->m; i++) {
            const float *xi = h->x + i * h->k;
            float mx = 0.0f;
            for (int64_t j = 0; j < h->k; j++) mx = fabsf(xi[j]) > mx ? fabsf(xi[j]) : mx;
            float inv = mx > 0.0f ? 32767.0f / mx : 0.0f;
            sx[i] = mx > 0.0f ? mx / 32767.0f : 1.0f;
            for (int64_t j = 0; j < h->k; j++) {
                float q = nearbyintf(xi[j] * inv);
                xq[i * h->k + j] = (int16_t)(q > 32767.0f ? 32767.0f : (q < -32767.0f ? -32767.0f : q));
            }
        }
        h->xq = xq;
        h->sx = sx;
    }
    bn_parallel_for((h->n + HEAD_UNIT - 1) / HEAD_UNIT, head_range, h);
    pthread_mutex_unlock(&g_call);
    return 0;
}

int bn_gemm_bf16(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n, float *y) {
    head_ctx h = {x, m, k, n, w, NULL, NULL, NULL, y, NULL, NULL};
    return run_head(&h);
}

int bn_gemm_f32(const float *x, int64_t m, int64_t k, const float *w, int64_t n, float *y) {
    head_ctx h = {x, m, k, n, NULL, w, NULL, NULL, y, NULL, NULL};
    return run_head(&h);
}

int bn_gemm_i8row(const float *x, int64_t m, int64_t k, const int8_t *w, const float *wscale, int64_t n, float *y) {
    head_ctx h = {x, m, k, n, NULL, NULL, w, wscale, y, NULL, NULL};
    return run_head(&h);
}

/* ---- bandwidth helper ----------------------------------------------------------------------------- */
typedef struct {
    char *dst;
    const char *src;
    int64_t bytes;
} copy_ctx;

#define COPY_CHUNK (1 << 20)

static void copy_range(void *c, int64_t lo, int64_t hi) {
    copy_ctx *cc = c;
    int64_t a = lo * COPY_CHUNK, b = hi * COPY_CHUNK < cc->bytes ? hi * COPY_CHUNK : cc->bytes;
    memcpy(cc->dst + a, cc->src + a, (size_t)(b - a));
}

void bn_parallel_copy(void *dst, const void *src, int64_t bytes) {
    copy_ctx c = {dst, src, bytes};
    pthread_mutex_lock(&g_call);
    bn_parallel_for((bytes + COPY_CHUNK - 1) / COPY_CHUNK, copy_range, &c);
    pthread_mutex_unlock(&g_call);
}

typedef struct {
    const uint64_t *src;
    int64_t words;
    uint64_t sum;
} read_ctx;

static void read_range(void *c, int64_t lo, int64_t hi) {
    read_ctx *rc = c;
    const int64_t per = COPY_CHUNK / 8;
    int64_t a = lo * per, b = hi * per < rc->words ? hi * per : rc->words;
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0; /* four chains: the adds never limit the load rate */
    int64_t i = a;
    for (; i + 4 <= b; i += 4) {
        s0 += rc->src[i];
        s1 += rc->src[i + 1];
        s2 += rc->src[i + 2];
        s3 += rc->src[i + 3];
    }
    for (; i < b; i++) s0 += rc->src[i];
    __atomic_fetch_add(&rc->sum, s0 + s1 + s2 + s3, __ATOMIC_RELAXED);
}

uint64_t bn_parallel_read(const void *src, int64_t bytes) {
    read_ctx c = {src, bytes / 8, 0};
    pthread_mutex_lock(&g_call);
    bn_parallel_for((c.words * 8 + COPY_CHUNK - 1) / COPY_CHUNK, read_range, &c);
    pthread_mutex_unlock(&g_call);
    return c.sum;
}
