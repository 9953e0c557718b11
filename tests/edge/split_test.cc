#include "tests/sparrow_test.h"

#include <torch/script.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <limits>

#include "core/error.h"
#include "core/models.h"
#include "edge/act_codec.h"
#include "edge/split.h"

using sparrow::ConfigError;
using sparrow::FormatError;
using sparrow::core::make_model;
using namespace sparrow::edge;

namespace {

at::Tensor images(int64_t n, uint64_t seed) {
  torch::manual_seed(seed);
  return torch::randn({n, 1, 28, 28});
}

at::Tensor labels(int64_t n) { return torch::arange(n, torch::kLong).remainder(10); }

ActPacket roundtrip(const ActPacket& p) {
  const std::vector<uint8_t> bytes = p.serialize();
  CHECK(bytes.size() == p.wire_bytes());
  return ActPacket::deserialize(bytes.data(), bytes.size());
}

// Runs one uncompressed split step and one unsplit step on identical models and
// compares losses and every parameter gradient.
void check_split_equals_unsplit(const std::string& name, const std::string& cut) {
  auto split_model_ptr = make_model(name, 3);
  auto whole = make_model(name, 3);
  const at::Tensor x = images(6, 11), y = labels(6);

  at::Tensor loss = torch::nn::functional::cross_entropy(whole->forward(x), y);
  loss.backward();

  Split s = split_model(split_model_ptr, cut);
  EdgeHalf edge(s.bottom, "none", /*freeze=*/false);
  CloudHalf cloud(s.top, "none");
  ActPacket act = roundtrip(edge.forward(x));
  CHECK(act.want_gradient);
  CloudHalf::Result r = cloud.step(act, y);
  REQUIRE(r.gradient.has_value());
  edge.backward(roundtrip(*r.gradient));
  CHECK(r.loss == doctest::Approx(loss.item<double>()).epsilon(1e-6));

  auto ref = whole->named_parameters();
  int compared = 0;
  for (const auto& p : split_model_ptr->named_parameters()) {
    CAPTURE(p.key());
    REQUIRE(p.value().grad().defined());
    const at::Tensor& g = ref[p.key()].grad();
    CHECK(at::allclose(p.value().grad(), g, 1e-5, 1e-6));
    ++compared;
  }
  CHECK(compared == static_cast<int>(ref.size()));
}

// Two children ("l1", "l2"), each x @ W^T + b, run in order by forward.
// With relu = false forward is exactly the composition of the children.
void save_two_layer_script(const std::string& path, bool relu) {
  auto layer = [](int64_t in, int64_t out, float fill) {
    torch::jit::Module m("Lin");
    m.register_parameter(
        "weight", (torch::full({out, in}, fill) + torch::arange(out * in).reshape({out, in}) * 0.01).requires_grad_(),
        false);
    m.register_parameter("bias", torch::full({out}, 0.1).requires_grad_(), false);
    m.define(R"(
def forward(self, x):
    return torch.matmul(x, self.weight.t()) + self.bias
)");
    return m;
  };
  torch::jit::Module net("Net");
  net.register_module("l1", layer(4, 5, 0.2f));
  net.register_module("l2", layer(5, 3, -0.1f));
  net.define(relu ? R"(
def forward(self, x):
    return self.l2.forward(torch.relu(self.l1.forward(x)))
)"
                  : R"(
def forward(self, x):
    return self.l2.forward(self.l1.forward(x))
)");
  net.save(path);
}

}  // namespace

TEST_CASE("split: stages compose to the model's forward") {
  for (std::string name : {"mlp", "cnn", "resnet"}) {
    CAPTURE(name);
    auto m = make_model(name, 1);
    const auto names = stage_names(*m);
    REQUIRE(names.size() >= 3);
    for (size_t k = 1; k < names.size(); ++k) {
      Split s = split_model(m, std::to_string(k));
      CHECK(check_stages(s, images(3, 2)) < 1e-5);
      // Bottom and top parameters partition the model's.
      CHECK(s.bottom.parameter_names().size() + s.top.parameter_names().size() == m->named_parameters().size());
    }
  }
  auto cnn = make_model("cnn", 1);
  CHECK(stage_names(*cnn) == std::vector<std::string>({"conv1", "conv2", "fc1", "fc2"}));
  Split s = split_model(cnn, "conv2");
  CHECK(s.bottom.parameter_names() ==
        std::vector<std::string>({"conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias"}));
  CHECK(s.bottom.forward(images(2, 1)).sizes() == at::IntArrayRef({2, 64, 7, 7}));
  CHECK(s.bottom.parameters()[0].data_ptr() == cnn->named_parameters()["conv1.weight"].data_ptr());  // shared
}

