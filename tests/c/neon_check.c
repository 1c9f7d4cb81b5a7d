/* NEON path check of the C kernel library (csrc/), for AArch64: natively, or cross-compiled on x86-64 and run
 * under qemu user-mode emulation (tests/test_kernels_neon.py does both builds):
 *
 *   aarch64-linux-gnu-gcc -O3 -std=c11 -fPIC -ffp-contract=off -fno-math-errno -Wall -march=armv8-a \
 *       -pthread -static -Icsrc csrc/[a-z]*.c tests/c/neon_check.c -o neon_check -lm
 *   qemu-aarch64 -cpu max ./neon_check
 *
 * -march=armv8-a builds the vmull_s8 / vpadalq_s16 kernel, -march=armv8.2-a+dotprod the vdotq_s32 one.
 *
 * Every result is compared with an oracle computed here by naive loops, independent of the library (only the
 * packing into the library's layout goes through bn_pack, and the products check it too):
 *   - bn_ternary_matmul_i32: the exact integer product, bit for bit, on the NEON and scalar paths, 1 and 2 threads;
 *   - bn_quantize_act: the per-token int8 quantization bitnet_cpu.h defines (reciprocal(max) * 127, round half to
 *     even, clamp), bit for bit, with the padding zeroed, on both paths;
 *   - bn_ternary_linear_f32: float(X . T) * (s / a) from the oracle's X and a, bit for bit, both paths, 1 and 2
 *     threads;
 *   - bn_gemm_bf16, bn_gemm_f32: within the fp32 dot-product error bound (below) of a double-precision sum, both
 *     paths, and each row alone bit-identical to the same row inside a call of several rows;
 *   - bn_gemm_i8row: NEON bit-identical to scalar, both within the int16 quantization bound of a double sum;
 *   - bn_decode_forward_f32 (one or two fused layers, decode and prefill): NEON bit-identical to scalar. On
 *     AArch64 the only instruction-set-dependent pieces of the step are its ternary projections (bit-exact
 *     above); attention and SiLU take the portable code on every ARM path, so the whole step must agree bit for
 *     bit (the x86 suite checks that code against torch: tests/test_kernels_cpu_decode.py).
 * Exits 1 after listing the mismatches (what, path, threads, shape, index, got, want); prints one summary line on
 * success.
 */
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bitnet_cpu.h"
#include "bitnet_decode.h"

#if !defined(__aarch64__)
#error "neon_check.c is for AArch64 (natively or under qemu-aarch64)"
#endif

#if defined(__ARM_FEATURE_DOTPROD)
#define KERNEL_NAME "vdotq_s32 (dotprod)"
#else
#define KERNEL_NAME "vmull_s8/vpadalq_s16"
#endif

/* ---- helpers ---------------------------------------------------------------------------------------------- */
static uint64_t g_rng;
static void seed(uint64_t s) { g_rng = s * 0x9E3779B97F4A7C15ULL + 1; }
static uint64_t next64(void) { /* splitmix64 */
    uint64_t z = (g_rng += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}
static int rand_int(int lo, int hi) { return lo + (int)(next64() % (uint64_t)(hi - lo + 1)); } /* [lo, hi] */
static float rand_f(float lo, float hi) { return lo + (hi - lo) * (float)((next64() >> 40) * (1.0 / 16777216.0)); }

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "neon_check: out of memory\n");
        exit(2);
    }
    return p;
}

static const int PATHS[2] = {BN_ISA_SCALAR, BN_ISA_NEON};
static const int THREADS[2] = {1, 2};

static long g_checks;
static long g_failures;
#define MAX_REPORTS 40

