#pragma once
// Bytes: Encoded::values. Owns its bytes like a std::vector<uint8_t>, or is a
// read-only view of bytes that something else keeps alive (a received ZeroMQ
// frame, wire::parse with an owner), so a 100 MB dense update is verified and
// folded where it arrived instead of being copied out first. Writing through a
// view (non-const data(), operator[], resize, ...) first copies it into owned
// storage. It also remembers that validate() found its values finite, until
// the next write, so one update is scanned once on its way from the parser to
// the sum.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <vector>

namespace sparrow::compression {

class Bytes {
 public:
  Bytes() = default;
  Bytes(std::initializer_list<uint8_t> v) : own_(v.begin(), v.end()) {}
  Bytes(const std::vector<uint8_t>& v) : own_(v.begin(), v.end()) {}  // NOLINT: implicit, as the vector it replaces
  Bytes(const Bytes& o) { *this = o; }
  Bytes(Bytes&& o) noexcept { *this = std::move(o); }
  Bytes& operator=(const Bytes& o);
  Bytes& operator=(Bytes&& o) noexcept;

  // A view of [p, p + n) that `owner` keeps alive (it is held until this
  // Bytes and its copies are gone or written to).
  static Bytes view(const uint8_t* p, size_t n, std::shared_ptr<const void> owner);
  bool is_view() const { return view_ != nullptr; }

  size_t size() const { return view_ ? view_size_ : own_.size(); }
  bool empty() const { return size() == 0; }
  const uint8_t* data() const { return view_ ? view_ : own_.data(); }
  uint8_t* data() { return writable().data(); }
  const uint8_t* begin() const { return data(); }
  const uint8_t* end() const { return data() + size(); }
  uint8_t* begin() { return data(); }
  uint8_t* end() { return data() + size(); }
  uint8_t operator[](size_t i) const { return data()[i]; }
  uint8_t& operator[](size_t i) { return writable()[i]; }
  uint8_t back() const { return data()[size() - 1]; }
  uint8_t& back() { return writable().back(); }
  void push_back(uint8_t v) { writable().push_back(v); }
  void pop_back() { writable().pop_back(); }

  // As std::vector: new bytes are zero.
  void resize(size_t n) { resize(n, 0); }
  void resize(size_t n, uint8_t v);
  // New bytes left uninitialised (the caller writes every one): no zero-fill
  // pass over a large buffer that is about to be overwritten.
  void resize_uninitialized(size_t n);
  void assign(size_t n, uint8_t v);
  void assign(const uint8_t* first, const uint8_t* last);
  void reserve(size_t n) { writable().reserve(n); }
  void clear();

  // validate()'s memo: the values were found finite as `tag` (value type and
  // count); cleared by any write.
  bool checked(uint64_t tag) const { return checked_.load(std::memory_order_relaxed) == tag; }
  void set_checked(uint64_t tag) const { checked_.store(tag, std::memory_order_relaxed); }

  friend bool operator==(const Bytes& a, const Bytes& b);
  friend bool operator!=(const Bytes& a, const Bytes& b) { return !(a == b); }

 private:
  // Large buffers (a dense update of a big model) are backed by transparent
  // huge pages where the kernel allows it: 512x fewer page faults on first touch.
  static void* allocate_large(size_t n);
  static void free_large(void* p);
  static constexpr size_t kLarge = size_t{4} << 20;
  // A std::allocator that default-initialises (resize_uninitialized skips the
  // zero-fill) and takes large blocks from allocate_large.
  template <typename T>
  struct DefaultInit : std::allocator<T> {
    template <typename U>
    struct rebind {
      using other = DefaultInit<U>;
    };
    using std::allocator<T>::allocator;
    T* allocate(size_t n) {
      if (n * sizeof(T) >= kLarge) return static_cast<T*>(allocate_large(n * sizeof(T)));
      return std::allocator<T>::allocate(n);
    }
    void deallocate(T* p, size_t n) {
      if (n * sizeof(T) >= kLarge) return free_large(p);
      std::allocator<T>::deallocate(p, n);
    }
    template <typename U>
    void construct(U* p) noexcept {
      ::new (static_cast<void*>(p)) U;
    }
    template <typename U, typename... Args>
    void construct(U* p, Args&&... args) {
      ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
    }
  };
  using Storage = std::vector<uint8_t, DefaultInit<uint8_t>>;
  Storage& writable();  // copies a view into owned storage; clears the memo

  Storage own_;
  const uint8_t* view_ = nullptr;
  size_t view_size_ = 0;
  std::shared_ptr<const void> owner_;
  mutable std::atomic<uint64_t> checked_{0};
};

}  // namespace sparrow::compression
