/* exp(x) for x <= 0 on 8 float lanes (AVX2 + FMA), shared by the attention's softmax and the SiLU of the fused
 * decode step: Cephes expf (2^n * degree-6 polynomial on |r| <= ln2/2, ~1 ulp); below -87.3 (and -inf, a masked
 * key) 0. libm's scalar expf was a quarter of the attention time at 1024 positions, and nearly all of a
 * 0.7B-shape (SiLU) model's elementwise time. */
#ifndef BN_VEXP_AVX2_H
#define BN_VEXP_AVX2_H

#include <immintrin.h>

static inline __attribute__((always_inline, target("avx2,fma"))) __m256 bn_exp_neg8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f);
    __m256 zero_mask = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(zero_mask, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

#endif
