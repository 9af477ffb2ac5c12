// Minimal stand-in for Vitis HLS <hls_vector.h>, for building the kernels with a plain C++ compiler.
//
// Only the subset the kernels use: a fixed-size array of N lanes with element access and fill
// construction. Put this folder on the include path only when the Xilinx headers are absent
// (the `csim` target of ../Makefile does); v++/Vitis HLS use their own header.
#ifndef SMARTINF_SHIM_HLS_VECTOR_H
#define SMARTINF_SHIM_HLS_VECTOR_H

#ifdef __SYNTHESIS__
#error "hls_kernels/shim/hls_vector.h is a g++ stand-in; synthesis must use the Vitis HLS headers"
#endif

#include <cstddef>

namespace hls {

template <typename T, std::size_t N>
struct vector {
    static_assert(N > 0 && (N & (N - 1)) == 0, "hls::vector needs a power-of-two lane count");

    T data[N];

    vector() = default;
    vector(const T& fill) {  // NOLINT(google-explicit-constructor): matches Vitis' implicit splat
        for (std::size_t i = 0; i < N; ++i) data[i] = fill;
    }

    T& operator[](std::size_t i) { return data[i]; }
    const T& operator[](std::size_t i) const { return data[i]; }
    static constexpr std::size_t size() { return N; }
};

}  // namespace hls

#endif  // SMARTINF_SHIM_HLS_VECTOR_H
