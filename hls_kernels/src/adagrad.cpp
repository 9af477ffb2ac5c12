/*
 * adagrad.cpp — Adagrad (learning-rate decay, L2 weight decay) update kernels for the SmartSSD FPGA,
 * dense and top-k gradients.
 *
 * Description:
 *   One call updates n elements of a shard in place: fp32 master weights and the fp32 squared-gradient
 *   sum stay in device DRAM, the gradient comes in as T (bf16, fp16 or fp32), the parameters leave as T.
 *   The arithmetic is torch.optim.Adagrad's, rounding for rounding:
 *
 *     g = g_raw * grad_scale;  if maximize: g = -g;  if wd: g = g + wd*p
 *     sum = sum + g*g
 *     p = p + (-clr) * g / (sqrt(sum) + eps),   clr = lr / (1 + (t - 1) * lr_decay)
 *     param_out = T(p)
 *
 *   The host passes the derived scalars (include/smartinf_abi.h: adagrad_scalars()).
 *
 *          master   state_sum        grad (dense T)    grad_idx + grad_val (top-k)
 *            |          |                 |                    |
 *        load_vec   load_vec          load_grad            load_pairs
 *            |          |                 |                    |
 *            |          |                 |               decompress (tile scatter)
 *            v          v                 v                    v
 *          +------------------------------------------------------------+
 *          |     adagrad_compute: 16 fp32 lanes per cycle, masked tail  |
 *          +------------------------------------------------------------+
 *            |          |                 |
 *        store_vec  store_vec        store_param
 *            v          v                 v
 *          master   state_sum        param_out (T)
 *
 * Entry points (T = bf16 | fp16 | fp32):
 *   smartinf_adagrad_<T>      (master, state_sum, grad, param_out, n, <scalars>, flags)
 *   smartinf_adagrad_topk_<T> (master, state_sum, grad_idx, grad_val, param_out, n, k, <scalars>, flags)
 *   <scalars> = grad_scale, l2_wd, eps, neg_clr
 */
#include "smartinf_kernel.h"

namespace smartinf {

inline void adagrad_element(float& p, float& sum, float g, const AdagradScalars& s) {
    g = g * s.grad_scale;
    if (s.flags & kFlagMaximize) g = -g;
    if (s.flags & kFlagWeightDecay) g = fmadd(p, s.l2_wd, g);  // grad.add_(p, alpha=wd)
    sum = fmadd(g, g, sum);                                     // sum.addcmul_(g, g, value=1)
    const float std_ = hls::sqrt(sum) + s.eps;
    p = p + (s.neg_clr * g) / std_;  // p.addcdiv_(g, std, value=-clr)
}

template <typename T>
void adagrad_compute(hls::stream<fvec>& p_in, hls::stream<fvec>& s_in, hls::stream<fvec>& g_in,
                     hls::stream<fvec>& p_out, hls::stream<fvec>& s_out, hls::stream<lvec<T>>& param_out,
                     uint32_t nvec, uint32_t n, AdagradScalars s) {
adagrad_compute_loop:
    for (uint32_t i = 0; i < nvec; ++i) {
        SMARTINF_PRAGMA(HLS PIPELINE II = 1)
        SMARTINF_PRAGMA(HLS LOOP_TRIPCOUNT min = kTripMinVecs avg = kTripAvgVecs max = kTripMaxVecs)
        const fvec p = p_in.read(), sum = s_in.read(), g = g_in.read();
        fvec p2, sum2;
        lvec<T> q;
    adagrad_lanes:
        for (int l = 0; l < kLanes; ++l) {
            SMARTINF_PRAGMA(HLS UNROLL)
            float pe = p[l], se = sum[l];
            adagrad_element(pe, se, g[l], s);
            const bool live = i * kLanes + l < n;  // masked tail: state past n is left as it was
            p2[l] = live ? pe : p[l];
            sum2[l] = live ? se : sum[l];
            q[l] = live ? Elem<T>::narrow(pe) : typename Elem<T>::lane(0);
        }
        p_out.write(p2);
        s_out.write(sum2);
        param_out.write(q);
    }
}

template <typename T, typename S>
void adagrad_dense(fvec* master, typename State<S>::port* state_sum, beat_f32* state_sum_scales, const typename Elem<T>::beat* grad,
                   typename Elem<T>::beat* param_out, uint32_t nvec, uint32_t n, AdagradScalars s) {
    SMARTINF_PRAGMA(HLS DATAFLOW)
    hls::stream<fvec> p_s("p_in"), s_s("sum_in"), g_s("grad"), p2_s("p_out"), s2_s("sum_out");
    hls::stream<lvec<T>> q_s("param_out");
    SMARTINF_PRAGMA(HLS STREAM variable = p_s depth = kStreamDepth)
    SMARTINF_PRAGMA(HLS STREAM variable = s_s depth = kStreamDepth)
    SMARTINF_PRAGMA(HLS STREAM variable = g_s depth = kStreamDepth)
    load_vec(master, p_s, nvec, true);
    State<S>::load(state_sum, state_sum_scales, s_s, nvec, true, true);
    load_grad<T>(grad, g_s, nvec, n);
    adagrad_compute<T>(p_s, s_s, g_s, p2_s, s2_s, q_s, nvec, n, s);
    store_vec(p2_s, master, nvec, true);
    State<S>::store(s2_s, state_sum, state_sum_scales, nvec, true, true);
    store_param<T>(q_s, param_out, nvec);
}

template <typename T, typename S>
void adagrad_topk(fvec* master, typename State<S>::port* state_sum, beat_f32* state_sum_scales, const beat_u32* grad_idx, const typename Elem<T>::beat* grad_val,
                  typename Elem<T>::beat* param_out, uint32_t nvec, uint32_t n, uint32_t k, AdagradScalars s) {
    SMARTINF_PRAGMA(HLS DATAFLOW)
    hls::stream<fvec> p_s("p_in"), s_s("sum_in"), g_s("grad"), p2_s("p_out"), s2_s("sum_out");
    hls::stream<Pair> pair_s("pairs");
    hls::stream<lvec<T>> q_s("param_out");
    SMARTINF_PRAGMA(HLS STREAM variable = p_s depth = kStreamDepth)
    SMARTINF_PRAGMA(HLS STREAM variable = s_s depth = kStreamDepth)
    SMARTINF_PRAGMA(HLS STREAM variable = pair_s depth = kStreamDepth)
    load_vec(master, p_s, nvec, true);
    State<S>::load(state_sum, state_sum_scales, s_s, nvec, true, true);
    load_pairs<T>(grad_idx, grad_val, pair_s, k);
    decompress(pair_s, g_s, nvec, n, k);
    adagrad_compute<T>(p_s, s_s, g_s, p2_s, s2_s, q_s, nvec, n, s);
    store_vec(p2_s, master, nvec, true);
    State<S>::store(s2_s, state_sum, state_sum_scales, nvec, true, true);
    store_param<T>(q_s, param_out, nvec);
}

}  // namespace smartinf

