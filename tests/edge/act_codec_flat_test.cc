// The LibTorch activation codecs (edge/act_codec.h) against the torch-free ones
// (edge/codec/act_codec_flat.h): the same packet bytes, decoded values and
// state for every codec family over several steps, and the flat arithmetic
// against the torch arithmetic the LibTorch codecs ran before they ran the
// flat code (bit-exact for dense, quant and topk; within a tolerance for
// lowrank, whose QR and products round differently).
#include "tests/sparrow_test.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "edge/act_codec.h"
#include "edge/codec/act_codec_flat.h"

using namespace sparrow::edge;

namespace {

std::vector<float> normals(size_t n, uint64_t key) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = sparrow::rng::normal(key, i);
  return v;
}

at::Tensor tensor_of(const std::vector<float>& v, const std::vector<int64_t>& shape) {
  return at::from_blob(const_cast<float*>(v.data()), shape, at::kFloat).clone();
}

// Bit-equality of a decoded tensor and a flat decode.
bool same_bits(const at::Tensor& t, const std::vector<float>& v) {
  const at::Tensor c = t.contiguous();
  return c.scalar_type() == at::kFloat && static_cast<size_t>(c.numel()) == v.size() &&
         (v.empty() || std::memcmp(c.data_ptr<float>(), v.data(), 4 * v.size()) == 0);
}

double max_abs(const at::Tensor& t) { return t.abs().max().item<double>(); }

// ---- The LibTorch codec's arithmetic before it ran the flat code (reference) ----

at::Tensor ref_orthonormal(const at::Tensor& x) { return std::get<0>(at::linalg_qr(x, "reduced")); }

at::Tensor ref_gaussian(int64_t rows, int64_t cols, uint64_t key) {
  at::Tensor t = at::empty({rows, cols}, at::kFloat);
  float* d = t.data_ptr<float>();
  for (int64_t i = 0; i < rows * cols; ++i) d[i] = sparrow::rng::normal(key, static_cast<uint64_t>(i));
  return t;
}

struct RefLowRank {
  at::Tensor p;  // N x R
  at::Tensor q;  // M x R (the basis the step used)
  CodecState state;
};

// One fp32 lowrank training step (no quantised factors) as the LibTorch codec
// computed it: linalg_qr, torch products.
RefLowRank ref_lowrank_step(const at::Tensor& a, CodecState s, int64_t rank, int64_t iters, bool warm, uint64_t seed,
                            double beta, uint64_t refresh_k) {
  const int64_t rows = a.size(0), cols = a.size(1);
  const int64_t r = beta > 0 ? std::min(rank, cols) : std::min({rank, rows, cols});
  const uint64_t step = s.steps++;
  at::Tensor q = s.basis;
  const bool fits = q.defined() && q.size(0) == cols && q.size(1) == r;
  const bool refresh = !fits || s.refresh_next || step % refresh_k == 0;
  if (beta > 0) {
    at::Tensor t = s.tracker;
    const bool tracked = t.defined() && t.size(0) == cols && t.size(1) == r && s.sketch.defined();
    if (!tracked) t = ref_orthonormal(ref_gaussian(cols, r, sparrow::rng::derive(seed, step)));
    at::Tensor y = a.t().mm(a.mm(t)) / static_cast<double>(rows);
    s.sketch = tracked ? beta * s.sketch + (1 - beta) * y : y;
    s.tracker = ref_orthonormal(s.sketch).contiguous();
  }
  if (refresh) {
    if (beta > 0) {
      q = s.tracker;
    } else {
      const bool reuse = warm && fits;
      if (!reuse) q = ref_orthonormal(ref_gaussian(cols, r, sparrow::rng::derive(seed, step)));
      const int64_t n = reuse ? iters : std::max<int64_t>(iters, 1);
      for (int64_t i = 0; i < n; ++i) q = ref_orthonormal(a.t().mm(a.mm(q)));
    }
    s.basis = q.contiguous();
    s.basis_id += 1;
    s.refresh_next = false;
  }
  return {a.mm(q), q, s};
}

