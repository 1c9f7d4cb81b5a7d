/* bitnet_cpu: ternary (1.58-bit) x int8 kernels for CPUs. Plain C11, no Python or torch headers.
 *
 * Packed layout "cpu-2bit-v2" (PackingFormat.CPU_2BIT):
 *   T int8 [N, K] with values {-1, 0, 1} -> uint8 [Np, Kp/4] bytes, Kp = K rounded up to a multiple of 128,
 *   Np = N rounded up to a multiple of 4. Each row is Kp/128 blocks of 32 bytes. In a block, byte j holds
 *   the codes (t + 1, in 0..2) of the block's elements j, j+32, j+64, j+96 in bits 0-1, 2-3, 4-5, 6-7.
 *   Rows come in groups of 4 whose blocks are interleaved: group g, block b, row-in-group i sits at byte
 *   g*4*(Kp/4) + b*128 + i*32. Padding rows and elements hold code 1 (t=0).
 *   Why: one 32-byte load + shift + mask yields 32 consecutive codes, which line up with 32 consecutive
 *   int8 activations, so the AVX2 maddubs / VNNI dpbusd / NEON paths need no shuffles; and the decode
 *   kernel's 4 rows are one sequential memory stream, which the prefetchers keep at full bandwidth.
 *
 * Math: with codes c = t + 1 (unsigned), sum_k t_k x_k = sum_k c_k x_k - sum_k x_k. The activation sum is
 * computed once per token, so the unsigned-by-signed int8 instructions give the exact integer product.
 *
 * Activations: per token a = 127 / max(max|x|, 1e-5) (computed as reciprocal(m) * 127 like torch's
 * scalar / tensor), X = clamp(round_half_even(x * a), -128, 127), and the linear output is
 * y = float(X . T) * (s / a): bit-identical to bitnetlm.quant.ternary.bitlinear_reference in float32.
 */
/* Packed layout "cpu-base3-v1" (PackingFormat.CPU_BASE3), 1.6 bits a weight:
 *   T [N, K] -> uint8 [Np, Kp3/5], Kp3 = K rounded up to a multiple of 320, Np = N rounded up to 4. Each row is
 *   Kp3/320 blocks of 64 bytes; byte j of a block holds the codes c_i = t + 1 of the block's elements j, 64+j,
 *   128+j, 192+j, 256+j (i = 0..4) as ceil(v * 256 / 243), v = sum_i c_i 3^(4-i) (llama.cpp's TQ1_0 digits).
 *   Code i is then ((byte * 3^i mod 256) * 3) >> 8: a multiply-shift unpack giving 64 codes aligned with 64
 *   consecutive int8 activations per step, so the kernels keep the int8 dot products. Rows in groups of 4 with
 *   interleaved blocks, padding code 1, as in cpu-2bit-v2. 20% fewer bytes for decode to read, more work to unpack:
 *   which is faster depends on the machine's memory bandwidth per core (runtime weights_layout).
 */
#ifndef BITNET_CPU_H
#define BITNET_CPU_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define BN_BLOCK 128 /* K elements per packed block */
#define BN3_BYTES 64 /* bytes per cpu-base3-v1 block */
#define BN3_BLOCK (5 * BN3_BYTES) /* K elements per cpu-base3-v1 block */

/* weight layouts (bn_*_layout functions) */
enum { BN_LAYOUT_2BIT = 0, BN_LAYOUT_BASE3 = 1 };

/* instruction-set paths (bn_isa_* values) */
enum { BN_ISA_AUTO = -1, BN_ISA_SCALAR = 0, BN_ISA_AVX2 = 1, BN_ISA_AVX512VNNI = 2, BN_ISA_NEON = 3 };

/* library info and configuration */
const char *bn_version(void);
int bn_isa_supported(int isa);      /* 1 when this build and this CPU can run the path */
int bn_isa_best(void);              /* the path used by default */
int bn_set_isa(int isa);            /* force a path (BN_ISA_AUTO = best); returns the active path or -1 */
int bn_get_isa(void);
const char *bn_isa_name(int isa);
int bn_set_num_threads(int n);      /* n <= 0: the default given at bn_init (physical cores) */
int bn_get_num_threads(void);

