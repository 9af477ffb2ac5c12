// csim_tb.cpp — C-simulation testbench for the update kernels (built by `make csim`, run by `make check`).
//
// Every entry point (3 rules x dense/top-k x bf16/fp16/fp32) runs several steps on random data and on
// edge cases (zero, huge, tiny and subnormal values, lengths that are not multiples of the 16-lane
// vector or of the 16384-element decompression tile) and is compared bit for bit with a scalar
// reference written here from torch.optim's definitions, independently of the kernel code:
//   - rounding to bf16/fp16 is a nearest-value search over the format's codes (ties to even),
//   - decoding uses ldexp, decompression a plain scatter into a zeroed array.
// Buffer padding is checked too: state lanes past n keep their sentinel, parameter lanes past n are 0.
// Prints "TEST PASSED" and exits 0 when every comparison holds.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "smartinf_abi.h"
#include "smartinf_kernel.h"  // only for the conversion unit check (the kernels' own bf16/fp16 codecs)
#include "smartinf_kernels.h"

namespace {

enum class Rule { kAdam, kSgd, kAdagrad, kEfAdam };
enum class DType { kBf16, kFp16, kFp32 };
enum class Data { kRandom, kZero, kHuge, kTiny, kWide };

const char* name(Rule r) {
    const char* names[] = {"adam", "sgd", "adagrad", "efadam"};
    return names[static_cast<int>(r)];
}
const char* name(DType d) { return d == DType::kBf16 ? "bf16" : d == DType::kFp16 ? "fp16" : "fp32"; }
const char* name(Data d) {
    const char* names[] = {"random", "zero", "huge", "tiny", "wide"};
    return names[static_cast<int>(d)];
}

uint32_t bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}
float from_bits(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// ---- reference number formats --------------------------------------------------------------------
struct Format {
    int mant_bits;      // stored mantissa bits
    int bias;           // exponent bias
    uint32_t max_code;  // largest finite positive code; max_code + 1 is +inf
};
const Format kBf16 = {7, 127, 0x7F7F};
const Format kFp16 = {10, 15, 0x7BFF};

double decode(const Format& f, uint32_t code) {
    const bool neg = (code >> 15) & 1;
    const uint32_t e = (code >> f.mant_bits) & ((1u << (15 - f.mant_bits)) - 1);
    const uint32_t m = code & ((1u << f.mant_bits) - 1);
    double mag;
    if (e == 0) mag = std::ldexp(static_cast<double>(m), 1 - f.bias - f.mant_bits);
    else if (code - (code & 0x8000u) > f.max_code) mag = m ? NAN : INFINITY;
    else mag = std::ldexp(static_cast<double>((1u << f.mant_bits) + m), static_cast<int>(e) - f.bias - f.mant_bits);
    return neg ? -mag : mag;
}

// Nearest representable value, ties to the even code; past the largest finite value the next "value"
// is max + ulp, whose code is +inf (IEEE overflow under round to nearest even).
uint32_t encode(const Format& f, float x) {
    if (std::isnan(x)) return 0x7FFF;  // any NaN; compared by class only
    const uint32_t sign = std::signbit(x) ? 0x8000u : 0u;
    const double a = std::fabs(static_cast<double>(x));
    uint32_t lo = 0, hi = f.max_code;  // find the largest code with decode(code) <= a
    int e2 = 0;
    std::frexp(a, &e2);  // a in [2^(e2-1), 2^e2): start from the codes of that binade
    const int biased = e2 - 1 + f.bias;
    if (a > 0 && biased >= 1 && biased < (1 << (15 - f.mant_bits)) - 1) {
        lo = static_cast<uint32_t>(biased) << f.mant_bits;
        hi = std::min<uint32_t>(f.max_code, lo + (1u << f.mant_bits) - 1);
    } else if (a > 0 && biased < 1) {
        hi = (1u << f.mant_bits) - 1;  // below the normal range: a subnormal code (or 0)
    }
    if (a >= decode(f, f.max_code)) {
        lo = f.max_code;
    } else {
        while (lo < hi) {
            const uint32_t mid = (lo + hi + 1) / 2;
            if (decode(f, mid) <= a) lo = mid;
            else hi = mid - 1;
        }
    }
    const double vlo = decode(f, lo);
    const uint32_t up = lo + 1;
    const double top = decode(f, f.max_code);
    const double vup = up > f.max_code ? top + (top - decode(f, f.max_code - 1)) : decode(f, up);
    if (a == vlo) return sign | lo;
    const double dlo = a - vlo, dup = vup - a;
    if (dlo < dup) return sign | lo;
    if (dup < dlo) return sign | up;
    return sign | ((lo & 1u) ? up : lo);
}

struct TypeInfo {
    DType dt;
    int bytes;
    const Format* fmt;  // null for fp32
};
TypeInfo info(DType d) {
    if (d == DType::kBf16) return {d, 2, &kBf16};
    if (d == DType::kFp16) return {d, 2, &kFp16};
    return {d, 4, nullptr};
}

// ---- aligned, padded buffers ---------------------------------------------------------------------
struct Buf {
    std::vector<uint8_t> raw;
    uint8_t* p = nullptr;
    int elem = 4;
    size_t count = 0;
    Buf(size_t n, int elem_bytes) : raw(smartinf::padded_elems(static_cast<uint32_t>(n), elem_bytes) * elem_bytes + 128),
                                    elem(elem_bytes),
                                    count(smartinf::padded_elems(static_cast<uint32_t>(n), elem_bytes)) {
        const uintptr_t a = reinterpret_cast<uintptr_t>(raw.data());
        p = raw.data() + ((64 - a % 64) % 64);
    }
    uint32_t get(size_t i) const {
        if (elem == 2) {
            uint16_t v;
            std::memcpy(&v, p + 2 * i, 2);
            return v;
        }
        uint32_t v;
        std::memcpy(&v, p + 4 * i, 4);
        return v;
    }
    void set(size_t i, uint32_t v) {
        if (elem == 2) {
            const uint16_t h = static_cast<uint16_t>(v);
            std::memcpy(p + 2 * i, &h, 2);
        } else {
            std::memcpy(p + 4 * i, &v, 4);
        }
    }
    float getf(size_t i) const { return from_bits(get(i)); }
    void setf(size_t i, float f) { set(i, bits(f)); }
};

uint32_t to_t(const TypeInfo& t, float x) { return t.fmt ? encode(*t.fmt, x) : bits(x); }
float from_t(const TypeInfo& t, uint32_t code) {
    return t.fmt ? static_cast<float>(decode(*t.fmt, code)) : from_bits(code);
}

// ---- the scalar reference: torch.optim semantics, one element at a time ---------------------------
struct Hyper {
    double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, wd = 0.0, momentum = 0.0, dampening = 0.0,
           lr_decay = 0.0, grad_scale = 1.0;
    bool decoupled = false, nesterov = false, maximize = false;
    std::string label;
};

// torch's CPU vector kernels round a*b+c once (vec::fmadd) in add(alpha=), lerp and addcmul; its
// non-vectorised "default" path rounds twice (the kernels' -DSMARTINF_TORCH_FMA=0 build).
#ifndef SMARTINF_TORCH_FMA
#define SMARTINF_TORCH_FMA 1
#endif
float fused(float a, float b, float c) {
#if SMARTINF_TORCH_FMA
    return std::fma(a, b, c);
#else
    return a * b + c;  // built with -ffp-contract=off: two roundings
#endif
}

void ref_step(Rule rule, const Hyper& h, int step, float& p, float& s0, float& s1, float g) {
    g = g * static_cast<float>(h.grad_scale);
    if (h.maximize) g = -g;
    if (rule == Rule::kAdam) {
        if (h.wd != 0.0) {
            if (h.decoupled) p = p * static_cast<float>(1.0 - h.lr * h.wd);
            else g = fused(p, static_cast<float>(h.wd), g);
        }
        const float w = static_cast<float>(1.0 - h.beta1);
        s0 = std::fabs(w) < 0.5f ? fused(w, g - s0, s0) : fused(w - 1.0f, g - s0, g);
        s1 = s1 * static_cast<float>(h.beta2);
        s1 = fused(static_cast<float>(1.0 - h.beta2) * g, g, s1);
        const double bc1 = 1.0 - std::pow(h.beta1, step);
        const double bc2_sqrt = std::sqrt(1.0 - std::pow(h.beta2, step));
        const float denom = std::sqrt(s1) / static_cast<float>(bc2_sqrt) + static_cast<float>(h.eps);
        p = p + (static_cast<float>(-h.lr / bc1) * s0) / denom;
    } else if (rule == Rule::kEfAdam) {  // Adam with beta1 = 0 and no first moment; s0 is exp_avg_sq
        if (h.wd != 0.0) {
            if (h.decoupled) p = p * static_cast<float>(1.0 - h.lr * h.wd);
            else g = fused(p, static_cast<float>(h.wd), g);
        }
        s0 = s0 * static_cast<float>(h.beta2);
        s0 = fused(static_cast<float>(1.0 - h.beta2) * g, g, s0);
        const double bc2_sqrt = std::sqrt(1.0 - std::pow(h.beta2, step));
        const float denom = std::sqrt(s0) / static_cast<float>(bc2_sqrt) + static_cast<float>(h.eps);
        p = p + (static_cast<float>(-h.lr) * g) / denom;
    } else if (rule == Rule::kSgd) {
        if (h.wd != 0.0) g = fused(p, static_cast<float>(h.wd), g);
        float update = g;
        if (h.momentum != 0.0) {
            if (step == 1) s0 = g;
            else s0 = fused(g, static_cast<float>(1.0 - h.dampening), s0 * static_cast<float>(h.momentum));
            update = h.nesterov ? fused(s0, static_cast<float>(h.momentum), g) : s0;
        }
        p = fused(update, static_cast<float>(-h.lr), p);
    } else {
        if (h.wd != 0.0) g = fused(p, static_cast<float>(h.wd), g);
        const double clr = h.lr / (1.0 + (step - 1) * h.lr_decay);
        s0 = fused(g, g, s0);
        const float std_ = std::sqrt(s0) + static_cast<float>(h.eps);
        p = p + (static_cast<float>(-clr) * g) / std_;
    }
}

// ---- calling the kernels ------------------------------------------------------------------------
struct Call {
    Rule rule;
    DType dt;
    bool topk;
    uint32_t n, k;
    Buf *master, *s0, *s1, *grad, *idx, *val, *param;
};

#define SMARTINF_DISPATCH(SUFFIX, T)                                                                      \
    if (c.rule == Rule::kAdam) {                                                                          \
        const smartinf::AdamScalars s = smartinf::adam_scalars(step, h.lr, h.beta1, h.beta2, h.eps, h.wd, \
                                                               h.decoupled, h.maximize, h.grad_scale);    \
        if (c.topk)                                                                                       \
            smartinf_adam_topk_##SUFFIX(F(c.master), F(c.s0), F(c.s1), U(c.idx), (const T*)c.val->p,       \
                                        (T*)c.param->p, c.n, c.k, s.grad_scale, s.decay_mul, s.l2_wd,     \
                                        s.lerp_w, s.beta2, s.one_minus_beta2, s.bc2_sqrt, s.eps,          \
                                        s.neg_step_size, s.flags);                                        \
        else                                                                                              \
            smartinf_adam_##SUFFIX(F(c.master), F(c.s0), F(c.s1), (const T*)c.grad->p, (T*)c.param->p,     \
                                   c.n, s.grad_scale, s.decay_mul, s.l2_wd, s.lerp_w, s.beta2,            \
                                   s.one_minus_beta2, s.bc2_sqrt, s.eps, s.neg_step_size, s.flags);       \
    } else if (c.rule == Rule::kSgd) {                                                                    \
        const smartinf::SgdScalars s = smartinf::sgd_scalars(step, h.lr, h.momentum, h.dampening,         \
                                                             h.nesterov, h.wd, h.maximize, h.grad_scale); \
        float* buf = h.momentum != 0.0 ? F(c.s0) : nullptr; /* no buffer without momentum */             \
        if (c.topk)                                                                                       \
            smartinf_sgd_topk_##SUFFIX(F(c.master), buf, U(c.idx), (const T*)c.val->p, (T*)c.param->p,    \
                                       c.n, c.k, s.grad_scale, s.l2_wd, s.momentum,                      \
                                       s.one_minus_dampening, s.neg_lr, s.flags);                         \
        else                                                                                              \
            smartinf_sgd_##SUFFIX(F(c.master), buf, (const T*)c.grad->p, (T*)c.param->p, c.n,             \
                                  s.grad_scale, s.l2_wd, s.momentum, s.one_minus_dampening, s.neg_lr,     \
                                  s.flags);                                                               \
    } else if (c.rule == Rule::kEfAdam) {                                                                 \
        const smartinf::EfAdamScalars s = smartinf::efadam_scalars(step, h.lr, h.beta2, h.eps, h.wd,      \
                                                                   h.decoupled, h.maximize, h.grad_scale); \
        if (c.topk)                                                                                       \
            smartinf_efadam_topk_##SUFFIX(F(c.master), F(c.s0), U(c.idx), (const T*)c.val->p,              \
                                          (T*)c.param->p, c.n, c.k, s.grad_scale, s.decay_mul, s.l2_wd,   \
                                          s.beta2, s.one_minus_beta2, s.bc2_sqrt, s.eps, s.neg_lr,        \
                                          s.flags);                                                       \
        else                                                                                              \
            smartinf_efadam_##SUFFIX(F(c.master), F(c.s0), (const T*)c.grad->p, (T*)c.param->p, c.n,      \
                                     s.grad_scale, s.decay_mul, s.l2_wd, s.beta2, s.one_minus_beta2,      \
                                     s.bc2_sqrt, s.eps, s.neg_lr, s.flags);                               \
    } else {                                                                                              \
        const smartinf::AdagradScalars s = smartinf::adagrad_scalars(step, h.lr, h.lr_decay, h.eps, h.wd, \
                                                                     h.maximize, h.grad_scale);           \
        if (c.topk)                                                                                       \
            smartinf_adagrad_topk_##SUFFIX(F(c.master), F(c.s0), U(c.idx), (const T*)c.val->p,             \
                                           (T*)c.param->p, c.n, c.k, s.grad_scale, s.l2_wd, s.eps,        \
                                           s.neg_clr, s.flags);                                           \
        else                                                                                              \
            smartinf_adagrad_##SUFFIX(F(c.master), F(c.s0), (const T*)c.grad->p, (T*)c.param->p, c.n,     \
                                      s.grad_scale, s.l2_wd, s.eps, s.neg_clr, s.flags);                  \
    }