// q8/q4 as the LibTorch codec computed it: torch min/max, division, round.
ActPacket ref_quant(const at::Tensor& a, int bits, int64_t block_spec) {
  const int64_t rows = a.size(0), cols = a.size(1);
  const int64_t block = block_spec == 0 ? cols : std::min(block_spec, cols);
  const int64_t nb = (cols + block - 1) / block, pad = nb * block - cols;
  at::Tensor padded = pad ? at::cat({a, a.narrow(1, cols - 1, 1).expand({rows, pad})}, 1) : a;
  at::Tensor blocks = padded.reshape({rows, nb, block});
  at::Tensor lo = std::get<0>(blocks.min(2, true)), hi = std::get<0>(blocks.max(2, true));
  const double levels = (1 << bits) - 1;
  at::Tensor step_t = (hi - lo) / levels;
  at::Tensor safe = at::where(step_t > 0, step_t, at::ones_like(step_t));
  at::Tensor codes = ((blocks - lo) / safe).round().clamp(0, levels);
  codes = codes.reshape({rows, nb * block}).narrow(1, 0, cols).to(at::kByte).contiguous();
  at::Tensor sc = at::cat({lo, step_t}, 2).reshape({-1}).contiguous();
  ActPacket p;
  p.format = ActFormat::kQuant;
  p.params = {static_cast<uint32_t>(bits), static_cast<uint32_t>(block)};
  p.scales.assign(sc.data_ptr<float>(), sc.data_ptr<float>() + sc.numel());
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const int64_t n = codes.numel();
  if (bits == 8) {
    p.data.assign(c, c + n);
  } else {
    p.data.assign(static_cast<size_t>((n + 1) / 2), 0);
    for (int64_t i = 0; i < n; ++i) p.data[i / 2] |= static_cast<uint8_t>(c[i] << (4 * (i & 1)));
  }
  return p;
}

// topk as the LibTorch codec computed it (no ties in continuous data).
ActPacket ref_topk(const at::Tensor& a, double ratio) {
  const at::Tensor flat = a.reshape({-1});
  const int64_t k = std::min<int64_t>(flat.numel(), static_cast<int64_t>(std::ceil(ratio * flat.numel())));
  at::Tensor idx = std::get<0>(std::get<1>(flat.abs().topk(k, 0, true, false)).sort());
  at::Tensor vals = flat.index_select(0, idx).contiguous();
  at::Tensor idx32 = idx.to(at::kInt).contiguous();
  ActPacket p;
  p.format = ActFormat::kTopK;
  p.params = {static_cast<uint32_t>(k)};
  p.data.resize(static_cast<size_t>(8 * k));
  std::memcpy(p.data.data(), idx32.data_ptr<int32_t>(), static_cast<size_t>(4 * k));
  std::memcpy(p.data.data() + 4 * k, vals.data_ptr<float>(), static_cast<size_t>(4 * k));
  return p;
}

}  // namespace

