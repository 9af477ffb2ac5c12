// smartinf_abi.h — what a host needs to call the kernels: flag bits and the scalar arguments.
//
// The kernels take *derived* fp32 scalars: the host computes them in double precision from the
// optimizer hyper-parameters and rounds each to float once, exactly where torch.optim rounds a
// Python float to the tensor's dtype. That keeps the kernels free of pow/sqrt on scalars and makes
// their fp32 arithmetic the same as torch's (see README.md, "Exactness").
//
// The helpers below are plain C++ (no HLS headers) for C++ hosts and the testbench; a Python host
// does the same arithmetic (tests/hls/test_kernels_csim.py has the mirror).
#ifndef SMARTINF_ABI_H
#define SMARTINF_ABI_H

#include <cmath>
#include <cstdint>

namespace smartinf {

// ---- `flags` bits ------------------------------------------------------------------------------
constexpr uint32_t kFlagMaximize = 1u << 0;        // g = -g (torch `maximize=True`)
constexpr uint32_t kFlagWeightDecay = 1u << 1;     // L2 decay into the gradient: g = g + wd * p
constexpr uint32_t kFlagDecoupledDecay = 1u << 2;  // AdamW decay: p = p * (1 - lr * wd)
constexpr uint32_t kFlagMomentum = 1u << 3;        // SGD keeps a momentum buffer (momentum != 0)
constexpr uint32_t kFlagFirstStep = 1u << 4;       // SGD step == 1: the buffer becomes a copy of g
constexpr uint32_t kFlagNesterov = 1u << 5;        // SGD Nesterov momentum

// ---- vector geometry shared with the host ------------------------------------------------------
constexpr uint32_t kBeatBytes = 64;  // every AXI port moves 512-bit beats
// Buffers must be allocated with their element count rounded up to a whole beat:
// 16 elements for fp32/uint32 buffers, 32 elements for bf16/fp16 buffers.
constexpr uint32_t padded_elems(uint32_t n, uint32_t elem_bytes) {
    return (n + kBeatBytes / elem_bytes - 1) / (kBeatBytes / elem_bytes) * (kBeatBytes / elem_bytes);
}

// ---- derived scalars ---------------------------------------------------------------------------
struct AdamScalars {
    float grad_scale;       // (float)grad_scale
    float decay_mul;        // (float)(1 - lr*wd) for AdamW, else 1
    float l2_wd;            // (float)wd for Adam (L2), else 0
    float lerp_w;           // (float)(1 - beta1): the lerp weight of exp_avg
    float beta2;            // (float)beta2
    float one_minus_beta2;  // (float)(1 - beta2)
    float bc2_sqrt;         // (float)sqrt(1 - beta2^step)
    float eps;              // (float)eps
    float neg_step_size;    // (float)(-lr / (1 - beta1^step))
    uint32_t flags;         // kFlagMaximize | kFlagWeightDecay | kFlagDecoupledDecay
};

inline AdamScalars adam_scalars(uint32_t step, double lr, double beta1, double beta2, double eps,
                                double weight_decay, bool decoupled, bool maximize, double grad_scale) {
    AdamScalars s;
    const bool decay = weight_decay != 0.0;
    s.grad_scale = static_cast<float>(grad_scale);
    s.decay_mul = (decay && decoupled) ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
    s.l2_wd = (decay && !decoupled) ? static_cast<float>(weight_decay) : 0.0f;
    s.lerp_w = static_cast<float>(1.0 - beta1);
    s.beta2 = static_cast<float>(beta2);
    s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
    s.bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, static_cast<double>(step))));
    s.eps = static_cast<float>(eps);
    s.neg_step_size = static_cast<float>(-lr / (1.0 - std::pow(beta1, static_cast<double>(step))));
    s.flags = (maximize ? kFlagMaximize : 0u) | ((decay && !decoupled) ? kFlagWeightDecay : 0u) |
              ((decay && decoupled) ? kFlagDecoupledDecay : 0u);
    return s;
}

