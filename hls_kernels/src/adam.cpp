/*
 * adam.cpp — Adam and AdamW update kernels for the SmartSSD FPGA (dense and top-k gradients).
 *
 * Description:
 *   One call updates n elements of a shard in place. The fp32 master weights and both moments live in
 *   device DRAM and never cross PCIe; the gradient comes in as T (bf16, fp16 or fp32) and the updated
 *   parameters leave as T. The arithmetic is torch.optim.Adam/AdamW's, rounding for rounding:
 *
 *     g  = g_raw * grad_scale;  if maximize: g = -g
 *     AdamW: p = p * (1 - lr*wd)          Adam (L2): g = g + wd*p
 *     m  = lerp(m, g, 1 - beta1)
 *     v  = v * beta2 + (1 - beta2) * g * g
 *     p  = p + (-lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
 *     param_out = T(p)                    (round to nearest even)
 *
 *   The host passes the derived scalars (include/smartinf_abi.h: adam_scalars()).
 *
 *          master    exp_avg  exp_avg_sq      grad (dense T)    grad_idx + grad_val (top-k)
 *            |          |         |                |                   |
 *        load_vec   load_vec  load_vec         load_grad           load_pairs
 *            |          |         |                |                   |
 *            |          |         |                |              decompress: zero a tile,
 *            |          |         |                |              scatter pairs, stream out
 *            v          v         v                v                   v
 *          +------------------------------------------------------------------+
 *          |          adam_compute: 16 fp32 lanes per cycle, masked tail      |
 *          +------------------------------------------------------------------+
 *            |          |         |                |
 *        store_vec  store_vec store_vec       store_param
 *            v          v         v                v
 *          master    exp_avg  exp_avg_sq      param_out (T)
 *
 *   All processes run concurrently (DATAFLOW) and talk through hls::stream FIFOs.
 *
 * Entry points (T = bf16 | fp16 | fp32):
 *   smartinf_adam_<T>      (master, exp_avg, exp_avg_sq, grad, param_out, n, <scalars>, flags)
 *   smartinf_adam_topk_<T> (master, exp_avg, exp_avg_sq, grad_idx, grad_val, param_out, n, k, <scalars>, flags)
 *   <scalars> = grad_scale, decay_mul, l2_wd, lerp_w, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size
 */
#include "smartinf_kernel.h"

