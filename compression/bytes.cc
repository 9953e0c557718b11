#include "compression/bytes.h"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <new>

namespace sparrow::compression {

void* Bytes::allocate_large(size_t n) {
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t size = (n + kHuge - 1) / kHuge * kHuge;
  void* p = std::aligned_alloc(kHuge, size);
  if (!p) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
  (void)::madvise(p, size, MADV_HUGEPAGE);  // advice only: without THP it is 4 KiB pages as before
#endif
  return p;
}

void Bytes::free_large(void* p) { std::free(p); }

Bytes& Bytes::operator=(const Bytes& o) {
  if (this == &o) return *this;
  own_ = o.own_;
  view_ = o.view_;
  view_size_ = o.view_size_;
  owner_ = o.owner_;
  checked_.store(o.checked_.load(std::memory_order_relaxed), std::memory_order_relaxed);
  return *this;
}

Bytes& Bytes::operator=(Bytes&& o) noexcept {
  if (this == &o) return *this;
  own_ = std::move(o.own_);
  view_ = o.view_;
  view_size_ = o.view_size_;
  owner_ = std::move(o.owner_);
  checked_.store(o.checked_.load(std::memory_order_relaxed), std::memory_order_relaxed);
  o.own_.clear();
  o.view_ = nullptr;
  o.view_size_ = 0;
  o.checked_.store(0, std::memory_order_relaxed);
  return *this;
}

Bytes Bytes::view(const uint8_t* p, size_t n, std::shared_ptr<const void> owner) {
  Bytes b;
  if (n == 0) return b;
  b.view_ = p;
  b.view_size_ = n;
  b.owner_ = std::move(owner);
  return b;
}

Bytes::Storage& Bytes::writable() {
  checked_.store(0, std::memory_order_relaxed);
  if (view_) {
    Storage copy(view_size_);
    std::memcpy(copy.data(), view_, view_size_);
    own_ = std::move(copy);
    view_ = nullptr;
    view_size_ = 0;
    owner_.reset();
  }
  return own_;
}

void Bytes::resize(size_t n, uint8_t v) {
  Storage& s = writable();
  const size_t old = s.size();
  s.resize(n);
  if (n > old) std::memset(s.data() + old, v, n - old);
}

void Bytes::resize_uninitialized(size_t n) { writable().resize(n); }

void Bytes::assign(size_t n, uint8_t v) {
  Storage& s = writable();
  s.resize(n);
  if (n) std::memset(s.data(), v, n);
}

void Bytes::assign(const uint8_t* first, const uint8_t* last) {
  Storage& s = writable();
  s.assign(first, last);
}

void Bytes::clear() { writable().clear(); }

bool operator==(const Bytes& a, const Bytes& b) {
  return a.size() == b.size() && (a.size() == 0 || std::memcmp(a.data(), b.data(), a.size()) == 0);
}

}  // namespace sparrow::compression