struct EfAdamScalars {
    float grad_scale;       // (float)grad_scale
    float decay_mul;        // (float)(1 - lr*wd) for AdamW, else 1
    float l2_wd;            // (float)wd for Adam (L2), else 0
    float beta2;            // (float)beta2
    float one_minus_beta2;  // (float)(1 - beta2)
    float bc2_sqrt;         // (float)sqrt(1 - beta2^step)
    float eps;              // (float)eps
    float neg_lr;           // (float)(-lr): no first moment, so no first bias correction
    uint32_t flags;         // kFlagMaximize | kFlagWeightDecay | kFlagDecoupledDecay
};

inline EfAdamScalars efadam_scalars(uint32_t step, double lr, double beta2, double eps, double weight_decay,
                                    bool decoupled, bool maximize, double grad_scale) {
    const AdamScalars a = adam_scalars(step, lr, 0.0, beta2, eps, weight_decay, decoupled, maximize, grad_scale);
    EfAdamScalars s;
    s.grad_scale = a.grad_scale;
    s.decay_mul = a.decay_mul;
    s.l2_wd = a.l2_wd;
    s.beta2 = a.beta2;
    s.one_minus_beta2 = a.one_minus_beta2;
    s.bc2_sqrt = a.bc2_sqrt;
    s.eps = a.eps;
    s.neg_lr = a.neg_step_size;  // -lr / (1 - 0^step) = -lr
    s.flags = a.flags;
    return s;
}

struct SgdScalars {
    float grad_scale;           // (float)grad_scale
    float l2_wd;                // (float)wd
    float momentum;             // (float)momentum
    float one_minus_dampening;  // (float)(1 - dampening)
    float neg_lr;               // (float)(-lr)
    uint32_t flags;             // kFlagMaximize | kFlagWeightDecay | kFlagMomentum | kFlagFirstStep | kFlagNesterov
};

inline SgdScalars sgd_scalars(uint32_t step, double lr, double momentum, double dampening, bool nesterov,
                              double weight_decay, bool maximize, double grad_scale) {
    SgdScalars s;
    const bool use_momentum = momentum != 0.0;
    s.grad_scale = static_cast<float>(grad_scale);
    s.l2_wd = static_cast<float>(weight_decay);
    s.momentum = static_cast<float>(momentum);
    s.one_minus_dampening = static_cast<float>(1.0 - dampening);
    s.neg_lr = static_cast<float>(-lr);
    s.flags = (maximize ? kFlagMaximize : 0u) | (weight_decay != 0.0 ? kFlagWeightDecay : 0u) |
              (use_momentum ? kFlagMomentum : 0u) | ((use_momentum && step == 1) ? kFlagFirstStep : 0u) |
              ((use_momentum && nesterov) ? kFlagNesterov : 0u);
    return s;
}

struct AdagradScalars {
    float grad_scale;  // (float)grad_scale
    float l2_wd;       // (float)wd
    float eps;         // (float)eps
    float neg_clr;     // (float)(-lr / (1 + (step - 1) * lr_decay))
    uint32_t flags;    // kFlagMaximize | kFlagWeightDecay
};

inline AdagradScalars adagrad_scalars(uint32_t step, double lr, double lr_decay, double eps, double weight_decay,
                                      bool maximize, double grad_scale) {
    AdagradScalars s;
    s.grad_scale = static_cast<float>(grad_scale);
    s.l2_wd = static_cast<float>(weight_decay);
    s.eps = static_cast<float>(eps);
    s.neg_clr = static_cast<float>(-(lr / (1.0 + (static_cast<double>(step) - 1.0) * lr_decay)));
    s.flags = (maximize ? kFlagMaximize : 0u) | (weight_decay != 0.0 ? kFlagWeightDecay : 0u);
    return s;
}

}  // namespace smartinf

#endif  // SMARTINF_ABI_H
