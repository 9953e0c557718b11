// CUDA kernels (compression/cuda/kernels.h) and the CUDA branches of the dgc and
// sign codecs, each against its CPU reference on random inputs: identical
// indices and values for selection, identical bytes for sign packing, identical
// DGC state. Built in every configuration; without SPARROW_WITH_CUDA or without
// a CUDA device each case reports why and returns (skipped).
#include "tests/sparrow_test.h"

#include <ATen/ATen.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "compression/codec_util.h"
#include "compression/compressor.h"
#include "compression/dgc.h"
#include "compression/state.h"

#if SPARROW_WITH_CUDA
#include "compression/cuda/kernels.h"
#endif

using namespace sparrow::compression;
namespace cd = sparrow::compression::detail;

namespace {

// True when the CUDA cases can run; otherwise reports why.
bool cuda_ready() {
#if SPARROW_WITH_CUDA
  if (at::hasCUDA()) return true;
  MESSAGE("skipped: no CUDA device");
  return false;
#else
  MESSAGE("skipped: built without SPARROW_WITH_CUDA");
  return false;
#endif
}

#if SPARROW_WITH_CUDA
at::Tensor on_gpu(const at::Tensor& t) { return t.to(at::Device(at::kCUDA)); }

template <typename T>
std::vector<T> host_vec(const at::Tensor& t) {
  const at::Tensor c = t.cpu().contiguous();
  return std::vector<T>(c.data_ptr<T>(), c.data_ptr<T>() + c.numel());
}

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor x = a.cpu().contiguous(), y = b.cpu().contiguous();
  return x.sizes().equals(y.sizes()) &&
         std::memcmp(x.data_ptr<float>(), y.data_ptr<float>(), static_cast<size_t>(x.numel()) * 4) == 0;
}
#endif

}  // namespace

TEST_CASE("cuda select_abs_ge matches collect_abs_ge") {
  if (!cuda_ready()) return;
#if SPARROW_WITH_CUDA
  at::manual_seed(11);
  for (const int64_t n : {int64_t{1}, int64_t{4095}, int64_t{4097}, int64_t{1000003}, int64_t{5000000}}) {
    at::Tensor a = at::randn({n});
    if (n > 10) a.index_put_({at::arange(0, n, 997)}, std::nanf(""));  // NaN never passes
    for (const float thr : {0.0f, 1.5f, 3.0f, 100.0f}) {
      std::vector<int64_t> want;
      cd::collect_abs_ge(a.data_ptr<float>(), n, thr, want);
      const at::Tensor d = on_gpu(a);
      at::Tensor ws = at::empty({static_cast<int64_t>(cuda::select_workspace_bytes(n))}, d.options().dtype(at::kByte));
      const int64_t c = cuda::select_abs_ge_count(d.data_ptr<float>(), n, thr, ws.data_ptr(), nullptr);
      REQUIRE(c == static_cast<int64_t>(want.size()));
      at::Tensor di = at::empty({c}, d.options().dtype(at::kLong)), dv = at::empty({c}, d.options());
      cuda::select_abs_ge_scatter(d.data_ptr<float>(), n, thr, ws.data_ptr(), di.data_ptr<int64_t>(),
                                  dv.data_ptr<float>(), nullptr);
      CHECK(host_vec<int64_t>(di) == want);
      std::vector<float> want_v(want.size());
      for (size_t j = 0; j < want.size(); ++j) want_v[j] = a.data_ptr<float>()[want[j]];
      CHECK(host_vec<float>(dv) == want_v);
    }
  }
#endif
}