float* F(Buf* b) { return reinterpret_cast<float*>(b->p); }
const uint32_t* U(Buf* b) { return reinterpret_cast<const uint32_t*>(b->p); }

void run_kernel(const Call& c, const Hyper& h, uint32_t step) {
    if (c.dt == DType::kBf16) {
        SMARTINF_DISPATCH(bf16, uint16_t)
    } else if (c.dt == DType::kFp16) {
        SMARTINF_DISPATCH(fp16, uint16_t)
    } else {
        SMARTINF_DISPATCH(fp32, float)
    }
}

// ---- one case: several steps of one entry point on one data set ----------------------------------
int g_failures = 0;
long g_checks = 0;

bool same_float(float a, float b) { return bits(a) == bits(b) || (std::isnan(a) && std::isnan(b)); }

void fail(const std::string& what, const std::string& where, size_t i, double got, double want) {
    if (g_failures < 20)
        std::printf("MISMATCH %s: %s at %zu: kernel %.9g, reference %.9g\n", what.c_str(), where.c_str(), i, got,
                    want);
    ++g_failures;
}

float draw(std::mt19937& rng, Data kind, DType dt, bool for_grad) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> uni(0.0f, 1.0f);
    if (kind == Data::kRandom) return normal(rng) * (for_grad ? 0.1f : 1.0f);
    if (kind == Data::kZero) return for_grad ? 0.0f : normal(rng);
    const float sign = uni(rng) < 0.5f ? -1.0f : 1.0f;
    if (kind == Data::kHuge) return sign * (dt == DType::kFp16 && for_grad ? 6.0e4f : 1.0e30f) * (1.0f + uni(rng));
    if (kind == Data::kTiny) {
        if (dt == DType::kFp16 && for_grad) return sign * (uni(rng) < 0.5f ? 1.0e-6f : 3.0e-8f) * (1 + uni(rng));
        return sign * (uni(rng) < 0.5f ? 1.0e-30f : 1.0e-40f) * (1.0f + uni(rng));  // 1e-40: subnormal
    }
    return sign * std::pow(10.0f, -44.0f + 82.0f * uni(rng));  // kWide
}