/* one mismatch: what, path, threads, shape, index, got, want */
static void report(const char *what, int isa, int nt, const char *shape, const char *index, const char *fmt, ...) {
    g_failures++;
    if (g_failures > MAX_REPORTS) return;
    char gw[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(gw, sizeof gw, fmt, ap);
    va_end(ap);
    fprintf(stderr, "MISMATCH %s path=%s threads=%d %s at %s: %s\n", what, bn_isa_name(isa), nt, shape, index, gw);
}

static uint32_t fbits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* Compare an m x n float32 result with the expected one bit for bit; name each differing element (prefix[i,j]). */
static void check_bits(const char *what, int isa, int nt, const char *shape, const char *prefix, const float *got,
                       const float *want, int64_t m, int64_t n) {
    for (int64_t e = 0; e < m * n; e++)
        if (fbits(got[e]) != fbits(want[e])) {
            char idx[48];
            snprintf(idx, sizeof idx, "%s[%lld,%lld]", prefix, (long long)(e / n), (long long)(e % n));
            report(what, isa, nt, shape, idx, "got %.9g (0x%08x) want %.9g (0x%08x)", got[e], fbits(got[e]), want[e],
                   fbits(want[e]));
        }
}

static void set_path(int isa, int nt) {
    int r = bn_set_isa(isa);
    if (r != isa || bn_get_isa() != isa) {
        fprintf(stderr, "neon_check: bn_set_isa(%s) returned %d, bn_get_isa() %d\n", bn_isa_name(isa), r, bn_get_isa());
        exit(1);
    }
    if (bn_set_num_threads(nt) != nt || bn_get_num_threads() != nt) {
        fprintf(stderr, "neon_check: bn_set_num_threads(%d) gave %d\n", nt, bn_get_num_threads());
        exit(1);
    }
}

/* the per-token quantization bitnet_cpu.h defines, written out independently of the library */
static void oracle_quant_row(const float *x, int64_t k, int8_t *q, float *a, int32_t *sum) {
    float m = 0.0f;
    for (int64_t e = 0; e < k; e++) m = fmaxf(m, fabsf(x[e]));
    if (m < 1e-5f) m = 1e-5f;
    float r = 1.0f / m; /* torch's 127 / t is reciprocal(t) * 127 */
    float s = r * 127.0f;
    int32_t acc = 0;
    for (int64_t e = 0; e < k; e++) {
        float v = rintf(x[e] * s); /* default rounding mode: half to even */
        v = v > 127.0f ? 127.0f : (v < -128.0f ? -128.0f : v);
        q[e] = (int8_t)v;
        acc += q[e];
    }
    *a = s;
    *sum = acc;
}

/* the exact product out[i, j] = sum_e xq[i, e] * t[j, e] (int64 sums, checked to fit int32) */
static void oracle_matmul(const int8_t *xq, int64_t m, int64_t k, const int8_t *t, int64_t n, int32_t *out) {
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            int64_t acc = 0;
            for (int64_t e = 0; e < k; e++) acc += (int64_t)xq[i * k + e] * t[j * k + e];
            if (acc > INT32_MAX || acc < INT32_MIN) {
                fprintf(stderr, "neon_check: oracle sum out of int32 range\n");
                exit(2);
            }
            out[i * n + j] = (int32_t)acc;
        }
}