TEST_CASE("split: bad cuts are config errors") {
  auto cnn = make_model("cnn", 1);
  for (std::string cut : {"fc2", "0", "4", "99999999999", "conv3", ""}) {
    CAPTURE(cut);
    CHECK_THROWS_AS(split_model(cnn, cut), ConfigError);
  }
  CHECK_THROWS_AS(EdgeHalf(split_model(cnn, "1").bottom, "lowrank:rank=0", false), ConfigError);
  CHECK_THROWS_AS(CloudHalf(split_model(cnn, "1").top, "lowrank:rank=2"), ConfigError);
  for (std::string spec : {"bogus", "q8:bits=8", "topk:ratio=0", "lowrank:warm=0,iters=0", "q4:block=-1"}) {
    CAPTURE(spec);
    CHECK_THROWS_AS(ActCodec{spec}, ConfigError);
  }
}

TEST_CASE("split: a number that is also a stage name is refused, after: and first: say which") {
  // An nn.Sequential as TorchScript has it: children named 0, 1, 2.
  const std::string path = "split_test_sequential.pt";
  {
    auto lin = [](int64_t in, int64_t out) {
      torch::jit::Module m("Lin");
      m.register_parameter("weight", torch::ones({out, in}), false);  // linear(-1) < 0
      m.register_parameter("bias", torch::zeros({out}), false);
      m.define("def forward(self, x):\n    return torch.linear(x, self.weight, self.bias)\n");
      return m;
    };
    torch::jit::Module relu("Relu");
    relu.define("def forward(self, x):\n    return torch.relu(x)\n");
    torch::jit::Module seq("Seq");
    seq.register_module("0", lin(4, 5));
    seq.register_module("1", relu);
    seq.register_module("2", lin(5, 3));
    seq.define(R"(
def forward(self, x):
    return getattr(self, "2").forward(getattr(self, "1").forward(getattr(self, "0").forward(x)))
)");
    seq.save(path);
  }
  auto m = make_model("torchscript:" + path, 0);
  std::remove(path.c_str());
  REQUIRE(stage_names(*m) == std::vector<std::string>({"0", "1", "2"}));
  for (const std::string cut : {"0", "1"}) {
    CAPTURE(cut);
    try {
      split_model(m, cut);
      FAIL("an ambiguous cut was accepted");
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      CHECK(what.find("ambiguous") != std::string::npos);
      CHECK(what.find("after:" + cut) != std::string::npos);
      // "first:0" would leave an empty bottom: only the valid form is offered.
      CHECK((what.find("first:" + cut) != std::string::npos) == (cut == "1"));
    }
  }
  // after:1 ends the bottom with the stage named "1" (children 0 and 1);
  // first:1 is the first stage alone.
  CHECK(split_model(m, "after:1").bottom.parameter_names() == std::vector<std::string>({"0_weight", "0_bias"}));
  CHECK(split_model(m, "after:1").top.forward(torch::ones({2, 5})).sizes() == at::IntArrayRef({2, 3}));
  CHECK(split_model(m, "first:1").top.forward(torch::ones({2, 5})).sizes() == at::IntArrayRef({2, 3}));
  CHECK(split_model(m, "first:1").bottom.forward(-torch::ones({2, 4})).min().item<float>() < 0);  // no ReLU yet
  CHECK(split_model(m, "after:1").bottom.forward(-torch::ones({2, 4})).min().item<float>() >= 0);
  for (const std::string cut : {"after:2", "after:3", "first:0", "first:3", "first:", "first:x", "after:"}) {
    CAPTURE(cut);
    CHECK_THROWS_AS(split_model(m, cut), ConfigError);
  }
  // On named stages the explicit forms agree with the bare ones.
  auto cnn = make_model("cnn", 1);
  for (const std::string cut : {"2", "conv2", "after:conv2", "first:2"}) {
    CAPTURE(cut);
    CHECK(split_model(cnn, cut).bottom.parameter_names() ==
          std::vector<std::string>({"conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias"}));
  }
}

TEST_CASE("split: uncompressed split gives the unsplit gradients") {
  SUBCASE("mlp") { check_split_equals_unsplit("mlp", "fc1"); }
  SUBCASE("cnn") { check_split_equals_unsplit("cnn", "conv2"); }
  SUBCASE("cnn after fc1") { check_split_equals_unsplit("cnn", "3"); }
}

