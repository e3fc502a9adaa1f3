"""flashcore: exact attention (FlashAttention) for CPU and CUDA.

Drop-in for flash_attn:  ``import flashcore as flash_attn``; then
``flash_attn.flash_attn_func(q, k, v)`` on torch tensors (CUDA or CPU, with autograd,
torch.compile and CUDA graphs) or numpy arrays (CPU backend). Framework-neutral calls for any
DLPack array and an explicit stream: ``attention_forward`` / ``attention_backward``. Inference:
``flash_attn_with_kvcache`` (decode against contiguous or paged KV caches, appending in place)
and ``merge_partials`` (combine attention over disjoint key sets). Context parallel across the
ranks of a torch.distributed group: ``flashcore.ring_attention.ring_flash_attn_func``. Padded
batches to and from the varlen calls' packed tokens: ``flashcore.bert_padding`` (flash_attn's
``unpad_input`` / ``pad_input``).

The compiled part is the extension ``flashcore._C`` (the C ABI in include/flashcore/flashcore.h).
torch is never imported by flashcore itself: the torch integration (flashcore._torch) loads
when torch is already imported or a torch tensor is first passed in.
"""

import sys as _sys

from . import _C
from ._dlpack_api import BACKENDS as _BACKENDS
from ._dlpack_api import attention_backward, attention_forward
from .flash_attn_interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
    merge_partials,
    set_default_backend,
)

__version__ = _C.version()


def build_info():
    """The library's build configuration: backends compiled in, CUDA archs, head dims, dtypes."""
    return _C.build_info()


def backends():
    """Names of the backends the library knows ('cpu_reference', 'cpu_flash', ...)."""
    return [name for name in _BACKENDS if name != "auto"]


def backend_available(name, device_id=0):
    """Whether a backend is compiled in and has a device to run on."""
    from ._dlpack_api import backend_id

    return _C.backend_available(backend_id(name), device_id)


def cuda_device_count():
    """CUDA devices visible to flashcore (0 without CUDA support or GPU)."""
    return _C.cuda_device_count()


def cuda_device_description(device_id=0):
    """One line about a visible CUDA device: name, compute capability, SMs, memory, DRAM peak
    bandwidth. ValueError when no such device is visible."""
    return _C.cuda_device_description(device_id)


# Register the torch custom ops now when torch is loaded already: registration then happens
# outside any torch.compile trace. Otherwise flash_attn_interface loads them on first use.
if "torch" in _sys.modules:
    from .flash_attn_interface import _load_torch_impl

    _load_torch_impl()
    del _load_torch_impl

__all__ = [
    "__version__",
    "attention_backward",
    "attention_forward",
    "backend_available",
    "backends",
    "build_info",
    "cuda_device_count",
    "cuda_device_description",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "merge_partials",
    "set_default_backend",
]
