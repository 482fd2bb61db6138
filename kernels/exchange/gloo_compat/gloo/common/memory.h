// Declarations for gloo/transport/tcp/pair.h, which includes "gloo/common/memory.h" but whose
// Debian package (libgloo-dev 0.0~git20220518.5b14351-3) does not install that header.
//
// Written for this project, not taken from gloo: it declares only the three pointer wrappers
// pair.h names, with just enough to make them complete types. gloo_communicator.cc includes
// pair.h for one thing, a pointer to tcp::Pair::signalExceptionExternal, a member function that
// libgloo.so defines; that translation unit never creates, copies or destroys a Pair or any of
// these wrappers, so none of their code is instantiated here and libgloo.so's own definitions
// are the only ones that run. -idirafter puts this folder after the system include path: a gloo
// that installs the real header wins.
#pragma once

#include <memory>

namespace gloo {

template <typename T>
class ShareableNonOwningPtr;  // owned by an UnboundBuffer inside libgloo

// A weak reference to an UnboundBuffer that a pending operation holds.
template <typename T>
class WeakNonOwningPtr final {
 private:
  std::weak_ptr<T> ptr_;
};

// A WeakNonOwningPtr locked for the duration of a completion callback.
template <typename T>
class NonOwningPtr final {
 private:
  std::shared_ptr<T> ptr_;
};

}  // namespace gloo
