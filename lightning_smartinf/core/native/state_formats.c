/* The state formats on host cores (lightning_smartinf/core/state_formats.py): the "int8" format's conversions, one
 * pass over a chunk, and Adam's update fused with the "int8" and "bf16" formats, one pass over a chunk instead of a
 * load, the rule's nine passes and a store. Each gives the bytes of its plain-torch reference, bit for bit.
 *
 * A state of n elements is stored in "int8" as ceil(n / 256) blocks: the blocks' codes (one byte per element, zero
 * past the last element), then one fp32 scale per block. An element's code is an 8-bit float code, rounded to nearest
 * with ties to even, of the element divided by its block's scale, the block's largest magnitude over the code's
 * largest value (an all-zero block: scale 0, divided by 1). A signed state takes FP8 E4M3 (float8_e4m3fn, largest
 * 448); a state that is never negative is stored by its square root in the format's ROOT_CODE, an unsigned 8-bit
 * float (see ROOT_EXPONENT_BITS), where a non-zero value never becomes zero. In "bf16" each element is rounded to
 * bfloat16, to nearest with ties to even, as torch rounds.
 *
 * Every operation is one IEEE-754 single-precision operation as torch does it (sqrt, division, multiplication, each
 * correctly rounded; no two fused but where torch's vectorised kernels fuse them, written fmaf: built with
 * -ffp-contract=off), so the bytes match the reference's.
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

/* How far ahead of the element in hand a streaming loop asks for memory (`ahead`): a block's loads arrive too late
 * for the hardware's prefetcher on some machines (a 2-core VM read a gradient three times faster with it). */
#define AHEAD_ELEMENTS 1024

/* Ask for the cache lines of [p, p + bytes) to be brought in (`write`: to be written too); never faults. */
static inline void ahead(const void *p, int64_t bytes, int write) {
    for (int64_t line = 0; line < bytes; line += 64) {
        if (write)
            __builtin_prefetch((const char *)p + line, 1, 0);
        else
            __builtin_prefetch((const char *)p + line, 0, 0);
    }
}

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

/* Store one block of BLOCK values as int8 codes[BLOCK] and *scale: `coded` holds the values the codes encode (a state
 * that is never negative: its values' square roots, then root codes; else the values, then E4M3 codes). Read, never
 * written. */
static void int8_store_block(const float *coded, int root, uint8_t *codes, float *scale) {
    /* The largest magnitude: non-negative floats order as their bits do (and a NaN, above infinity, makes the scale
     * NaN, as torch's amax does). */
    uint32_t largest = 0;
    for (int i = 0; i < BLOCK; ++i) {
        uint32_t bits;
        memcpy(&bits, coded + i, 4);
        uint32_t magnitude = bits & 0x7FFFFFFFu;
        largest = magnitude > largest ? magnitude : largest;
    }
    union { uint32_t u; float f; } top = {largest};
    float step = top.f / (root ? ROOT_MAX : E4M3_MAX);
    float divisor = step == 0.0f ? 1.0f : step;
    union { float f[BLOCK]; uint32_t u[BLOCK]; } quotient;
    for (int i = 0; i < BLOCK; ++i) quotient.f[i] = coded[i] / divisor;
    if (root) {
        for (int i = 0; i < BLOCK; ++i) codes[i] = root_code(quotient.u[i]);
    } else {
        for (int i = 0; i < BLOCK; ++i) codes[i] = e4m3_code(quotient.u[i]);
    }
    *scale = step;
}

/* Store n fp32 values as int8: codes[ceil(n / 256) * 256], then scales[ceil(n / 256)]. The values are read, never
 * written; sqrt_first: store their square roots in the root code (a state that is never negative), else E4M3 codes. */