/* ---- ternary: matmul, quantization, linear ------------------------------------------------------------------ */
static void check_ternary(int64_t m, int64_t n, int64_t k, uint64_t case_id) {
    char shape[96];
    snprintf(shape, sizeof shape, "m=%lld n=%lld k=%lld", (long long)m, (long long)n, (long long)k);
    seed(1000 + case_id);
    int64_t kp = bn_padded_k(k);
    int8_t *t = xmalloc((size_t)(n * k)), *xq = xmalloc((size_t)(m * k));
    /* weight rows: mostly random ternary, some all +1 / all -1 (the largest sums); activation rows: random int8
     * over the full range, or all -128 / all 127 */
    for (int64_t j = 0; j < n; j++) {
        int kind = (int)((j + case_id) % 5);
        for (int64_t e = 0; e < k; e++) t[j * k + e] = (int8_t)(kind < 3 ? rand_int(-1, 1) : (kind == 3 ? 1 : -1));
    }
    for (int64_t i = 0; i < m; i++) {
        int kind = (int)((i + case_id) % 4);
        for (int64_t e = 0; e < k; e++) xq[i * k + e] = (int8_t)(kind < 2 ? rand_int(-128, 127) : (kind == 2 ? -128 : 127));
    }
    uint8_t *p = xmalloc((size_t)(bn_packed_rows(n) * bn_packed_row_bytes(k)));
    bn_pack(t, n, k, p);

    int32_t *want = xmalloc(sizeof(int32_t) * (size_t)(m * n)), *got = xmalloc(sizeof(int32_t) * (size_t)(m * n));
    oracle_matmul(xq, m, k, t, n, want);
    for (int pi = 0; pi < 2; pi++)
        for (int ti = 0; ti < 2; ti++) {
            set_path(PATHS[pi], THREADS[ti]);
            memset(got, 0x5a, sizeof(int32_t) * (size_t)(m * n)); /* an output left unwritten shows */
            int rc = bn_ternary_matmul_i32(xq, m, k, p, n, got);
            g_checks++;
            if (rc != 0) report("bn_ternary_matmul_i32 rc", PATHS[pi], THREADS[ti], shape, "-", "got %d want 0", rc);
            for (int64_t e = 0; e < m * n; e++)
                if (got[e] != want[e]) {
                    char idx[48];
                    snprintf(idx, sizeof idx, "[%lld,%lld]", (long long)(e / n), (long long)(e % n));
                    report("bn_ternary_matmul_i32", PATHS[pi], THREADS[ti], shape, idx, "got %d want %d", got[e], want[e]);
                }
        }

    /* float activations: random, one outlier, multiples of 0.5 up to 63.5, all zero (max below 1e-5) */
    float *x = xmalloc(sizeof(float) * (size_t)(m * k));
    for (int64_t i = 0; i < m; i++) {
        int kind = (int)((i + case_id) % 4);
        for (int64_t e = 0; e < k; e++) {
            float v = kind == 0 ? rand_f(-4.0f, 4.0f)
                    : kind == 1 ? rand_f(-1.0f, 1.0f)
                    : kind == 2 ? 0.5f * (float)rand_int(-127, 127) : 0.0f;
            x[i * k + e] = v;
        }
        if (kind == 1) x[i * k + (int64_t)(next64() % (uint64_t)k)] = next64() & 1 ? 50.0f : -50.0f;
    }
    int8_t *qw = xmalloc((size_t)(m * k)), *qg = xmalloc((size_t)(m * kp));
    float *aw = xmalloc(sizeof(float) * (size_t)m), *ag = xmalloc(sizeof(float) * (size_t)m);
    int32_t *sw = xmalloc(sizeof(int32_t) * (size_t)m), *sg = xmalloc(sizeof(int32_t) * (size_t)m);
    for (int64_t i = 0; i < m; i++) oracle_quant_row(x + i * k, k, qw + i * k, aw + i, sw + i);
    for (int pi = 0; pi < 2; pi++)
        for (int ti = 0; ti < 2; ti++) {
            set_path(PATHS[pi], THREADS[ti]);
            memset(qg, 0x5a, (size_t)(m * kp));
            memset(ag, 0xff, sizeof(float) * (size_t)m);
            memset(sg, 0x5a, sizeof(int32_t) * (size_t)m);
            bn_quantize_act(x, m, k, qg, kp, ag, sg);
            g_checks++;
            for (int64_t i = 0; i < m; i++) {
                char idx[48];
                snprintf(idx, sizeof idx, "row %lld", (long long)i);
                if (fbits(ag[i]) != fbits(aw[i]))
                    report("bn_quantize_act a", PATHS[pi], THREADS[ti], shape, idx, "got %.9g want %.9g", ag[i], aw[i]);
                if (sg[i] != sw[i])
                    report("bn_quantize_act xsum", PATHS[pi], THREADS[ti], shape, idx, "got %d want %d", sg[i], sw[i]);
                for (int64_t e = 0; e < kp; e++) {
                    int w = e < k ? qw[i * k + e] : 0;
                    if (qg[i * kp + e] != w) {
                        snprintf(idx, sizeof idx, "[%lld,%lld]", (long long)i, (long long)e);
                        report("bn_quantize_act xq", PATHS[pi], THREADS[ti], shape, idx, "got %d want %d", qg[i * kp + e], w);
                    }
                }
            }
        }

    /* linear: y = float(X . T) * (s / a), from the oracle's X and a */
    float scale = rand_f(0.01f, 2.0f);
    float *yw = xmalloc(sizeof(float) * (size_t)(m * n)), *yg = xmalloc(sizeof(float) * (size_t)(m * n));
    oracle_matmul(qw, m, k, t, n, want);
    for (int64_t i = 0; i < m; i++) {
        float sa = scale / aw[i];
        for (int64_t j = 0; j < n; j++) yw[i * n + j] = (float)want[i * n + j] * sa;
    }
    for (int pi = 0; pi < 2; pi++)
        for (int ti = 0; ti < 2; ti++) {
            set_path(PATHS[pi], THREADS[ti]);
            memset(yg, 0xff, sizeof(float) * (size_t)(m * n)); /* NaN */
            int rc = bn_ternary_linear_f32(x, m, k, p, n, scale, yg);
            g_checks++;
            if (rc != 0) report("bn_ternary_linear_f32 rc", PATHS[pi], THREADS[ti], shape, "-", "got %d want 0", rc);
            check_bits("bn_ternary_linear_f32", PATHS[pi], THREADS[ti], shape, "", yg, yw, m, n);
        }
    free(t); free(xq); free(p); free(want); free(got); free(x); free(qw); free(qg); free(aw); free(ag); free(sw);
    free(sg); free(yw); free(yg);
}

