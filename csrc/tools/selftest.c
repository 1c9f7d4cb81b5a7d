/* Standalone self-test of the C library: every ISA path this CPU runs against the scalar path, which the
 * Python tests check against the torch oracle. Used to check paths on machines without Python/torch,
 * e.g. NEON under qemu:
 *   aarch64-linux-gnu-gcc -O2 -std=c11 -pthread -Icsrc csrc/[a-z]*.c csrc/tools/selftest.c -o /tmp/st -lm
 *   qemu-aarch64 -L /usr/aarch64-linux-gnu /tmp/st
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bitnet_cpu.h"

static uint64_t rng = 88172645463325252ULL;
static uint32_t rnd(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)rng;
}

int main(void) {
    static const int64_t shapes[][3] = {{256, 2560, 1}, {640, 2560, 5}, {37, 300, 7}, {5, 129, 1}, {1, 1, 1},
                                        {13, 127, 4}, {66, 384, 9}, {96, 6912, 2}, {70, 2560, 21}, {9, 6912, 16}};
    int fails = 0, checked = 0;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int64_t n = shapes[s][0], k = shapes[s][1], m = shapes[s][2];
        int8_t *t = malloc((size_t)(n * k)), *xq = malloc((size_t)(m * k)), *t2 = malloc((size_t)(n * k));
        float *x = malloc(sizeof(float) * (size_t)(m * k));
        uint8_t *p = malloc((size_t)(bn_packed_rows(n) * bn_packed_row_bytes(k)));
        int32_t *ref = malloc(sizeof(int32_t) * (size_t)(m * n)), *got = malloc(sizeof(int32_t) * (size_t)(m * n));
        float *yref = malloc(sizeof(float) * (size_t)(m * n)), *y = malloc(sizeof(float) * (size_t)(m * n));
        for (int64_t i = 0; i < n * k; i++) t[i] = (int8_t)((int)(rnd() % 3) - 1);
        for (int64_t i = 0; i < m * k; i++) xq[i] = (int8_t)(rnd() & 255);
        for (int64_t i = 0; i < m * k; i++) x[i] = ((float)(rnd() % 20001) - 10000.0f) / 997.0f;
        bn_pack(t, n, k, p);
        bn_unpack(p, n, k, t2);
        if (memcmp(t, t2, (size_t)(n * k))) {
            printf("pack/unpack mismatch %lld x %lld\n", (long long)n, (long long)k);
            fails++;
        }
        /* the plain definition */
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < n; j++) {
                int32_t acc = 0;
                for (int64_t e = 0; e < k; e++) acc += xq[i * k + e] * t[j * k + e];
                ref[i * n + j] = acc;
            }
        bn_set_isa(BN_ISA_SCALAR);
        bn_ternary_linear_f32(x, m, k, p, n, 0.37f, yref);
        for (int isa = BN_ISA_SCALAR; isa <= BN_ISA_NEON; isa++) {
            if (!bn_isa_supported(isa)) continue;
            bn_set_isa(isa);
            for (int nt = 1; nt <= 3; nt++) {
                bn_set_num_threads(nt);
                bn_ternary_matmul_i32(xq, m, k, p, n, got);
                bn_ternary_linear_f32(x, m, k, p, n, 0.37f, y);
                checked++;
                if (memcmp(ref, got, sizeof(int32_t) * (size_t)(m * n)) || memcmp(yref, y, sizeof(float) * (size_t)(m * n))) {
                    printf("MISMATCH isa=%s threads=%d shape %lld x %lld x %lld\n", bn_isa_name(isa), nt,
                           (long long)m, (long long)n, (long long)k);
                    fails++;
                }
            }
        }
        free(t); free(xq); free(t2); free(x); free(p); free(ref); free(got); free(yref); free(y);
    }
    /* float heads: every path within float rounding of the scalar one */
    {
        int64_t n = 77, k = 300, m = 3;
        float *x = malloc(sizeof(float) * m * k), *y0 = malloc(sizeof(float) * m * n), *y1 = malloc(sizeof(float) * m * n);
        uint16_t *wb = malloc(2 * n * k);
        int8_t *wi = malloc(n * k);
        float *ws = malloc(sizeof(float) * n);
        for (int64_t i = 0; i < m * k; i++) x[i] = ((float)(rnd() % 2001) - 1000.0f) / 1000.0f;
        for (int64_t i = 0; i < n * k; i++) wb[i] = (uint16_t)(0x3c00 + (rnd() % 0x200)) | (uint16_t)((rnd() & 1) << 15);
        for (int64_t i = 0; i < n * k; i++) wi[i] = (int8_t)(rnd() % 255 - 127);
        for (int64_t i = 0; i < n; i++) ws[i] = 0.01f * (float)(1 + i % 5);
        for (int h = 0; h < 2; h++) {
            bn_set_isa(BN_ISA_SCALAR);
            if (h == 0) bn_gemm_bf16(x, m, k, wb, n, y0); else bn_gemm_i8row(x, m, k, wi, ws, n, y0);
            for (int isa = BN_ISA_SCALAR; isa <= BN_ISA_NEON; isa++) {
                if (!bn_isa_supported(isa)) continue;
                bn_set_isa(isa);
                if (h == 0) bn_gemm_bf16(x, m, k, wb, n, y1); else bn_gemm_i8row(x, m, k, wi, ws, n, y1);
                checked++;
                for (int64_t i = 0; i < m * n; i++)
                    if (fabsf(y0[i] - y1[i]) > 1e-4f * (1.0f + fabsf(y0[i]))) {
                        printf("head %d MISMATCH isa=%s at %lld: %g vs %g\n", h, bn_isa_name(isa), (long long)i, y0[i], y1[i]);
                        fails++;
                        break;
                    }
            }
        }
    }
    printf("paths:");
    for (int isa = BN_ISA_SCALAR; isa <= BN_ISA_NEON; isa++)
        if (bn_isa_supported(isa)) printf(" %s", bn_isa_name(isa));
    printf("\n%d checks, %d failures\n", checked, fails);
    return fails != 0;
}
