// CUDA kernels (compression/cuda/kernels.h) and the CUDA branches of the dgc and
// sign codecs, each against its CPU reference on random inputs: identical
// indices and values for selection, identical bytes for sign packing, identical
// DGC state. Built in every configuration; without SPARROW_WITH_CUDA or without
// a CUDA device each case reports why and returns (skipped).
#include "tests/sparrow_test.h"

#include <ATen/ATen.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "compression/codec_util.h"
#include "compression/compressor.h"
#include "compression/dgc.h"
#include "compression/cuda/select_rule.h"
#include "compression/state.h"

#if SPARROW_WITH_CUDA
#include "compression/cuda/device_codec.h"
#include "compression/cuda/kernels.h"
#endif

using namespace sparrow::compression;
namespace cd = sparrow::compression::detail;

namespace {

bool same_bits_cpu(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor x = a.contiguous(), y = b.contiguous();
  return x.sizes().equals(y.sizes()) &&
         std::memcmp(x.data_ptr<float>(), y.data_ptr<float>(), static_cast<size_t>(x.numel()) * 4) == 0;
}

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

namespace {

// ---- DGC states that drive every branch of the adaptation loop ----------------

// One DGC step to encode: the codec spec, the input and the state before it.
struct DgcFixture {
  std::string name;
  std::string spec;
  double ratio;
  at::Tensor g, u, v;  // CPU, same shape
  double sample = 0.01;
};

// The positions dgc samples at `step` (ctx.name "w", seed 0) for a tensor of n
// elements: the fixtures put large |v| there to steer the threshold.
at::Tensor sampled_mask(int64_t n, double ratio, uint64_t step) {
  Context ctx;
  ctx.name = "w";
  const cd::DgcSamplePlan plan = cd::dgc_sample_plan(n, ratio, 0.01);
  at::Tensor m = at::zeros({n}, at::kBool);
  if (plan.exact()) return m.fill_(true);
  const int64_t off = cd::dgc_sample_offset(cd::step_key(ctx, step), plan.stride);
  m.index_put_({at::arange(off, n, plan.stride)}, true);
  return m;
}

std::vector<DgcFixture> dgc_fixtures() {
  std::vector<DgcFixture> out;
  at::manual_seed(42);
  const int64_t rows = 200, cols = 1000, n = rows * cols;
  auto steered = [&](const char* name, double ratio, float rest_hi, double medium_frac, float med_lo, float med_hi) {
    // Sampled |v| in [10, 11); a `medium_frac` share of the rest in [med_lo, med_hi);
    // the others in [0, rest_hi). g = 0 and momentum 0 keep v as built.
    const at::Tensor smp = sampled_mask(n, ratio, 0);
    at::Tensor v = at::rand({n}) * rest_hi;
    const at::Tensor med = at::rand({n}) < medium_frac;
    v = at::where(med, at::rand({n}) * (med_hi - med_lo) + med_lo, v);
    v = at::where(smp, at::rand({n}) + 10.0f, v);
    v = v * at::where(at::rand({n}) < 0.5, at::full({n}, -1.0f), at::full({n}, 1.0f));
    DgcFixture f{name,
                 "dgc:ratio=" + std::to_string(ratio),
                 ratio,
                 at::zeros({rows, cols}),
                 at::zeros({rows, cols}),
                 v.reshape({rows, cols})};
    out.push_back(f);
  };
  // n = 200,000: about 2,061 samples. ratio 0.05: k = 10,000, thr0 near 10.95,
  // thr_j = thr0·0.8^j reaches the band [3, 3.5) at j = 6.
  // thr0 from the large samples; the rest never reaches 0.8k: ten lowerings.
  steered("ten lowerings", 0.05, 1e-3f, 0.0, 0.0f, 0.0f);
  // Six lowerings, then about 2,061 + 7,000 in [0.8k, k].
  steered("lowered into range", 0.05, 1e-3f, 0.0354, 3.0f, 3.5f);
  // Six lowerings, then about 2,061 + 9,500 in (k, 1.3k]: the first k indices (idx[:k]).
  steered("lowered, truncated", 0.05, 1e-3f, 0.048, 3.0f, 3.5f);
  // ratio 0.01 (k = 2,000): lowered once, then far above 1.3k: the exact top-k.
  steered("lowered, top-k", 0.01, 9.0f, 0.0, 0.0f, 0.0f);
  {  // Ties: |v| in {0, 1, 2, 3}: thr0 = 3, a quarter of v passes, keep_topk breaks the ties by index.
    const at::Tensor v = at::randint(0, 4, {rows, cols}).to(at::kFloat);
    out.push_back({"ties, top-k", "dgc:ratio=0.01", 0.01, at::zeros({rows, cols}), at::zeros({rows, cols}), v});
  }
  {  // Every element a sample (n = 40 <= 2/ratio): no adaptation, ties truncated to k = 2.
    const at::Tensor v = at::randint(0, 3, {5, 8}).to(at::kFloat);
    out.push_back({"exact with ties", "dgc:ratio=0.05", 0.05, at::zeros({5, 8}), at::zeros({5, 8}), v});
  }
  // Plain gradients with momentum (the common case: thr0 kept).
  out.push_back({"momentum", "dgc:ratio=0.01,momentum=0.9", 0.01, at::randn({rows, cols}), at::randn({rows, cols}),
                 at::randn({rows, cols})});
  out.push_back({"sample=1", "dgc:ratio=0.001,sample=1", 0.001, at::randn({rows, cols}), at::zeros({rows, cols}),
                 at::zeros({rows, cols}), 1.0});
  return out;
}

// The device algorithm (compression/cuda/dgc_device.cu) in plain C++, driven by
// the same select_rule.h functions: radix select of the samples, the 11 level
// counts, dgc_choose, the top-k radix select and the two-class selection with
// its quota. Updates u and v (host, flat) like the kernels.
struct EmulatedStep {
  std::vector<int64_t> idx;
  std::vector<float> val;
  cuda::DgcChoice choice;
  bool exact = false;
};

uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}
float float_of(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

cuda::RadixState emulate_radix(const std::vector<float>& a, int64_t rank) {
  std::vector<uint32_t> hist(cuda::kRadixPasses * cuda::kRadixBins, 0);
  for (int p = 0; p < cuda::kRadixPasses; ++p) {
    const cuda::RadixState s = cuda::radix_walk(hist.data(), p, rank);
    for (const float x : a) {
      const int bin = cuda::radix_bin(cuda::abs_key_bits(bits_of(x)), s, p);
      if (bin >= 0) ++hist[static_cast<size_t>(p * cuda::kRadixBins + bin)];
    }
  }
  return cuda::radix_walk(hist.data(), cuda::kRadixPasses, rank);
}

EmulatedStep emulate_dgc(const float* g, float* u, float* v, int64_t n, double ratio, double sample, float m,
                         uint64_t step, const Context& ctx) {
  const cd::DgcSamplePlan plan = cd::dgc_sample_plan(n, ratio, sample);
  const int64_t off = plan.exact() ? 0 : cd::dgc_sample_offset(cd::step_key(ctx, step), plan.stride);
  const int64_t count = plan.exact() ? n : (n - off - 1) / plan.stride + 1;
  const int64_t rank = std::min(std::max<int64_t>(plan.top_k_samples, 1), count);
  auto new_u = [m](float uu, float gg) {
    volatile float a = m * uu, b = gg * 1.0f;  // volatile: no FMA contraction
    return a + b;
  };
  std::vector<float> samples(static_cast<size_t>(count));
  for (int64_t j = 0; j < count; ++j) {
    const int64_t i = off + j * plan.stride;
    samples[static_cast<size_t>(j)] = std::fabs(v[i] + new_u(u[i], g[i]));
  }
  float thr[cuda::kDgcLevels];
  thr[0] = float_of(emulate_radix(samples, rank).prefix);
  for (int j = 1; j < cuda::kDgcLevels; ++j) thr[j] = thr[j - 1] * 0.8f;
  unsigned long long counts[cuda::kDgcLevels] = {};
  std::vector<float> mags(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    u[i] = new_u(u[i], g[i]);
    v[i] = v[i] + u[i];
    mags[static_cast<size_t>(i)] = std::fabs(v[i]);
    for (int j = 0; j < cuda::kDgcLevels; ++j) counts[j] += mags[static_cast<size_t>(i)] >= thr[j] ? 1 : 0;
  }
  EmulatedStep out;
  out.choice = cuda::dgc_choose(counts, plan.k, plan.exact());
  out.exact = plan.exact();
  float hi = std::numeric_limits<float>::infinity(), lo = thr[out.choice.level];
  int64_t quota = plan.k;
  if (out.choice.topk) {
    const cuda::RadixState s = emulate_radix(mags, plan.k);
    hi = lo = float_of(s.prefix);
    quota = s.rank;
  }
  int64_t ties = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float mag = mags[static_cast<size_t>(i)];
    bool sel = cuda::class_a(mag, hi);
    if (!sel && cuda::class_b(mag, lo, hi)) sel = ties++ < quota;
    if (!sel) continue;
    out.idx.push_back(i);
    out.val.push_back(v[i]);
    u[i] = 0.0f;
    v[i] = 0.0f;
  }
  return out;
}

}  // namespace