TEST_CASE("split: frozen bottom asks for no gradient") {
  auto m = make_model("mlp", 1);
  Split s = split_model(m, "fc2");
  EdgeHalf edge(s.bottom, "q8", /*freeze=*/true);
  CloudHalf cloud(s.top, "none");
  ActPacket act = edge.forward(images(4, 1));
  CHECK_FALSE(act.want_gradient);
  CHECK_FALSE(roundtrip(act).want_gradient);
  CloudHalf::Result r = cloud.step(act, labels(4));
  CHECK_FALSE(r.gradient.has_value());
  CHECK(m->named_parameters()["fc3.weight"].grad().defined());
  CHECK_FALSE(m->named_parameters()["fc1.weight"].grad().defined());
  CHECK_FALSE(m->named_parameters()["fc1.weight"].requires_grad());
}

TEST_CASE("split: torchscript models cut at child names") {
  const std::string path = "split_test_two_layer.pt";
  save_two_layer_script(path, /*relu=*/false);
  auto plain = make_model("torchscript:" + path, 0);
  save_two_layer_script(path, /*relu=*/true);
  auto m = make_model("torchscript:" + path, 0);
  std::remove(path.c_str());
  torch::manual_seed(5);
  const at::Tensor x = torch::randn({8, 4});
  CHECK(check_stages(split_model(plain, "1"), x) < 1e-6);
  CHECK(stage_names(*m) == std::vector<std::string>({"l1", "l2"}));
  Split s = split_model(m, "l1");
  CHECK(s.bottom.parameter_names() == std::vector<std::string>({"l1_weight", "l1_bias"}));
  CHECK(s.top.parameter_names() == std::vector<std::string>({"l2_weight", "l2_bias"}));
  // This forward relus between the children, the stages do not: check_stages sees it.
  CHECK(check_stages(s, x) > 1e-3);
  // Gradients flow through the cut into the scripted parameters.
  EdgeHalf edge(s.bottom, "none", false);
  CloudHalf cloud(s.top, "none");
  CloudHalf::Result r = cloud.step(edge.forward(x), torch::zeros({8}, torch::kLong));
  REQUIRE(r.gradient.has_value());
  edge.backward(*r.gradient);
  CHECK(m->named_parameters()["l1_weight"].grad().defined());
  CHECK(m->named_parameters()["l2_bias"].grad().defined());
}

TEST_CASE("act codec: lowrank gradient is autograd through the reconstruction") {
  torch::manual_seed(7);
  const at::Tensor a = torch::randn({8, 30}, torch::requires_grad());
  const at::Tensor w = torch::randn({8, 30});
  ActCodec codec("lowrank:rank=3,iters=2");
  CodecState state;
  ActPacket act = roundtrip(codec.encode(a, state));
  CHECK(act.format == ActFormat::kLowRank);
  CHECK(act.data.size() == 4u * 3 * (8 + 30));
  CHECK(act.params[3] == 1);  // basis id
  const at::Tensor q = state.basis;
  REQUIRE(q.sizes() == at::IntArrayRef({30, 3}));
  CHECK(at::allclose(q.t().mm(q), torch::eye(3), 1e-4, 1e-5));  // orthonormal

  // Reference: L = sum(tanh(A_hat) * w) with A_hat = A Q Q^T, Q detached.
  auto loss = [&](const at::Tensor& t) { return (torch::tanh(t) * w).sum(); };
  loss(a.mm(q.detach()).mm(q.detach().t())).backward();
  const at::Tensor ref = a.grad().clone();

  // Cloud: decode, loss, gradient of A_hat, send only G Q.
  at::Tensor a_hat = decode(act).requires_grad_();
  CHECK(at::allclose(a_hat, a.detach().mm(q).mm(q.t()), 1e-4, 1e-5));
  loss(a_hat).backward();
  CodecState peer;
  CHECK(at::allclose(decode_activation(act, peer), a_hat));
  CHECK(peer.basis_id == state.basis_id);
  ActPacket back = roundtrip(encode_gradient(a_hat.grad(), act, ActCodec("none"), peer));
  CHECK(back.format == ActFormat::kProjected);
  CHECK(back.data.size() == 4u * 8 * 3);  // N x R, not N x M
  const at::Tensor got = decode_gradient(back, state, {8, 30});
  CHECK(at::allclose(got, ref, 1e-4, 1e-6));
  // A different basis would give a different gradient: the check can fail.
  CodecState other;
  other.basis = std::get<0>(at::linalg_qr(torch::randn({30, 3})));
  CHECK_FALSE(at::allclose(decode_gradient(back, other, {8, 30}), ref, 1e-3, 1e-4));
}

