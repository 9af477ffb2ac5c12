// smartinf_kernel.h — building blocks shared by the update kernels in ../src/.
//
// Geometry: every AXI port moves 512-bit beats. Compute runs on `fvec` = 16 fp32 lanes per cycle.
// A beat of fp32 state or indices holds 16 elements; a beat of bf16/fp16 gradient or parameter
// holds 32 (two compute vectors). Lengths that are not a multiple of 16 end in a masked tail:
// lanes at or past `n` are read (the buffers are padded to whole beats) but never changed.
//
// Processes (each a pipelined loop, joined by hls::stream inside a DATAFLOW region):
//   load_vec      fp32 state beats            -> stream<fvec>
//   load_grad     dense T gradient beats      -> stream<fvec>   (exact widening to fp32, tail = 0)
//   load_pairs    top-k (uint32 idx, T value) -> stream<Pair>
//   decompress    stream<Pair>                -> stream<fvec>   (scatter into a zeroed on-chip tile)
//   store_vec     stream<fvec>                -> fp32 state beats
//   store_param   stream<T lanes>             -> T parameter beats (tail lanes written as 0)
#ifndef SMARTINF_KERNEL_H
#define SMARTINF_KERNEL_H

#include <cstdint>

#include <hls_math.h>
#include <hls_stream.h>
#include <hls_vector.h>

#include "smartinf_abi.h"

// Vitis HLS accepts pragmas produced by macros through _Pragma; g++ ignores them.
#define SMARTINF_PRAGMA(x) _Pragma(#x)

// torch's CPU kernels on AVX2/AVX-512 (and NEON) fuse `add(alpha=)`, `lerp` and `addcmul` into one
// rounding (vec::fmadd, or the compiler contracting `self + s*a*b`). Build with
// -DSMARTINF_TORCH_FMA=0 to match torch's non-vectorised "default" CPU capability instead.
#ifndef SMARTINF_TORCH_FMA
#define SMARTINF_TORCH_FMA 1
#endif

