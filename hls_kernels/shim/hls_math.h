// Minimal stand-in for Vitis HLS <hls_math.h>, for building the kernels with a plain C++ compiler.
//
// The kernels need only single-precision square root and fused multiply-add, both correctly
// rounded IEEE-754 operations in the C library (and in the Vitis floating-point cores).
#ifndef SMARTINF_SHIM_HLS_MATH_H
#define SMARTINF_SHIM_HLS_MATH_H

#ifdef __SYNTHESIS__
#error "hls_kernels/shim/hls_math.h is a g++ stand-in; synthesis must use the Vitis HLS headers"
#endif

#include <cmath>

namespace hls {

inline float sqrt(float x) { return std::sqrt(x); }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }

}  // namespace hls

#endif  // SMARTINF_SHIM_HLS_MATH_H