TEST_CASE("act codec: lowrank recovers a low-rank activation and warm starts") {
  torch::manual_seed(3);
  const at::Tensor a = torch::randn({16, 4}).mm(torch::randn({4, 50}));  // rank 4
  ActCodec codec("lowrank:rank=4,iters=1");
  CodecState state;
  const at::Tensor first = decode(codec.encode(a, state));
  CHECK(state.steps == 1);
  CHECK((first - a).norm().item<double>() / a.norm().item<double>() < 1e-3);
  // Warm start: a slightly changed activation is still captured with one iteration.
  const at::Tensor b = a + 1e-3 * torch::randn({16, 50});
  const at::Tensor second = decode(codec.encode(b, state));
  CHECK((second - b).norm().item<double>() / b.norm().item<double>() < 1e-2);
  // Rank above min(N, M) is clamped.
  CodecState s2;
  ActPacket small = ActCodec("lowrank:rank=8").encode(torch::randn({3, 5}), s2);
  CHECK(small.params[2] == 3);
}

TEST_CASE("act codec: q8 and q4 error bounds") {
  torch::manual_seed(9);
  const at::Tensor x = torch::randn({16, 100}) * 3 + 1;
  for (std::string spec : {"q8", "q4", "q8:block=32", "q4:block=7"}) {
    CAPTURE(spec);
    const bool q8 = spec.rfind("q8", 0) == 0;
    CodecState st;
    ActPacket p = roundtrip(ActCodec(spec).encode(x, st));
    CHECK(p.data.size() == (q8 ? 1600u : 800u));
    const at::Tensor d = decode(p);
    // Per row: the widest block's step / 2 bounds the error of every value.
    const double levels = q8 ? 255 : 15;
    const at::Tensor range = std::get<0>(x.max(1)) - std::get<0>(x.min(1));
    const at::Tensor err = std::get<0>((d - x).abs().max(1));
    CHECK((err <= range / levels / 2 + 1e-5).all().item<bool>());
    CHECK(err.max().item<double>() > 0);  // it is lossy: the bound is not vacuous
  }
  // Constant rows (step 0) decode exactly.
  CodecState st;
  CHECK(at::equal(decode(ActCodec("q4").encode(torch::full({2, 9}, 0.5f), st)), torch::full({2, 9}, 0.5f)));
}

TEST_CASE("act codec: dense and topk round trips") {
  torch::manual_seed(4);
  const at::Tensor x = torch::randn({4, 3, 5});
  CodecState st;
  CHECK(at::equal(decode(roundtrip(ActCodec("none").encode(x, st))), x));
  ActPacket p = roundtrip(ActCodec("topk:ratio=0.1").encode(x, st));
  CHECK(p.params[0] == 6);
  CHECK(p.wire_bytes() == ActPacket::kHeaderBytes + 3 * 8 + 4 + 6 * 8);
  const at::Tensor d = decode(p);
  CHECK(d.sizes() == x.sizes());
  CHECK(d.ne(0).sum().item<int64_t>() == 6);
  const at::Tensor kept = d.ne(0);
  CHECK(at::equal(d.masked_select(kept), x.masked_select(kept)));
  CHECK(x.abs().masked_select(kept).min().item<float>() >=
        x.abs().masked_select(kept.logical_not()).max().item<float>());
}

TEST_CASE("act codec: a k = 0 top-k packet decodes to zeros") {
  // Was a memcpy from a null pointer (undefined behaviour, reported by UBSan).
  ActPacket p;
  p.format = ActFormat::kTopK;
  p.shape = {4, 15};
  p.params = {0};
  const at::Tensor d = decode(roundtrip(p));
  CHECK(d.sizes() == at::IntArrayRef({4, 15}));
  CHECK(d.abs().sum().item<float>() == 0);
}