namespace smartinf {

inline void adam_element(float& p, float& m, float& v, float g, const AdamScalars& s) {
    g = g * s.grad_scale;
    if (s.flags & kFlagMaximize) g = -g;
    if (s.flags & kFlagDecoupledDecay) p = p * s.decay_mul;
    if (s.flags & kFlagWeightDecay) g = fmadd(p, s.l2_wd, g);  // grad.add_(p, alpha=wd)
    m = lerp(m, g, s.lerp_w);                                   // exp_avg.lerp_(grad, 1 - beta1)
    v = v * s.beta2;                                            // exp_avg_sq.mul_(beta2)
    v = fmadd(s.one_minus_beta2 * g, g, v);                     //   .addcmul_(grad, grad, 1 - beta2)
    const float denom = hls::sqrt(v) / s.bc2_sqrt + s.eps;
    p = p + (s.neg_step_size * m) / denom;  // p.addcdiv_(m, denom, value=-step_size)
}

template <typename T>
void adam_compute(hls::stream<fvec>& p_in, hls::stream<fvec>& m_in, hls::stream<fvec>& v_in,
                  hls::stream<fvec>& g_in, hls::stream<fvec>& p_out, hls::stream<fvec>& m_out,
                  hls::stream<fvec>& v_out, hls::stream<lvec<T>>& param_out, uint32_t nvec, uint32_t n,
                  AdamScalars s) {
adam_compute_loop:
    for (uint32_t i = 0; i < nvec; ++i) {
        SMARTINF_PRAGMA(HLS PIPELINE II = 1)
        SMARTINF_PRAGMA(HLS LOOP_TRIPCOUNT min = kTripMinVecs avg = kTripAvgVecs max = kTripMaxVecs)
        const fvec p = p_in.read(), m = m_in.read(), v = v_in.read(), g = g_in.read();
        fvec p2, m2, v2;
        lvec<T> q;
    adam_lanes:
        for (int l = 0; l < kLanes; ++l) {
            SMARTINF_PRAGMA(HLS UNROLL)
            float pe = p[l], me = m[l], ve = v[l];
            adam_element(pe, me, ve, g[l], s);
            const bool live = i * kLanes + l < n;  // masked tail: state past n is left as it was
            p2[l] = live ? pe : p[l];
            m2[l] = live ? me : m[l];
            v2[l] = live ? ve : v[l];
            q[l] = live ? Elem<T>::narrow(pe) : typename Elem<T>::lane(0);
        }
        p_out.write(p2);
        m_out.write(m2);
        v_out.write(v2);
        param_out.write(q);
    }
}

// S: how both moments are stored (State<S>); exp_avg_sq is never negative (stored by its root in int8).
template <typename T, typename S>
void adam_dense(fvec* master, typename State<S>::port* exp_avg, beat_f32* exp_avg_scales,
                typename State<S>::port* exp_avg_sq, beat_f32* exp_avg_sq_scales, const typename Elem<T>::beat* grad,
                typename Elem<T>::beat* param_out, uint32_t nvec, uint32_t n, AdamScalars s) {
    SMARTINF_PRAGMA(HLS DATAFLOW)
    hls::stream<fvec> p_s("p_in"), m_s("m_in"), v_s("v_in"), g_s("grad"), p2_s("p_out"), m2_s("m_out"),
        v2_s("v_out");
    hls::stream<lvec<T>> q_s("param_out");
    SMARTINF_PRAGMA(HLS STREAM variable = p_s depth = kStreamDepth)
    SMARTINF_PRAGMA(HLS STREAM variable = m_s depth = kStreamDepth)
    SMARTINF_PRAGMA(HLS STREAM variable = v_s depth = kStreamDepth)
    SMARTINF_PRAGMA(HLS STREAM variable = g_s depth = kStreamDepth)
    load_vec(master, p_s, nvec, true);
    State<S>::load(exp_avg, exp_avg_scales, m_s, nvec, true, false);
    State<S>::load(exp_avg_sq, exp_avg_sq_scales, v_s, nvec, true, true);
    load_grad<T>(grad, g_s, nvec, n);
    adam_compute<T>(p_s, m_s, v_s, g_s, p2_s, m2_s, v2_s, q_s, nvec, n, s);
    store_vec(p2_s, master, nvec, true);
    State<S>::store(m2_s, exp_avg, exp_avg_scales, nvec, true, false);
    State<S>::store(v2_s, exp_avg_sq, exp_avg_sq_scales, nvec, true, true);
    store_param<T>(q_s, param_out, nvec);
}

template <typename T, typename S>
void adam_topk(fvec* master, typename State<S>::port* exp_avg, beat_f32* exp_avg_scales,
               typename State<S>::port* exp_avg_sq, beat_f32* exp_avg_sq_scales, const beat_u32* grad_idx,
               const typename Elem<T>::beat* grad_val, typename Elem<T>::beat* param_out, uint32_t nvec, uint32_t n,
               uint32_t k, AdamScalars s) {
    SMARTINF_PRAGMA(HLS DATAFLOW)
    hls::stream<fvec> p_s("p_in"), m_s("m_in"), v_s("v_in"), g_s("grad"), p2_s("p_out"), m2_s("m_out"),
        v2_s("v_out");
    hls::stream<Pair> pair_s("pairs");
    hls::stream<lvec<T>> q_s("param_out");
    SMARTINF_PRAGMA(HLS STREAM variable = p_s depth = kStreamDepth)
    SMARTINF_PRAGMA(HLS STREAM variable = m_s depth = kStreamDepth)
    SMARTINF_PRAGMA(HLS STREAM variable = v_s depth = kStreamDepth)
    SMARTINF_PRAGMA(HLS STREAM variable = pair_s depth = kStreamDepth)
    load_vec(master, p_s, nvec, true);
    State<S>::load(exp_avg, exp_avg_scales, m_s, nvec, true, false);
    State<S>::load(exp_avg_sq, exp_avg_sq_scales, v_s, nvec, true, true);
    load_pairs<T>(grad_idx, grad_val, pair_s, k);
    decompress(pair_s, g_s, nvec, n, k);
    adam_compute<T>(p_s, m_s, v_s, g_s, p2_s, m2_s, v2_s, q_s, nvec, n, s);
    store_vec(p2_s, master, nvec, true);
    State<S>::store(m2_s, exp_avg, exp_avg_scales, nvec, true, false);
    State<S>::store(v2_s, exp_avg_sq, exp_avg_sq_scales, nvec, true, true);
    store_param<T>(q_s, param_out, nvec);
}

}  // namespace smartinf

