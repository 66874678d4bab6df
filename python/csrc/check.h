// TS_CHECK: TORCH_CHECK without iostreams.
//
// Note [No iostreams in _C]. On the GPU host (Ubuntu 24.04, g++ 13, the torch
// 2.11 wheel), any std::istream/ostream use inside trainstream._C crashed in
// libstdc++'s locale code (std::codecvt, seen under cuda-gdb from an
// std::ifstream >> int), and so did TORCH_CHECK failures, whose messages c10::str
// formats with an ostringstream instantiated in our module. Code linked into _C
// therefore builds messages with std::string only.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdio>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace trainstream::python::detail {

inline void Append(std::string& s, const char* v) { s += v; }
inline void Append(std::string& s, const std::string& v) { s += v; }
inline void Append(std::string& s, char v) { s += v; }
inline void Append(std::string& s, const c10::Device& d) { s += d.str(); }
inline void Append(std::string& s, c10::ScalarType t) { s += c10::toString(t); }
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
void Append(std::string& s, T v) {
  s += std::to_string(v);
}
template <typename T, std::enable_if_t<std::is_floating_point_v<T>, int> = 0>
void Append(std::string& s, T v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", static_cast<double>(v));
  s += buf;
}

template <typename... Args>
std::string Concat(const Args&... args) {
  std::string s;
  (Append(s, args), ...);
  return s;
}

}  // namespace trainstream::python::detail

// Throws std::runtime_error (Python RuntimeError, as TORCH_CHECK would) with the
// arguments concatenated when `cond` is false.
#define TS_CHECK(cond, ...)                                                                    \
  do {                                                                                         \
    if (!(cond)) throw std::runtime_error(::trainstream::python::detail::Concat(__VA_ARGS__)); \
  } while (0)
