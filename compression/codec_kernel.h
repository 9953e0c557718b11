#pragma once
// A codec's CPU implementation without LibTorch: the one both the LibTorch
// compressors (for CPU tensors, through torch_codec.h) and flat::Codec (the
// lite client) run, so both give the same bytes and the same state for the
// same input, state and context. Internal to compression/.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "compression/codec_bits.h"
#include "compression/encoded.h"
#include "core/spec.h"

namespace sparrow::compression::detail {

class Kernel {
 public:
  virtual ~Kernel() = default;
  virtual std::string method() const = 0;
  // Compresses x (numel_of(shape) floats, contiguous, already checked finite
  // by the caller: check_finite_input). Reads/updates `slots` in place and
  // increments slots.step(). Immutable: encode may run concurrently on
  // different slots.
  virtual Encoded encode(const float* x, const std::vector<int64_t>& shape, Slots& slots,
                         const CodecView& ctx) const = 0;
  virtual double mask_ratio() const { return 0.0; }
  virtual bool share_mean() const { return false; }
};

// The kernel of spec's method, consuming the keys it knows; nullptr when the
// method has none (it needs LibTorch, or is unknown). flat_codec.cc.
std::unique_ptr<Kernel> make_kernel(Spec& spec);
// The methods make_kernel knows, sorted.
std::vector<std::string> kernel_methods();

// One factory per file (each parses its spec keys, ConfigError on bad values).
std::unique_ptr<Kernel> make_dense_kernel(const std::string& method, Spec& spec);   // none, fp16, bf16 (dense.cc)
std::unique_ptr<Kernel> make_sparse_kernel(const std::string& method, Spec& spec);  // topk, stc, randomk, threshold,
                                                                                    // tcs (sparse.cc)
std::unique_ptr<Kernel> make_qsgd_kernel(Spec& spec);                               // qsgd.cc
std::unique_ptr<Kernel> make_terngrad_kernel(Spec& spec);                           // terngrad.cc
std::unique_ptr<Kernel> make_sign_kernel(bool ef);                                  // sign_cpu.cc
std::unique_ptr<Kernel> make_powersgd_kernel(Spec& spec);                           // powersgd_cpu.cc
std::unique_ptr<Kernel> make_acp_kernel(Spec& spec);                                // acp_cpu.cc

// DGC's options (spec keys ratio, momentum, clip, warmup, sample, dense1d,
// values, index, decay, max_age), shared with its CUDA path (dgc.cc).
struct DgcOptions {
  double ratio = 0.001, momentum = 0.0, clip = 0.0;
  int64_t warmup = 0;
  double sample = 0.01;
  bool dense1d = true;
  ValueType vt = ValueType::kF32;
  IndexMode index = IndexMode::kAuto;
  StalePolicy stale;
};
DgcOptions parse_dgc_options(Spec& spec);
std::unique_ptr<Kernel> make_dgc_kernel(const DgcOptions& o);  // dgc_cpu.cc

}  // namespace sparrow::compression::detail