void run_case(Rule rule, DType dt, bool topk, uint32_t n, int k_mode, Data kind, const Hyper& h, uint32_t seed) {
    const TypeInfo t = info(dt);
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> uni(0.0f, 1.0f);
    const float kSentinel = -12345.678f;
    Buf master(n, 4), s0(n, 4), s1(n, 4), grad(n, t.bytes), param(n, t.bytes);
    std::vector<float> rp(n), r0(n), r1(n);  // reference state
    for (size_t i = 0; i < master.count; ++i) {
        const bool live = i < n;
        master.setf(i, live ? draw(rng, kind == Data::kZero ? Data::kRandom : kind, dt, false) : kSentinel);
        s0.setf(i, live ? (rule == Rule::kAdagrad || rule == Rule::kEfAdam ? std::fabs(draw(rng, Data::kRandom, dt, false)) : 0.1f * draw(rng, Data::kRandom, dt, false)) : kSentinel);
        s1.setf(i, live ? 0.01f * std::fabs(draw(rng, Data::kRandom, dt, false)) : kSentinel);
        if (live) {
            rp[i] = master.getf(i);
            r0[i] = s0.getf(i);
            r1[i] = s1.getf(i);
        }
    }
    const bool sgd_no_buf = rule == Rule::kSgd && h.momentum == 0.0;
    char where_buf[200];
    for (uint32_t step = 1; step <= 3; ++step) {
        std::snprintf(where_buf, sizeof where_buf, "%s%s_%s n=%u k_mode=%d data=%s cfg=%s step=%u", name(rule),
                      topk ? "_topk" : "", name(dt), n, k_mode, name(kind), h.label.c_str(), step);
        const std::string where = where_buf;
        // Gradient in T: dense values, then (top-k) a sorted subset of positions.
        std::vector<float> g(n, 0.0f);  // the fp32 gradient the reference sees
        for (size_t i = 0; i < grad.count; ++i) {
            if (i < n) {
                grad.set(i, to_t(t, draw(rng, kind, dt, true)));
                g[i] = from_t(t, grad.get(i));
            } else {
                grad.set(i, t.bytes == 2 ? 0x7FFFu : 0x7FC00001u);  // NaN padding: must be ignored
            }
        }
        uint32_t k = 0;
        std::vector<uint32_t> picks;
        if (topk) {
            for (uint32_t i = 0; i < n; ++i) {
                const bool take = k_mode == 0 ? false : k_mode == 2 ? true : uni(rng) < 0.3f;
                if (take) picks.push_back(i);
            }
            std::vector<float> dense(n, 0.0f);
            for (uint32_t i : picks) dense[i] = g[i];
            g = dense;
            if (k_mode == 3) {  // indices past n are dropped
                picks.push_back(n);
                picks.push_back(n + 17);
            }
            k = static_cast<uint32_t>(picks.size());
        }
        Buf idx(k, 4), val(k, t.bytes);
        for (uint32_t j = 0; j < k; ++j) {
            idx.set(j, picks[j]);
            val.set(j, picks[j] < n ? grad.get(picks[j]) : to_t(t, 1.0f));
        }
        for (size_t i = 0; i < param.count; ++i) param.set(i, 0xABCDu);  // must all be overwritten

        Call c{rule, dt, topk, n, k, &master, &s0, &s1, &grad, &idx, &val, &param};
        run_kernel(c, h, step);
        for (uint32_t i = 0; i < n; ++i) ref_step(rule, h, static_cast<int>(step), rp[i], r0[i], r1[i], g[i]);

        for (size_t i = 0; i < master.count; ++i) {
            ++g_checks;
            const bool live = i < n;
            if (!same_float(master.getf(i), live ? rp[i] : kSentinel)) fail("master", where, i, master.getf(i), live ? rp[i] : kSentinel);
            if (!sgd_no_buf && !same_float(s0.getf(i), live ? r0[i] : kSentinel))
                fail("state0", where, i, s0.getf(i), live ? r0[i] : kSentinel);
            if (rule == Rule::kAdam && !same_float(s1.getf(i), live ? r1[i] : kSentinel))
                fail("state1", where, i, s1.getf(i), live ? r1[i] : kSentinel);
        }
        for (size_t i = 0; i < param.count; ++i) {
            const uint32_t want = i < n ? to_t(t, rp[i]) : 0u;
            const uint32_t got = param.get(i);
            const bool both_nan = i < n && std::isnan(rp[i]) && std::isnan(from_t(t, got));
            if (got != want && !both_nan) fail("param", where, i, from_t(t, got), from_t(t, want));
        }
    }
}

