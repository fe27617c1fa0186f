/* The int8 kernels' float epilogue: what a group's exact int32 sums become, per group and 16
 * output columns, in the order int8_gemm.c documents ("Arithmetic"). One copy for the VNNI
 * panels (int8_gemm.c), the many-row paths (int8_rows.c), the few-row panels (int8_few.c) and
 * the AMX tiles (amx_i8_gemm.c): their outputs are equal bit for bit only while these are the
 * same steps in the same order.
 *
 * Arguments are the 16 columns' vectors: sum the group's integer sums, dw (and mw) the
 * weight's scales (and minima), d = x's group scale and ds = d * the sum of x's quants, both
 * broadcast. Each call is one link of one output chain for one group; the caller runs the
 * groups in k order. Always inlined, so the caller's accumulators stay in registers (with
 * these calls every kernel compiled to the same instructions as with the steps written out in
 * each: bench/int8_bits.py --code).
 */
#ifndef STOPLINE_INT8_EPILOGUE_H
#define STOPLINE_INT8_EPILOGUE_H

#include <immintrin.h>

#define I8_EPILOGUE static inline __attribute__((always_inline, target("avx512f")))

/* acc = fma(float(sum), dw * d, acc): Q8_0 and each Q6_K half with x's offset 128 s already
 * off sum (int8_rows.c starts its sums at -128 s; amx_i8_gemm.c subtracts it from a tile's). */
I8_EPILOGUE __m512 i8_scaled(__m512 acc, __m512i sum, __m512 dw, __m512 d) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dw, d), acc);
}

/* Q4_1, Q4_K: acc = fma(float(sum), dw * d, acc); acc = fma(mw, ds, acc). */
I8_EPILOGUE __m512 i8_q4_group(__m512 acc, __m512i sum, __m512 dw, __m512 mw, __m512 d, __m512 ds) {
    return _mm512_fmadd_ps(mw, ds, i8_scaled(acc, sum, dw, d));
}

/* Q8_0 as stored (v + 128): acc = fma(float(sum - off), dw * d, acc), off = 128 s. Q6_K is
 * this twice a group, k 0-15 (its sum, scale s0, x's offset of those k) then k 16-31 (s1): the
 * callers run both column halves' first step, then both second steps, as they always have. */
I8_EPILOGUE __m512 i8_q8_group(__m512 acc, __m512i sum, __m512i off, __m512 dw, __m512 d) {
    return i8_scaled(acc, _mm512_sub_epi32(sum, off), dw, d);
}

#endif