/* ---- float heads ------------------------------------------------------------------------------------------- */
static uint16_t to_bf16_trunc(float f) { return (uint16_t)(fbits(f) >> 16); }
static double from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Float heads (bf16 or float32 weights). Tolerance: a float32 dot product of k terms, summed in any order
 * (sequential, 4 lanes + a tree, with or without fused multiply-adds), is within gamma_k * sum |x_j w_j| of the
 * exact value, gamma_k = k u / (1 - k u), u = 2^-24 (Higham, Accuracy and Stability of Numerical Algorithms, 2nd
 * ed., eq. 3.5 and sec. 3.1: the bound holds for every order of summation). The double sum stands in for the exact
 * one (its own error is ~2^-29 of that bound). The order differs between the paths (scalar: one chain of rounded
 * products; NEON: 4 fma lanes, a horizontal add, a scalar tail), so they are not compared bit for bit. A lost or
 * doubled term (|x_j w_j| about sum / k) exceeds the bound while k^2 u < 1, i.e. for every k below 4096. */
static void check_float_head(int64_t m, int64_t n, int64_t k, uint64_t case_id, int f32) {
    const char *name = f32 ? "bn_gemm_f32" : "bn_gemm_bf16";
    char shape[96];
    snprintf(shape, sizeof shape, "m=%lld n=%lld k=%lld", (long long)m, (long long)n, (long long)k);
    seed(5000 + case_id);
    float *x = xmalloc(sizeof(float) * (size_t)(m * k)), *y = xmalloc(sizeof(float) * (size_t)(m * n));
    uint16_t *w = xmalloc(sizeof(uint16_t) * (size_t)(n * k));
    float *wf = xmalloc(sizeof(float) * (size_t)(n * k));
    for (int64_t e = 0; e < m * k; e++) x[e] = rand_f(-2.0f, 2.0f);
    for (int64_t e = 0; e < n * k; e++) {
        w[e] = to_bf16_trunc(rand_f(-1.0f, 1.0f));
        wf[e] = f32 ? rand_f(-1.0f, 1.0f) : (float)from_bf16(w[e]);
    }
    double *want = xmalloc(sizeof(double) * (size_t)(m * n)), *tol = xmalloc(sizeof(double) * (size_t)(m * n));
    const double u = 1.0 / 16777216.0, gamma = (double)k * u / (1.0 - (double)k * u);
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            double s = 0.0, a = 0.0;
            for (int64_t e = 0; e < k; e++) {
                double pr = (double)x[i * k + e] * wf[j * k + e];
                s += pr;
                a += fabs(pr);
            }
            want[i * n + j] = s;
            tol[i * n + j] = gamma * a;
        }
    float *y1 = xmalloc(sizeof(float) * (size_t)n);
    for (int pi = 0; pi < 2; pi++)
        for (int ti = 0; ti < 2; ti++) {
            set_path(PATHS[pi], THREADS[ti]);
            memset(y, 0xff, sizeof(float) * (size_t)(m * n));
            int rc = f32 ? bn_gemm_f32(x, m, k, wf, n, y) : bn_gemm_bf16(x, m, k, w, n, y);
            g_checks++;
            if (rc != 0) report(name, PATHS[pi], THREADS[ti], shape, "-", "rc %d, want 0", rc);
            for (int64_t e = 0; e < m * n; e++)
                if (!(fabs((double)y[e] - want[e]) <= tol[e])) {
                    char idx[48];
                    snprintf(idx, sizeof idx, "[%lld,%lld]", (long long)(e / n), (long long)(e % n));
                    report(name, PATHS[pi], THREADS[ti], shape, idx, "got %.9g want %.9g +- %.3g", y[e], want[e],
                           tol[e]);
                }
            /* batch invariance: each row alone gives the same bits as inside the m-row call */
            for (int64_t i = 0; i < m; i++) {
                f32 ? bn_gemm_f32(x + i * k, 1, k, wf, n, y1) : bn_gemm_bf16(x + i * k, 1, k, w, n, y1);
                check_bits(f32 ? "bn_gemm_f32 row alone" : "bn_gemm_bf16 row alone", PATHS[pi], THREADS[ti], shape,
                           "", y1, y + i * n, 1, n);
            }
        }
    free(x); free(y); free(y1); free(w); free(wf); free(want); free(tol);
}

/* int8 head: the NEON path reuses the scalar kernel today; it must stay bit-identical to it (bitnet_cpu.h: "the
 * same on every path"). Sanity bound against the double sum of x . w * ws: x is quantized to int16 steps of
 * sx = max|x| / 32767, each term off by at most half a step, so |error| <= ws * sum |w_j| * sx / 2; twice that
 * covers the float rounding of the scale and of the chunk sums (relative 2^-24 each, far below a step). */