TEST_CASE("act codec: bad packets are rejected") {
  torch::manual_seed(6);
  CodecState st;
  const ActPacket good = ActCodec("none").encode(torch::randn({2, 3}), st);
  const std::vector<uint8_t> bytes = good.serialize();
  CHECK_THROWS_AS(ActPacket::deserialize(bytes.data(), bytes.size() - 1), FormatError);
  std::vector<uint8_t> longer = bytes;
  longer.push_back(0);
  CHECK_THROWS_AS(ActPacket::deserialize(longer.data(), longer.size()), FormatError);
  std::vector<uint8_t> fmt = bytes;
  fmt[0] = 9;
  CHECK_THROWS_AS(ActPacket::deserialize(fmt.data(), fmt.size()), FormatError);
  CHECK_THROWS_AS(ActPacket::deserialize(bytes.data(), 3), FormatError);

  ActPacket nan = good;
  const float bad = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(nan.data.data() + 4, &bad, 4);
  CHECK_THROWS_AS(decode(nan), FormatError);
  ActPacket shape = good;
  shape.shape = {2, -3};
  CHECK_THROWS_AS(decode(shape), FormatError);
  ActPacket size = good;
  size.data.pop_back();
  CHECK_THROWS_AS(decode(size), FormatError);

  ActPacket topk = ActCodec("topk:ratio=0.5").encode(torch::randn({2, 3}), st);
  std::swap(topk.data[0], topk.data[4]);  // indices no longer ascending
  CHECK_THROWS_AS(decode(topk), FormatError);
  ActPacket quant = ActCodec("q8").encode(torch::randn({2, 3}), st);
  quant.params[0] = 5;
  CHECK_THROWS_AS(decode(quant), FormatError);
  ActPacket lr = ActCodec("lowrank:rank=2").encode(torch::randn({4, 6}), st);
  lr.params[2] = 0;
  CHECK_THROWS_AS(decode(lr), FormatError);

  // The device rejects a gradient for another shape or another basis.
  CodecState peer;
  ActPacket lr_act = ActCodec("lowrank:rank=2").encode(torch::randn({4, 6}), st);
  decode_activation(lr_act, peer);
  ActPacket proj = encode_gradient(torch::randn({4, 6}), lr_act, ActCodec("none"), peer);
  CHECK_THROWS_AS(decode(proj), FormatError);
  CHECK_THROWS_AS(decode_gradient(proj, st, {4, 5}), FormatError);
  CodecState empty;
  CHECK_THROWS_AS(decode_gradient(proj, empty, {4, 6}), FormatError);
}

TEST_CASE("split: a bad activation changes nothing in the cloud") {
  auto m = make_model("mlp", 1);
  Split s = split_model(m, "fc1");
  EdgeHalf edge(s.bottom, "none", false);
  CloudHalf cloud(s.top, "none");
  ActPacket act = edge.forward(images(4, 1));
  ActPacket broken = act;
  broken.data.resize(broken.data.size() - 4);
  CHECK_THROWS_AS(cloud.step(broken, labels(4)), FormatError);
  CHECK_THROWS_AS(cloud.step(act, labels(3)), FormatError);
  CHECK_THROWS_AS(cloud.step(act, labels(4) + 10), FormatError);
  CHECK_THROWS_AS(cloud.step(act, labels(4).to(torch::kInt)), FormatError);
  for (const at::Tensor& p : s.top.parameters()) CHECK_FALSE(p.grad().defined());
  // A bad gradient packet leaves the device's step pending and retryable.
  CloudHalf::Result r = cloud.step(act, labels(4));
  ActPacket g = *r.gradient;
  g.shape = {4, 100};
  g.data.resize(4 * 400);
  CHECK_THROWS_AS(edge.backward(g), FormatError);
  edge.backward(*r.gradient);
  CHECK(m->named_parameters()["fc1.weight"].grad().defined());
  CHECK_THROWS(edge.backward(*r.gradient));  // nothing pending any more
}

