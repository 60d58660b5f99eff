// Continuous batching from a C++ (pybind11) extension through recurrent_cache's C header.
//
// The same schedule as the C and Cython examples: each step builds a batch of new prompts
// and one decode token per running sequence, rc_batch_init validates, splits and proves it
// fits, and each ubatch is applied; "the model" adds the tokens a sequence consumed to
// column 0 of its s row of layer 0.  RAII owns the context and the batch; the GIL is
// released for the loop.  Build: see setup.py next to this file.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "recurrent_cache/capi.h"

namespace py = pybind11;

namespace {

constexpr int32_t kMaxPrompt = 8;

// Owns an rc_ctx (created and freed with the GIL held, as the header requires).
class Context {
  public:
    explicit Context(py::handle cache) : ctx_(rc_ctx_new(cache.ptr())) {
        if (ctx_ == nullptr) throw py::error_already_set();
    }
    ~Context() { rc_ctx_free(ctx_); }
    Context(const Context&) = delete;
    Context& operator=(const Context&) = delete;
    rc_ctx* get() const { return ctx_; }
    // Raise with the library's message (formatted with the detail of the failure).
    void check(int code) const {
        if (code >= 0) return;
        char message[512];
        rc_error_message(ctx_, code, message, sizeof message);
        throw std::runtime_error(message);
    }

  private:
    rc_ctx* ctx_;
};

struct BatchRelease {
    void operator()(rc_batch* batch) const { rc_batch_release(batch); }
};
using Batch = std::unique_ptr<rc_batch, BatchRelease>;

uint32_t next_random(uint32_t& state) {  // Numerical Recipes' LCG, as the Python twin
    state = state * 1664525u + 1013904223u;
    return state >> 8;
}

int decode_batch(rc_ctx* ctx, const std::vector<int32_t>& seq_ids, const std::vector<int32_t>& pos,
                 int32_t n_ubatch) {
    void* s0 = nullptr;
    size_t row_bytes = 0;
    int code = rc_tensor(ctx, rc_n_layer(ctx), &s0, &row_bytes);  // s of layer 0 (f32)
    rc_batch* raw = nullptr;
    if (code == RC_OK) {
        code = rc_batch_init(ctx, static_cast<int32_t>(seq_ids.size()), seq_ids.data(), nullptr, pos.data(),
                             nullptr, n_ubatch, 0, &raw);
    }
    if (code != RC_OK) return code;
    Batch batch(raw);
    rc_ubatch ub;
    while ((code = rc_batch_apply(batch.get(), &ub)) == 1) {
        for (int32_t g = 0; g < ub.n_seqs; ++g) {  // group g's state is row head + g
            auto* row = reinterpret_cast<float*>(static_cast<char*>(s0) + size_t(ub.head + g) * row_bytes);
            row[0] += static_cast<float>(ub.n_seq_tokens);
        }
    }
    return code;
}

int run_schedule(rc_ctx* ctx, int32_t n_seqs, int32_t n_steps, uint32_t seed, int32_t n_ubatch) {
    std::vector<int32_t> seq_ids, pos;
    uint32_t rng = seed;
    for (int32_t step = 0; step < n_steps; ++step) {
        seq_ids.clear();
        pos.clear();
        for (int32_t seq = 0; seq < n_seqs; ++seq) {
            const uint32_t roll = next_random(rng) % 16;
            const int32_t start = rc_seq_pos_max(ctx, seq) + 1;
            if (start > 0 && roll == 0) {
                rc_seq_rm(ctx, seq, -1, -1);  // the client finished
                continue;
            }
            if (start > 0 && roll == 1) {
                rc_seq_cp(ctx, static_cast<int32_t>(next_random(rng) % static_cast<uint32_t>(n_seqs)), seq);
                continue;
            }
            const int32_t length = start > 0 ? 1 : 1 + static_cast<int32_t>(next_random(rng) % kMaxPrompt);
            if (start == 0 && roll >= 8) continue;  // the slot stays free this step
            for (int32_t k = 0; k < length; ++k) {
                seq_ids.push_back(seq);
                pos.push_back(start + k);
            }
        }
        if (!seq_ids.empty()) {
            const int code = decode_batch(ctx, seq_ids, pos, n_ubatch);
            if (code < 0) return code;
        }
    }
    return RC_OK;
}

int continuous_batching(py::object cache, int32_t n_seqs, int32_t n_steps, uint32_t seed, int32_t n_ubatch) {
    Context ctx(cache);
    if (n_seqs < 1 || n_seqs > rc_size(ctx.get()))
        throw py::value_error("n_seqs must be in [1, " + std::to_string(rc_size(ctx.get())) + "]");
    int code;
    {
        py::gil_scoped_release released;
        code = run_schedule(ctx.get(), n_seqs, n_steps, seed, n_ubatch);
    }
    ctx.check(code);
    return code;
}

}  // namespace

PYBIND11_MODULE(continuous_batching_cpp, m) {
    if (import_recurrent_cache() < 0) throw py::error_already_set();  // ImportError saying why
    m.def("continuous_batching", &continuous_batching, py::arg("cache"), py::arg("n_seqs"), py::arg("n_steps"),
          py::arg("seed"), py::arg("n_ubatch") = 16,
          "The continuous-batching schedule, in C++; 0 or RuntimeError with the library's message.");
}