static void check_i8row(int64_t m, int64_t n, int64_t k, uint64_t case_id) {
    char shape[96];
    snprintf(shape, sizeof shape, "m=%lld n=%lld k=%lld", (long long)m, (long long)n, (long long)k);
    seed(7000 + case_id);
    float *x = xmalloc(sizeof(float) * (size_t)(m * k)), *ws = xmalloc(sizeof(float) * (size_t)n);
    float *y0 = xmalloc(sizeof(float) * (size_t)(m * n)), *y = xmalloc(sizeof(float) * (size_t)(m * n));
    int8_t *w = xmalloc((size_t)(n * k));
    for (int64_t e = 0; e < m * k; e++) x[e] = rand_f(-3.0f, 3.0f);
    for (int64_t e = 0; e < n * k; e++) w[e] = (int8_t)rand_int(-127, 127);
    for (int64_t j = 0; j < n; j++) ws[j] = rand_f(0.001f, 0.02f);
    set_path(BN_ISA_SCALAR, 1);
    if (bn_gemm_i8row(x, m, k, w, ws, n, y0) != 0) report("bn_gemm_i8row rc", BN_ISA_SCALAR, 1, shape, "-", "nonzero");
    for (int64_t i = 0; i < m; i++) {
        double mx = 0.0;
        for (int64_t e = 0; e < k; e++) { /* not fmax(): gcc 12's aarch64 vectorizer crashes on that reduction */
            double v = fabs((double)x[i * k + e]);
            mx = v > mx ? v : mx;
        }
        for (int64_t j = 0; j < n; j++) {
            double s = 0.0, aw = 0.0;
            for (int64_t e = 0; e < k; e++) {
                s += (double)x[i * k + e] * w[j * k + e];
                aw += fabs((double)w[j * k + e]);
            }
            double want = s * ws[j], tol = ws[j] * aw * mx / 32767.0 + 1e-30;
            g_checks++;
            if (!(fabs((double)y0[i * n + j] - want) <= tol)) {
                char idx[48];
                snprintf(idx, sizeof idx, "[%lld,%lld]", (long long)i, (long long)j);
                report("bn_gemm_i8row vs double", BN_ISA_SCALAR, 1, shape, idx, "got %.9g want %.9g +- %.3g",
                       y0[i * n + j], want, tol);
            }
        }
    }
    for (int ti = 0; ti < 2; ti++) {
        set_path(BN_ISA_NEON, THREADS[ti]);
        memset(y, 0xff, sizeof(float) * (size_t)(m * n));
        int rc = bn_gemm_i8row(x, m, k, w, ws, n, y);
        g_checks++;
        if (rc != 0) report("bn_gemm_i8row rc", BN_ISA_NEON, THREADS[ti], shape, "-", "got %d want 0", rc);
        check_bits("bn_gemm_i8row vs scalar", BN_ISA_NEON, THREADS[ti], shape, "", y, y0, m, n);
    }
    free(x); free(ws); free(y0); free(y); free(w);
}

/* ---- fused decode / prefill step ------------------------------------------------------------------------------ */
typedef struct {
    bn_decode_config c;
    int64_t n_layers, b, t;
    int64_t nproj[BN_DEC_NPROJ], kproj[BN_DEC_NPROJ];
    float *norms[4][2];          /* per layer: in, post, attn_sub, ffn_sub */
    uint8_t *w[2][BN_DEC_NPROJ];
    float scales[2][BN_DEC_NPROJ];
    bn_decode_layer layers[2];
    float *h0, *cos, *sin;
    uint8_t *valid;
    int64_t *slot;
    void *k0[2], *v0[2];         /* initial caches */
    size_t cache_bytes;
} decode_case;

