// The C ABI's per-thread last error, shared by every file that implements C entry points
// (c_api.cpp owns the storage; kvcache_api.cpp records through it too).
#pragma once

#include "api/status.hpp"
#include "flashcore/flashcore.h"

namespace flashcore {
/** Stores s.message (or "" on success) as this thread's fc_last_error() and returns s.code. */
fc_status record_status(const Status& s);
}  // namespace flashcore