std::vector<Hyper> configs(Rule rule) {
    std::vector<Hyper> out;
    Hyper h;
    if (rule == Rule::kAdam) {
        h.label = "adam";
        out.push_back(h);
        h.label = "adam-l2-maximize";
        h.wd = 0.01;
        h.maximize = true;
        h.grad_scale = 1.0 / 3.0;
        out.push_back(h);
        h = Hyper();
        h.label = "adamw-lerp-big";
        h.wd = 0.1;
        h.decoupled = true;
        h.beta1 = 0.3;  // lerp weight 0.7 takes torch's other lerp branch
        h.beta2 = 0.95;
        h.lr = 3e-2;
        h.eps = 1e-6;
        out.push_back(h);
    } else if (rule == Rule::kEfAdam) {
        h.label = "efadam";
        out.push_back(h);
        h.label = "efadam-l2-maximize";
        h.wd = 0.01;
        h.maximize = true;
        h.grad_scale = 1.0 / 3.0;
        out.push_back(h);
        h = Hyper();
        h.label = "efadamw-beta1-ignored";
        h.wd = 0.1;
        h.decoupled = true;
        h.beta1 = 0.3;
        h.beta2 = 0.95;
        h.lr = 3e-2;
        h.eps = 1e-6;
        out.push_back(h);
    } else if (rule == Rule::kSgd) {
        h.label = "sgd-plain-wd";
        h.lr = 0.1;
        h.wd = 1e-2;
        out.push_back(h);
        h = Hyper();
        h.label = "sgd-momentum-dampening";
        h.lr = 0.05;
        h.momentum = 0.9;
        h.dampening = 0.1;
        h.grad_scale = 0.5;
        out.push_back(h);
        h = Hyper();
        h.label = "sgd-nesterov-wd-maximize";
        h.momentum = 0.8;
        h.nesterov = true;
        h.wd = 1e-4;
        h.maximize = true;
        out.push_back(h);
    } else {
        h.label = "adagrad-lr-decay";
        h.lr = 1e-2;
        h.lr_decay = 0.01;
        h.eps = 1e-10;
        out.push_back(h);
        h = Hyper();
        h.label = "adagrad-wd-maximize";
        h.lr = 0.1;
        h.wd = 0.1;
        h.maximize = true;
        h.grad_scale = 2.5;
        out.push_back(h);
    }
    return out;
}