static void build_decode(decode_case *D, int act, int kv_dtype, int sub_norms, int64_t b, int64_t t, uint64_t case_id) {
    memset(D, 0, sizeof *D);
    seed(9000 + case_id);
    /* inter = 96 and hidden = 80: K not a multiple of 128, N not a multiple of 4 nor of 16 (hidden 80 = 5 units) */
    D->c = (bn_decode_config){.hidden = 80, .inter = 96, .n_heads = 4, .n_kv = 2, .head_dim = 20, .max_seq = 12,
                              .eps = 1e-5f, .act = act, .kv_dtype = kv_dtype};
    D->n_layers = 2;
    D->b = b;
    D->t = t;
    const bn_decode_config *c = &D->c;
    int64_t H = c->hidden, I = c->inter, qd = c->n_heads * c->head_dim, kvd = c->n_kv * c->head_dim;
    int64_t np[BN_DEC_NPROJ] = {qd, kvd, kvd, H, I, I, H}, kk[BN_DEC_NPROJ] = {H, H, H, qd, H, H, I};
    for (int l = 0; l < 2; l++) {
        bn_decode_layer *L = &D->layers[l];
        for (int q = 0; q < BN_DEC_NPROJ; q++) {
            D->nproj[q] = np[q];
            D->kproj[q] = kk[q];
            int8_t *tt = xmalloc((size_t)(np[q] * kk[q]));
            for (int64_t e = 0; e < np[q] * kk[q]; e++) tt[e] = (int8_t)rand_int(-1, 1);
            D->w[l][q] = xmalloc((size_t)(bn_packed_rows(np[q]) * bn_packed_row_bytes(kk[q])));
            bn_pack(tt, np[q], kk[q], D->w[l][q]);
            free(tt);
            D->scales[l][q] = rand_f(0.05f, 0.2f);
            L->w[q] = D->w[l][q];
            L->scale[q] = &D->scales[l][q];
        }
        int64_t nlen[4] = {H, H, qd, I};
        for (int z = 0; z < 4; z++) {
            D->norms[z][l] = xmalloc(sizeof(float) * (size_t)nlen[z]);
            for (int64_t e = 0; e < nlen[z]; e++) D->norms[z][l][e] = rand_f(0.5f, 1.5f);
        }
        L->in_norm = D->norms[0][l];
        L->post_norm = D->norms[1][l];
        L->attn_sub_norm = sub_norms ? D->norms[2][l] : NULL;
        L->ffn_sub_norm = sub_norms ? D->norms[3][l] : NULL;
    }
    int64_t m = b * t, S = c->max_seq, Dh = c->head_dim;
    D->h0 = xmalloc(sizeof(float) * (size_t)(m * H));
    for (int64_t e = 0; e < m * H; e++) D->h0[e] = rand_f(-1.0f, 1.0f);
    D->slot = xmalloc(sizeof(int64_t) * (size_t)m);
    D->valid = xmalloc((size_t)(b * S));
    D->cos = xmalloc(sizeof(float) * (size_t)(m * Dh));
    D->sin = xmalloc(sizeof(float) * (size_t)(m * Dh));
    for (int64_t r = 0; r < b; r++) {
        int64_t start = 3 + 2 * r; /* rows at different positions; earlier slots hold cached tokens */
        for (int64_t s = 0; s < S; s++) D->valid[r * S + s] = s < start + t && s != 1; /* slot 1: padding */
        for (int64_t i = 0; i < t; i++) {
            int64_t tok = r * t + i, pos = start + i;
            D->slot[tok] = pos;
            for (int64_t d = 0; d < Dh; d++) {
                double ang = (double)pos * pow(10000.0, -(double)(2 * (d % (Dh / 2))) / (double)Dh);
                D->cos[tok * Dh + d] = (float)cos(ang);
                D->sin[tok * Dh + d] = (float)sin(ang);
            }
        }
    }
    size_t es = kv_dtype == BN_KV_BF16 ? 2 : 4;
    D->cache_bytes = (size_t)(b * c->n_kv * S * Dh) * es;
    for (int l = 0; l < 2; l++) {
        D->k0[l] = xmalloc(D->cache_bytes);
        D->v0[l] = xmalloc(D->cache_bytes);
        size_t cnt = D->cache_bytes / es;
        for (size_t e = 0; e < cnt; e++) {
            float kv = rand_f(-1.0f, 1.0f), vv = rand_f(-1.0f, 1.0f);
            if (es == 2) {
                ((uint16_t *)D->k0[l])[e] = to_bf16_trunc(kv);
                ((uint16_t *)D->v0[l])[e] = to_bf16_trunc(vv);
            } else {
                ((float *)D->k0[l])[e] = kv;
                ((float *)D->v0[l])[e] = vv;
            }
        }
    }
}

/* run the step on a copy of the inputs; h [m, hidden], caches kc/vc [2][cache_bytes] */
static int run_decode(const decode_case *D, float *h, void *kc[2], void *vc[2]) {
    int64_t m = D->b * D->t;
    memcpy(h, D->h0, sizeof(float) * (size_t)(m * D->c.hidden));
    for (int l = 0; l < 2; l++) {
        memcpy(kc[l], D->k0[l], D->cache_bytes);
        memcpy(vc[l], D->v0[l], D->cache_bytes);
    }
    float *work = xmalloc(sizeof(float) * (size_t)bn_decode_work_floats(&D->c, m));
    int rc = bn_decode_forward_f32(&D->c, D->layers, D->n_layers, kc, vc, D->valid, D->slot, D->cos, D->sin, D->b,
                                   D->t, h, work);
    free(work);
    return rc;
}