TEST_CASE("cuda: device selection rule, emulated on the CPU, matches the CPU dgc") {
  // No GPU needed: select_rule.h's decisions driven as the kernels drive them.
  Context ctx;
  ctx.name = "w";
  int lowered = 0, topk = 0, ten = 0, exact = 0;
  for (const DgcFixture& f : dgc_fixtures()) {
    CAPTURE(f.name);
    auto codec = make_compressor(f.spec);
    State state;
    state.tensors["u"] = f.u.clone();
    state.tensors["v"] = f.v.clone();
    const Encoded want = codec->encode(f.g, state, ctx);

    at::Tensor u = f.u.clone(), v = f.v.clone();
    const int64_t n = f.g.numel();
    const float m = f.spec.find("momentum=0.9") != std::string::npos ? 0.9f : 0.0f;
    const EmulatedStep got =
        emulate_dgc(f.g.data_ptr<float>(), u.data_ptr<float>(), v.data_ptr<float>(), n, f.ratio, f.sample, m, 0, ctx);
    const Encoded mine =
        cd::make_sparse(cd::shape_of(f.g), got.idx.data(), got.val.data(), got.idx.size(), ValueType::kF32);
    CHECK(mine.count == want.count);
    CHECK(mine.indices == want.indices);
    CHECK(mine.values == want.values);
    CHECK(same_bits_cpu(u, state.tensors.at("u")));
    CHECK(same_bits_cpu(v, state.tensors.at("v")));
    lowered += got.choice.level > 0 && !got.choice.topk;
    topk += got.choice.topk;
    ten += got.choice.level == cuda::kDgcLevels - 1;
    exact += got.exact;
  }
  // The fixtures reach every branch of the loop.
  CHECK(lowered >= 2);
  CHECK(topk >= 2);
  CHECK(ten == 1);
  CHECK(exact == 2);
}

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