// The reference conversion must agree with its own definition on a few known values.
void self_check() {
    struct {
        const Format* f;
        float x;
        uint32_t code;
    } known[] = {
        {&kFp16, 1.0f, 0x3C00}, {&kFp16, 65504.0f, 0x7BFF},  {&kFp16, 65520.0f, 0x7C00},
        {&kFp16, 65519.0f, 0x7BFF}, {&kFp16, 5.9604645e-8f, 0x0001}, {&kFp16, 2.9802322e-8f, 0x0000},
        {&kFp16, -2.0f, 0xC000}, {&kBf16, 1.0f, 0x3F80}, {&kBf16, 1.00390625f, 0x3F80},  // tie -> even
        {&kBf16, 1.01171875f, 0x3F82}, {&kBf16, 3.4028235e38f, 0x7F80},                  // tie -> even (inf)
    };
    for (const auto& c : known) {
        if (encode(*c.f, c.x) != c.code) {
            std::printf("reference encoder wrong for %.9g: %#x, want %#x\n", c.x, encode(*c.f, c.x), c.code);
            ++g_failures;
        }
    }
}

// The kernels' bf16/fp16 codecs against the reference on every code, and on every rounding boundary:
// each midpoint between neighbouring codes (an exact tie) and the floats on either side of it.
void conversion_check() {
    struct Codec {
        const Format* f;
        uint16_t (*narrow)(float);
        float (*widen)(uint16_t);
        const char* name;
    } codecs[] = {{&kBf16, smartinf::float_to_bf16, smartinf::bf16_to_float, "bf16"},
                  {&kFp16, smartinf::float_to_fp16, smartinf::fp16_to_float, "fp16"}};
    int bad = 0;
    for (const Codec& c : codecs) {
        for (uint32_t code = 0; code <= 0xFFFF; ++code) {
            const double want = decode(*c.f, code);
            const float got = c.widen(static_cast<uint16_t>(code));
            if (!(std::isnan(want) ? std::isnan(got) : bits(got) == bits(static_cast<float>(want)))) ++bad;
        }
        const double top = decode(*c.f, c.f->max_code);
        for (uint32_t code = 0; code <= c.f->max_code; ++code) {
            const double lo = decode(*c.f, code);
            const double hi = code == c.f->max_code ? top + (top - decode(*c.f, code - 1)) : decode(*c.f, code + 1);
            const float mid = static_cast<float>((lo + hi) / 2);  // exact: one more bit than the format
            const float probes[] = {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY),
                                    static_cast<float>(lo), std::nextafter(static_cast<float>(lo), INFINITY)};
            for (float x : probes)
                for (float y : {x, -x})
                    if (c.narrow(y) != encode(*c.f, y)) {
                        if (bad < 10)
                            std::printf("%s codec: %.9g -> %#x, reference %#x\n", c.name, y, c.narrow(y),
                                        encode(*c.f, y));
                        ++bad;
                    }
        }
        for (float y : {static_cast<float>(2 * top), 1.0e5f, 1.0e20f, 3.4028235e38f, 1.0e-45f, 1.0e-30f})
            for (float z : {y, -y})
                if (c.narrow(z) != encode(*c.f, z)) ++bad;
        for (uint32_t nan_bits : {0x7FC00000u, 0x7F800001u, 0x7FFFFFFFu, 0xFFFFFFFFu})  // NaN stays NaN
            if (!std::isnan(c.widen(c.narrow(from_bits(nan_bits))))) ++bad;
        if (c.narrow(INFINITY) != c.f->max_code + 1 || c.narrow(-INFINITY) != (0x8000u | (c.f->max_code + 1))) ++bad;
    }
    if (bad) std::printf("conversion check: %d mismatches\n", bad);
    g_failures += bad;
}

// ---- state formats: the kernels that keep their states in bf16 or int8 ---------------------------
// Reference, written from the formats' definitions (lightning_smartinf/core/state_formats.py), not from the
// kernels: bf16 widens exactly and rounds with the nearest-value search above; an int8 state is blocks of 256
// 8-bit codes (value by ldexp) times the block's fp32 scale (its largest magnitude over the code's largest value).
// A signed state's code is FP8 E4M3, found by a nearest-value search over its finite values, ties to the even
// code, 464 and above saturating to 448 (torch's conversion); a never-negative state is stored by its square root
// in the root code, an unsigned 8-bit float (kTbRootExponentBits of exponent, bias 2^(bits - 1) - 1, the rest
// mantissa, subnormals), found by the same search, saturating from half a step above its largest, a non-zero
// value never coded zero. Every element the kernel touches (whole beats, whole blocks) is decoded, the live ones
// stepped by ref_step, all encoded again.
enum class StateFmt { kBf16, kInt8 };
const char* name(StateFmt f) { return f == StateFmt::kBf16 ? "bf16" : "int8"; }

double e4m3_decode(uint32_t code) {
    const uint32_t e = (code >> 3) & 0xFu, m = code & 0x7u;
    if (e == 0xF && m == 0x7) return NAN;
    const double mag = e == 0 ? std::ldexp(static_cast<double>(m), -9) : std::ldexp(8.0 + m, static_cast<int>(e) - 10);
    return (code & 0x80u) ? -mag : mag;
}