TEST_CASE("act codec: LibTorch and flat codecs give the same bytes, values and state") {
  const std::vector<int64_t> shape{8, 3, 4, 5};  // N = 8, M = 60
  const size_t numel = 8 * 60;
  const struct {
    const char* act;
    const char* grad;
  } cases[] = {
      {"none", "none"},
      {"q8", "q4"},
      {"q4", "q8:block=16"},
      {"q8:block=7", "topk:ratio=0.1"},
      {"q4:block=16", "none"},
      {"topk:ratio=0.05", "q8:block=7"},
      {"topk:ratio=1", "topk:ratio=0.3"},
      {"lowrank:rank=4", "none"},
      {"lowrank:rank=3,iters=2", "none"},
      {"lowrank:rank=5,warm=0,iters=1,seed=9", "none"},
      {"lowrank:rank=6,beta=0.9,refresh=3", "none"},
      {"lowrank:rank=12,beta=0.5,refresh=8,ramp=1", "none"},
      {"lowrank:rank=4,bits=8", "none"},
      {"lowrank:rank=4,bits=4,qbits=4", "none"},
      {"lowrank:rank=4,bits=4,gbits=32", "none"},
      {"lowrank:rank=6,beta=0.9,refresh=4,bits=8,gbits=4,seed=3", "none"},
      {"lowrank:rank=10,beta=0.8,refresh=2,bits=4,qbits=4,gbits=8,ramp=1", "none"},
  };
  for (const auto& c : cases) {
    const std::string spec = c.act;
    CAPTURE(spec);
    const ActCodec codec(c.act), grad_codec(c.grad);
    const flat::ActCodec fcodec(c.act), fgrad(c.grad);
    CodecState dev, cloud;
    flat::CodecState fdev, fcloud;
    for (uint64_t step = 0; step < 8; ++step) {
      CAPTURE(step);
      const bool infer = step == 3;
      if (step == 5) dev.refresh_next = fdev.refresh_next = true;
      const std::vector<float> x = normals(numel, 1000 * step + 17);
      CodecState scratch = dev;
      flat::CodecState fscratch = fdev;
      const ActPacket p = codec.encode(tensor_of(x, shape), infer ? scratch : dev, infer);
      const ActPacket fp = fcodec.encode(x.data(), shape, infer ? fscratch : fdev, infer);
      REQUIRE(p.serialize() == fp.serialize());
      CHECK(to_flat(dev).serialize() == fdev.serialize());
      CHECK(to_flat(scratch).serialize() == fscratch.serialize());

      // The cloud: the LibTorch decoder on the flat packet, the flat decoder.
      const at::Tensor a_hat = decode_activation(fp, cloud);
      CHECK(same_bits(a_hat, flat::decode_activation(fp, fcloud)));
      CHECK(a_hat.sizes().vec() == shape);
      CHECK(to_flat(cloud).serialize() == fcloud.serialize());

      const std::vector<float> g = normals(numel, 1000 * step + 99);
      const ActPacket gp = encode_gradient(tensor_of(g, shape), fp, grad_codec, cloud);
      const ActPacket fgp = flat::encode_gradient(g.data(), fp, fgrad, fcloud);
      REQUIRE(gp.serialize() == fgp.serialize());
      // The device turns it into the gradient w.r.t. its activation.
      const CodecState& used = infer ? scratch : dev;
      const flat::CodecState& fused = infer ? fscratch : fdev;
      CHECK(same_bits(decode_gradient(fgp, used, shape), flat::decode_gradient(fgp, fused, shape)));
      if (fp.format == ActFormat::kDense || fp.format == ActFormat::kLowRank || fp.format == ActFormat::kLowRankQ ||
          fp.format == ActFormat::kQuant || fp.format == ActFormat::kTopK)
        CHECK(same_bits(decode(fp), flat::decode(fp)));
    }
    // Codec state: flat bytes, read by the LibTorch side (a torch-free device's
    // progress), and the LibTorch bytes, give the same state.
    const std::string bytes = fdev.serialize();
    CHECK(to_flat(deserialize_codec_state(bytes)).serialize() == bytes);
    CHECK(to_flat(deserialize_codec_state(serialize_codec_state(dev))).serialize() == bytes);
    CHECK(flat::CodecState::deserialize(bytes).serialize() == bytes);
    CHECK(to_flat(from_flat(fdev)).serialize() == bytes);
  }
}

TEST_CASE("act codec: the flat dense, quant and topk are the earlier torch arithmetic, bit for bit") {
  const int64_t rows = 6, cols = 45;
  for (uint64_t seed = 0; seed < 4; ++seed) {
    std::vector<float> x = normals(static_cast<size_t>(rows * cols), 500 + seed);
    x[7] *= 30;  // an outlier
    const at::Tensor a = tensor_of(x, {rows, cols});
    flat::CodecState st;
    for (int bits : {8, 4})
      for (int64_t block : {0, 1, 4, 7, 45, 100}) {
        CAPTURE(bits);
        CAPTURE(block);
        ActPacket ref = ref_quant(a, bits, block);
        ref.shape = {rows, cols};
        const std::string spec = std::string(bits == 8 ? "q8" : "q4") + ":block=" + std::to_string(block);
        CHECK(flat::ActCodec(spec).encode(x.data(), rows, cols, st).serialize() == ref.serialize());
      }
    for (double ratio : {0.01, 0.1, 0.5, 1.0}) {
      CAPTURE(ratio);
      ActPacket ref = ref_topk(a, ratio);
      ref.shape = {rows, cols};
      CHECK(flat::ActCodec("topk:ratio=" + std::to_string(ratio)).encode(x.data(), rows, cols, st).serialize() ==
            ref.serialize());
    }
    ActPacket dense = flat::ActCodec("none").encode(x.data(), rows, cols, st);
    CHECK(same_bits(a, flat::decode(dense)));
  }
}

