/* CUDA spelling of the portable kernel dialect used by bitnet_kernels.c (see vendor_opencl.h), and the
 * features every CUDA device we build for has. Kernels are extern "C" so the host looks them up by the
 * same names as the OpenCL plugin. */

#include <cuda_fp16.h>

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
#define NUM_GROUPS_X ((int)gridDim.x)
#define U64 unsigned long long

#define AS_FLOAT(u) __uint_as_float(u)
#define AS_UINT(f) __float_as_uint(f)
#define UNROLL_WORDS _Pragma("unroll")

/* cuMemAlloc aligns every buffer to 256 bytes. */
#define HAS_WIDE_LOADS 1

#define HAS_F16 1
#define F16_TO_F32(h) __half2float(__ushort_as_half((unsigned short)(h)))
#define F32_TO_F16(f) ((unsigned int)__half_as_ushort(__float2half_rn(f)))

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 610
#define HAS_DP4A 1
#define DOT4_U8_I8(c, q) __dp4a((int)(c), (q), 0) /* the codes are 0..2: signed or not, the same bytes */
#endif

/* Subgroups are warps of 32 (the whole block when it is smaller), reduced by butterflies of shuffles. */
#define HAS_SUBGROUP_REDUCE 1
#define SG_LANE (TID % 32)
#define SG_ID (TID / 32)
#define SG_COUNT ((LSIZE + 31) / 32)
#define SG_MASK_ (LSIZE >= 32 ? 0xffffffffu : (1u << LSIZE) - 1u)
#define SG_WIDTH_ (LSIZE >= 32 ? 32 : LSIZE)

template <typename T> static __device__ __forceinline__ T sg_sum_(T v)
{
    for (int o = SG_WIDTH_ / 2; o > 0; o >>= 1) v += __shfl_xor_sync(SG_MASK_, v, o);
    return v;
}

static __device__ __forceinline__ float sg_max_(float v)
{
    for (int o = SG_WIDTH_ / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(SG_MASK_, v, o));
    return v;
}

static __device__ __forceinline__ int sg_min_(int v)
{
    for (int o = SG_WIDTH_ / 2; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(SG_MASK_, v, o));
    return v;
}

#define SG_SUM(v) sg_sum_(v)
#define SG_MAX(v) sg_max_(v)
#define SG_MIN(v) sg_min_(v)
