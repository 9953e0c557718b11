#include "liteclient/ring.h"

#include "core/error.h"
#include "core/rng.h"
#include "secagg/secagg.h"

namespace sparrow::liteclient {

RingUpdate quantise_update(const Layout& layout, const std::vector<float>& delta, double weight, double clip,
                           double scale, uint64_t key) {
  SPARROW_CHECK(static_cast<int64_t>(delta.size()) == layout.total,
                "quantise_update: the update holds " << delta.size() << " values, the model " << layout.total);
  RingUpdate q;
  q.x.resize(delta.size());
  for (size_t k = 0; k < layout.names.size(); ++k) {
    const auto off = static_cast<size_t>(layout.offsets[k]);
    q.clipped += secagg::quantise(delta.data() + off, static_cast<size_t>(layout.sizes[k]), weight, clip, scale,
                                  rng::derive(key, off), q.x.data() + off);
  }
  return q;
}

}  // namespace sparrow::liteclient
