// smartinf_kernels.h — C prototypes of the kernel entry points, for hosts that call the g++ C-simulation
// library (build/libsmartinf_kernels.so) and for the testbench. Port types are spelled as plain element
// pointers here; the kernels see the same memory as 512-bit beats (see README.md, "Buffers").
//
// <T> is bf16 or fp16 (uint16_t bit patterns) or fp32 (float); names ending in _state_bf16 or _state_int8 keep the
// states (not the master) in that format. Arguments, in order:
//   state ports      fp32 master, then each state in its format (an int8 state: codes, then block scales); the
//                    kernel touches whole 16-element vectors (fp32), 32-element beats (bf16) or 256-element blocks
//                    (int8) of every port of one element per lane (README.md, "Buffers")
//   grad             dense gradient in T, padded to a whole 64-byte beat (32 bf16/fp16 or 16 fp32)
//   grad_idx/val, k  top-k gradient: k uint32 indices, strictly ascending, and their k values in T
//   param_out        updated parameters in T, padded like grad; lanes past n are written as 0
//   n                number of elements to update
//   scalars, flags   derived fp32 hyper-parameters, see smartinf_abi.h
#ifndef SMARTINF_KERNELS_H
#define SMARTINF_KERNELS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SMARTINF_ADAM_SCALARS_DECL                                                                 \
    float grad_scale, float decay_mul, float l2_wd, float lerp_w, float beta2, float one_minus_beta2, \
        float bc2_sqrt, float eps, float neg_step_size, uint32_t flags
#define SMARTINF_SGD_SCALARS_DECL \
    float grad_scale, float l2_wd, float momentum, float one_minus_dampening, float neg_lr, uint32_t flags
#define SMARTINF_ADAGRAD_SCALARS_DECL float grad_scale, float l2_wd, float eps, float neg_clr, uint32_t flags
#define SMARTINF_EFADAM_SCALARS_DECL                                                                \
    float grad_scale, float decay_mul, float l2_wd, float beta2, float one_minus_beta2, float bc2_sqrt, \
        float eps, float neg_lr, uint32_t flags

// State ports per format F (see smartinf_kernel.h, "state formats"): fp32 values, bf16 bit patterns, or int8's
// E4M3 codes and, in a second port, the fp32 scales of its 256-element blocks.
#define SMARTINF_STATE_DECL_fp32(name) float* name
#define SMARTINF_STATE_DECL_bf16(name) uint16_t* name
#define SMARTINF_STATE_DECL_int8(name) uint8_t *name, float *name##_scales

#define SMARTINF_DECLARE(NAME, T, F)                                                                    \
    void smartinf_adam_##NAME(float* master, SMARTINF_STATE_DECL_##F(exp_avg),                           \
                              SMARTINF_STATE_DECL_##F(exp_avg_sq), const T* grad, T* param_out, uint32_t n, \
                              SMARTINF_ADAM_SCALARS_DECL);                                              \
    void smartinf_adam_topk_##NAME(float* master, SMARTINF_STATE_DECL_##F(exp_avg),                      \
                                   SMARTINF_STATE_DECL_##F(exp_avg_sq), const uint32_t* grad_idx,         \
                                   const T* grad_val, T* param_out, uint32_t n, uint32_t k,               \
                                   SMARTINF_ADAM_SCALARS_DECL);                                         \
    void smartinf_sgd_##NAME(float* master, SMARTINF_STATE_DECL_##F(momentum_buf), const T* grad,         \
                             T* param_out, uint32_t n, SMARTINF_SGD_SCALARS_DECL);                      \
    void smartinf_sgd_topk_##NAME(float* master, SMARTINF_STATE_DECL_##F(momentum_buf),                  \
                                  const uint32_t* grad_idx, const T* grad_val, T* param_out, uint32_t n,  \
                                  uint32_t k, SMARTINF_SGD_SCALARS_DECL);                               \
    void smartinf_adagrad_##NAME(float* master, SMARTINF_STATE_DECL_##F(state_sum), const T* grad,        \
                                 T* param_out, uint32_t n, SMARTINF_ADAGRAD_SCALARS_DECL);              \
    void smartinf_adagrad_topk_##NAME(float* master, SMARTINF_STATE_DECL_##F(state_sum),                 \
                                      const uint32_t* grad_idx, const T* grad_val, T* param_out,          \
                                      uint32_t n, uint32_t k, SMARTINF_ADAGRAD_SCALARS_DECL);           \
    void smartinf_efadam_##NAME(float* master, SMARTINF_STATE_DECL_##F(exp_avg_sq), const T* grad,        \
                                T* param_out, uint32_t n, SMARTINF_EFADAM_SCALARS_DECL);                \
    void smartinf_efadam_topk_##NAME(float* master, SMARTINF_STATE_DECL_##F(exp_avg_sq),                 \
                                     const uint32_t* grad_idx, const T* grad_val, T* param_out,           \
                                     uint32_t n, uint32_t k, SMARTINF_EFADAM_SCALARS_DECL);

SMARTINF_DECLARE(bf16, uint16_t, fp32)
SMARTINF_DECLARE(fp16, uint16_t, fp32)
SMARTINF_DECLARE(fp32, float, fp32)
SMARTINF_DECLARE(bf16_state_bf16, uint16_t, bf16)
SMARTINF_DECLARE(fp16_state_bf16, uint16_t, bf16)
SMARTINF_DECLARE(fp32_state_bf16, float, bf16)
SMARTINF_DECLARE(bf16_state_int8, uint16_t, int8)
SMARTINF_DECLARE(fp16_state_int8, uint16_t, int8)
SMARTINF_DECLARE(fp32_state_int8, float, int8)

#undef SMARTINF_DECLARE

#ifdef __cplusplus
}
#endif

#endif  // SMARTINF_KERNELS_H