TEST_CASE("cuda dgc_update is bit-identical to the CPU step") {
  if (!cuda_ready()) return;
#if SPARROW_WITH_CUDA
  at::manual_seed(12);
  const int64_t n = 300001;
  at::Tensor g = at::randn({n}), u = at::randn({n}), v = at::randn({n});
  const float m = 0.9f, coef = 0.37f;
  at::Tensor gd = on_gpu(g), ud = on_gpu(u), vd = on_gpu(v);
  cuda::dgc_update(gd.data_ptr<float>(), ud.data_ptr<float>(), vd.data_ptr<float>(), n, m, coef, nullptr);
  float *up = u.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    volatile float prod_u = m * up[i], prod_g = gp[i] * coef;  // volatile: no FMA contraction
    up[i] = prod_u + prod_g;
    vp[i] = vp[i] + up[i];
  }
  CHECK(same_bits(ud, u));
  CHECK(same_bits(vd, v));
#endif
}

TEST_CASE("cuda sign_pack gives the CPU's bytes and residual") {
  if (!cuda_ready()) return;
#if SPARROW_WITH_CUDA
  at::manual_seed(13);
  for (const int64_t n : {int64_t{1}, int64_t{7}, int64_t{8}, int64_t{65537}, int64_t{1000001}}) {
    at::Tensor g = at::randn({n}), r = at::randn({n}) * 0.1;
    const at::Tensor p = g + r;
    double want_l1 = 0.0;
    for (int64_t i = 0; i < n; ++i) want_l1 += std::fabs(p.data_ptr<float>()[i]);
    Bytes want_bits;
    cd::pack_values(p.data_ptr<float>(), static_cast<uint64_t>(n), ValueType::kSign, want_bits);

    at::Tensor gd = on_gpu(g), rd = on_gpu(r);
    at::Tensor ws = at::empty({static_cast<int64_t>(cuda::sum_abs_workspace_bytes(n))}, gd.options().dtype(at::kByte));
    const double l1 = cuda::sum_abs(gd.data_ptr<float>(), rd.data_ptr<float>(), n, ws.data_ptr(), nullptr);
    CHECK(l1 == doctest::Approx(want_l1).epsilon(1e-12));
    const float scale = static_cast<float>(want_l1 / static_cast<double>(n));
    at::Tensor bits = at::empty({(n + 7) / 8}, gd.options().dtype(at::kByte));
    cuda::sign_pack(gd.data_ptr<float>(), rd.data_ptr<float>(), n, scale, bits.data_ptr<uint8_t>(), nullptr);
    CHECK(Bytes(host_vec<uint8_t>(bits)) == want_bits);
    const at::Tensor want_r = p - at::where(p < 0, at::full({n}, -scale), at::full({n}, scale));
    CHECK(same_bits(rd, want_r));
  }
#endif
}

TEST_CASE("cuda dgc and sign codecs match their CPU paths") {
  if (!cuda_ready()) return;
#if SPARROW_WITH_CUDA
  at::manual_seed(14);
  Context ctx;
  for (const char* spec : {"dgc:ratio=0.01,momentum=0.9", "dgc:ratio=0.001,sample=1", "dgc:ratio=0.05,values=fp16"}) {
    CAPTURE(spec);
    auto codec = make_compressor(spec);
    State cpu_state, gpu_state;
    for (int step = 0; step < 4; ++step) {
      const at::Tensor g = at::randn({512, 1000});
      const Encoded a = codec->encode(g, cpu_state, ctx);
      const Encoded b = codec->encode(on_gpu(g), gpu_state, ctx);
      CHECK(a.count == b.count);
      CHECK(a.indices == b.indices);
      CHECK(a.values == b.values);
      CHECK(same_bits(cpu_state.tensors.at("u"), gpu_state.tensors.at("u")));
      CHECK(same_bits(cpu_state.tensors.at("v"), gpu_state.tensors.at("v")));
    }
  }
  auto sign = make_compressor("sign");
  State cpu_state, gpu_state;
  for (int step = 0; step < 3; ++step) {
    const at::Tensor g = at::randn({100003});
    const Encoded a = sign->encode(g, cpu_state, ctx);
    const Encoded b = sign->encode(on_gpu(g), gpu_state, ctx);
    CHECK(a.values == b.values);
    REQUIRE(b.scales.size() == 1);
    CHECK(b.scales[0] == doctest::Approx(a.scales[0]).epsilon(1e-6));
  }
#endif
}