namespace smartinf {

// ---- sizes and trip-count hints ----------------------------------------------------------------
constexpr int kLanes = 16;                      // fp32 lanes per compute vector (one 512-bit beat)
constexpr int kTileVecs = 1024;                 // top-k decompression tile: 1024 vectors ...
constexpr int kTileElems = kTileVecs * kLanes;  // ... = 16384 elements (64 KiB of fp32 on chip)
constexpr int kStreamDepth = 64;                // FIFO depth between processes (one full burst)
constexpr int kBurstBeats = 64;                 // 64 x 512 bit = 4 KiB, the AXI burst limit
// LOOP_TRIPCOUNT hints, in vectors per call (a 4 Mi-element shard is typical, 64 Mi the most).
constexpr int kTripMinVecs = 1;
constexpr int kTripAvgVecs = (4 << 20) / kLanes;
constexpr int kTripMaxVecs = (64 << 20) / kLanes;
constexpr int kTripAvgPairs = (4 << 20) / 100;  // top-k at 1 %
constexpr int kTripMaxPairs = 64 << 20;
constexpr int kTripMaxTiles = (64 << 20) / kTileElems;

using fvec = hls::vector<float, kLanes>;
using beat_f32 = hls::vector<float, 16>;
using beat_u32 = hls::vector<uint32_t, 16>;
using beat_u16 = hls::vector<uint16_t, 32>;

// Low-precision element types: storage only (the kernels compute in fp32).
struct bf16_t {
    uint16_t bits;
};
struct fp16_t {
    uint16_t bits;
};

// ---- exact float <-> bits <-> bf16/fp16 --------------------------------------------------------
inline uint32_t float_bits(float f) {
    union {
        float f;
        uint32_t u;
    } c;
    c.f = f;
    return c.u;
}

inline float bits_float(uint32_t u) {
    union {
        float f;
        uint32_t u;
    } c;
    c.u = u;
    return c.f;
}

inline float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// Round to nearest even, as c10::BFloat16(float): NaN -> 0x7FC0, overflow rounds to +-inf.
inline uint16_t float_to_bf16(float f) {
    const uint32_t u = float_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    const uint32_t rounding_bias = 0x7FFFu + ((u >> 16) & 1u);
    return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

inline float fp16_to_float(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1Fu;
    const uint32_t mant = h & 0x3FFu;
    if (exp == 0) {
        // zero or subnormal: mant * 2^-24 is exact in fp32
        const float mag = static_cast<float>(mant) * 5.9604644775390625e-8f;
        return sign ? -mag : mag;
    }
    if (exp == 0x1F) return bits_float(sign | 0x7F800000u | (mant << 13));  // inf / NaN
    return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

// IEEE-754 binary16 round to nearest even, as torch's `.half()`: subnormals kept, overflow -> +-inf,
// NaN stays a (quiet) NaN.
inline uint16_t float_to_fp16(float f) {
    const uint32_t u = float_bits(f);
    const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
    const uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu));  // NaN
    if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 rounds to inf
    if (a >= 0x38800000u) {                                            // normal half (>= 2^-14)
        uint32_t h = ((a >> 23) - 112u) << 10 | ((a >> 13) & 0x3FFu);
        const uint32_t rest = a & 0x1FFFu;
        if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry may reach the exponent
        return static_cast<uint16_t>(sign | h);
    }
    if (a <= 0x33000000u) return sign;  // <= 2^-25: rounds to zero (2^-25 itself ties to even 0)
    // subnormal half: value = m * 2^(e-150) = (m >> shift) units of 2^-24, shift = 126 - e in [14, 24]
    const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126u - (a >> 23);
    uint32_t h = m >> shift;
    const uint32_t rest = m & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rest > half || (rest == half && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
}

// ---- element traits: how a T travels on a 512-bit port -----------------------------------------
template <typename T>
struct Elem;

template <>
struct Elem<float> {
    using lane = float;
    using beat = beat_f32;
    static constexpr int kPerBeat = 16;
    static float widen(float x) { return x; }
    static float narrow(float x) { return x; }
};

template <>
struct Elem<bf16_t> {
    using lane = uint16_t;
    using beat = beat_u16;
    static constexpr int kPerBeat = 32;
    static float widen(uint16_t x) { return bf16_to_float(x); }
    static uint16_t narrow(float x) { return float_to_bf16(x); }
};

template <>
struct Elem<fp16_t> {
    using lane = uint16_t;
    using beat = beat_u16;
    static constexpr int kPerBeat = 32;
    static float widen(uint16_t x) { return fp16_to_float(x); }
    static uint16_t narrow(float x) { return float_to_fp16(x); }
};

template <typename T>
using lvec = hls::vector<typename Elem<T>::lane, kLanes>;  // one compute vector of T lanes

// ---- fp32 arithmetic in torch's rounding order -------------------------------------------------
inline float fmadd(float a, float b, float c) {  // a*b + c, as torch's vec::fmadd
#if SMARTINF_TORCH_FMA
    return hls::fma(a, b, c);
#else
    return a * b + c;  // build with -ffp-contract=off so the compiler keeps two roundings
#endif
}

// torch.lerp(start, end, weight) for a scalar weight (at::native lerp_vec).
inline float lerp(float start, float end, float weight) {
    const float diff = end - start;
    if (weight < 0.5f && weight > -0.5f) return fmadd(weight, diff, start);
    return fmadd(weight - 1.0f, diff, end);
}

// ---- processes ---------------------------------------------------------------------------------
inline void load_vec(const fvec* src, hls::stream<fvec>& out, uint32_t nvec, bool enable) {
load_vec_loop:
    for (uint32_t i = 0; i < nvec; ++i) {
        SMARTINF_PRAGMA(HLS PIPELINE II = 1)
        SMARTINF_PRAGMA(HLS LOOP_TRIPCOUNT min = kTripMinVecs avg = kTripAvgVecs max = kTripMaxVecs)
        out.write(enable ? src[i] : fvec(0.0f));
    }
}

inline void store_vec(hls::stream<fvec>& in, fvec* dst, uint32_t nvec, bool enable) {
store_vec_loop:
    for (uint32_t i = 0; i < nvec; ++i) {
        SMARTINF_PRAGMA(HLS PIPELINE II = 1)
        SMARTINF_PRAGMA(HLS LOOP_TRIPCOUNT min = kTripMinVecs avg = kTripAvgVecs max = kTripMaxVecs)
        const fvec v = in.read();
        if (enable) dst[i] = v;
    }
}

// Dense gradient: widen T to fp32 exactly; lanes at or past n become 0.
template <typename T>
void load_grad(const typename Elem<T>::beat* grad, hls::stream<fvec>& out, uint32_t nvec, uint32_t n) {
    constexpr int kVecsPerBeat = Elem<T>::kPerBeat / kLanes;
    typename Elem<T>::beat b;
load_grad_loop:
    for (uint32_t i = 0; i < nvec; ++i) {
        SMARTINF_PRAGMA(HLS PIPELINE II = 1)
        SMARTINF_PRAGMA(HLS LOOP_TRIPCOUNT min = kTripMinVecs avg = kTripAvgVecs max = kTripMaxVecs)
        const uint32_t part = i % kVecsPerBeat;
        if (part == 0) b = grad[i / kVecsPerBeat];
        fvec g;
    load_grad_lanes:
        for (int l = 0; l < kLanes; ++l) {
            SMARTINF_PRAGMA(HLS UNROLL)
            const uint32_t e = i * kLanes + l;
            g[l] = e < n ? Elem<T>::widen(b[part * kLanes + l]) : 0.0f;
        }
        out.write(g);
    }
}

// Parameter output: pack T lanes into beats; the unused half of a last bf16/fp16 beat is 0.
template <typename T>
void store_param(hls::stream<lvec<T>>& in, typename Elem<T>::beat* param, uint32_t nvec) {
    constexpr int kVecsPerBeat = Elem<T>::kPerBeat / kLanes;
    typename Elem<T>::beat b;
store_param_loop:
    for (uint32_t i = 0; i < nvec; ++i) {
        SMARTINF_PRAGMA(HLS PIPELINE II = 1)
        SMARTINF_PRAGMA(HLS LOOP_TRIPCOUNT min = kTripMinVecs avg = kTripAvgVecs max = kTripMaxVecs)
        const uint32_t part = i % kVecsPerBeat;
        const lvec<T> v = in.read();
    store_param_lanes:
        for (int l = 0; l < Elem<T>::kPerBeat; ++l) {
            SMARTINF_PRAGMA(HLS UNROLL)
            const uint32_t lane_part = static_cast<uint32_t>(l) / kLanes;
            if (lane_part == part) b[l] = v[l % kLanes];
            else if (part == 0) b[l] = 0;  // later parts of this beat may not come (odd tail)
        }
        if (part == kVecsPerBeat - 1 || i == nvec - 1) param[i / kVecsPerBeat] = b;
    }
}

// One top-k entry: absolute element index and its value widened to fp32.
struct Pair {
    uint32_t idx;
    float val;
};

template <typename T>
void load_pairs(const beat_u32* idx, const typename Elem<T>::beat* val, hls::stream<Pair>& out, uint32_t k) {
    constexpr int kPerBeat = Elem<T>::kPerBeat;
    beat_u32 ib;
    typename Elem<T>::beat vb;
load_pairs_loop:
    for (uint32_t j = 0; j < k; ++j) {
        SMARTINF_PRAGMA(HLS PIPELINE II = 1)
        SMARTINF_PRAGMA(HLS LOOP_TRIPCOUNT min = 0 avg = kTripAvgPairs max = kTripMaxPairs)
        if (j % 16 == 0) ib = idx[j / 16];
        if (j % kPerBeat == 0) vb = val[j / kPerBeat];
        Pair p;
        p.idx = ib[j % 16];
        p.val = Elem<T>::widen(vb[j % kPerBeat]);
        out.write(p);
    }
}

// Top-k decompression, one on-chip tile of kTileElems at a time: scatter the pairs that fall in the
// tile into a zeroed buffer, then stream the tile out (clearing it for the next one).
// Precondition: indices strictly ascending. Pairs with idx >= n are dropped; a pair whose index lies
// before the current tile (an unsorted input) is dropped too; a repeated index keeps the last value.
inline void decompress(hls::stream<Pair>& pairs, hls::stream<fvec>& out, uint32_t nvec, uint32_t n, uint32_t k) {
    // 16 single-lane banks: the scatter writes one element of one bank per cycle, the emit reads (and
    // clears) the same address of all 16 banks per cycle.
    float tile[kLanes][kTileVecs];
    SMARTINF_PRAGMA(HLS ARRAY_PARTITION variable = tile dim = 1 type = complete)
    SMARTINF_PRAGMA(HLS BIND_STORAGE variable = tile type = ram_t2p impl = bram)
    const uint32_t ntiles = (nvec + kTileVecs - 1) / kTileVecs;
    uint32_t taken = 0;  // pairs read from the stream
    bool pending = false;
    Pair next = {0, 0.0f};

clear_tile:
    for (int v = 0; v < kTileVecs; ++v) {
        SMARTINF_PRAGMA(HLS PIPELINE II = 1)
    clear_lanes:
        for (int l = 0; l < kLanes; ++l) {
            SMARTINF_PRAGMA(HLS UNROLL)
            tile[l][v] = 0.0f;
        }
    }
tiles:
    for (uint32_t t = 0; t < ntiles; ++t) {
        SMARTINF_PRAGMA(HLS LOOP_TRIPCOUNT min = 1 max = kTripMaxTiles)
        const uint32_t base = t * kTileElems;
        const uint32_t tile_vecs = (nvec - t * kTileVecs < kTileVecs) ? nvec - t * kTileVecs : kTileVecs;
        const uint32_t end = base + tile_vecs * kLanes;
    scatter:
        while (pending || taken < k) {
            SMARTINF_PRAGMA(HLS PIPELINE II = 1)
            SMARTINF_PRAGMA(HLS LOOP_TRIPCOUNT min = 0 avg = kTripAvgPairs max = kTripMaxPairs)
            if (!pending) {
                next = pairs.read();
                ++taken;
                pending = true;
            }
            if (next.idx >= end) break;  // belongs to a later tile (or lies past the last one)
            if (next.idx >= base && next.idx < n) {
                const uint32_t off = next.idx - base;
                tile[off % kLanes][off / kLanes] = next.val;
            }
            pending = false;
        }
    emit:
        for (uint32_t v = 0; v < tile_vecs; ++v) {
            SMARTINF_PRAGMA(HLS PIPELINE II = 1)
            SMARTINF_PRAGMA(HLS LOOP_TRIPCOUNT min = 1 max = kTileVecs)
            fvec g;
        emit_lanes:
            for (int l = 0; l < kLanes; ++l) {
                SMARTINF_PRAGMA(HLS UNROLL)
                g[l] = tile[l][v];
                tile[l][v] = 0.0f;
            }
            out.write(g);
        }
    }
drain:  // pairs past the last tile (idx >= n) must still leave the stream
    while (taken < k) {
        SMARTINF_PRAGMA(HLS PIPELINE II = 1)
        SMARTINF_PRAGMA(HLS LOOP_TRIPCOUNT min = 0 max = kTripMaxPairs)
        pairs.read();
        ++taken;
    }
}

// ---- state formats: how a state tensor (not the master, always fp32) is kept in DDR -------------
// The formats of lightning_smartinf/core/state_formats.py, byte for byte (see README.md, "State formats"):
//   StF32   4 bytes per element, as is;
//   StBf16  2 bytes per element, rounded to nearest even (float_to_bf16);
//   StInt8  blocks of kBlock elements: one 8-bit code per element (the element over its block's scale, round to
//           nearest even), then one fp32 scale per block (the block's largest magnitude over the code's largest
//           value, in a port of its own). A signed state's code is FP8 E4M3 (largest 448); a never-negative state
//           (`root`) is stored by its square root in the root code (root_code below, largest kRootMax).
// A process handles whole beats (bf16) or whole blocks (int8): State<S>::vecs(n) vectors. Lanes at or past n
// are loaded and stored back as they were (the compute process masks them); in int8 they count towards their
// block's scale, as in the reference, and a last beat of scales is completed with 0 (the scales of blocks
// holding padding only, which stays zero).
struct StF32 {};
struct StBf16 {};
struct StInt8 {};

constexpr int kBlock = 256;                        // elements per int8 scale
constexpr int kBlockVecs = kBlock / kLanes;        // 16 compute vectors per block
constexpr int kCodesPerBeat = 64;                  // E4M3 codes per 512-bit beat: 4 vectors
constexpr int kScalesPerBeat = 16;                 // fp32 scales per beat: 16 blocks
constexpr float kE4M3Max = 448.0f;                 // a block's largest magnitude maps here
using beat_u8 = hls::vector<uint8_t, kCodesPerBeat>;

// The E4M3 (float8_e4m3fn) code of x as torch's conversion gives it: round to nearest even; 464 and above (and
// infinity) saturate to 448's code 0x7E; NaN is 0x7F (with x's sign). A block's values over its scale reach 464
// only where the scale is subnormal (the block's largest magnitude under 448 * 2^-126).
inline uint8_t e4m3_code(float x) {
    const uint32_t u = float_bits(x);
    const uint32_t sign = (u >> 24) & 0x80u;
    const uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return static_cast<uint8_t>(sign | 0x7Fu);  // NaN
    if (a >= 0x43E80000u) return static_cast<uint8_t>(sign | 0x7Eu);  // 464 and above, infinity: 448
    if (a < 0x3C800000u) {  // below 2^-6, the smallest normal: multiples of 2^-9, code 8 is 2^-6
        // |x| * 2^9 is exact (a power of two); adding 2^23 rounds it to an integer (nearest even) in the low bits.
        const float shifted = bits_float(a) * 512.0f + 8388608.0f;
        return static_cast<uint8_t>(sign | (float_bits(shifted) - 0x4B000000u));
    }
    // Normal: keep 3 of the 23 mantissa bits, the 20 dropped rounded to nearest even; a carry runs into the
    // exponent, which the codes continue. Biases: fp32 127, E4M3 7.
    const uint32_t code = ((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
    return static_cast<uint8_t>(sign | code);
}

// The root code (state_formats.ROOT_CODE): an unsigned 8-bit float of kRootExponentBits exponent bits (bias
// kRootBias) and kRootMantissaBits mantissa bits, with subnormals and no infinity or NaN. kRootMax: code 255's value;
// kRootSubnormalSteps: the inverse of the smallest code, 2^(1 - bias - mantissa bits).
constexpr int kRootExponentBits = 4;
constexpr int kRootMantissaBits = 8 - kRootExponentBits;
constexpr int kRootBias = (1 << (kRootExponentBits - 1)) - 1;
constexpr float kRootMax = 496.0f;
constexpr float kRootSubnormalSteps = 1024.0f;

// The root code of x (not negative, or NaN): round to nearest even; from half a step above kRootMax, infinity and
// NaN saturate to code 255; a non-zero value below the smallest code takes that code, never zero.
inline uint8_t root_code(float x) {
    const uint32_t a = float_bits(x) & 0x7FFFFFFFu;
    if (a >= 0x7F800000u) return 0xFFu;  // infinity, NaN
    if (a < (static_cast<uint32_t>(128 - kRootBias) << 23)) {  // below the smallest normal, 2^(1 - bias)
        // |x| * kRootSubnormalSteps is exact (a power of two); adding 2^23 rounds it to an integer (nearest even).
        const uint32_t c = float_bits(bits_float(a) * kRootSubnormalSteps + 8388608.0f) - 0x4B000000u;
        return static_cast<uint8_t>(c == 0 && a != 0 ? 1u : c);
    }
    // Normal: keep kRootMantissaBits of the 23 mantissa bits, the dropped ones rounded to nearest even; a carry runs
    // into the exponent, which the codes continue. fp32's bias is 127.
    constexpr uint32_t dropped = 23 - kRootMantissaBits;
    const uint32_t code = ((a + ((1u << (dropped - 1)) - 1u) + ((a >> dropped) & 1u)) >> dropped) -
                          (static_cast<uint32_t>(127 - kRootBias) << kRootMantissaBits);
    return static_cast<uint8_t>(code > 0xFFu ? 0xFFu : code);
}

// The value of root code c (exact in fp32).
inline float root_value(uint8_t c) {
    const uint32_t exp = static_cast<uint32_t>(c) >> kRootMantissaBits;
    const uint32_t mant = c & ((1u << kRootMantissaBits) - 1u);
    if (exp == 0) return static_cast<float>(mant) / kRootSubnormalSteps;  // exact: a power of two
    return bits_float(((exp + 127u - kRootBias) << 23) | (mant << (23 - kRootMantissaBits)));
}

// The value of E4M3 code c (exact in fp32); 0x7F and 0xFF are NaN.
inline float e4m3_value(uint8_t c) {
    const uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
    const uint32_t exp = (c >> 3) & 0xFu;
    const uint32_t mant = c & 0x7u;
    if (exp == 0xFu && mant == 0x7u) return bits_float(sign | 0x7FC00000u);
    if (exp == 0) {
        const float mag = static_cast<float>(mant) * 0.001953125f;  // mant * 2^-9, exact
        return sign ? -mag : mag;
    }
    return bits_float(sign | ((exp + 120u) << 23) | (mant << 20));
}

template <typename S>
struct State;

template <>
struct State<StF32> {
    using port = fvec;
    static uint32_t vecs(uint32_t n) { return (n + kLanes - 1) / kLanes; }
    static void load(const port* src, const beat_f32*, hls::stream<fvec>& out, uint32_t nvec, bool enable, bool) {
        load_vec(src, out, nvec, enable);
    }
    static void store(hls::stream<fvec>& in, port* dst, beat_f32*, uint32_t nvec, bool enable, bool) {
        store_vec(in, dst, nvec, enable);
    }
};

template <>
struct State<StBf16> {
    using port = beat_u16;
    static constexpr int kVecsPerBeat = 2;
    static uint32_t vecs(uint32_t n) { return (n + 31) / 32 * kVecsPerBeat; }
    static void load(const port* src, const beat_f32*, hls::stream<fvec>& out, uint32_t nvec, bool enable, bool) {
        port b(0);
    load_bf16_loop:
        for (uint32_t i = 0; i < nvec; ++i) {
            SMARTINF_PRAGMA(HLS PIPELINE II = 1)
            SMARTINF_PRAGMA(HLS LOOP_TRIPCOUNT min = kTripMinVecs avg = kTripAvgVecs max = kTripMaxVecs)
            const uint32_t part = i % kVecsPerBeat;
            if (part == 0 && enable) b = src[i / kVecsPerBeat];
            fvec v;
        load_bf16_lanes:
            for (int l = 0; l < kLanes; ++l) {
                SMARTINF_PRAGMA(HLS UNROLL)
                v[l] = enable ? bf16_to_float(b[part * kLanes + l]) : 0.0f;
            }
            out.write(v);
        }
    }
    static void store(hls::stream<fvec>& in, port* dst, beat_f32*, uint32_t nvec, bool enable, bool) {
        port b;
    store_bf16_loop:
        for (uint32_t i = 0; i < nvec; ++i) {
            SMARTINF_PRAGMA(HLS PIPELINE II = 1)
            SMARTINF_PRAGMA(HLS LOOP_TRIPCOUNT min = kTripMinVecs avg = kTripAvgVecs max = kTripMaxVecs)
            const uint32_t part = i % kVecsPerBeat;
            const fvec v = in.read();
        store_bf16_lanes:
            for (int l = 0; l < kLanes; ++l) {
                SMARTINF_PRAGMA(HLS UNROLL)
                b[part * kLanes + l] = float_to_bf16(v[l]);
            }
            if (part == kVecsPerBeat - 1 && enable) dst[i / kVecsPerBeat] = b;  // nvec is whole beats
        }
    }
};

template <>
struct State<StInt8> {
    using port = beat_u8;
    static constexpr int kVecsPerBeat = kCodesPerBeat / kLanes;  // 4
    static uint32_t vecs(uint32_t n) { return (n + kBlock - 1) / kBlock * kBlockVecs; }
    // codes * scale, squared for a `root` state (each one fp32 rounding, as the reference).
    static void load(const port* codes, const beat_f32* scales, hls::stream<fvec>& out, uint32_t nvec, bool enable,
                     bool root) {
        port cb(0);
        beat_f32 sb(0.0f);
    load_int8_loop:
        for (uint32_t i = 0; i < nvec; ++i) {
            SMARTINF_PRAGMA(HLS PIPELINE II = 1)
            SMARTINF_PRAGMA(HLS LOOP_TRIPCOUNT min = kTripMinVecs avg = kTripAvgVecs max = kTripMaxVecs)
            const uint32_t part = i % kVecsPerBeat;
            const uint32_t block = i / kBlockVecs;
            if (part == 0 && enable) cb = codes[i / kVecsPerBeat];
            if (i % (kBlockVecs * kScalesPerBeat) == 0 && enable) sb = scales[block / kScalesPerBeat];
            const float scale = sb[block % kScalesPerBeat];
            fvec v;
        load_int8_lanes:
            for (int l = 0; l < kLanes; ++l) {
                SMARTINF_PRAGMA(HLS UNROLL)
                const uint8_t c = cb[part * kLanes + l];
                const float x = (root ? root_value(c) : e4m3_value(c)) * scale;
                v[l] = !enable ? 0.0f : root ? x * x : x;
            }
            out.write(v);
        }
    }
    // One block at a time: its largest magnitude sets the scale before any of its codes can be written.
    static void store(hls::stream<fvec>& in, port* codes, beat_f32* scales, uint32_t nvec, bool enable, bool root) {
        const uint32_t nblocks = nvec / kBlockVecs;
        beat_f32 sb(0.0f);
    store_int8_blocks:
        for (uint32_t b = 0; b < nblocks; ++b) {
            SMARTINF_PRAGMA(HLS LOOP_TRIPCOUNT min = 1 max = kTripMaxVecs / kBlockVecs)
            float block[kBlockVecs][kLanes];
            SMARTINF_PRAGMA(HLS ARRAY_PARTITION variable = block dim = 2 type = complete)
            uint32_t top = 0;  // the largest magnitude's bits: non-negative floats order as their bits (NaN last)
        store_int8_gather:
            for (int v = 0; v < kBlockVecs; ++v) {
                SMARTINF_PRAGMA(HLS PIPELINE II = 1)
                const fvec x = in.read();
                for (int l = 0; l < kLanes; ++l) {
                    SMARTINF_PRAGMA(HLS UNROLL)
                    const float y = root ? hls::sqrt(x[l]) : x[l];
                    block[v][l] = y;
                    const uint32_t mag = float_bits(y) & 0x7FFFFFFFu;
                    top = mag > top ? mag : top;
                }
            }
            const float scale = bits_float(top) / (root ? kRootMax : kE4M3Max);
            const float divisor = scale == 0.0f ? 1.0f : scale;  // an all-zero block: scale 0, codes 0
        store_int8_codes:
            for (int q = 0; q < kBlockVecs / kVecsPerBeat; ++q) {
                SMARTINF_PRAGMA(HLS PIPELINE II = 1)
                port cb;
                for (int l = 0; l < kCodesPerBeat; ++l) {
                    SMARTINF_PRAGMA(HLS UNROLL)
                    const float y = block[q * kVecsPerBeat + l / kLanes][l % kLanes] / divisor;
                    cb[l] = root ? root_code(y) : e4m3_code(y);
                }
                if (enable) codes[b * (kBlockVecs / kVecsPerBeat) + q] = cb;
            }
            if (b % kScalesPerBeat == 0) sb = beat_f32(0.0f);
            sb[b % kScalesPerBeat] = scale;
            if ((b % kScalesPerBeat == kScalesPerBeat - 1 || b == nblocks - 1) && enable) scales[b / kScalesPerBeat] = sb;
        }
    }
};

}  // namespace smartinf

// ---- state ports of the extern "C" entry points, per format suffix -----------------------------
// SMARTINF_STATE_PORT_<F>(name): the port(s) of one state; an int8 state has a second, `name_scales`.
// SMARTINF_STATE_SCALES_<F>(name): that second port, or a null pointer.
// SMARTINF_STATE_AXI_<F>(name, bundle): its interface pragmas.
#define SMARTINF_STATE_PORT_fp32(name) smartinf::fvec* name
#define SMARTINF_STATE_PORT_bf16(name) smartinf::beat_u16* name
#define SMARTINF_STATE_PORT_int8(name) smartinf::beat_u8 *name, smartinf::beat_f32 *name##_scales
#define SMARTINF_STATE_SCALES_fp32(name) nullptr
#define SMARTINF_STATE_SCALES_bf16(name) nullptr
#define SMARTINF_STATE_SCALES_int8(name) name##_scales
#define SMARTINF_STATE_AXI_fp32(name, bundle) SMARTINF_AXI(name, bundle)
#define SMARTINF_STATE_AXI_bf16(name, bundle) SMARTINF_AXI(name, bundle)
#define SMARTINF_STATE_AXI_int8(name, bundle) SMARTINF_AXI(name, bundle) SMARTINF_AXI(name##_scales, bundle##_scales)
// The state type of each suffix.
#define SMARTINF_STATE_TYPE_fp32 smartinf::StF32
#define SMARTINF_STATE_TYPE_bf16 smartinf::StBf16
#define SMARTINF_STATE_TYPE_int8 smartinf::StInt8

// Every entry point's name suffix, gradient/parameter type and state format: X(NAME, T, F) for each of the nine
// kernel types. With fp32 state the suffix is the type alone (smartinf_adam_bf16); else <T>_state_<F>
// (smartinf_adam_bf16_state_int8).
#define SMARTINF_FOR_EACH_KERNEL_TYPE(X)                                                           \
    X(bf16, smartinf::bf16_t, fp32)                                                                \
    X(fp16, smartinf::fp16_t, fp32)                                                                \
    X(fp32, float, fp32)                                                                           \
    X(bf16_state_bf16, smartinf::bf16_t, bf16)                                                     \
    X(fp16_state_bf16, smartinf::fp16_t, bf16)                                                     \
    X(fp32_state_bf16, float, bf16)                                                                \
    X(bf16_state_int8, smartinf::bf16_t, int8)                                                     \
    X(fp16_state_int8, smartinf::fp16_t, int8)                                                     \
    X(fp32_state_int8, float, int8)

// ---- interface pragmas for the extern "C" entry points -----------------------------------------
// State (master and moments) and gradient/parameter traffic use separate AXI bundles so their
// bursts overlap; every scalar and the return go through the AXI-Lite control bundle.
#define SMARTINF_AXI(P, B)                                                                             \
    SMARTINF_PRAGMA(HLS INTERFACE m_axi port = P offset = slave bundle = B max_read_burst_length = 64 \
                        max_write_burst_length = 64 num_read_outstanding = 16 num_write_outstanding = 16)
#define SMARTINF_LITE(P) SMARTINF_PRAGMA(HLS INTERFACE s_axilite port = P bundle = control)

#endif  // SMARTINF_KERNEL_H