void smartinf_int8_store(const float *values, int64_t n, int sqrt_first, uint8_t *codes, float *scales) {
    float block[BLOCK];
    int64_t blocks = (n + BLOCK - 1) / BLOCK;
    for (int64_t b = 0; b < blocks; ++b) {
        int64_t start = b * BLOCK;
        int64_t count = n - start < BLOCK ? n - start : BLOCK;
        const float *in = values + start;
        if (sqrt_first) {
            for (int64_t i = 0; i < count; ++i) block[i] = sqrtf(in[i]);
        } else {
            for (int64_t i = 0; i < count; ++i) block[i] = in[i];
        }
        for (int64_t i = count; i < BLOCK; ++i) block[i] = 0.0f;
        int8_store_block(block, sqrt_first, codes + start, scales + b);
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

/* ---- Adam and AdamW fused with a state format -------------------------------------------------------------------
 *
 * torch.optim.Adam/AdamW's single-tensor arithmetic, rounding for rounding as torch's AVX2 and AVX-512 kernels round
 * (they fuse `lerp`, `addcmul` and `add(alpha=)` into one rounding each: fmaf here), with square roots correctly
 * rounded (the reference of a stored format takes them so; torch's vectorised CPU sqrt is 1 ulp off for some inputs).
 * The gradient comes already multiplied by the gradient scale. Per element, in the reference's order:
 *
 *     if maximize: g = -g
 *     AdamW: p = p * decay_mul            Adam (L2): g = g + l2_decay * p
 *     m = lerp(m, g, lerp_weight)         v = v * beta2 + one_minus_beta2 * g * g
 *     p = p + (neg_step_size * m) / (sqrt(v) / bias_correction2_sqrt + eps)
 *
 * The scalars come as torch rounds them to fp32, in this order (lightning_smartinf.core.rules.adam_kernel_scalars):
 * decay_mul, l2_decay, lerp_weight, beta2, one_minus_beta2, bias_correction2_sqrt, eps, neg_step_size. A block of
 * BLOCK elements is loaded from its format, updated and stored, in memory on the stack. */

/* The flags' bits (rules.FLAG_MAXIMIZE, FLAG_WEIGHT_DECAY, FLAG_DECOUPLED_DECAY). */
#define ADAM_MAXIMIZE 1
#define ADAM_L2_DECAY 2
#define ADAM_DECOUPLED_DECAY 4

/* torch.lerp(start, end, weight) for a scalar weight, as its vectorised kernel computes it. */
static inline float lerp(float start, float end, float weight) {
    float diff = end - start;
    return (weight < 0.5f && weight > -0.5f) ? fmaf(weight, diff, start) : fmaf(weight - 1.0f, diff, end);
}

/* Update `count` elements of p (masters), m and v (fp32) with the gradient g; roots (unless NULL) takes each new v's
 * square root, the one its update divides by, which the "int8" format stores. The flags and roots do not change within
 * the loop: the compiler takes their branches out of it and vectorises each variant. */
static void adam_block(float *p, const float *g, float *m, float *v, float *roots, int64_t count, const float *s,
                       int flags) {
    const float decay_mul = s[0], l2_decay = s[1], lerp_weight = s[2], beta2 = s[3], one_minus_beta2 = s[4];
    const float bias_correction2_sqrt = s[5], eps = s[6], neg_step_size = s[7];
    const float sign = (flags & ADAM_MAXIMIZE) ? -1.0f : 1.0f; /* exact: a negation */
    const int decoupled = (flags & ADAM_DECOUPLED_DECAY) != 0, l2 = (flags & ADAM_L2_DECAY) != 0;
    for (int64_t i = 0; i < count; ++i) {
        float ge = g[i] * sign, pe = p[i];
        if (decoupled) pe = pe * decay_mul;
        if (l2) ge = fmaf(pe, l2_decay, ge);
        float me = lerp(m[i], ge, lerp_weight);
        float ve = fmaf(one_minus_beta2 * ge, ge, v[i] * beta2);
        float root = sqrtf(ve);
        float denom = root / bias_correction2_sqrt + eps;
        p[i] = pe + (neg_step_size * me) / denom;
        m[i] = me;
        v[i] = ve;
        if (roots != NULL) roots[i] = root;
    }
}

static inline float bf16_value(uint16_t bits) {
    union { uint32_t u; float f; } value = {(uint32_t)bits << 16};
    return value.f;
}

/* Round to nearest, ties to even, as torch's conversion to bfloat16 does: NaN becomes 0x7FC0. Without branches. */
static inline uint16_t bf16_bits(float x) {
    union { float f; uint32_t u; } value = {x};
    uint32_t rounded = (value.u + 0x7FFFu + ((value.u >> 16) & 1u)) >> 16;
    uint32_t nan = -(uint32_t)((value.u & 0x7FFFFFFFu) > 0x7F800000u);
    return (uint16_t)((0x7FC0u & nan) | (rounded & ~nan));
}

/* Split masters (lightning_smartinf/core/split_masters.py): an fp32 master kept as its bf16 rounding (the parameter,
 * held elsewhere), its low 16 bits and one bit saying whether the rounding carried into the high half. Carry bits
 * are packed eight to a byte, element i in bit i % 8 of byte i / 8; a last byte's bits past n are written zero. The
 * encoder also writes the parameters (the roundings) unless params is NULL. Both
 * go a span at a time: the carry bits one per byte (or word) in a local array, so the loops over elements vectorise. */
#define SPAN 256

void smartinf_split_encode(const float *master, int64_t n, uint16_t *low, uint8_t *carry, uint16_t *params) {
    uint8_t carried[SPAN];
    uint16_t rounded[SPAN];
    for (int64_t start = 0; start < n; start += SPAN) {
        int64_t count = n - start >= SPAN ? SPAN : n - start, bytes = (count + 7) / 8;
        if (start + AHEAD_ELEMENTS < n) ahead(master + start + AHEAD_ELEMENTS, 4 * SPAN, 0);
        for (int64_t i = 0; i < count; ++i) {
            uint32_t bits;
            memcpy(&bits, master + start + i, 4);
            low[start + i] = (uint16_t)bits;
            rounded[i] = bf16_bits(master[start + i]);
            carried[i] = rounded[i] != (uint16_t)(bits >> 16);
        }
        if (params != NULL) memcpy(params + start, rounded, (size_t)count * 2);
        for (int64_t i = count; i < 8 * bytes; ++i) carried[i] = 0;
        for (int64_t b = 0; b < bytes; ++b) {
            const uint8_t *c = carried + 8 * b;
            carry[start / 8 + b] =
                (uint8_t)(c[0] | c[1] << 1 | c[2] << 2 | c[3] << 3 | c[4] << 4 | c[5] << 5 | c[6] << 6 | c[7] << 7);
        }
    }
}

/* The n masters whose bf16 roundings are params (as bits) and whose low halves and carry bits smartinf_split_encode
 * wrote: ((param - carry) << 16) | low, as 32-bit patterns; the params are also copied to aside unless it is NULL. */
void smartinf_split_decode(const uint16_t *params, const uint16_t *low, const uint8_t *carry, int64_t n,
                           float *master, uint16_t *aside) {
    uint32_t carried[SPAN];
    for (int64_t start = 0; start < n; start += SPAN) {
        int64_t count = n - start >= SPAN ? SPAN : n - start, bytes = (count + 7) / 8;
        if (start + AHEAD_ELEMENTS < n) {
            ahead(params + start + AHEAD_ELEMENTS, 2 * SPAN, 0);
            ahead(low + start + AHEAD_ELEMENTS, 2 * SPAN, 0);
            ahead(carry + (start + AHEAD_ELEMENTS) / 8, SPAN / 8, 0);
        }
        for (int64_t b = 0; b < bytes; ++b) {
            uint32_t byte = carry[start / 8 + b];
            for (int j = 0; j < 8; ++j) carried[8 * b + j] = (byte >> j) & 1u;
        }
        for (int64_t i = 0; i < count; ++i) {
            uint32_t bits = (((uint32_t)params[start + i] << 16) | low[start + i]) - (carried[i] << 16);
            memcpy(master + start + i, &bits, 4);
        }
        if (aside != NULL) memcpy(aside + start, params + start, (size_t)count * 2);
    }
}

/* Where a kernel finds the masters of a chunk: whole (fp32, `whole`; their bf16 roundings, the parameters, written
 * to `params` after the update unless it is NULL), or split (`params`, `low` and `carry` as smartinf_split_encode lays
 * them out; the parameters also copied to `aside` unless it is NULL). A split block is rebuilt into a local array
 * before its update, and stored back, with its parameters rounded, after it. */
struct masters {
    float *whole;
    uint16_t *params, *low;
    uint8_t *carry;
    uint16_t *aside;
};

/* Where a kernel finds the gradient of a chunk: fp32 (`f32`), or bf16 (`bf16`, when `f32` is NULL); either is
 * multiplied by `scale` unless it is 1, one fp32 rounding, as torch's `g.mul_(scale)` of the fp32 gradient does. */
struct gradient {
    const float *f32;
    const uint16_t *bf16;
    float scale;
};

static const float *gradient_in(const struct gradient *g, int64_t start, int64_t count, float *local) {
    if (g->f32 != NULL && g->scale == 1.0f) return g->f32 + start;
    if (g->f32 != NULL) {
        for (int64_t i = 0; i < count; ++i) local[i] = g->f32[start + i] * g->scale;
    } else if (g->scale == 1.0f) {
        for (int64_t i = 0; i < count; ++i) local[i] = bf16_value(g->bf16[start + i]);
    } else {
        for (int64_t i = 0; i < count; ++i) local[i] = bf16_value(g->bf16[start + i]) * g->scale;
    }
    return local;
}

static void gradient_ahead(const struct gradient *g, int64_t start) {
    if (g->f32 != NULL)
        ahead(g->f32 + start + AHEAD_ELEMENTS, 4 * BLOCK, 0);
    else
        ahead(g->bf16 + start + AHEAD_ELEMENTS, 2 * BLOCK, 0);
}

/* Ask for the masters of the block AHEAD_ELEMENTS on from start, which the kernels' loops come to later. */
static void masters_ahead(const struct masters *at, int64_t start) {
    int64_t next = start + AHEAD_ELEMENTS;
    if (at->whole != NULL) {
        ahead(at->whole + next, 4 * BLOCK, 1);
        if (at->params != NULL) ahead(at->params + next, 2 * BLOCK, 1);
    } else {
        ahead(at->params + next, 2 * BLOCK, 1);
        ahead(at->low + next, 2 * BLOCK, 1);
        ahead(at->carry + next / 8, BLOCK / 8, 1);
    }
}

static float *masters_in(const struct masters *at, int64_t start, int64_t count, float *local) {
    if (at->whole != NULL) return at->whole + start;
    if (count > 0)
        smartinf_split_decode(at->params + start, at->low + start, at->carry + start / 8, count, local,
                              at->aside != NULL ? at->aside + start : NULL);
    return local;
}

static void masters_out(const struct masters *at, int64_t start, int64_t count, const float *p) {
    if (count == 0) return;
    if (at->whole == NULL) {
        smartinf_split_encode(p, count, at->low + start, at->carry + start / 8, at->params + start);
    } else if (at->params != NULL) {
        for (int64_t i = 0; i < count; ++i) at->params[start + i] = bf16_bits(p[i]);
    }
}

/* Elements [0, padded) of a chunk, whole blocks (its records' padding included), of which the first n are updated:
 * masters (see struct masters) and gradient fp32; exp_avg and exp_avg_sq in "int8", each given by its codes (padded
 * bytes) and its scales (one per block), as smartinf_int8_store lays them out. Padding blocks are loaded and stored
 * again, as the reference does. Blocks are independent: a chunk may be updated in pieces of whole blocks, at once on
 * several threads. */
static void adam_int8(const struct masters *at, const struct gradient *grad, int64_t n, int64_t padded,
                      uint8_t *exp_avg_codes, float *exp_avg_scales, uint8_t *exp_avg_sq_codes,
                      float *exp_avg_sq_scales, const float *scalars, int flags) {
    float m[BLOCK], v[BLOCK], roots[BLOCK], local[BLOCK], g[BLOCK];
    int64_t blocks = padded / BLOCK;
    for (int64_t b = 0; b < blocks; ++b) {
        int64_t start = b * BLOCK;
        int64_t count = n - start >= BLOCK ? BLOCK : (n > start ? n - start : 0);
        if (start + AHEAD_ELEMENTS < padded) {
            masters_ahead(at, start);
            gradient_ahead(grad, start);
            ahead(exp_avg_codes + start + AHEAD_ELEMENTS, BLOCK, 1);
            ahead(exp_avg_sq_codes + start + AHEAD_ELEMENTS, BLOCK, 1);
        }
        float *p = masters_in(at, start, count, local);
        smartinf_int8_load(exp_avg_codes + start, exp_avg_scales + b, BLOCK, 0, m);
        smartinf_int8_load(exp_avg_sq_codes + start, exp_avg_sq_scales + b, BLOCK, 1, v);
        adam_block(p, gradient_in(grad, start, count, g), m, v, roots, count, scalars, flags);
        for (int64_t i = count; i < BLOCK; ++i) roots[i] = sqrtf(v[i]); /* padding: loaded, stored again */
        int8_store_block(m, 0, exp_avg_codes + start, exp_avg_scales + b);
        int8_store_block(roots, 1, exp_avg_sq_codes + start, exp_avg_sq_scales + b);
        masters_out(at, start, count, p);
    }
}

/* The gradient of every entry point: fp32 (`grad`), or bf16 (`grad_bf16`, when `grad` is NULL), times `grad_scale`
 * (see struct gradient). */
void smartinf_adam_int8(float *master, uint16_t *params, const float *grad, const uint16_t *grad_bf16,
                        float grad_scale, int64_t n, int64_t padded, uint8_t *exp_avg_codes, float *exp_avg_scales,
                        uint8_t *exp_avg_sq_codes, float *exp_avg_sq_scales, const float *scalars, int flags) {
    struct masters at = {master, params, NULL, NULL, NULL};
    struct gradient g = {grad, grad_bf16, grad_scale};
    adam_int8(&at, &g, n, padded, exp_avg_codes, exp_avg_scales, exp_avg_sq_codes, exp_avg_sq_scales, scalars,
              flags);
}

/* smartinf_adam_int8 over split masters; the chunk's first element is the first of a block (so of a carry byte). */
void smartinf_adam_int8_split(uint16_t *params, uint16_t *low, uint8_t *carry, uint16_t *aside, const float *grad,
                              const uint16_t *grad_bf16, float grad_scale, int64_t n, int64_t padded,
                              uint8_t *exp_avg_codes, float *exp_avg_scales, uint8_t *exp_avg_sq_codes,
                              float *exp_avg_sq_scales, const float *scalars, int flags) {
    struct masters at = {NULL, params, low, carry, aside};
    struct gradient g = {grad, grad_bf16, grad_scale};
    adam_int8(&at, &g, n, padded, exp_avg_codes, exp_avg_scales, exp_avg_sq_codes, exp_avg_sq_scales, scalars,
              flags);
}

/* As adam_int8, with exp_avg and exp_avg_sq in "bf16": the first n elements (the padding past them is left as it is:
 * a bf16 value loads and stores back unchanged). */
static void adam_bf16(const struct masters *at, const struct gradient *grad, int64_t n, uint16_t *exp_avg,
                      uint16_t *exp_avg_sq, const float *scalars, int flags) {
    float m[BLOCK], v[BLOCK], local[BLOCK], g[BLOCK];
    for (int64_t start = 0; start < n; start += BLOCK) {
        int64_t count = n - start >= BLOCK ? BLOCK : n - start;
        if (start + AHEAD_ELEMENTS < n) {
            masters_ahead(at, start);
            gradient_ahead(grad, start);
            ahead(exp_avg + start + AHEAD_ELEMENTS, 2 * BLOCK, 1);
            ahead(exp_avg_sq + start + AHEAD_ELEMENTS, 2 * BLOCK, 1);
        }
        float *p = masters_in(at, start, count, local);
        for (int64_t i = 0; i < count; ++i) {
            m[i] = bf16_value(exp_avg[start + i]);
            v[i] = bf16_value(exp_avg_sq[start + i]);
        }
        adam_block(p, gradient_in(grad, start, count, g), m, v, NULL, count, scalars, flags);
        for (int64_t i = 0; i < count; ++i) {
            exp_avg[start + i] = bf16_bits(m[i]);
            exp_avg_sq[start + i] = bf16_bits(v[i]);
        }
        masters_out(at, start, count, p);
    }
}

void smartinf_adam_bf16(float *master, uint16_t *params, const float *grad, const uint16_t *grad_bf16,
                        float grad_scale, int64_t n, uint16_t *exp_avg, uint16_t *exp_avg_sq, const float *scalars,
                        int flags) {
    struct masters at = {master, params, NULL, NULL, NULL};
    struct gradient g = {grad, grad_bf16, grad_scale};
    adam_bf16(&at, &g, n, exp_avg, exp_avg_sq, scalars, flags);
}

/* smartinf_adam_bf16 over split masters; the chunk's first element is the first of a carry byte. */
void smartinf_adam_bf16_split(uint16_t *params, uint16_t *low, uint8_t *carry, uint16_t *aside, const float *grad,
                              const uint16_t *grad_bf16, float grad_scale, int64_t n, uint16_t *exp_avg,
                              uint16_t *exp_avg_sq, const float *scalars, int flags) {
    struct masters at = {NULL, params, low, carry, aside};
    struct gradient g = {grad, grad_bf16, grad_scale};
    adam_bf16(&at, &g, n, exp_avg, exp_avg_sq, scalars, flags);
}