uint8_t e4m3_encode(float x) {
    const uint8_t sign = std::signbit(x) ? 0x80 : 0;
    if (std::isnan(x)) return sign | 0x7F;
    const double a = std::fabs(static_cast<double>(x));
    if (a >= 464.0) return sign | 0x7E;
    uint32_t best = 0;
    for (uint32_t c = 1; c <= 0x7E; ++c) {
        const double d = std::fabs(e4m3_decode(c) - a), dbest = std::fabs(e4m3_decode(best) - a);
        if (d < dbest || (d == dbest && (c & 1u) == 0)) best = c;
    }
    return static_cast<uint8_t>(sign | best);
}

constexpr int kTbRootExponentBits = 4;  // state_formats.ROOT_CODE

double root_decode(uint32_t code) {
    const int mbits = 8 - kTbRootExponentBits, bias = (1 << (kTbRootExponentBits - 1)) - 1;
    const uint32_t e = code >> mbits, m = code & ((1u << mbits) - 1u);
    if (e == 0) return std::ldexp(static_cast<double>(m), 1 - bias - mbits);
    return std::ldexp(static_cast<double>((1u << mbits) + m), static_cast<int>(e) - bias - mbits);
}

uint8_t root_encode(float x) {
    if (std::isnan(x)) return 0xFF;
    const double a = std::fabs(static_cast<double>(x));
    if (a >= root_decode(0xFF) + (root_decode(0xFF) - root_decode(0xFE)) / 2) return 0xFF;
    uint32_t best = 0;
    for (uint32_t c = 1; c <= 0xFF; ++c) {
        const double d = std::fabs(root_decode(c) - a), dbest = std::fabs(root_decode(best) - a);
        if (d < dbest || (d == dbest && (c & 1u) == 0)) best = c;
    }
    return static_cast<uint8_t>(best == 0 && a != 0 ? 1 : best);
}

// One state in a format, in buffers sized for `elems` (whole beats or blocks) elements.
struct FmtState {
    StateFmt fmt;
    uint32_t elems;
    Buf data, scales;  // bf16: data holds the bit patterns; int8: data the codes, scales one float per block
    FmtState(StateFmt f, uint32_t e)
        : fmt(f), elems(e), data(f == StateFmt::kBf16 ? e : e / 4, f == StateFmt::kBf16 ? 2 : 4),
          scales(e / 256 + 1, 4) {}
    uint8_t* codes() { return data.p; }
    float* scale_ptr() { return reinterpret_cast<float*>(scales.p); }
    std::vector<float> decode_all(bool root) {
        std::vector<float> out(elems);
        for (uint32_t i = 0; i < elems; ++i) {
            if (fmt == StateFmt::kBf16) {
                out[i] = from_bits(data.get(i) << 16);
            } else {
                const uint8_t c = codes()[i];
                const float x = static_cast<float>(root ? root_decode(c) : e4m3_decode(c)) * scales.getf(i / 256);
                out[i] = root ? x * x : x;
            }
        }
        return out;
    }
    // The reference's bytes of `values`, as a separate buffer set (compared with what the kernel wrote).
    void encode_all(const std::vector<float>& values, bool root) {
        for (uint32_t b = 0; b * 256 < elems || (fmt == StateFmt::kBf16 && b * 256 < elems); ++b) {
            const uint32_t lo = b * 256, hi = std::min(elems, lo + 256);
            if (fmt == StateFmt::kBf16) {
                for (uint32_t i = lo; i < hi; ++i) data.set(i, encode(kBf16, values[i]));
                continue;
            }
            std::vector<float> y(hi - lo);
            float top = 0.0f;
            bool nan = false;
            for (uint32_t i = lo; i < hi; ++i) {
                y[i - lo] = root ? std::sqrt(values[i]) : values[i];
                if (std::isnan(y[i - lo])) nan = true;
                top = std::max(top, std::fabs(y[i - lo]));
            }
            const float scale = nan ? NAN : top / static_cast<float>(root ? root_decode(0xFF) : 448.0);
            const float divisor = scale == 0.0f ? 1.0f : scale;
            for (uint32_t i = lo; i < hi; ++i) {
                const float q = y[i - lo] / divisor;
                codes()[i] = root ? root_encode(q) : e4m3_encode(q);
            }
            scales.setf(b, scale);
        }
    }
};

void* port(FmtState& s) { return s.data.p; }

#define ST_bf16(x) reinterpret_cast<uint16_t*>(port(x))
#define ST_int8(x) reinterpret_cast<uint8_t*>(port(x)), (x).scale_ptr()
#define SMARTINF_FORMAT_DISPATCH(NAME, T, FMT)                                                           \
    if (rule == Rule::kAdam) {                                                                           \
        const smartinf::AdamScalars s = smartinf::adam_scalars(step, h.lr, h.beta1, h.beta2, h.eps, h.wd, \
                                                               h.decoupled, h.maximize, h.grad_scale);    \
        smartinf_adam_##NAME(F(&master), ST_##FMT(*st[0]), ST_##FMT(*st[1]), (const T*)grad.p, (T*)param.p, \
                             n, s.grad_scale, s.decay_mul, s.l2_wd, s.lerp_w, s.beta2, s.one_minus_beta2,   \
                             s.bc2_sqrt, s.eps, s.neg_step_size, s.flags);                                \
    } else if (rule == Rule::kSgd) {                                                                     \
        const smartinf::SgdScalars s = smartinf::sgd_scalars(step, h.lr, h.momentum, h.dampening,        \
                                                             h.nesterov, h.wd, h.maximize, h.grad_scale); \
        smartinf_sgd_##NAME(F(&master), ST_##FMT(*st[0]), (const T*)grad.p, (T*)param.p, n, s.grad_scale, \
                            s.l2_wd, s.momentum, s.one_minus_dampening, s.neg_lr, s.flags);               \
    } else if (rule == Rule::kEfAdam) {                                                                  \
        const smartinf::EfAdamScalars s = smartinf::efadam_scalars(step, h.lr, h.beta2, h.eps, h.wd,     \
                                                                   h.decoupled, h.maximize, h.grad_scale); \
        smartinf_efadam_##NAME(F(&master), ST_##FMT(*st[0]), (const T*)grad.p, (T*)param.p, n,           \
                               s.grad_scale, s.decay_mul, s.l2_wd, s.beta2, s.one_minus_beta2, s.bc2_sqrt, \
                               s.eps, s.neg_lr, s.flags);                                                \
    } else {                                                                                             \
        const smartinf::AdagradScalars s = smartinf::adagrad_scalars(step, h.lr, h.lr_decay, h.eps, h.wd, \
                                                                     h.maximize, h.grad_scale);           \
        smartinf_adagrad_##NAME(F(&master), ST_##FMT(*st[0]), (const T*)grad.p, (T*)param.p, n,          \
                                s.grad_scale, s.l2_wd, s.eps, s.neg_clr, s.flags);                        \
    }

