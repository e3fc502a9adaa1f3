// Stand-ins for the CUDA KV-cache path when the library is built without CUDA: every entry
// reports that it is not compiled in (dispatch never reaches them without a device anyway).
#include "api/kvcache_backends.hpp"

namespace flashcore::cuda {

static Status decode_not_built() {
  return Status::unsupported("backend: the CUDA KV-cache path is not compiled into this build (configure with nvcc present)");
}
int kvcache_num_splits(const KvCacheParams&) { return 1; }
size_t kvcache_workspace(const KvCacheParams&) { return 0; }
bool kvcache_supports(const KvCacheParams&, Status* why) {
  *why = decode_not_built();
  return false;
}
Status kvcache_forward(const KvCacheParams&, void*, size_t) { return decode_not_built(); }
Status merge_partials(const MergeParams&) { return decode_not_built(); }
bool decode_route_suits(const KvCacheParams&) { return false; }

}  // namespace flashcore::cuda