TEST_CASE("act codec: cached basis between refreshes") {
  torch::manual_seed(12);
  const at::Tensor mix = torch::randn({5, 40});
  ActCodec codec("lowrank:rank=5,iters=1,beta=0.5,refresh=3");
  CodecState device, cloud;
  std::vector<std::string> formats;
  for (int step = 0; step < 6; ++step) {
    const at::Tensor a = torch::randn({10, 5}).mm(mix);  // rank 5, same row space every step
    ActPacket p = roundtrip(codec.encode(a, device));
    formats.push_back(act_format_name(p.format));
    const at::Tensor d = decode_activation(p, cloud);
    CHECK((d - a).norm().item<double>() / a.norm().item<double>() < 1e-3);
    if (p.format == ActFormat::kLowRankCached) CHECK(p.data.size() == 4u * 10 * 5);  // P only
    // The projected gradient uses the cached basis on both sides.
    const at::Tensor g = torch::randn({10, 40});
    const at::Tensor back = decode_gradient(encode_gradient(g, p, ActCodec("none"), cloud), device, {10, 40});
    CHECK(at::allclose(back, g.mm(device.basis).mm(device.basis.t()), 1e-4, 1e-5));
  }
  CHECK(formats == std::vector<std::string>(
                       {"lowrank", "lowrank_cached", "lowrank_cached", "lowrank", "lowrank_cached", "lowrank_cached"}));
  // A cloud without the basis refuses a cached packet and stays as it was.
  CodecState fresh;
  codec.encode(torch::randn({10, 5}).mm(mix), device);  // step 6 refreshes
  ActPacket cached = codec.encode(torch::randn({10, 5}).mm(mix), device);
  REQUIRE(cached.format == ActFormat::kLowRankCached);
  CHECK_THROWS_AS(decode_activation(cached, fresh), FormatError);
  CHECK_FALSE(fresh.basis.defined());
  CHECK_THROWS_AS(decode(cached), FormatError);
  device.refresh_next = true;
  CHECK(codec.encode(torch::randn({10, 5}).mm(mix), device).format == ActFormat::kLowRank);
}

TEST_CASE("split: two devices share one cloud top") {
  // Each device has its own bottom (its own model copy) and lowrank basis; the
  // cloud keeps one CloudHalf per device over the same top parameters.
  auto cloud_model = make_model("mlp", 1);
  auto dev_a = make_model("mlp", 1), dev_b = make_model("mlp", 1);
  ModelPart top = split_model(cloud_model, "fc1").top;
  EdgeHalf a(split_model(dev_a, "fc1").bottom, "lowrank:rank=2,refresh=4", false);
  EdgeHalf b(split_model(dev_b, "fc1").bottom, "lowrank:rank=3,refresh=4", false);
  CloudHalf for_a(top, "none"), for_b(top, "none");
  for (int step = 0; step < 3; ++step) {
    CloudHalf::Result ra = for_a.step(a.forward(images(4, 10 + step)), labels(4));
    CloudHalf::Result rb = for_b.step(b.forward(images(4, 20 + step)), labels(4));
    a.backward(*ra.gradient);
    b.backward(*rb.gradient);
  }
  CHECK(for_a.peer_state().basis.size(1) == 2);
  CHECK(for_b.peer_state().basis.size(1) == 3);
  // Device b's cached packet does not decode with device a's basis.
  ActPacket pb = b.forward(images(4, 30));
  REQUIRE(pb.format == ActFormat::kLowRankCached);
  CHECK_THROWS_AS(for_a.step(pb, labels(4)), FormatError);
  CHECK(top.parameters()[0].grad().defined());
  CHECK(dev_a->named_parameters()["fc1.weight"].grad().defined());
  CHECK(dev_b->named_parameters()["fc1.weight"].grad().defined());
}