/* packing */
int64_t bn_padded_k(int64_t k);                        /* K rounded up to BN_BLOCK */
int64_t bn_packed_row_bytes(int64_t k);                /* bytes per packed row = bn_padded_k(k) / 4 */
int64_t bn_packed_rows(int64_t n);                     /* rows stored = n rounded up to 4 */
void bn_pack(const int8_t *t, int64_t n, int64_t k, uint8_t *out); /* out: bn_packed_rows(n) * row bytes */
void bn_unpack(const uint8_t *p, int64_t n, int64_t k, int8_t *out);
/* transformers' offline 2-bit layout uint8 [ceil(n/4), k] (row r at row r % R, bits 2*(r / R)) -> packed */
void bn_repack_hf(const uint8_t *hf, int64_t n, int64_t k, uint8_t *out);

/* cpu-base3-v1 packing: padded K, bytes per row (rows as bn_packed_rows) */
int64_t bn3_padded_k(int64_t k);
int64_t bn3_packed_row_bytes(int64_t k);
/* a packed [n, k] matrix from layout `from` into layout `to` (BN_LAYOUT_*), threaded, without an int8 copy;
 * returns 0, -1 for a bad layout or size, -2 out of memory */
int bn_repack(const uint8_t *src, int from, int64_t n, int64_t k, uint8_t *out, int to);

/* per-token int8 activation quantization: x fp32 [m, k] -> xq int8 [m, ldq] (zero padded from k to ldq),
 * a fp32 [m] (may be NULL), xsum int32 [m] = sum of each row of xq (may be NULL). */
void bn_quantize_act(const float *x, int64_t m, int64_t k, int8_t *xq, int64_t ldq, float *a, int32_t *xsum);

/* exact integer product out[i, j] = sum_k xq[i, k] * T[j, k]; xq int8 [m, k] (any values), int32 out [m, n] */
int bn_ternary_matmul_i32(const int8_t *xq, int64_t m, int64_t k, const uint8_t *packed, int64_t n, int32_t *out);

/* ternary linear: y[m, n] = float((X . T)[m, n]) * (scale / a[m]) with X, a from bn_quantize_act(x) */
int bn_ternary_linear_f32(const float *x, int64_t m, int64_t k, const uint8_t *packed, int64_t n, float scale, float *y);

/* several ternary linears sharing the same input (q/k/v, gate/up): one quantization, one thread dispatch.
 * packed[i]: [n[i], k], *scale[i]: its weight scale (read at call time), y[i]: [m, n[i]]; count <= 8 */
int bn_ternary_linear_multi_f32(const float *x, int64_t m, int64_t k, int count, const uint8_t *const *packed,
                                const int64_t *n, const float *const *scale, float *const *y);
/* the same with a row stride ldy for every y[i] (outputs side by side in one [m, ldy] buffer) */
int bn_ternary_linear_multi_f32_ld(const float *x, int64_t m, int64_t k, int count, const uint8_t *const *packed,
                                   const int64_t *n, const float *const *scale, float *const *y, int64_t ldy);

/* the integer product and the linears for weights in either layout (BN_LAYOUT_*) */
int bn_ternary_matmul_i32_layout(const int8_t *xq, int64_t m, int64_t k, const uint8_t *packed, int64_t n,
                                 int32_t *out, int layout);
int bn_ternary_linear_multi_f32_layout(const float *x, int64_t m, int64_t k, int count, const uint8_t *const *packed,
                                       const int64_t *n, const float *const *scale, float *const *y, int64_t ldy,
                                       int layout);

/* float heads: y[m, n] = x[m, :] . W[n, :] for W in bf16 (uint16 bit patterns), float32, or int8 with per-row
 * scales (y = wscale[n] * sum_k x[m, k] * q[n, k]); multithreaded over n. bf16, float32: fp32 accumulation. int8: x
 * is quantized per row to int16 (error <= 1.5e-5 of max|x|) and the products summed exactly in int32 (vpmaddwd).
 * Batch-invariant: each y[i, :] is summed in an order fixed by k alone, so it is bit-identical whatever m is and
 * whatever the other rows of x hold (a GEMM that blocks K by the row count would not be). */
int bn_gemm_bf16(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n, float *y);
int bn_gemm_f32(const float *x, int64_t m, int64_t k, const float *w, int64_t n, float *y);
int bn_gemm_i8row(const float *x, int64_t m, int64_t k, const int8_t *w, const float *wscale, int64_t n, float *y);

/* STREAM-like copy bandwidth helper: copies src to dst with the library's threads (bytes) */
void bn_parallel_copy(void *dst, const void *src, int64_t bytes);
/* Read-only bandwidth helper: the sum of src's 64-bit words (bytes / 8 of them), read with the library's threads.
 * Decode only reads its weights, so this, not the copy, is its ceiling. */
uint64_t bn_parallel_read(const void *src, int64_t bytes);

#ifdef __cplusplus
}
#endif
#endif