#define SMARTINF_ADAM_SCALAR_ARGS                                                                       \
    float grad_scale, float decay_mul, float l2_wd, float lerp_w, float beta2, float one_minus_beta2, \
        float bc2_sqrt, float eps, float neg_step_size, uint32_t flags
#define SMARTINF_ADAM_SCALAR_PRAGMAS                                                                 \
    SMARTINF_LITE(n) SMARTINF_LITE(grad_scale) SMARTINF_LITE(decay_mul) SMARTINF_LITE(l2_wd)         \
    SMARTINF_LITE(lerp_w) SMARTINF_LITE(beta2) SMARTINF_LITE(one_minus_beta2) SMARTINF_LITE(bc2_sqrt) \
    SMARTINF_LITE(eps) SMARTINF_LITE(neg_step_size) SMARTINF_LITE(flags) SMARTINF_LITE(return)
#define SMARTINF_ADAM_STATE_PRAGMAS(F)                                                               \
    SMARTINF_AXI(master, gmem_master) SMARTINF_STATE_AXI_##F(exp_avg, gmem_exp_avg)                 \
    SMARTINF_STATE_AXI_##F(exp_avg_sq, gmem_exp_avg_sq) SMARTINF_AXI(param_out, gmem_param)
#define SMARTINF_ADAM_SCALARS                                                                         \
    const smartinf::AdamScalars s = {grad_scale, decay_mul, l2_wd,   lerp_w,        beta2,            \
                                     one_minus_beta2, bc2_sqrt, eps, neg_step_size, flags}

// One dense and one top-k entry point: gradient and parameters in T, moments stored in format F.
#define SMARTINF_ADAM_ENTRIES(NAME, T, F)                                                               \
    extern "C" void smartinf_adam_##NAME(smartinf::fvec* master, SMARTINF_STATE_PORT_##F(exp_avg),       \
                                         SMARTINF_STATE_PORT_##F(exp_avg_sq),                            \
                                         const smartinf::Elem<T>::beat* grad,                            \
                                         smartinf::Elem<T>::beat* param_out, uint32_t n,                 \
                                         SMARTINF_ADAM_SCALAR_ARGS) {                                    \
        SMARTINF_ADAM_STATE_PRAGMAS(F)                                                                  \
        SMARTINF_AXI(grad, gmem_grad)                                                                   \
        SMARTINF_ADAM_SCALAR_PRAGMAS                                                                    \
        SMARTINF_ADAM_SCALARS;                                                                          \
        using S = SMARTINF_STATE_TYPE_##F;                                                              \
        smartinf::adam_dense<T, S>(master, exp_avg, SMARTINF_STATE_SCALES_##F(exp_avg), exp_avg_sq,     \
                                   SMARTINF_STATE_SCALES_##F(exp_avg_sq), grad, param_out,              \
                                   smartinf::State<S>::vecs(n), n, s);                                  \
    }                                                                                                   \
    extern "C" void smartinf_adam_topk_##NAME(                                                          \
        smartinf::fvec* master, SMARTINF_STATE_PORT_##F(exp_avg), SMARTINF_STATE_PORT_##F(exp_avg_sq),  \
        const smartinf::beat_u32* grad_idx, const smartinf::Elem<T>::beat* grad_val,                    \
        smartinf::Elem<T>::beat* param_out, uint32_t n, uint32_t k, SMARTINF_ADAM_SCALAR_ARGS) {        \
        SMARTINF_ADAM_STATE_PRAGMAS(F)                                                                  \
        SMARTINF_AXI(grad_idx, gmem_grad_idx)                                                           \
        SMARTINF_AXI(grad_val, gmem_grad)                                                               \
        SMARTINF_LITE(k)                                                                                \
        SMARTINF_ADAM_SCALAR_PRAGMAS                                                                    \
        SMARTINF_ADAM_SCALARS;                                                                          \
        using S = SMARTINF_STATE_TYPE_##F;                                                              \
        smartinf::adam_topk<T, S>(master, exp_avg, SMARTINF_STATE_SCALES_##F(exp_avg), exp_avg_sq,      \
                                  SMARTINF_STATE_SCALES_##F(exp_avg_sq), grad_idx, grad_val, param_out, \
                                  smartinf::State<S>::vecs(n), n, k, s);                                \
    }

SMARTINF_FOR_EACH_KERNEL_TYPE(SMARTINF_ADAM_ENTRIES)