TEST_CASE("act codec: quantised lowrank factors") {
  torch::manual_seed(21);
  const at::Tensor mix = torch::randn({4, 40});  // every batch lies in one 4-dim row space
  for (std::string spec :
       {"lowrank:rank=12,beta=0.5,refresh=3,bits=8", "lowrank:rank=12,beta=0.5,refresh=3,bits=4",
        "lowrank:rank=12,beta=0.5,refresh=3,bits=8,gbits=32", "lowrank:rank=12,beta=0.5,refresh=3,bits=8,qbits=4"}) {
    CAPTURE(spec);
    const uint32_t bits = spec.find(",bits=4") != std::string::npos ? 4 : 8;
    const uint32_t qbits = spec.find("qbits=4") != std::string::npos ? 4 : 8;
    const bool fp32_grad = spec.find("gbits=32") != std::string::npos;
    ActCodec codec(spec);
    CodecState device, cloud;
    std::vector<std::string> formats;
    for (int step = 0; step < 4; ++step) {
      // 6 rows, rank 12 > 6: a streaming basis may exceed the batch.
      const at::Tensor a = torch::randn({6, 4}).mm(mix);
      ActPacket p = roundtrip(codec.encode(a, device));
      formats.push_back(act_format_name(p.format));
      REQUIRE(p.params.size() == 7);
      CHECK(p.params[2] == 12);
      CHECK(p.params[4] == bits);
      CHECK(p.params[5] == (fp32_grad ? 32u : bits));
      CHECK(p.params[6] == qbits);
      const size_t p_bytes = bits == 8 ? 6 * 12 : 6 * 12 / 2;
      CHECK(p.data.size() == p_bytes + (p.format == ActFormat::kLowRankQ ? 12u * 40 * qbits / 8 : 0u));
      const at::Tensor d = decode_activation(p, cloud);
      // Both sides hold the same (dequantised) basis, bit for bit.
      CHECK(at::equal(cloud.basis, device.basis));
      if (p.format == ActFormat::kLowRankQ) CHECK(at::equal(decode(p), d));
      const double rel = (d - a).norm().item<double>() / a.norm().item<double>();
      CHECK(rel < (bits == 8 && qbits == 8 ? 0.05 : 0.3));
      CHECK(rel > 1e-5);  // lossy: the quantisation is really applied
      // The gradient: quantised G Q, rebuilt with the shared basis.
      const at::Tensor g = torch::randn({6, 40});
      ActPacket back = roundtrip(encode_gradient(g, p, ActCodec("none"), cloud));
      CHECK(back.format == (fp32_grad ? ActFormat::kProjected : ActFormat::kProjectedQ));
      const at::Tensor exact = g.mm(device.basis).mm(device.basis.t());
      const at::Tensor got = decode_gradient(back, device, {6, 40});
      if (fp32_grad) {
        CHECK(at::allclose(got, exact, 1e-4, 1e-5));
      } else {
        CHECK(back.data.size() == p_bytes);
        // G Q quantised per column (error <= step / 2 each), then rebuilt with the basis.
        const double err = (got - exact).norm().item<double>() / exact.norm().item<double>();
        CHECK(err > 0);
        CHECK(err < (bits == 8 ? 0.02 : 0.2));
      }
    }
    CHECK(formats == std::vector<std::string>({"lowrank_q", "lowrank_cached_q", "lowrank_cached_q", "lowrank_q"}));
  }
  // Sizes at the benchmark's shape: P at 8 bits is a quarter of fp32.
  CodecState s8, s32;
  const at::Tensor a = torch::relu(torch::randn({64, 3136}));
  const ActPacket p8 = ActCodec("lowrank:rank=64,beta=0.9,bits=8").encode(a, s8);
  const ActPacket p32 = ActCodec("lowrank:rank=64,beta=0.9").encode(a, s32);
  CHECK(p8.wire_bytes() < p32.wire_bytes() / 3);
}

