/* The "int8" state format's conversions on host cores: one pass over a chunk, the bytes the plain-torch reference
 * (lightning_smartinf/core/state_formats.py, class Int8) gives, bit for bit.
 *
 * A state of n elements is stored as ceil(n / 256) blocks: the blocks' codes (one byte per element, zero past the
 * last element), then one fp32 scale per block. An element's code is an 8-bit float code, rounded to nearest with
 * ties to even, of the element divided by its block's scale, the block's largest magnitude over the code's largest
 * value (an all-zero block: scale 0, divided by 1). A signed state takes FP8 E4M3 (float8_e4m3fn, largest 448); a
 * state that is never negative is stored by its square root in the format's ROOT_CODE, an unsigned 8-bit float (see
 * ROOT_EXPONENT_BITS), where a non-zero value never becomes zero.
 *
 * Every operation is one IEEE-754 single-precision operation as torch does it (sqrt, division, multiplication, each
 * correctly rounded; no two fused: built with -ffp-contract=off), so the bytes match the reference's.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 256
#define E4M3_MAX 448.0f
/* The root code (state_formats.ROOT_CODE): an unsigned 8-bit float of ROOT_EXPONENT_BITS exponent bits (bias
 * ROOT_BIAS) and ROOT_MANTISSA_BITS mantissa bits, with subnormals, no infinity or NaN; ROOT_MAX is code 255's value,
 * ROOT_SUBNORMAL_STEPS the subnormal codes per unit (the inverse of the smallest code, 2**(1 - bias - mantissa)). */
#define ROOT_EXPONENT_BITS 4
#define ROOT_MANTISSA_BITS (8 - ROOT_EXPONENT_BITS)
#define ROOT_BIAS ((1 << (ROOT_EXPONENT_BITS - 1)) - 1)
#define ROOT_MAX 496.0f
#define ROOT_SUBNORMAL_STEPS 1024.0f

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

/* The root code of the non-negative float (or NaN) with bits `bits`: round to nearest, ties to even; from half a step
 * above ROOT_MAX, infinity and NaN saturate to code 255; a non-zero value below the smallest code takes that code,
 * never zero. Without branches, as e4m3_code. */
static inline uint8_t root_code(uint32_t bits) {
    const uint32_t dropped = 23 - ROOT_MANTISSA_BITS;
    uint32_t magnitude = bits & 0x7FFFFFFFu;
    /* A normal: keep ROOT_MANTISSA_BITS of fp32's 23 mantissa bits, the dropped ones rounded to nearest, ties to even;
     * a carry moves into the exponent, which the codes continue. fp32's exponent bias is 127. */
    uint32_t normal = ((magnitude + ((1u << (dropped - 1)) - 1u) + ((magnitude >> dropped) & 1u)) >> dropped)
                      - ((uint32_t)(127 - ROOT_BIAS) << ROOT_MANTISSA_BITS);
    /* Below the smallest normal, 2**(1 - bias), the codes count multiples of the smallest code: |x| over it is exact
     * (a power of two), and adding 2**23 rounds it to an integer, to nearest with ties to even, into the low bits. */
    union { uint32_t u; float f; } value = {magnitude}, shifted;
    shifted.f = value.f * ROOT_SUBNORMAL_STEPS + 8388608.0f;
    uint32_t subnormal = shifted.u - 0x4B000000u;
    uint32_t small = -(uint32_t)(magnitude < ((uint32_t)(128 - ROOT_BIAS) << 23));
    uint32_t code = (subnormal & small) | (normal & ~small);
    uint32_t huge = -(uint32_t)(code > 255u); /* half a step above ROOT_MAX and beyond, infinity and NaN */
    code = (255u & huge) | (code & ~huge);
    return (uint8_t)(code | (uint32_t)((code == 0u) & (magnitude != 0u)));
}

