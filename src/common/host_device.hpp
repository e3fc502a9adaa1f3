// Portable qualifiers so src/common/ headers compile as plain C++ and as CUDA.
#pragma once

#if defined(__CUDACC__)
#define FC_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FC_HOST_DEVICE inline
#endif