TEST_CASE("act codec: bad quantised lowrank packets are rejected") {
  torch::manual_seed(22);
  CHECK_THROWS_AS(ActCodec("lowrank:bits=16"), ConfigError);
  CHECK_THROWS_AS(ActCodec("lowrank:bits=8,gbits=2"), ConfigError);
  CHECK_THROWS_AS(ActCodec("lowrank:gbits=8"), ConfigError);  // fp32 factors, quantised gradient
  CHECK_THROWS_AS(ActCodec("lowrank:qbits=4"), ConfigError);
  CHECK_THROWS_AS(ActCodec("lowrank:bits=8,qbits=2"), ConfigError);
  ActCodec codec("lowrank:rank=3,beta=0.5,refresh=2,bits=4");
  CodecState device, cloud;
  const ActPacket full = codec.encode(torch::randn({4, 10}), device);
  const ActPacket cached = codec.encode(torch::randn({4, 10}), device);
  REQUIRE(full.format == ActFormat::kLowRankQ);
  REQUIRE(cached.format == ActFormat::kLowRankCachedQ);
  std::vector<ActPacket> bad;
  for (const ActPacket& good : {full, cached}) {
    ActPacket p = good;
    p.params[4] = 5;  // bits
    bad.push_back(p);
    p = good;
    p.params[5] = 16;  // gradient bits
    bad.push_back(p);
    p = good;
    p.params[6] = 32;  // basis bits
    bad.push_back(p);
    p = good;
    p.params[2] = 11;  // rank > M
    bad.push_back(p);
    p = good;
    p.params[3] = 0;  // basis id
    bad.push_back(p);
    p = good;
    p.params[1] = 9;  // M does not match the shape
    bad.push_back(p);
    p = good;
    p.scales[1] = -1;  // negative step
    bad.push_back(p);
    p = good;
    p.scales[0] = std::numeric_limits<float>::infinity();
    bad.push_back(p);
    p = good;
    p.scales[0] = 3e38f;  // finite, but the top code decodes to inf
    p.scales[1] = 3e38f;
    bad.push_back(p);
    p = good;
    p.scales.pop_back();
    bad.push_back(p);
    p = good;
    p.data.pop_back();
    bad.push_back(p);
    p = good;
    p.params.pop_back();
    bad.push_back(p);
  }
  for (size_t i = 0; i < bad.size(); ++i) {
    CAPTURE(i);
    CHECK_THROWS_AS(validate(bad[i]), FormatError);
    const std::vector<uint8_t> bytes = bad[i].serialize();
    CHECK_THROWS_AS(ActPacket::deserialize(bytes.data(), bytes.size()), FormatError);
    CodecState before = cloud;
    CHECK_THROWS_AS(decode_activation(bad[i], cloud), FormatError);
    CHECK(cloud.basis_id == before.basis_id);
  }
  // A cached packet needs its basis; the self-contained one decodes.
  CHECK_THROWS_AS(decode(cached), FormatError);
  CHECK_THROWS_AS(decode_activation(cached, cloud), FormatError);
  decode_activation(full, cloud);
  CHECK(decode_activation(cached, cloud).sizes() == at::IntArrayRef({4, 10}));

  // The quantised gradient: bad bits, sizes, scales; wrong rank for the device.
  const ActPacket grad = encode_gradient(torch::randn({4, 10}), cached, ActCodec("none"), cloud);
  REQUIRE(grad.format == ActFormat::kProjectedQ);
  CHECK(decode_gradient(grad, device, {4, 10}).sizes() == at::IntArrayRef({4, 10}));
  CHECK_THROWS_AS(decode(grad), FormatError);
  std::vector<ActPacket> bad_grads;
  ActPacket g = grad;
  g.params[2] = 32;
  bad_grads.push_back(g);
  g = grad;
  g.params[1] = 2;  // rank: sizes no longer match
  bad_grads.push_back(g);
  g = grad;
  g.params[0] = 5;
  bad_grads.push_back(g);
  g = grad;
  g.scales[3] = -0.5f;
  bad_grads.push_back(g);
  g = grad;
  g.scales[2] = std::numeric_limits<float>::quiet_NaN();
  bad_grads.push_back(g);
  g = grad;
  g.data.push_back(0);
  bad_grads.push_back(g);
  for (size_t i = 0; i < bad_grads.size(); ++i) {
    CAPTURE(i);
    CHECK_THROWS_AS(decode_gradient(bad_grads[i], device, {4, 10}), FormatError);
  }
  CodecState other;
  other.basis = torch::randn({10, 2});
  CHECK_THROWS_AS(decode_gradient(grad, other, {4, 10}), FormatError);  // rank 3 vs the device's 2
}

TEST_CASE("split: quantised lowrank split step") {
  auto m = make_model("cnn", 2);
  Split s = split_model(m, "conv2");
  EdgeHalf edge(s.bottom, "lowrank:rank=80,beta=0.9,refresh=2,bits=8", false);
  CloudHalf cloud(s.top, "none");
  for (int step = 0; step < 3; ++step) {
    ActPacket act = roundtrip(edge.forward(images(8, 40 + step)));
    CHECK(act.params[2] == 80);  // rank above the batch of 8
    CloudHalf::Result r = cloud.step(act, labels(8));
    REQUIRE(r.gradient.has_value());
    CHECK(r.gradient->format == ActFormat::kProjectedQ);
    edge.backward(roundtrip(*r.gradient));
  }
  CHECK(m->named_parameters()["conv1.weight"].grad().defined());
  CHECK(m->named_parameters()["conv1.weight"].grad().abs().sum().item<double>() > 0);
}

TEST_CASE("act codec: ramp adds two early refreshes") {
  torch::manual_seed(23);
  const at::Tensor mix = torch::randn({3, 20});
  for (bool ramp : {false, true}) {
    CAPTURE(ramp);
    ActCodec codec(std::string("lowrank:rank=3,beta=0.5,refresh=8,bits=8") + (ramp ? ",ramp=1" : ""));
    CodecState device, cloud;
    std::vector<int> refreshes;
    for (int step = 0; step < 17; ++step) {
      ActPacket p = roundtrip(codec.encode(torch::randn({5, 3}).mm(mix), device));
      decode_activation(p, cloud);
      if (p.format == ActFormat::kLowRankQ) refreshes.push_back(step);
    }
    CHECK(refreshes == (ramp ? std::vector<int>({0, 2, 4, 8, 16}) : std::vector<int>({0, 8, 16})));
  }
}
