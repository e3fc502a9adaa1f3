// Translation unit of the shared library libflashcore: its exported symbols are the C ABI
// functions pulled in whole from flashcore_impl; this file only anchors the target.
#include "flashcore/flashcore.h"

extern "C" FC_API int32_t fc_abi_version(void) { return FC_ABI_VERSION; }
