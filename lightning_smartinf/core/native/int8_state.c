/* The "int8" state format's conversions on host cores: one pass over a chunk, the bytes the plain-torch reference
 * (lightning_smartinf/core/state_formats.py, class Int8) gives, bit for bit.
 *
 * A state of n elements is stored as ceil(n / 256) blocks: the blocks' codes (one byte per element, zero past the
 * last element), then one fp32 scale per block. An element's code is the FP8 E4M3 (float8_e4m3fn) code, rounded to
 * nearest with ties to even, of the element divided by its block's scale, the block's largest magnitude over 448
 * (an all-zero block: scale 0, divided by 1). A state that is never negative is stored by its square root.
 *
 * Every operation is one IEEE-754 single-precision operation as torch does it (sqrt, division, multiplication, each
 * correctly rounded; no two fused: built with -ffp-contract=off), so the bytes match the reference's.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 256
#define E4M3_MAX 448.0f

/* The E4M3 code of the float with bits `bits`, as torch's conversion gives it: round to nearest, ties to even; 464
 * and above (and infinity) saturate to 448's code 0x7E; NaN is 0x7F (with x's sign). A block's values over its scale
 * stay below 464 but where the scale is subnormal (the block's largest magnitude under 448 * 2**-126): there the
 * quotient can reach 512, which saturates. Without branches (masks instead), so that the compiler vectorises the loop
 * that calls it. */
static inline uint8_t e4m3_code(uint32_t bits) {
    uint32_t sign = (bits >> 24) & 0x80u;
    uint32_t magnitude = bits & 0x7FFFFFFFu;
    /* A normal: keep 3 of fp32's 23 mantissa bits, rounding the 20 dropped to nearest, ties to even; a carry moves
     * into the exponent, which the codes continue. fp32's exponent bias is 127, E4M3's 7. */
    uint32_t normal = ((magnitude + 0x7FFFFu + ((magnitude >> 20) & 1u)) >> 20) - (120u << 3);
    /* Below 2**-6, E4M3's smallest normal, the codes count multiples of 2**-9 (8 is 2**-6's code). Adding 2**23
     * rounds |x| * 2**9 (exact: a power of two) to an integer, to nearest with ties to even, into the low bits. */
    union { uint32_t u; float f; } value = {magnitude}, shifted;
    shifted.f = value.f * 512.0f + 8388608.0f;
    uint32_t subnormal = shifted.u - 0x4B000000u;
    uint32_t small = -(uint32_t)(magnitude < 0x3C800000u);
    uint32_t code = (subnormal & small) | (normal & ~small);
    uint32_t huge = -(uint32_t)(magnitude >= 0x43E80000u); /* 464 and above, infinity and NaN */
    uint32_t nan = -(uint32_t)(magnitude > 0x7F800000u);
    uint32_t saturated = (0x7Fu & nan) | (0x7Eu & ~nan);
    return (uint8_t)(sign | (saturated & huge) | (code & ~huge));
}

/* Store n fp32 values as int8: codes[ceil(n / 256) * 256], then scales[ceil(n / 256)]. The values are read, never
 * written; sqrt_first: store their square roots (a state that is never negative). */
void smartinf_int8_store(const float *values, int64_t n, int sqrt_first, uint8_t *codes, float *scales) {
    union { float f[BLOCK]; uint32_t u[BLOCK]; } block;
    int64_t blocks = (n + BLOCK - 1) / BLOCK;
    for (int64_t b = 0; b < blocks; ++b) {
        int64_t start = b * BLOCK;
        int64_t count = n - start < BLOCK ? n - start : BLOCK;
        const float *in = values + start;
        if (sqrt_first) {
            for (int64_t i = 0; i < count; ++i) block.f[i] = sqrtf(in[i]);
        } else {
            for (int64_t i = 0; i < count; ++i) block.f[i] = in[i];
        }
        for (int64_t i = count; i < BLOCK; ++i) block.f[i] = 0.0f;
        /* The largest magnitude: non-negative floats order as their bits do (and a NaN, above infinity, makes the
         * scale NaN, as torch's amax does). */
        uint32_t largest = 0;
        for (int i = 0; i < BLOCK; ++i) {
            uint32_t magnitude = block.u[i] & 0x7FFFFFFFu;
            largest = magnitude > largest ? magnitude : largest;
        }
        union { uint32_t u; float f; } top = {largest};
        float scale = top.f / E4M3_MAX;
        float divisor = scale == 0.0f ? 1.0f : scale;
        for (int i = 0; i < BLOCK; ++i) block.f[i] = block.f[i] / divisor;
        uint8_t *out = codes + start;
        for (int i = 0; i < BLOCK; ++i) out[i] = e4m3_code(block.u[i]);
        scales[b] = scale;
    }
}

/* Load n fp32 values from int8 codes and scales (laid out as smartinf_int8_store writes them); value_of_code: the
 * 256 codes' values; square: the state was stored by its square root. */
void smartinf_int8_load(
    const uint8_t *codes, const float *scales, int64_t n, int square, const float *value_of_code, float *out
) {
    int64_t blocks = (n + BLOCK - 1) / BLOCK;
    for (int64_t b = 0; b < blocks; ++b) {
        int64_t start = b * BLOCK;
        int64_t count = n - start < BLOCK ? n - start : BLOCK;
        float scale = scales[b];
        const uint8_t *in = codes + start;
        float *dst = out + start;
        if (square) {
            for (int64_t i = 0; i < count; ++i) {
                float value = value_of_code[in[i]] * scale;
                dst[i] = value * value;
            }
        } else {
            for (int64_t i = 0; i < count; ++i) dst[i] = value_of_code[in[i]] * scale;
        }
    }
}