TEST_CASE("cuda: dgc on the device matches the CPU on every adaptation path") {
  if (!cuda_ready()) return;
#if SPARROW_WITH_CUDA
  Context ctx;
  ctx.name = "w";
  for (const DgcFixture& f : dgc_fixtures()) {
    CAPTURE(f.name);
    auto codec = make_compressor(f.spec);
    State cpu, gpu;
    cpu.tensors["u"] = f.u.clone();
    cpu.tensors["v"] = f.v.clone();
    gpu.tensors["u"] = f.u.clone();
    gpu.tensors["v"] = f.v.clone();
    for (int step = 0; step < 3; ++step) {  // the fixture's step, then two on random gradients
      CAPTURE(step);
      const at::Tensor g = step == 0 ? f.g : at::randn(f.g.sizes());
      const Encoded a = codec->encode(g, cpu, ctx);
      const Encoded b = codec->encode(on_gpu(g), gpu, ctx);
      CHECK(a.count == b.count);
      CHECK(a.indices == b.indices);
      CHECK(a.values == b.values);
      CHECK(same_bits(cpu.tensors.at("u"), gpu.tensors.at("u")));
      CHECK(same_bits(cpu.tensors.at("v"), gpu.tensors.at("v")));
      CHECK(cpu.step == gpu.step);
    }
  }
#endif
}