static void check_decode(int act, int kv_dtype, int sub_norms, int64_t b, int64_t t, uint64_t case_id) {
    decode_case D;
    build_decode(&D, act, kv_dtype, sub_norms, b, t, case_id);
    char shape[128];
    snprintf(shape, sizeof shape, "decode act=%s kv=%s sub_norms=%d b=%lld t=%lld", act == BN_ACT_SILU ? "silu" : "relu2",
             kv_dtype == BN_KV_BF16 ? "bf16" : "f32", sub_norms, (long long)b, (long long)t);
    int64_t m = b * t, H = D.c.hidden;
    float *hw = xmalloc(sizeof(float) * (size_t)(m * H)), *hg = xmalloc(sizeof(float) * (size_t)(m * H));
    void *kw[2], *vw[2], *kg[2], *vg[2];
    for (int l = 0; l < 2; l++) {
        kw[l] = xmalloc(D.cache_bytes);
        vw[l] = xmalloc(D.cache_bytes);
        kg[l] = xmalloc(D.cache_bytes);
        vg[l] = xmalloc(D.cache_bytes);
    }
    set_path(BN_ISA_SCALAR, 1);
    int rc = run_decode(&D, hw, kw, vw);
    g_checks++;
    if (rc != 0) report("bn_decode_forward_f32 rc", BN_ISA_SCALAR, 1, shape, "-", "got %d want 0", rc);
    /* the step did something: h finite and moved, this step's cache slots written */
    int moved = 0;
    for (int64_t e = 0; e < m * H; e++) {
        if (!isfinite(hw[e])) {
            report("bn_decode_forward_f32 finite", BN_ISA_SCALAR, 1, shape, "h", "got %g", hw[e]);
            break;
        }
        moved |= hw[e] != D.h0[e];
    }
    if (!moved) report("bn_decode_forward_f32 moved", BN_ISA_SCALAR, 1, shape, "h", "h unchanged");
    if (memcmp(kw[0], D.k0[0], D.cache_bytes) == 0)
        report("bn_decode_forward_f32 cache write", BN_ISA_SCALAR, 1, shape, "k cache", "unchanged");
    for (int pi = 0; pi < 2; pi++)
        for (int ti = 0; ti < 2; ti++) {
            if (pi == 0 && ti == 0) continue;
            set_path(PATHS[pi], THREADS[ti]);
            rc = run_decode(&D, hg, kg, vg);
            g_checks++;
            if (rc != 0) report("bn_decode_forward_f32 rc", PATHS[pi], THREADS[ti], shape, "-", "got %d want 0", rc);
            check_bits("bn_decode_forward_f32 vs scalar", PATHS[pi], THREADS[ti], shape, "h", hg, hw, m, H);
            for (int l = 0; l < 2; l++) {
                if (memcmp(kg[l], kw[l], D.cache_bytes) || memcmp(vg[l], vw[l], D.cache_bytes)) {
                    char idx[48];
                    snprintf(idx, sizeof idx, "layer %d cache", l);
                    report("bn_decode_forward_f32 vs scalar", PATHS[pi], THREADS[ti], shape, idx, "k/v cache differs");
                }
            }
        }
    free(hw); free(hg);
    for (int l = 0; l < 2; l++) {
        free(kw[l]); free(vw[l]); free(kg[l]); free(vg[l]); free(D.k0[l]); free(D.v0[l]);
        for (int q = 0; q < BN_DEC_NPROJ; q++) free(D.w[l][q]);
        for (int z = 0; z < 4; z++) free(D.norms[z][l]);
    }
    free(D.h0); free(D.cos); free(D.sin); free(D.valid); free(D.slot);
}

/* ---- main ------------------------------------------------------------------------------------------------------ */
/* --no-dotprod-cpu: a dotprod build on a CPU without the dot-product instructions must not offer NEON (its
 * kernel would die on sdot): the library falls back to the scalar path, whose results are checked elsewhere */
