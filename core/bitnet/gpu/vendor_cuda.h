/* CUDA spelling of the portable kernel dialect used by bitnet_kernels.c (see vendor_opencl.h).
 * Kernels are extern "C" so the host looks them up by the same names as the OpenCL plugin. */

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define KERNEL extern "C" __global__ void
#define DEVICE static __device__ __forceinline__
#define GLOBAL
#define LOCAL __shared__
#define LOCAL_PTR
#define RESTRICT __restrict__
#define BARRIER() __syncthreads()

#define TID ((int)threadIdx.x)
#define LSIZE ((int)blockDim.x)
#define GROUP_X ((int)blockIdx.x)
#define GROUP_Y ((int)blockIdx.y)
#define GLOBAL_X ((int)(blockIdx.x * blockDim.x + threadIdx.x))

#define AS_FLOAT(u) __uint_as_float(u)
#define AS_UINT(f) __float_as_uint(f)