// Several steps of one dense entry point smartinf_<rule>_<bf16|fp32>_state_<fmt> against the reference. SGD without
// momentum runs with the buffer's port in place but must leave it as it was.
void run_format_case(Rule rule, DType dt, StateFmt fmt, uint32_t n, Data kind, const Hyper& h, uint32_t seed) {
    const TypeInfo t = info(dt);
    std::mt19937 rng(seed);
    const uint32_t unit = fmt == StateFmt::kBf16 ? 32 : 256;
    const uint32_t elems = std::max(1u, (n + unit - 1) / unit) * unit;  // what the kernel touches
    const int nstates = rule == Rule::kAdam ? 2 : 1;
    const bool root[2] = {rule == Rule::kAdagrad || rule == Rule::kEfAdam, true};  // never-negative states
    const bool untouched = rule == Rule::kSgd && h.momentum == 0.0;
    Buf master(elems, 4), grad(elems, t.bytes), param(elems, t.bytes);
    FmtState s0(fmt, elems), s1(fmt, elems), want0(fmt, elems), want1(fmt, elems);
    FmtState* st[2] = {&s0, &s1};
    FmtState* want[2] = {&want0, &want1};
    std::vector<float> rp(elems), init(elems);
    for (uint32_t i = 0; i < elems; ++i) rp[i] = draw(rng, kind == Data::kZero ? Data::kRandom : kind, dt, false);
    for (uint32_t i = 0; i < elems; ++i) master.setf(i, rp[i]);
    for (int j = 0; j < nstates; ++j) {
        for (uint32_t i = 0; i < elems; ++i) {
            const float x = draw(rng, kind, dt, false) * (j == 0 ? 0.1f : 0.01f);
            init[i] = root[j] ? x * x : x;  // a never-negative state
        }
        st[j]->encode_all(init, root[j]);
    }
    char where_buf[200];
    for (uint32_t step = 1; step <= 3; ++step) {
        std::snprintf(where_buf, sizeof where_buf, "%s_%s_state_%s n=%u data=%s cfg=%s step=%u", name(rule), name(dt),
                      name(fmt), n, name(kind), h.label.c_str(), step);
        const std::string where = where_buf;
        std::vector<float> g(elems, 0.0f);
        for (uint32_t i = 0; i < elems; ++i) {
            grad.set(i, i < n ? to_t(t, draw(rng, kind, dt, true)) : (t.bytes == 2 ? 0x7FFFu : 0x7FC00001u));
            if (i < n) g[i] = from_t(t, grad.get(i));
        }
        std::vector<float> r[2], zero(elems, 0.0f);
        for (int j = 0; j < 2; ++j) r[j] = j < nstates ? st[j]->decode_all(root[j]) : zero;
        for (int j = 0; j < nstates; ++j) {  // the bytes before the step: what an untouched state keeps
            std::memcpy(want[j]->data.p, st[j]->data.p, st[j]->data.count * st[j]->data.elem);
            std::memcpy(want[j]->scales.p, st[j]->scales.p, st[j]->scales.count * st[j]->scales.elem);
        }
        for (uint32_t i = 0; i < n; ++i) ref_step(rule, h, static_cast<int>(step), rp[i], r[0][i], r[1][i], g[i]);
        for (int j = 0; j < nstates && !untouched; ++j) want[j]->encode_all(r[j], root[j]);
        for (size_t i = 0; i < param.count; ++i) param.set(i, 0xABCDu);
        if (dt == DType::kBf16) {
            if (fmt == StateFmt::kBf16) { SMARTINF_FORMAT_DISPATCH(bf16_state_bf16, uint16_t, bf16) }
            else { SMARTINF_FORMAT_DISPATCH(bf16_state_int8, uint16_t, int8) }
        } else {
            if (fmt == StateFmt::kBf16) { SMARTINF_FORMAT_DISPATCH(fp32_state_bf16, float, bf16) }
            else { SMARTINF_FORMAT_DISPATCH(fp32_state_int8, float, int8) }
        }
        for (uint32_t i = 0; i < elems; ++i) {
            ++g_checks;
            if (!same_float(master.getf(i), rp[i])) fail("master", where, i, master.getf(i), rp[i]);
            const uint32_t wp = i < n ? to_t(t, rp[i]) : 0u, gp = param.get(i);
            if (gp != wp && !(i < n && std::isnan(rp[i]) && std::isnan(from_t(t, gp))))
                fail("param", where, i, from_t(t, gp), from_t(t, wp));
        }
        // Codes and scales compared exactly, but NaN by class only (its sign and payload are the hardware's).
        for (int j = 0; j < nstates; ++j) {
            for (uint32_t i = 0; i < elems; ++i) {
                ++g_checks;
                if (fmt == StateFmt::kBf16) {
                    const uint32_t got = st[j]->data.get(i), exp = want[j]->data.get(i);
                    const bool nans = (got & 0x7FFFu) > 0x7F80u && (exp & 0x7FFFu) > 0x7F80u;
                    if (got != exp && !nans) fail("bf16 state", where, i, from_bits(got << 16), from_bits(exp << 16));
                } else {
                    const uint8_t got = st[j]->codes()[i], exp = want[j]->codes()[i];
                    if (got != exp && !((got & 0x7F) == 0x7F && (exp & 0x7F) == 0x7F))
                        fail("int8 code", where, i, got, exp);
                }
            }
            if (fmt == StateFmt::kInt8)
                for (uint32_t b = 0; b < elems / 256; ++b)
                    if (!same_float(st[j]->scales.getf(b), want[j]->scales.getf(b)))
                        fail("int8 scale", where, b, st[j]->scales.getf(b), want[j]->scales.getf(b));
        }
    }
}

