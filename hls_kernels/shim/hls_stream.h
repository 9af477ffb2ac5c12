// Minimal stand-in for Vitis HLS <hls_stream.h>, for building the kernels with a plain C++ compiler.
//
// An unbounded FIFO, like the C-simulation model of hls::stream: the processes of a DATAFLOW region
// run one after another in C++, so every stream must hold a whole call's data. Reading an empty
// stream is a kernel bug (a deadlock in hardware) and aborts with a message.
#ifndef SMARTINF_SHIM_HLS_STREAM_H
#define SMARTINF_SHIM_HLS_STREAM_H

#ifdef __SYNTHESIS__
#error "hls_kernels/shim/hls_stream.h is a g++ stand-in; synthesis must use the Vitis HLS headers"
#endif

#include <cstdio>
#include <cstdlib>
#include <deque>
#include <string>

namespace hls {

template <typename T>
class stream {
  public:
    stream() = default;
    explicit stream(const char* name) : name_(name) {}
    stream(const stream&) = delete;
    stream& operator=(const stream&) = delete;

    void write(const T& value) { fifo_.push_back(value); }

    T read() {
        if (fifo_.empty()) {
            std::fprintf(stderr, "hls::stream '%s': read from an empty stream (a deadlock in hardware)\n",
                         name_.c_str());
            std::abort();
        }
        T value = fifo_.front();
        fifo_.pop_front();
        return value;
    }

    bool empty() const { return fifo_.empty(); }
    std::size_t size() const { return fifo_.size(); }

  private:
    std::string name_ = "<unnamed>";
    std::deque<T> fifo_;
};

}  // namespace hls

#endif  // SMARTINF_SHIM_HLS_STREAM_H