TEST_CASE("act codec: the flat lowrank is the earlier torch arithmetic within rounding") {
  // Each step starts both from the flat state, so differences do not compound.
  // Tolerances: the decoded activation within 1e-5 of max |A|; the basis and
  // the tracker within 1e-4 per entry, and the decoded gradient G Q Q^T within
  // 1e-4 of max |G|: a QR's rounding grows with the condition of its input
  // (the sketch's columns are scaled by eigenvalues ~1e3 apart here) and a
  // random G sees all of Q's error. Where the input of the QR has rank < R (a
  // streaming basis wider than the first batch), the columns past its rank are
  // any orthonormal completion: only the activation is compared there.
  const int64_t rows = 16, cols = 96;
  const struct {
    const char* spec;
    int64_t rank, iters;
    bool warm;
    uint64_t seed;
    double beta;
    uint64_t refresh;
  } cases[] = {
      {"lowrank:rank=4", 4, 1, true, 0, 0, 1},
      {"lowrank:rank=6,iters=3", 6, 3, true, 0, 0, 1},
      {"lowrank:rank=5,warm=0,iters=2,seed=4", 5, 2, false, 4, 0, 1},
      {"lowrank:rank=8,beta=0.9,refresh=3", 8, 1, true, 0, 0.9, 3},
      {"lowrank:rank=24,beta=0.5,refresh=2,seed=7", 24, 1, true, 7, 0.5, 2},
  };
  // A decaying spectrum plus noise, like an activation: a well separated basis.
  auto batch = [&](uint64_t key) {
    const std::vector<float> u = normals(static_cast<size_t>(rows * 8), key);
    const std::vector<float> v = normals(static_cast<size_t>(cols * 8), 77);  // shared directions
    const std::vector<float> e = normals(static_cast<size_t>(rows * cols), key + 1);
    std::vector<float> a(static_cast<size_t>(rows * cols));
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) {
        float s = 0.05f * e[i * cols + j];
        for (int64_t k = 0; k < 8; ++k) s += u[i * 8 + k] * v[j * 8 + k] * std::pow(0.6f, static_cast<float>(k));
        a[i * cols + j] = s;
      }
    return a;
  };
  for (const auto& c : cases) {
    const std::string spec = c.spec;
    CAPTURE(spec);
    const flat::ActCodec codec(c.spec);
    flat::CodecState st;
    for (uint64_t step = 0; step < 7; ++step) {
      CAPTURE(step);
      const std::vector<float> x = batch(10 * step + 1);
      const at::Tensor a = tensor_of(x, {rows, cols});
      const RefLowRank ref = ref_lowrank_step(a, from_flat(st), c.rank, c.iters, c.warm, c.seed, c.beta, c.refresh);
      const ActPacket p = codec.encode(x.data(), rows, cols, st);
      CHECK(st.basis_id == ref.state.basis_id);
      CHECK(st.steps == ref.state.steps);
      const at::Tensor q = from_flat(st).basis;
      REQUIRE(q.sizes() == ref.state.basis.sizes());
      const bool deficient = step == 0 && c.rank > rows;
      if (!deficient) CHECK((q - ref.state.basis).abs().max().item<double>() <= 1e-4);
      // The tracker accumulates orthogonalised factors over steps: at rank 24
      // the BLAS kernels of another CPU (another summation order) move it by
      // up to ~1.02e-4 (an AMD Zen 5 under OpenBLAS's Haswell kernels).
      if (c.beta > 0 && !deficient)
        CHECK((from_flat(st).tracker - ref.state.tracker).abs().max().item<double>() <= 2e-4);

      flat::CodecState cloud = st;  // the cloud holds the basis the device holds
      const at::Tensor a_hat = tensor_of(flat::decode_activation(p, cloud), {rows, cols});
      const at::Tensor ref_hat = ref.p.mm(ref.q.t());
      CHECK((a_hat - ref_hat).abs().max().item<double>() <= 1e-5 * max_abs(a));

      const std::vector<float> g = normals(static_cast<size_t>(rows * cols), 4000 + step);
      const ActPacket gp = flat::encode_gradient(g.data(), p, flat::ActCodec("none"), cloud);
      const at::Tensor back = tensor_of(flat::decode_gradient(gp, st, {rows, cols}), {rows, cols});
      const at::Tensor gt = tensor_of(g, {rows, cols});
      const at::Tensor ref_back = gt.mm(ref.q).mm(ref.q.t());
      if (!deficient) CHECK((back - ref_back).abs().max().item<double>() <= 1e-4 * max_abs(gt));
    }
  }
}