TEST_CASE("cuda: encode_device and fold_device equal the CPU encode and decode") {
  if (!cuda_ready()) return;
#if SPARROW_WITH_CUDA
  at::manual_seed(21);
  Context ctx;
  ctx.name = "w";
  for (const char* spec : {"dgc:ratio=0.01,momentum=0.9", "dgc:ratio=0.001"}) {
    CAPTURE(spec);
    auto codec = make_compressor(spec);
    State cpu, gpu;
    at::Tensor acc = at::zeros({300, 700}, at::TensorOptions().device(at::kCUDA));
    at::Tensor want_acc = at::zeros({300, 700});
    for (int step = 0; step < 3; ++step) {
      const at::Tensor g = at::randn({300, 700});
      const Encoded a = codec->encode(g, cpu, ctx);
      const cuda::DeviceEncoded d = cuda::encode_device(*codec, on_gpu(g), gpu, ctx);
      REQUIRE_FALSE(d.dense);
      CHECK(d.count.is_cuda());
      CHECK(host_vec<int64_t>(d.count)[0] == static_cast<int64_t>(a.count));
      CHECK(host_vec<int32_t>(d.status)[0] == 0);
      CHECK(d.capacity >= static_cast<int64_t>(a.count));
      const float w = step == 1 ? 0.5f : 1.0f;  // a power of two: the product is exact either way
      cuda::fold_device(d, w, acc);
      want_acc.add_(codec->decode(a, ctx) * w);
      CHECK(same_bits(acc, want_acc));
      CHECK(same_bits(cpu.tensors.at("u"), gpu.tensors.at("u")));
      CHECK(same_bits(cpu.tensors.at("v"), gpu.tensors.at("v")));
    }
  }
  // A tensor dgc sends dense (1-D with dense1d=1) folds all of its values.
  auto codec = make_compressor("dgc:ratio=0.01");
  State st;
  const at::Tensor b = at::randn({77});
  const cuda::DeviceEncoded d = cuda::encode_device(*codec, on_gpu(b), st, ctx);
  CHECK(d.dense);
  at::Tensor acc = at::zeros({77}, at::TensorOptions().device(at::kCUDA));
  cuda::fold_device(d, 1.0f, acc);
  CHECK(same_bits(acc, b));
  CHECK_THROWS(cuda::encode_device(*make_compressor("topk:ratio=0.01"), on_gpu(at::randn({10, 10})), st, ctx));
#endif
}

TEST_CASE("cuda: dgc rejects a non-finite input and leaves its state as it was") {
  if (!cuda_ready()) return;
#if SPARROW_WITH_CUDA
  at::manual_seed(22);
  Context ctx;
  ctx.name = "w";
  auto codec = make_compressor("dgc:ratio=0.01,momentum=0.9");
  State cpu, gpu;
  const at::Tensor g0 = at::randn({100, 500});
  codec->encode(g0, cpu, ctx);
  codec->encode(on_gpu(g0), gpu, ctx);
  const at::Tensor u = gpu.tensors.at("u").cpu(), v = gpu.tensors.at("v").cpu();
  at::Tensor bad = at::randn({100, 500});
  bad.view({-1})[4321] = std::numeric_limits<float>::infinity();
  CHECK_THROWS(codec->encode(on_gpu(bad), gpu, ctx));
  CHECK(gpu.step == cpu.step);
  CHECK(same_bits(gpu.tensors.at("u"), u));
  CHECK(same_bits(gpu.tensors.at("v"), v));
  // The device API reports it in status, selects nothing and writes nothing.
  bad.view({-1})[4321] = std::nanf("");
  const cuda::DeviceEncoded d = cuda::encode_device(*codec, on_gpu(bad), gpu, ctx);
  CHECK(host_vec<int32_t>(d.status)[0] == 1);
  CHECK(host_vec<int64_t>(d.count)[0] == 0);
  CHECK(same_bits(gpu.tensors.at("v"), v));
  --gpu.step;  // the device API counts the step; undo it to continue in lockstep with the CPU
  const at::Tensor g1 = at::randn({100, 500});
  const Encoded a = codec->encode(g1, cpu, ctx);
  const Encoded b = codec->encode(on_gpu(g1), gpu, ctx);
  CHECK(a.indices == b.indices);
  CHECK(a.values == b.values);
#endif
}

