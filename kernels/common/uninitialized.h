// A std::vector whose resize() leaves new elements uninitialised (default-initialised): buffers
// that are written whole before they are read (exchange workspaces, the geometry's scratch) skip
// the memset of a value-initialising resize, a wasted pass over memory on every step.
#pragma once

#include <memory>
#include <new>
#include <utility>
#include <vector>

namespace geofp8 {

template <typename T>
struct UninitializedAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = UninitializedAllocator<U>;
  };
  UninitializedAllocator() = default;
  template <typename U>
  UninitializedAllocator(const UninitializedAllocator<U>&) noexcept {}
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

template <typename T>
using UninitializedVector = std::vector<T, UninitializedAllocator<T>>;

}  // namespace geofp8