/* Store n fp32 values as int8: codes[ceil(n / 256) * 256], then scales[ceil(n / 256)]. The values are read, never
 * written; sqrt_first: store their square roots in the root code (a state that is never negative), else E4M3 codes. */
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
        float scale = top.f / (sqrt_first ? ROOT_MAX : E4M3_MAX);
        float divisor = scale == 0.0f ? 1.0f : scale;
        for (int i = 0; i < BLOCK; ++i) block.f[i] = block.f[i] / divisor;
        uint8_t *out = codes + start;
        if (sqrt_first) {
            for (int i = 0; i < BLOCK; ++i) out[i] = root_code(block.u[i]);
        } else {
            for (int i = 0; i < BLOCK; ++i) out[i] = e4m3_code(block.u[i]);
        }
        scales[b] = scale;
    }
}

/* The value of E4M3 code `code`, exact in fp32, as the reference's table holds it: a normal's exponent and mantissa
 * move into fp32's (bias 7 to 127), a subnormal is its mantissa times 2**-9, and the NaN codes (0x7F, 0xFF) take
 * torch's float8 conversion's bits, 0x7FF00000 with the code's sign. Without branches, so the loop vectorises. */
static inline float e4m3_value(uint32_t code) {
    uint32_t sign = (code & 0x80u) << 24;
    uint32_t exponent = (code >> 3) & 0xFu, mantissa = code & 7u;
    union { uint32_t u; float f; } normal = {sign | ((exponent + 120u) << 23) | (mantissa << 20)}, small;
    small.f = (float)mantissa * 0.001953125f; /* exact: an integer below 8 times a power of two */
    uint32_t subnormal = -(uint32_t)(exponent == 0u);
    uint32_t nan = -(uint32_t)((code & 0x7Fu) == 0x7Fu);
    uint32_t bits = ((sign | small.u) & subnormal) | (normal.u & ~subnormal);
    union { uint32_t u; float f; } value = {((sign | 0x7FF00000u) & nan) | (bits & ~nan)};
    return value.f;
}

/* The value of root code `code`, exact in fp32: a normal's exponent and mantissa move into fp32's, a subnormal is its
 * mantissa over ROOT_SUBNORMAL_STEPS. No infinity or NaN. Without branches, as e4m3_value. */
static inline float root_value(uint32_t code) {
    uint32_t exponent = code >> ROOT_MANTISSA_BITS, mantissa = code & ((1u << ROOT_MANTISSA_BITS) - 1u);
    union { uint32_t u; float f; } normal = {((exponent + (uint32_t)(127 - ROOT_BIAS)) << 23)
                                            | (mantissa << (23 - ROOT_MANTISSA_BITS))}, small;
    small.f = (float)mantissa * (1.0f / ROOT_SUBNORMAL_STEPS); /* exact, as above */
    uint32_t subnormal = -(uint32_t)(exponent == 0u);
    union { uint32_t u; float f; } value = {(small.u & subnormal) | (normal.u & ~subnormal)};
    return value.f;
}

/* Load n fp32 values from int8 codes and scales (laid out as smartinf_int8_store writes them); square: the state was
 * stored by its square root in the root code, else in E4M3. Each code's value is decoded from its bits (the values of
 * the reference's table, exactly), then multiplied by its block's scale (and squared), one IEEE operation each. */
void smartinf_int8_load(const uint8_t *codes, const float *scales, int64_t n, int square, float *out) {
    int64_t blocks = (n + BLOCK - 1) / BLOCK;
    for (int64_t b = 0; b < blocks; ++b) {
        int64_t start = b * BLOCK;
        int64_t count = n - start < BLOCK ? n - start : BLOCK;
        float scale = scales[b];
        const uint8_t *in = codes + start;
        float *dst = out + start;
        if (square) {
            for (int64_t i = 0; i < count; ++i) {
                float value = root_value(in[i]) * scale;
                dst[i] = value * value;
            }
        } else {
            for (int64_t i = 0; i < count; ++i) dst[i] = e4m3_value(in[i]) * scale;
        }
    }
}