// The fused variant (encode_device(..., fused = true)) against the CPU codec and
// the plain device variant on the same states: the selection from the
// candidates (threshold kept, the exact top-k among them) and both fallbacks
// to the full pass over v (a lowered threshold; a tile with more candidates
// than its slots), over several steps so the swapped state buffers are reused.
TEST_CASE("cuda: the fused device step equals the CPU and the plain device step") {
  if (!cuda_ready()) return;
#if SPARROW_WITH_CUDA
  Context ctx;
  ctx.name = "w";
  auto run = [&](const std::string& spec, const at::Tensor& u0, const at::Tensor& v0, const at::Tensor& g0, int steps) {
    auto codec = make_compressor(spec);
    State cpu, plain, fused;
    for (State* s : {&cpu, &plain, &fused}) {
      s->tensors["u"] = u0.clone();
      s->tensors["v"] = v0.clone();
    }
    for (int step = 0; step < steps; ++step) {
      CAPTURE(step);
      const at::Tensor g = step == 0 ? g0 : at::randn(g0.sizes());
      const Encoded a = codec->encode(g, cpu, ctx);
      const cuda::DeviceEncoded p = cuda::encode_device(*codec, on_gpu(g), plain, ctx);
      const cuda::DeviceEncoded f = cuda::encode_device(*codec, on_gpu(g), fused, ctx, true, true);
      REQUIRE_FALSE(f.dense);
      const int64_t cnt = host_vec<int64_t>(f.count)[0];
      CHECK(host_vec<int32_t>(f.status)[0] == 0);
      CHECK(cnt == static_cast<int64_t>(a.count));
      REQUIRE(host_vec<int64_t>(p.count)[0] == cnt);
      CHECK(host_vec<int64_t>(f.indices.slice(0, 0, cnt)) == host_vec<int64_t>(p.indices.slice(0, 0, cnt)));
      CHECK(same_bits(f.values.slice(0, 0, cnt), p.values.slice(0, 0, cnt)));
      at::Tensor acc = at::zeros(g.sizes(), at::TensorOptions().device(at::kCUDA));
      cuda::fold_device(f, 1.0f, acc);
      CHECK(same_bits(acc, codec->decode(a, ctx)));
      CHECK(same_bits(cpu.tensors.at("u"), fused.tensors.at("u")));
      CHECK(same_bits(cpu.tensors.at("v"), fused.tensors.at("v")));
      CHECK(cpu.step == fused.step);
    }
  };
  for (const DgcFixture& f : dgc_fixtures()) {
    CAPTURE(f.name);
    run(f.spec, f.u, f.v, f.g, 3);
  }
  at::manual_seed(23);
  const int64_t rows = 200, cols = 1000, n = rows * cols;
  {  // The sampled positions shrunk: count_0 is about 2k (the exact top-k), spread thinly over the tiles.
    INFO("top-k among the candidates");
    const at::Tensor v = at::randn({n});
    const at::Tensor shrunk = at::where(sampled_mask(n, 0.01, 0), v * 0.9f, v).reshape({rows, cols});
    run("dgc:ratio=0.01", at::zeros({rows, cols}), shrunk, at::zeros({rows, cols}), 2);
  }
  {  // Every large value in the first tile: more candidates there than slots.
    INFO("clustered: a tile overflows");
    at::Tensor v = at::randn({n}) * 0.01f;
    v.slice(0, 0, 4096).mul_(1000.0f);
    run("dgc:ratio=0.01", at::zeros({rows, cols}), v.reshape({rows, cols}), at::zeros({rows, cols}), 2);
  }
  run("dgc:ratio=0.001,momentum=0.9", at::zeros({512, 1000}), at::zeros({512, 1000}), at::randn({512, 1000}), 4);

  // A non-finite input: status 1, nothing selected, the state as it was.
  auto codec = make_compressor("dgc:ratio=0.01,momentum=0.9");
  State gpu;
  cuda::encode_device(*codec, on_gpu(at::randn({100, 500})), gpu, ctx, true, true);
  const at::Tensor u = gpu.tensors.at("u").cpu(), v = gpu.tensors.at("v").cpu();
  at::Tensor bad = at::randn({100, 500});
  bad.view({-1})[777] = std::nanf("");
  const cuda::DeviceEncoded d = cuda::encode_device(*codec, on_gpu(bad), gpu, ctx, true, true);
  CHECK(host_vec<int32_t>(d.status)[0] == 1);
  CHECK(host_vec<int64_t>(d.count)[0] == 0);
  CHECK(same_bits(gpu.tensors.at("u"), u));
  CHECK(same_bits(gpu.tensors.at("v"), v));
  CHECK_THROWS(codec->encode(on_gpu(bad), gpu, ctx));  // encode keeps the plain variant
#endif
}
