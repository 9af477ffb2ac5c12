/*
 * sgd.cpp — SGD (momentum, dampening, Nesterov, L2 weight decay) update kernels for the SmartSSD FPGA,
 * dense and top-k gradients.
 *
 * Description:
 *   One call updates n elements of a shard in place: fp32 master weights and the fp32 momentum buffer
 *   stay in device DRAM, the gradient comes in as T (bf16, fp16 or fp32), the parameters leave as T.
 *   The arithmetic is torch.optim.SGD's, rounding for rounding:
 *
 *     g = g_raw * grad_scale;  if maximize: g = -g;  if wd: g = g + wd*p
 *     with momentum:  step 1: buf = g   else: buf = buf*momentum + (1 - dampening)*g
 *                     update = nesterov ? g + momentum*buf : buf
 *     without:        update = g                  (momentum_buf is then neither read nor written)
 *     p = p - lr*update;   param_out = T(p)
 *
 *   The host passes the derived scalars (include/smartinf_abi.h: sgd_scalars()).
 *
 *          master   momentum_buf      grad (dense T)    grad_idx + grad_val (top-k)
 *            |           |                 |                    |
 *        load_vec    load_vec          load_grad            load_pairs
 *            |           |                 |                    |
 *            |           |                 |               decompress (tile scatter)
 *            v           v                 v                    v
 *          +------------------------------------------------------------+
 *          |        sgd_compute: 16 fp32 lanes per cycle, masked tail   |
 *          +------------------------------------------------------------+
 *            |           |                 |
 *        store_vec   store_vec        store_param
 *            v           v                 v
 *          master   momentum_buf      param_out (T)
 *
 * Entry points (T = bf16 | fp16 | fp32):
 *   smartinf_sgd_<T>      (master, momentum_buf, grad, param_out, n, <scalars>, flags)
 *   smartinf_sgd_topk_<T> (master, momentum_buf, grad_idx, grad_val, param_out, n, k, <scalars>, flags)
 *   <scalars> = grad_scale, l2_wd, momentum, one_minus_dampening, neg_lr
 */
#include "smartinf_kernel.h"

namespace smartinf {

inline void sgd_element(float& p, float& buf, float g, const SgdScalars& s) {
    g = g * s.grad_scale;
    if (s.flags & kFlagMaximize) g = -g;
    if (s.flags & kFlagWeightDecay) g = fmadd(p, s.l2_wd, g);  // grad.add_(p, alpha=wd)
    float update = g;
    if (s.flags & kFlagMomentum) {
        if (s.flags & kFlagFirstStep) buf = g;
        else buf = fmadd(g, s.one_minus_dampening, buf * s.momentum);  // buf.mul_(mu).add_(g, alpha=1-d)
        update = (s.flags & kFlagNesterov) ? fmadd(buf, s.momentum, g) : buf;  // g.add_(buf, alpha=mu)
    }
    p = fmadd(update, s.neg_lr, p);  // p.add_(update, alpha=-lr)
}

template <typename T>
void sgd_compute(hls::stream<fvec>& p_in, hls::stream<fvec>& b_in, hls::stream<fvec>& g_in,
                 hls::stream<fvec>& p_out, hls::stream<fvec>& b_out, hls::stream<lvec<T>>& param_out,
                 uint32_t nvec, uint32_t n, SgdScalars s) {
sgd_compute_loop:
    for (uint32_t i = 0; i < nvec; ++i) {
        SMARTINF_PRAGMA(HLS PIPELINE II = 1)
        SMARTINF_PRAGMA(HLS LOOP_TRIPCOUNT min = kTripMinVecs avg = kTripAvgVecs max = kTripMaxVecs)
        const fvec p = p_in.read(), b = b_in.read(), g = g_in.read();
        fvec p2, b2;
        lvec<T> q;
    sgd_lanes:
        for (int l = 0; l < kLanes; ++l) {
            SMARTINF_PRAGMA(HLS UNROLL)
            float pe = p[l], be = b[l];
            sgd_element(pe, be, g[l], s);
            const bool live = i * kLanes + l < n;  // masked tail: state past n is left as it was
            p2[l] = live ? pe : p[l];
            b2[l] = live ? be : b[l];
            q[l] = live ? Elem<T>::narrow(pe) : typename Elem<T>::lane(0);
        }
        p_out.write(p2);
        b_out.write(b2);
        param_out.write(q);
    }
}

template <typename T, typename S>
void sgd_dense(fvec* master, typename State<S>::port* momentum_buf, beat_f32* momentum_buf_scales, const typename Elem<T>::beat* grad,
               typename Elem<T>::beat* param_out, uint32_t nvec, uint32_t n, SgdScalars s) {
    SMARTINF_PRAGMA(HLS DATAFLOW)
    const bool use_buf = (s.flags & kFlagMomentum) != 0;
    hls::stream<fvec> p_s("p_in"), b_s("buf_in"), g_s("grad"), p2_s("p_out"), b2_s("buf_out");
    hls::stream<lvec<T>> q_s("param_out");
    SMARTINF_PRAGMA(HLS STREAM variable = p_s depth = kStreamDepth)
    SMARTINF_PRAGMA(HLS STREAM variable = b_s depth = kStreamDepth)
    SMARTINF_PRAGMA(HLS STREAM variable = g_s depth = kStreamDepth)
    load_vec(master, p_s, nvec, true);
    State<S>::load(momentum_buf, momentum_buf_scales, b_s, nvec, use_buf, false);
    load_grad<T>(grad, g_s, nvec, n);
    sgd_compute<T>(p_s, b_s, g_s, p2_s, b2_s, q_s, nvec, n, s);
    store_vec(p2_s, master, nvec, true);
    State<S>::store(b2_s, momentum_buf, momentum_buf_scales, nvec, use_buf, false);
    store_param<T>(q_s, param_out, nvec);
}

template <typename T, typename S>
void sgd_topk(fvec* master, typename State<S>::port* momentum_buf, beat_f32* momentum_buf_scales, const beat_u32* grad_idx, const typename Elem<T>::beat* grad_val,
              typename Elem<T>::beat* param_out, uint32_t nvec, uint32_t n, uint32_t k, SgdScalars s) {
    SMARTINF_PRAGMA(HLS DATAFLOW)
    const bool use_buf = (s.flags & kFlagMomentum) != 0;
    hls::stream<fvec> p_s("p_in"), b_s("buf_in"), g_s("grad"), p2_s("p_out"), b2_s("buf_out");
    hls::stream<Pair> pair_s("pairs");
    hls::stream<lvec<T>> q_s("param_out");
    SMARTINF_PRAGMA(HLS STREAM variable = p_s depth = kStreamDepth)
    SMARTINF_PRAGMA(HLS STREAM variable = b_s depth = kStreamDepth)
    SMARTINF_PRAGMA(HLS STREAM variable = pair_s depth = kStreamDepth)
    load_vec(master, p_s, nvec, true);
    State<S>::load(momentum_buf, momentum_buf_scales, b_s, nvec, use_buf, false);
    load_pairs<T>(grad_idx, grad_val, pair_s, k);
    decompress(pair_s, g_s, nvec, n, k);
    sgd_compute<T>(p_s, b_s, g_s, p2_s, b2_s, q_s, nvec, n, s);
    store_vec(p2_s, master, nvec, true);
    State<S>::store(b2_s, momentum_buf, momentum_buf_scales, nvec, use_buf, false);
    store_param<T>(q_s, param_out, nvec);
}

}  // namespace smartinf