// The kernels' E4M3 codec against the reference's on every code and every rounding edge.
void e4m3_check() {
    int bad = 0;
    for (uint32_t c = 0; c < 256; ++c) {
        const double want = e4m3_decode(c);
        const float got = smartinf::e4m3_value(static_cast<uint8_t>(c));
        if (!(std::isnan(want) ? std::isnan(got) : bits(got) == bits(static_cast<float>(want)))) ++bad;
    }
    for (uint32_t c = 0; c < 0x7E; ++c) {
        const float lo = static_cast<float>(e4m3_decode(c)), hi = static_cast<float>(e4m3_decode(c + 1));
        const float mid = (lo + hi) / 2;  // exact
        for (float x : {lo, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY), hi})
            for (float y : {x, -x})
                if (smartinf::e4m3_code(y) != e4m3_encode(y)) ++bad;
    }
    for (float y : {448.0f, 460.0f, 464.0f, 500.0f, 1.0e30f, INFINITY, NAN, 1.0e-45f, 1.0e-3f})
        for (float z : {y, -y})
            if (smartinf::e4m3_code(z) != e4m3_encode(z)) ++bad;
    if (bad) std::printf("E4M3 codec check: %d mismatches\n", bad);
    g_failures += bad;
}

// The kernels' root code against the reference's on every code and every rounding edge, saturation and the floor.
void root_code_check() {
    int bad = 0;
    for (uint32_t c = 0; c < 256; ++c)
        if (bits(smartinf::root_value(static_cast<uint8_t>(c))) != bits(static_cast<float>(root_decode(c)))) ++bad;
    for (uint32_t c = 0; c < 0xFF; ++c) {
        const float lo = static_cast<float>(root_decode(c)), hi = static_cast<float>(root_decode(c + 1));
        const float mid = (lo + hi) / 2;  // exact
        for (float x : {lo, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY), hi})
            if (smartinf::root_code(x) != root_encode(x)) ++bad;
    }
    const float top = static_cast<float>(root_decode(0xFF)), step = top - static_cast<float>(root_decode(0xFE));
    for (float y : {top, top + step / 4, top + step / 2, std::nextafter(top + step / 2, 0.0f), 1.0e30f, INFINITY,
                    NAN, 1.0e-45f, 1.0e-20f, static_cast<float>(root_decode(1)) / 2, 0.0f})
        if (smartinf::root_code(y) != root_encode(y)) ++bad;
    if (smartinf::root_code(1.0e-45f) != 1 || smartinf::root_code(0.0f) != 0) ++bad;
    if (bad) std::printf("root code check: %d mismatches\n", bad);
    g_failures += bad;
}

}  // namespace

int main() {
    self_check();
    conversion_check();
    const uint32_t lengths[] = {0, 1, 15, 16, 17, 31, 33, 1000, 4099, 20000};  // 20000: two tiles
    const Rule rules[] = {Rule::kAdam, Rule::kSgd, Rule::kAdagrad, Rule::kEfAdam};
    const DType dtypes[] = {DType::kBf16, DType::kFp16, DType::kFp32};
    const Data kinds[] = {Data::kRandom, Data::kZero, Data::kHuge, Data::kTiny, Data::kWide};
    uint32_t seed = 1;
    int cases = 0;
    for (Rule rule : rules)
        for (const Hyper& h : configs(rule))
            for (DType dt : dtypes)
                for (uint32_t n : lengths)
                    for (Data kind : kinds) {
                        if (n > 4099 && kind != Data::kRandom) continue;
                        run_case(rule, dt, false, n, 0, kind, h, seed++);
                        ++cases;
                        for (int k_mode = 0; k_mode < 4; ++k_mode) {  // k = 0, ~30 %, n, n + 2 out of range
                            if (kind != Data::kRandom && k_mode != 1) continue;
                            if (n > 4099 && (k_mode == 0 || k_mode == 3)) continue;  // tiles: k ~30 % and n
                            run_case(rule, dt, true, n, k_mode, kind, h, seed++);
                            ++cases;
                        }
                    }
    e4m3_check();
    root_code_check();
    const uint32_t format_lengths[] = {1, 17, 255, 256, 257, 1000, 4099};
    for (Rule rule : rules)
        for (const Hyper& h : configs(rule))
            for (DType dt : {DType::kBf16, DType::kFp32})
                for (StateFmt fmt : {StateFmt::kBf16, StateFmt::kInt8})
                    for (uint32_t n : format_lengths)
                        for (Data kind : kinds) {
                            if (n > 1000 && kind != Data::kRandom) continue;
                            run_format_case(rule, dt, fmt, n, kind, h, seed++);
                            ++cases;
                        }
    std::printf("%d cases, %ld element checks, %d mismatches\n", cases, g_checks, g_failures);
    if (g_failures) {
        std::printf("TEST FAILED\n");
        return 1;
    }
    std::printf("TEST PASSED\n");
    return 0;
}
