/* OpenCL C spelling of the portable kernel dialect used by bitnet_kernels.c.
 * The body is written in the C subset both OpenCL C and CUDA C++ accept; everything that is spelled
 * differently lives here and in vendor_cuda.h, nowhere else. The host defines the HAS_* feature macros
 * from the device's extensions (bitnet_opencl.probe.device_features); this header maps them to
 * OpenCL's built-ins. */

#define KERNEL __kernel void
#define DEVICE static inline
#define GLOBAL __global
#define LOCAL __local            /* declares a work-group array, at kernel scope */
#define LOCAL_PTR __local        /* qualifies a pointer parameter to such an array */
#define RESTRICT restrict
/* Work-groups here share data through local memory and (attention) their own global rows. */
#define BARRIER() barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE)

#define TID ((int)get_local_id(0))
#define LSIZE ((int)get_local_size(0))
#define GROUP_X ((int)get_group_id(0))
#define GROUP_Y ((int)get_group_id(1))
#define GLOBAL_X ((int)get_global_id(0))
#define NUM_GROUPS_X ((int)get_num_groups(0))
#define U64 ulong

#define AS_FLOAT(u) as_float(u)
#define AS_UINT(f) as_uint(f)

/* The body uses the C99 float names, as CUDA does; OpenCL overloads the plain ones. */
#define expf(x) exp(x)
#define sqrtf(x) sqrt(x)
#define rintf(x) rint(x)
#define fabsf(x) fabs(x)
#define fmaxf(a, b) fmax(a, b)
#define fminf(a, b) fmin(a, b)

#ifdef HAS_F16 /* cl_khr_fp16 */
#pragma OPENCL EXTENSION cl_khr_fp16 : enable
#define F16_TO_F32(h) ((float)as_half((ushort)(h)))
#define F32_TO_F16(f) ((uint)as_ushort(convert_half_rte(f)))
#endif

#ifdef HAS_DP4A /* cl_khr_integer_dot_product: its built-ins are declared from OpenCL C 3.0 on */
#define DOT4_U8_I8(c, q) dot_4x8packed_us_int((uint)(c), (uint)(q))
#endif

#ifdef HAS_SUBGROUP_REDUCE /* cl_khr_subgroups or cl_intel_subgroups */
#ifdef cl_khr_subgroups
#pragma OPENCL EXTENSION cl_khr_subgroups : enable
#endif
#define SG_LANE ((int)get_sub_group_local_id())
#define SG_ID ((int)get_sub_group_id())
#define SG_COUNT ((int)get_num_sub_groups())
#define SG_SUM(v) sub_group_reduce_add(v)
#define SG_MAX(v) sub_group_reduce_max(v)
#define SG_MIN(v) sub_group_reduce_min(v)
#endif
