// Environment switches the library reads at every call, so that a benchmark or a test can move a
// call onto another path between two calls: FLASHCORE_CHECK_CU_SEQLENS and FLASHCORE_CPU_AMX
// (README.md), FLASHCORE_CPU_CHUNK_KEYS (a test knob, cpu/key_split.hpp). One reader per kind of
// value, so that every switch of a kind parses the same way.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace flashcore {

/** Whether `name` is set to something other than "" or "0". */
inline bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != 0 && std::strcmp(v, "0") != 0;
}

/** `name` as a whole non-negative number; `fallback` when unset, empty or anything else. */
inline int64_t env_count(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == 0) return fallback;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  return *end == 0 && n >= 0 ? static_cast<int64_t>(n) : fallback;
}

/** The first character of `name`'s value (a mode letter or digit); 0 when unset or empty. */
inline char env_mode(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? v[0] : 0;
}

}  // namespace flashcore