#define SMARTINF_ADAGRAD_SCALAR_ARGS float grad_scale, float l2_wd, float eps, float neg_clr, uint32_t flags
#define SMARTINF_ADAGRAD_SCALAR_PRAGMAS                                                                \
    SMARTINF_LITE(n) SMARTINF_LITE(grad_scale) SMARTINF_LITE(l2_wd) SMARTINF_LITE(eps)                \
    SMARTINF_LITE(neg_clr) SMARTINF_LITE(flags) SMARTINF_LITE(return)
#define SMARTINF_ADAGRAD_STATE_PRAGMAS(F)                                                               \
    SMARTINF_AXI(master, gmem_master) SMARTINF_STATE_AXI_##F(state_sum, gmem_sum) SMARTINF_AXI(param_out, gmem_param)
#define SMARTINF_ADAGRAD_SCALARS const smartinf::AdagradScalars s = {grad_scale, l2_wd, eps, neg_clr, flags}

// One dense and one top-k entry point: gradient and parameters in T, the state stored in format F.
#define SMARTINF_ADAGRAD_ENTRIES(NAME, T, F)                                                             \
    extern "C" void smartinf_adagrad_##NAME(smartinf::fvec* master, SMARTINF_STATE_PORT_##F(state_sum),         \
                                              const smartinf::Elem<T>::beat* grad,                      \
                                              smartinf::Elem<T>::beat* param_out, uint32_t n,           \
                                              SMARTINF_ADAGRAD_SCALAR_ARGS) {                           \
        SMARTINF_ADAGRAD_STATE_PRAGMAS(F)                                                                \
        SMARTINF_AXI(grad, gmem_grad)                                                                   \
        SMARTINF_ADAGRAD_SCALAR_PRAGMAS                                                                 \
        SMARTINF_ADAGRAD_SCALARS;                                                                       \
        smartinf::adagrad_dense<T, SMARTINF_STATE_TYPE_##F>(master, state_sum, SMARTINF_STATE_SCALES_##F(state_sum), grad, param_out, smartinf::State<SMARTINF_STATE_TYPE_##F>::vecs(n), n, s);            \
    }                                                                                                   \
    extern "C" void smartinf_adagrad_topk_##NAME(                                                     \
        smartinf::fvec* master, SMARTINF_STATE_PORT_##F(state_sum), const smartinf::beat_u32* grad_idx,          \
        const smartinf::Elem<T>::beat* grad_val, smartinf::Elem<T>::beat* param_out, uint32_t n,        \
        uint32_t k, SMARTINF_ADAGRAD_SCALAR_ARGS) {                                                     \
        SMARTINF_ADAGRAD_STATE_PRAGMAS(F)                                                                \
        SMARTINF_AXI(grad_idx, gmem_grad_idx)                                                           \
        SMARTINF_AXI(grad_val, gmem_grad)                                                               \
        SMARTINF_LITE(k)                                                                                \
        SMARTINF_ADAGRAD_SCALAR_PRAGMAS                                                                 \
        SMARTINF_ADAGRAD_SCALARS;                                                                       \
        smartinf::adagrad_topk<T, SMARTINF_STATE_TYPE_##F>(master, state_sum, SMARTINF_STATE_SCALES_##F(state_sum), grad_idx, grad_val, param_out, smartinf::State<SMARTINF_STATE_TYPE_##F>::vecs(n), n, k, s); \
    }

SMARTINF_FOR_EACH_KERNEL_TYPE(SMARTINF_ADAGRAD_ENTRIES)
