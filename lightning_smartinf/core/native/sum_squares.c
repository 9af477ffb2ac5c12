/* Sums of squares in float64 of a float32 or bfloat16 tensor, for a gradient's norm: one pass over it, no copy, the
 * bytes the plain-torch reference (lightning_smartinf/core/float64_norm.py, lane_sums) gives, bit for bit.
 *
 * Element i's square goes to lane i % LANES, and each lane adds its squares in the order of the elements: lanes[j]
 * holds the sum so far on entry (zeros for a new tensor) and after the call, so that pieces of one tensor chain.
 * A float32 or bfloat16 value's square is exact in float64 (24 significant bits squared are 48 of 53), so each step
 * rounds once, in the addition, with or without contraction. Infinity and NaN propagate to their lane.
 */
#include <stdint.h>
#include <string.h>

#define LANES 8

typedef double (*value_at)(const void *x, int64_t i);

static inline double f32_at(const void *x, int64_t i) { return (double)((const float *)x)[i]; }

/* bfloat16 is float32's high half: its bits shifted left by 16 are the float32 of the same value. */
static inline double bf16_at(const void *x, int64_t i) {
    uint32_t wide = (uint32_t)((const uint16_t *)x)[i] << 16;
    float value;
    memcpy(&value, &wide, sizeof value);
    return (double)value;
}

/* Elements per block, and how far ahead of its block the loop asks for memory: the lanes' chains of additions keep
 * too few loads in flight for the hardware's prefetcher on some machines (a gradient partition read from memory
 * took 1.27 ns per bfloat16 element on a 2-core VM without this, 0.40 with it). */
#define BLOCK 32
#define AHEAD_BYTES 4096

/* Inlined into each entry point with its `value` and element size, so that the compiler vectorises the loop over
 * the lanes. */
static inline void sum_squares(const void *x, int64_t n, double *lanes, value_at value, int64_t size) {
    double sums[LANES];
    for (int j = 0; j < LANES; j++) sums[j] = lanes[j];
    int64_t i = 0;
    for (; i + BLOCK <= n; i += BLOCK) {
        for (int64_t line = 0; line < BLOCK * size; line += 64) {  /* each cache line of the block, ahead */
            __builtin_prefetch((const char *)x + i * size + line + AHEAD_BYTES, 0, 0);
        }
        for (int k = 0; k < BLOCK; k += LANES) {
            for (int j = 0; j < LANES; j++) {
                double v = value(x, i + k + j);
                sums[j] += v * v;
            }
        }
    }
    for (; i + LANES <= n; i += LANES) {
        for (int j = 0; j < LANES; j++) {
            double v = value(x, i + j);
            sums[j] += v * v;
        }
    }
    for (int j = 0; i + j < n; j++) {
        double v = value(x, i + j);
        sums[j] += v * v;
    }
    for (int j = 0; j < LANES; j++) lanes[j] = sums[j];
}

void smartinf_sum_squares_f32(const float *x, int64_t n, double *lanes) { sum_squares(x, n, lanes, f32_at, 4); }

void smartinf_sum_squares_bf16(const uint16_t *x, int64_t n, double *lanes) {
    sum_squares(x, n, lanes, bf16_at, 2);
}
