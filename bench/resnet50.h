#pragma once
// The parameter shapes of torchvision's ResNet-50 (25,557,032 parameters), so
// low-rank benchmarks see real layer shapes rather than one flat vector.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace sparrow::bench {

inline std::vector<std::pair<std::string, std::vector<int64_t>>> resnet50_shapes() {
  std::vector<std::pair<std::string, std::vector<int64_t>>> s;
  auto conv_bn = [&](const std::string& name, int64_t out, int64_t in, int64_t k) {
    s.push_back({name + ".weight", {out, in, k, k}});
    s.push_back({name + ".bn.weight", {out}});
    s.push_back({name + ".bn.bias", {out}});
  };
  conv_bn("conv1", 64, 3, 7);
  int64_t in = 64;
  const int64_t planes[4] = {64, 128, 256, 512};
  const int blocks[4] = {3, 4, 6, 3};
  for (int layer = 0; layer < 4; ++layer) {
    for (int b = 0; b < blocks[layer]; ++b) {
      const std::string p = "layer" + std::to_string(layer + 1) + "." + std::to_string(b);
      const int64_t w = planes[layer];
      conv_bn(p + ".conv1", w, in, 1);
      conv_bn(p + ".conv2", w, w, 3);
      conv_bn(p + ".conv3", w * 4, w, 1);
      if (b == 0) conv_bn(p + ".downsample", w * 4, in, 1);
      in = w * 4;
    }
  }
  s.push_back({"fc.weight", {1000, 2048}});
  s.push_back({"fc.bias", {1000}});
  return s;
}

}  // namespace sparrow::bench
