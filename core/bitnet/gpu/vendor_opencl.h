/* OpenCL C spelling of the portable kernel dialect used by bitnet_kernels.c.
 * The body is written in the C subset both OpenCL C 1.2 and CUDA C++ accept; everything that is
 * spelled differently lives here and in vendor_cuda.h, nowhere else. */

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

#define AS_FLOAT(u) as_float(u)
#define AS_UINT(f) as_uint(f)

/* The body uses the C99 float names, as CUDA does; OpenCL overloads the plain ones. */
#define expf(x) exp(x)
#define sqrtf(x) sqrt(x)
#define rintf(x) rint(x)
#define fabsf(x) fabs(x)
#define fmaxf(a, b) fmax(a, b)
#define fminf(a, b) fmin(a, b)