#define SMARTINF_SGD_SCALAR_ARGS \
    float grad_scale, float l2_wd, float momentum, float one_minus_dampening, float neg_lr, uint32_t flags
#define SMARTINF_SGD_SCALAR_PRAGMAS                                                                   \
    SMARTINF_LITE(n) SMARTINF_LITE(grad_scale) SMARTINF_LITE(l2_wd) SMARTINF_LITE(momentum)           \
    SMARTINF_LITE(one_minus_dampening) SMARTINF_LITE(neg_lr) SMARTINF_LITE(flags) SMARTINF_LITE(return)
#define SMARTINF_SGD_STATE_PRAGMAS(F)                                                                  \
    SMARTINF_AXI(master, gmem_master) SMARTINF_STATE_AXI_##F(momentum_buf, gmem_momentum)                      \
    SMARTINF_AXI(param_out, gmem_param)
#define SMARTINF_SGD_SCALARS \
    const smartinf::SgdScalars s = {grad_scale, l2_wd, momentum, one_minus_dampening, neg_lr, flags}

// One dense and one top-k entry point: gradient and parameters in T, the state stored in format F.
#define SMARTINF_SGD_ENTRIES(NAME, T, F)                                                                 \
    extern "C" void smartinf_sgd_##NAME(smartinf::fvec* master, SMARTINF_STATE_PORT_##F(momentum_buf),          \
                                          const smartinf::Elem<T>::beat* grad,                          \
                                          smartinf::Elem<T>::beat* param_out, uint32_t n,               \
                                          SMARTINF_SGD_SCALAR_ARGS) {                                   \
        SMARTINF_SGD_STATE_PRAGMAS(F)                                                                    \
        SMARTINF_AXI(grad, gmem_grad)                                                                   \
        SMARTINF_SGD_SCALAR_PRAGMAS                                                                     \
        SMARTINF_SGD_SCALARS;                                                                           \
        smartinf::sgd_dense<T, SMARTINF_STATE_TYPE_##F>(master, momentum_buf, SMARTINF_STATE_SCALES_##F(momentum_buf), grad, param_out, smartinf::State<SMARTINF_STATE_TYPE_##F>::vecs(n), n, s);             \
    }                                                                                                   \
    extern "C" void smartinf_sgd_topk_##NAME(                                                         \
        smartinf::fvec* master, SMARTINF_STATE_PORT_##F(momentum_buf), const smartinf::beat_u32* grad_idx,       \
        const smartinf::Elem<T>::beat* grad_val, smartinf::Elem<T>::beat* param_out, uint32_t n,        \
        uint32_t k, SMARTINF_SGD_SCALAR_ARGS) {                                                         \
        SMARTINF_SGD_STATE_PRAGMAS(F)                                                                    \
        SMARTINF_AXI(grad_idx, gmem_grad_idx)                                                           \
        SMARTINF_AXI(grad_val, gmem_grad)                                                               \
        SMARTINF_LITE(k)                                                                                \
        SMARTINF_SGD_SCALAR_PRAGMAS                                                                     \
        SMARTINF_SGD_SCALARS;                                                                           \
        smartinf::sgd_topk<T, SMARTINF_STATE_TYPE_##F>(master, momentum_buf, SMARTINF_STATE_SCALES_##F(momentum_buf), grad_idx, grad_val, param_out, smartinf::State<SMARTINF_STATE_TYPE_##F>::vecs(n), n, k, s); \
    }

SMARTINF_FOR_EACH_KERNEL_TYPE(SMARTINF_SGD_ENTRIES)
