#pragma once
// A 5x5 convolution (stride 1, padding 2) followed by bias, ReLU and 2x2
// max pooling (stride 2), on raw float arrays: the CNN's second convolution
// (82% of its multiply-adds), in training and evaluation.
//
// It uses Winograd's minimal filtering F(4x4, 5x5) (Lavin & Gray, "Fast
// Algorithms for Convolutional Neural Networks", CVPR 2016) with the points
// 0, +-1, +-2, +-1/2 and infinity: each 4x4 output tile is
// A^T [(G g G^T) . (B^T d B)] A with 8x8 transformed tiles, so the
// multiply-adds become 64 GEMMs [tiles, cin] x [cin, cout], one per
// transformed position: 64 multiplies per 16 outputs instead of 400. On the
// CNN's 14x14 images (tiled as 16x16) that is 1.7x fewer than F(2x2, 5x5),
// which Sparrow used before. A 4x4 output tile is four pooling windows, so
// bias, ReLU and pooling are fused into the output transform.
//
// The backward uses the same transforms transposed: W = A dY A^T per tile
// (dY has one non-zero per pooling window: four outer products); dU = sum over
// tiles of V^T W (accumulated over the minibatch in the transformed domain,
// turned into dL/dg = G^T dU G once per step); the input gradient is
// B (W U^T) B^T added back onto the overlapping input tiles. Arithmetic
// differs from a direct convolution only by float rounding (relative ~1e-6
// on the forward, ~1e-5 on the gradients, tested against ATen).
//
// The GEMMs run over `group` images at once ([group * tiles, cin] x
// [cin, cout] per transformed position): 4 in training, 1 in evaluation were
// the fastest on the 2-vCPU machine.

#include <cstdint>
#include <vector>

namespace sparrow::kernels {

class WinogradConv5Pool {
 public:
  // cin input channels of h x w images (h, w even), cout output channels,
  // up to `group` images per forward or backward.
  WinogradConv5Pool(int64_t cin, int64_t cout, int64_t h, int64_t w, int64_t group);

  int64_t group() const { return group_; }

  // Transforms the weights w [cout, cin, 5, 5] (and keeps bias [cout]); call
  // again whenever they change.
  void set_weights(const float* w, const float* bias);

  // n (<= group) images x [n, cin, h, w] -> out [n, cout, h/2, w/2] =
  // maxpool(relu(conv(x) + bias)). arg (n pooled_size() values, or null)
  // receives which element of each window won, for backward only (its
  // layout is internal: channels last).
  int64_t pooled_size() const { return cout_ * (h_ / 2) * (w_ / 2); }
  void forward(int64_t n, const float* x, float* out, int32_t* arg = nullptr);

  // Clears the gradients accumulated by backward.
  void zero_grad();

  // The backward of n images: x and arg as given to and returned by forward,
  // dout [n, cout, h/2, w/2] the gradient of out. Accumulates the weight and
  // bias gradients; writes dL/dx [n, cin, h, w] into dx unless it is null.
  void backward(int64_t n, const float* x, const int32_t* arg, const float* dout, float* dx);

  // gw = beta gw + alpha dL/dw and gb = beta gb + alpha dL/db over every image
  // since zero_grad (beta = 0 overwrites). gw may be the weights given to
  // set_weights (they are no longer read).
  void weight_grad(float* gw, float* gb, float alpha, float beta) const;

 private:
  void input_transform(int64_t n, const float* x);

  int64_t cin_, cout_, h_, w_, group_, th_, tw_, cols_, pad_size_;
  int64_t vstride_ = 0, mstride_ = 0;  // floats from one position's rows to the next in V and M
  std::vector<float> u_, ut_, bias_;   // U [64, cin, cout], U^T [64, cout, cin]
  std::vector<float> du_, db_;         // dL/dU [64, cin, cout], dL/db [cout]
  std::vector<float> pad_, dpad_;      // one image padded [4 th + 4, 4 tw + 4, cin], channels last; its gradient
  std::vector<float> pooled_;          // one image's output (or its gradient) channels last [h/2, w/2, cout]
  std::vector<float> v_, m_;           // V [64, group * tiles, cin], M [64, group * tiles, cout], padded
  std::vector<float> tmp_;             // a band's or a tile's half-transformed values
  std::vector<float> scratch_;         // the weight transform's
};

}  // namespace sparrow::kernels
