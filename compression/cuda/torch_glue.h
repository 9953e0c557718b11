#pragma once
// Glue between the codecs' CUDA branches (dgc.cc, sign.cc; compiled only with
// SPARROW_WITH_CUDA) and compression/cuda/kernels.h: the stream to launch on,
// device scratch and state slots on the input's device.
// Internal to compression/: included only by .cc files.

#include <ATen/ATen.h>

#include <string>

#include "compression/state.h"
#include "core/error.h"

// The kernels must run on the stream ATen uses for the tensors around them.
// A CUDA-enabled LibTorch ships the c10/cuda headers complete; a CPU-only one
// (as Debian's, where this file is only compile-checked) lacks
// cuda_cmake_macros.h, and the legacy default stream (nullptr), which is also
// ATen's default current stream, is used instead.
#if __has_include(<c10/cuda/impl/cuda_cmake_macros.h>)
#include <c10/cuda/CUDAStream.h>
#define SPARROW_HAVE_C10_CUDA 1
#endif

namespace sparrow::compression::cuda {

inline void* current_stream() {
#if defined(SPARROW_HAVE_C10_CUDA)
  return c10::cuda::getCurrentCUDAStream().stream();
#else
  return nullptr;
#endif
}

// Uninitialised device bytes on x's device (ATen's caching allocator).
inline at::Tensor scratch_bytes(size_t bytes, const at::Tensor& like) {
  return at::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
}

// State::slot creates slots on the CPU (and deserialize restores them there):
// the CUDA branches move a slot to x's device on first use; serialize() copies
// it back to the CPU, so checkpoints are unchanged.
inline at::Tensor& device_slot(State& state, const char* name, const at::Tensor& like, const char* method) {
  at::Tensor& t = state.slot(name, like);
  SPARROW_CHECK(t.scalar_type() == at::kFloat, method << ": state slot '" << name << "' must be float32");
  if (t.device() != like.device()) t = t.to(like.device());
  if (!t.is_contiguous()) t = t.contiguous();
  return t;
}

// A device tensor about to be dropped while kernels queued on the current
// stream still read it: tells ATen's caching allocator not to hand its memory
// to another stream before those kernels are done.
inline void retire_on_current_stream(const at::Tensor& t) {
#if defined(SPARROW_HAVE_C10_CUDA)
  t.record_stream(c10::cuda::getCurrentCUDAStream().unwrap());
#else
  (void)t;  // legacy default stream: every stream waits for it
#endif
}

// Contiguous float32 CUDA input with no NaN or infinity (the CPU codecs'
// as_input contract); throws sparrow::Error before any state is touched.
inline at::Tensor as_cuda_input(const at::Tensor& x, const char* method) {
  SPARROW_CHECK(x.scalar_type() == at::kFloat, method << ": input must be float32, got " << x.scalar_type());
  at::Tensor c = x.contiguous();
  SPARROW_CHECK(c.numel() == 0 || at::isfinite(c).all().item<bool>(), method << ": input has NaN or infinity");
  return c;
}

// Contiguous float32 CUDA input, without the finiteness check (which would
// wait for the device): dgc's device path checks on the device instead.
inline at::Tensor as_cuda_tensor(const at::Tensor& x, const char* method) {
  SPARROW_CHECK(x.defined() && x.is_cuda(), method << ": the device path needs a CUDA tensor");
  SPARROW_CHECK(x.scalar_type() == at::kFloat, method << ": input must be float32, got " << x.scalar_type());
  return x.contiguous();
}

}  // namespace sparrow::compression::cuda