static int check_no_neon(void) {
    int ok = bn_isa_supported(BN_ISA_NEON) == 0 && bn_isa_best() == BN_ISA_SCALAR && bn_set_isa(BN_ISA_NEON) == -1 &&
             bn_set_isa(BN_ISA_AUTO) == BN_ISA_SCALAR;
    if (!ok) {
        fprintf(stderr, "neon_check: without dotprod: supported(NEON) = %d, best = %s; want 0, scalar\n",
                bn_isa_supported(BN_ISA_NEON), bn_isa_name(bn_isa_best()));
        return 1;
    }
    printf("neon_check: OK: no dotprod on this CPU, NEON not offered, scalar path selected\n");
    return 0;
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--no-dotprod-cpu") == 0) return check_no_neon();
    if (bn_isa_supported(BN_ISA_NEON) != 1 || bn_isa_supported(BN_ISA_SCALAR) != 1) {
        fprintf(stderr, "neon_check: bn_isa_supported(NEON) = %d, (SCALAR) = %d; want 1, 1\n",
                bn_isa_supported(BN_ISA_NEON), bn_isa_supported(BN_ISA_SCALAR));
        return 1;
    }
    if (bn_isa_best() != BN_ISA_NEON) {
        fprintf(stderr, "neon_check: bn_isa_best() = %d (%s), want NEON\n", bn_isa_best(), bn_isa_name(bn_isa_best()));
        return 1;
    }
    if (bn_isa_supported(BN_ISA_AVX2) || bn_isa_supported(BN_ISA_AVX512VNNI)) {
        fprintf(stderr, "neon_check: an x86 path claims support on AArch64\n");
        return 1;
    }
    static const int64_t ms[] = {1, 2, 3, 8, 9, 17}; /* m < 3: 4-row decode units; m >= 3: 16-row prefill units */
    uint64_t id = 0;
    int cases = 0;
    /* small odd shapes: every n, k, m */
    static const int64_t small_n[] = {1, 3, 5, 7}, small_k[] = {1, 31, 127, 128, 129, 255, 300};
    for (size_t a = 0; a < 4; a++)
        for (size_t b = 0; b < 7; b++)
            for (size_t c = 0; c < 6; c++, cases++) check_ternary(ms[c], small_n[a], small_k[b], id++);
    /* several 4- and 16-row work units, so 2 threads share the rows; N not a multiple of 4 or 16 */
    static const int64_t mid[][2] = {{13, 384}, {30, 1000}, {66, 200}, {129, 129}};
    for (size_t a = 0; a < 4; a++)
        for (size_t c = 0; c < 6; c++, cases++) check_ternary(ms[c], mid[a][0], mid[a][1], id++);
    /* 2B4T inner dimensions (hidden 2560, MLP 6912), N cut down */
    static const int64_t big[][2] = {{8, 2560}, {64, 2560}, {8, 6912}, {36, 6912}, {64, 6912}};
    for (size_t a = 0; a < 5; a++)
        for (size_t c = 0; c < 6; c++, cases++) check_ternary(ms[c], big[a][0], big[a][1], id++);

    /* float heads: k with and without a tail after the 4-wide loop, n across 16-row work units */
    static const int64_t heads[][3] = {{1, 1, 1}, {1, 5, 3},  {2, 7, 5},   {3, 17, 31},  {1, 33, 127},
                                       {9, 16, 128}, {2, 40, 300}, {1, 20, 2560}, {3, 9, 4097}};
    for (size_t a = 0; a < sizeof heads / sizeof heads[0]; a++) {
        check_float_head(heads[a][0], heads[a][1], heads[a][2], id++, 0);
        check_float_head(heads[a][0], heads[a][1], heads[a][2], id++, 1);
        check_i8row(heads[a][0], heads[a][1], heads[a][2], id++);
        cases += 3;
    }

    /* fused decode (b rows, t = 1) and prefill (t > 1) */
    check_decode(BN_ACT_RELU2, BN_KV_F32, 1, 1, 1, id++);
    check_decode(BN_ACT_RELU2, BN_KV_BF16, 1, 3, 1, id++);
    check_decode(BN_ACT_SILU, BN_KV_F32, 0, 2, 3, id++);
    check_decode(BN_ACT_SILU, BN_KV_BF16, 0, 1, 5, id++);
    cases += 4;

    if (g_failures) {
        if (g_failures > MAX_REPORTS) fprintf(stderr, "... %ld more mismatches\n", g_failures - MAX_REPORTS);
        fprintf(stderr, "neon_check: FAILED: %ld mismatches in %ld checks (NEON kernel: %s)\n", g_failures, g_checks,
                KERNEL_NAME);
        return 1;
    }
    printf("neon_check: OK: %d cases, %ld checks, NEON kernel %s vs scalar and naive oracles, 1 and 2 threads\n", cases,
           g_checks, KERNEL_NAME);
    return 0;
}
