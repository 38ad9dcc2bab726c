/* bitnet GPU kernels, written once for OpenCL and CUDA.
 *
 * This body is the C subset OpenCL C and CUDA C++ share; a vendor header (vendor_opencl.h,
 * vendor_cuda.h or a third party's, prepended by bitnet.gpu.source) spells KERNEL, GLOBAL, LOCAL,
 * BARRIER, the index macros and the float math names. Fast paths key on feature macros, never on a
 * vendor; each has the portable body beside it, which runs wherever the feature is missing:
 *   HAS_SUBGROUP_REDUCE  SG_SUM / SG_MAX / SG_MIN over a subgroup (every lane gets the result), with
 *                        SG_LANE, SG_ID, SG_COUNT: subgroups are consecutive runs of TID.
 *   HAS_DP4A             DOT4_U8_I8(c, q): four unsigned bytes of c times four signed bytes of q, summed.
 *   HAS_F16              F16_TO_F32(bits) and F32_TO_F16(f) (round to nearest even) in hardware.
 *   HAS_WIDE_LOADS       128-bit loads through int4 / uint4 / float4 pointers: buffers are 16-byte aligned.
 * UNROLL_WORDS, optional, is the pragma that fully unrolls a block's word loop where a compiler needs it.
 *
 * Launch conventions (the same for both hosts): work-groups of LSIZE threads along x, a power of two
 * no larger than MAX_WG; GROUP_X / GROUP_Y index the grid. Activations are float32 row-major [n, width].
 * Ternary weights keep the canonical layout (bitnet.ternary) read as 32-bit words: 16 words per
 * 256-value block, one float scale per block. The host defines MAX_WG and TILE_N at build time.
 */

#ifndef MAX_WG
#define MAX_WG 256
#endif
#ifndef TILE_N
#define TILE_N 8 /* tokens per work-group in the matmuls: weights are read once per tile of tokens */
#endif

#define NEG_INF AS_FLOAT(0xff800000u)

/* ---- work-group reductions (LSIZE must be a power of two; every thread must call them) ---------- */

#define SUM(a, b) ((a) + (b))
/* Larger magnitude, then the larger value: a total order, so every thread combining the same values in
 * any order agrees on the winner (the portable tree keeps either sign on a tie; both give the same
 * product, see group_max_magnitude). */
#define MAX_MAGNITUDE(a, b) (fabsf(b) > fabsf(a) || (fabsf(b) == fabsf(a) && (b) > (a)) ? (b) : (a))

#ifdef HAS_SUBGROUP_REDUCE
/* After a subgroup reduction: the first lane of each subgroup publishes its result and every thread
 * combines them in subgroup order, the same order everywhere, so all threads hold the same bits. The
 * closing barrier keeps the portable contract: local writes made before the call are visible after it
 * (attention relies on this), and `red` may be reused at once. */
#define ACROSS_SUBGROUPS(red, v, COMBINE)                                                           \
    do {                                                                                          \
        if (SG_COUNT > 1) {                                                                       \
            if (SG_LANE == 0) red[SG_ID] = v;                                                     \
            BARRIER();                                                                            \
            v = red[0];                                                                           \
            for (int s_ = 1; s_ < SG_COUNT; ++s_) v = COMBINE(v, red[s_]);                        \
        }                                                                                         \
        BARRIER();                                                                                \
    } while (0)
#endif

/* The portable reduction: a tree over local memory; every thread ends with the result in v, and the
 * closing barrier lets the caller reuse `red` at once. */
#define TREE_REDUCE(red, v, COMBINE)                                                                \
    do {                                                                                          \
        red[TID] = v;                                                                             \
        BARRIER();                                                                                \
        for (int s_ = LSIZE / 2; s_ > 0; s_ >>= 1) {                                              \
            if (TID < s_) red[TID] = COMBINE(red[TID], red[TID + s_]);                            \
            BARRIER();                                                                            \
        }                                                                                         \
        v = red[0];                                                                               \
        BARRIER();                                                                                \
    } while (0)
/* The first of the larger magnitude: the tree may keep either sign on a tie (see below). */
#define FIRST_MAGNITUDE(a, b) (fabsf(b) > fabsf(a) ? (b) : (a))

DEVICE float group_sum(LOCAL_PTR float* red, float v)
{
#ifdef HAS_SUBGROUP_REDUCE
    v = SG_SUM(v);
    ACROSS_SUBGROUPS(red, v, SUM);
#else
    TREE_REDUCE(red, v, SUM);
#endif
    return v;
}

DEVICE int group_sum_int(LOCAL_PTR int* red, int v)
{
#ifdef HAS_SUBGROUP_REDUCE
    v = SG_SUM(v);
    ACROSS_SUBGROUPS(red, v, SUM);
#else
    TREE_REDUCE(red, v, SUM);
#endif
    return v;
}

DEVICE float group_max(LOCAL_PTR float* red, float v)
{
#ifdef HAS_SUBGROUP_REDUCE
    v = SG_MAX(v);
    ACROSS_SUBGROUPS(red, v, fmaxf);
#else
    TREE_REDUCE(red, v, fmaxf);
#endif
    return v;
}

/* The value of largest magnitude, sign kept (Q8_K's scale); which of +-v wins a tie does not change
 * the quantized product, since q and d both flip sign. */
DEVICE float group_max_magnitude(LOCAL_PTR float* red, float v)
{
#ifdef HAS_SUBGROUP_REDUCE
    /* The largest magnitude, then the largest value among the lanes that hold it. */
    const float m = SG_MAX(fabsf(v));
    v = SG_MAX(fabsf(v) == m ? v : NEG_INF);
    ACROSS_SUBGROUPS(red, v, MAX_MAGNITUDE);
#else
    TREE_REDUCE(red, v, FIRST_MAGNITUDE);
#endif
    return v;
}

/* ---- number formats ------------------------------------------------------------------------------ */

/* IEEE half bits to float, exact (subnormals, infinities and NaN included); the portable body has no
 * branches, so that it vectorizes. */
DEVICE float f16_to_f32(unsigned int h)
{
#ifdef HAS_F16
    return F16_TO_F32(h);
#else
    const unsigned int sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    const float sub = (float)m * 5.9604644775390625e-8f; /* zero and subnormals: m * 2^-24, exact */
    const unsigned int bits = e == 31 ? 0x7f800000u | (m << 13) : ((e + 112u) << 23) | (m << 13);
    return AS_FLOAT(sign | (e == 0 ? AS_UINT(sub) : bits));
#endif
}

/* Float to IEEE half bits, rounding to nearest even; overflow gives infinity, NaN stays NaN. The portable
 * body rounds subnormals by a float addition that leaves the half's bits at the bottom of the word. */
DEVICE unsigned int f32_to_f16(float f)
{
#ifdef HAS_F16
    return F32_TO_F16(f);
#else
    const unsigned int x = AS_UINT(f), sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
    if (a >= 0x47800000u) return sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u); /* >= 65536, inf, NaN */
    if (a < 0x38800000u) return sign | (AS_UINT(AS_FLOAT(a) + 0.5f) - 0x3f000000u); /* below 2^-14 */
    return sign | ((a + 0xc8000fffu + ((a >> 13) & 1u)) >> 13); /* rebias the exponent, round, shift */
#endif
}

/* Float to bfloat16 bits (the high half), rounding to nearest even; NaN stays a (quiet) NaN. */
DEVICE unsigned int f32_to_bf16(float f)
{
    const unsigned int x = AS_UINT(f);
    return (x & 0x7fffffffu) > 0x7f800000u ? (x >> 16) | 0x40u : (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
}

/* Sum of the four byte products: c holds four codes 0..2 (unsigned bytes), q four int8 values. */
DEVICE int dot4_codes(unsigned int c, int q)
{
#ifdef HAS_DP4A
    return DOT4_U8_I8(c, q);
#else
    const unsigned int u = (unsigned int)q;
    return (int)(c & 0xffu) * ((int)(u << 24) >> 24) + (int)((c >> 8) & 0xffu) * ((int)(u << 16) >> 24)
         + (int)((c >> 16) & 0xffu) * ((int)(u << 8) >> 24) + (int)(c >> 24) * ((int)u >> 24);
#endif
}

/* ---- ternary matmul ------------------------------------------------------------------------------- */

/* Block word i holds bytes 4i..4i+3; byte j holds values 128*(j/32) + j%32 + 32k at bit shift 2k. So
 * for each k the four bytes of a word meet four consecutive activations: one 32-bit word of int8 q.
 * Returns sum(q * code), exactly, in int. The innermost loop runs over consecutive words of w and q,
 * which a CPU compiler (PoCL) vectorizes; a GPU compiler unrolls it all. */
DEVICE int block_dot_i8(const unsigned int* w, const GLOBAL int* RESTRICT q)
{
    int sum = 0;
#ifdef HAS_WIDE_LOADS
    /* The 8 activation words of each (h, k) step as two 128-bit loads: a block of q starts a multiple of
     * 256 bytes into an aligned buffer, and the compiler cannot know it. */
    const GLOBAL int4* q4 = (const GLOBAL int4*)q;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int4 a = q4[8 * h + 2 * k], b = q4[8 * h + 2 * k + 1];
            const unsigned int* wh = w + 8 * h;
            const int sh = 2 * k;
            sum += dot4_codes((wh[0] >> sh) & 0x03030303u, a.x) + dot4_codes((wh[1] >> sh) & 0x03030303u, a.y)
                 + dot4_codes((wh[2] >> sh) & 0x03030303u, a.z) + dot4_codes((wh[3] >> sh) & 0x03030303u, a.w)
                 + dot4_codes((wh[4] >> sh) & 0x03030303u, b.x) + dot4_codes((wh[5] >> sh) & 0x03030303u, b.y)
                 + dot4_codes((wh[6] >> sh) & 0x03030303u, b.z) + dot4_codes((wh[7] >> sh) & 0x03030303u, b.w);
        }
#else
    for (int h = 0; h < 2; ++h)
        for (int k = 0; k < 4; ++k)
            for (int j = 0; j < 8; ++j)
                sum += dot4_codes((w[8 * h + j] >> (2 * k)) & 0x03030303u, q[32 * h + 8 * k + j]);
#endif
    return sum;
}

/* The float path ("none"): sum of x * (code - 1) over the block, in the same order of words. */
DEVICE float block_dot_f32(const unsigned int* w, const GLOBAL float* RESTRICT x)
{
    float sum = 0.0f;
#ifdef UNROLL_WORDS
    UNROLL_WORDS /* else sm_80+ keeps w[] in local memory (a 64-byte stack frame) to index it */
#endif
    for (int h = 0; h < 2; ++h)
        for (int k = 0; k < 4; ++k)
            for (int j = 0; j < 8; ++j) {
                const unsigned int c = w[8 * h + j] >> (2 * k);
                const GLOBAL float* xs = x + 128 * h + 32 * k + 4 * j;
                sum += ((float)((int)(c & 3u) - 1) * xs[0] + (float)((int)((c >> 8) & 3u) - 1) * xs[1])
                     + ((float)((int)((c >> 16) & 3u) - 1) * xs[2]
                        + (float)((int)((c >> 24) & 3u) - 1) * xs[3]);
            }
    return sum;
}

/* `lanes` consecutive threads hold partial sums acc[t] of one row for the tile's tokens; the first
 * adds them in lane order and stores y[tok0 + t, row]. */
DEVICE void store_tile(LOCAL_PTR float* red, const float* acc, GLOBAL float* RESTRICT y, int row, int rows,
                       int lanes, int tok0, int nt, int active)
{
#pragma unroll
    for (int t = 0; t < TILE_N; ++t) red[t * LSIZE + TID] = acc[t];
    BARRIER();
    if (active && TID % lanes == 0) {
        for (int t = 0; t < nt; ++t) {
            float s = 0.0f;
            for (int l = 0; l < lanes; ++l) s += red[t * LSIZE + TID + l];
            y[(size_t)(tok0 + t) * rows + row] = s;
        }
    }
}

/* A work-group computes LSIZE / lanes rows for TILE_N tokens (group y). The lanes of a row take its
 * 256-blocks in turn, load a block's 16 code words once and use them for every token of the tile.
 * int8 activations: the block's integer dot is exact, sum(q * (code - 1)) = sum(q * code) - sum(q)
 * with sum(q) from the quantize kernel, and is scaled once, by d_w * d_x. */
DEVICE void ternary_tile(const GLOBAL unsigned int* RESTRICT codes, const GLOBAL float* RESTRICT wscale,
                         const GLOBAL int* RESTRICT q, const GLOBAL float* RESTRICT qscale,
                         const GLOBAL int* RESTRICT qsum, const GLOBAL float* RESTRICT x, int float_act,
                         GLOBAL float* RESTRICT y, int rows, int nb, int n, int lanes, LOCAL_PTR float* red)
{
    const int lane = TID % lanes, row = GROUP_X * (LSIZE / lanes) + TID / lanes;
    const int tok0 = GROUP_Y * TILE_N, nt = min(TILE_N, n - tok0);
    const int active = TID < (LSIZE / lanes) * lanes && row < rows;
    float acc[TILE_N];
#pragma unroll
    for (int t = 0; t < TILE_N; ++t) acc[t] = 0.0f;
    for (int b = lane; active && b < nb; b += lanes) {
        const size_t wb = (size_t)row * nb + b;
        unsigned int w[16];
#ifdef HAS_WIDE_LOADS
        const GLOBAL uint4* c4 = (const GLOBAL uint4*)(codes + wb * 16); /* 64 bytes a block: four loads */
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint4 c = c4[i];
            w[4 * i] = c.x; w[4 * i + 1] = c.y; w[4 * i + 2] = c.z; w[4 * i + 3] = c.w;
        }
#else
#pragma unroll
        for (int i = 0; i < 16; ++i) w[i] = codes[wb * 16 + i];
#endif
        const float ws = wscale[wb];
#pragma unroll
        for (int t = 0; t < TILE_N; ++t) {
            if (t < nt) {
                const size_t xb = (size_t)(tok0 + t) * nb + b;
                if (float_act) acc[t] += ws * block_dot_f32(w, x + xb * 256);
                else acc[t] += (ws * qscale[xb]) * (float)(block_dot_i8(w, q + xb * 64) - qsum[xb]);
            }
        }
    }
    store_tile(red, acc, y, row, rows, lanes, tok0, nt, active);
}

KERNEL ternary_matmul_i8(const GLOBAL unsigned int* RESTRICT codes, const GLOBAL float* RESTRICT wscale,
                         const GLOBAL int* RESTRICT q, const GLOBAL float* RESTRICT qscale,
                         const GLOBAL int* RESTRICT qsum, GLOBAL float* RESTRICT y, int rows, int nb, int n,
                         int lanes)
{
    LOCAL float red[MAX_WG * TILE_N];
    ternary_tile(codes, wscale, q, qscale, qsum, 0, 0, y, rows, nb, n, lanes, red);
}

KERNEL ternary_matmul_f32(const GLOBAL unsigned int* RESTRICT codes, const GLOBAL float* RESTRICT wscale,
                          const GLOBAL float* RESTRICT x, GLOBAL float* RESTRICT y, int rows, int nb, int n,
                          int lanes)
{
    LOCAL float red[MAX_WG * TILE_N];
    ternary_tile(codes, wscale, 0, 0, 0, x, 1, y, rows, nb, n, lanes, red);
}

/* int8 activations for ternary_matmul_i8. Group (b, row) quantizes block b of the row and stores q,
 * the block's d (x ~ q * d) and sum(q). mode 0, "row" (BitNet b1.58): s = 127 / max|x| over the whole
 * row; each group rescans the row for it, which is cheap next to the matmul and keeps one launch with
 * a group per block. mode 1, "block256" (llama.cpp Q8_K): v = the value of largest magnitude of the
 * block, s = -127 / v. Both: q = clamp(rint(x * s), -128, 127) (round half to even), d = 1 / s. */
KERNEL quantize_i8(const GLOBAL float* RESTRICT x, GLOBAL signed char* RESTRICT q,
                   GLOBAL float* RESTRICT qscale, GLOBAL int* RESTRICT qsum, int cols, int mode)
{
    LOCAL float red[MAX_WG];
    LOCAL int ired[MAX_WG];
    const int b = GROUP_X, row = GROUP_Y, nb = cols / 256;
    const GLOBAL float* xr = x + (size_t)row * cols;
    float s;
    if (mode == 0) {
        float m = 0.0f;
        for (int e = TID; e < cols; e += LSIZE) m = fmaxf(m, fabsf(xr[e]));
        m = group_max(red, m);
        s = m > 0.0f ? 127.0f / m : 0.0f;
    } else {
        float v = 0.0f;
        for (int e = TID; e < 256; e += LSIZE) {
            const float xe = xr[b * 256 + e];
            if (fabsf(xe) > fabsf(v)) v = xe;
        }
        v = group_max_magnitude(red, v);
        s = v != 0.0f ? -127.0f / v : 0.0f;
    }
    int sum = 0;
    for (int e = TID; e < 256; e += LSIZE) {
        const int qe = (int)fminf(fmaxf(rintf(xr[b * 256 + e] * s), -128.0f), 127.0f);
        q[(size_t)row * cols + b * 256 + e] = (signed char)qe;
        sum += qe;
    }
    sum = group_sum_int(ired, sum);
    if (TID == 0) {
        qscale[(size_t)row * nb + b] = s != 0.0f ? 1.0f / s : 0.0f;
        qsum[(size_t)row * nb + b] = sum;
    }
}

/* ---- dense matmul: the F32 / F16 / BF16 LM head ------------------------------------------------------ */

#define FMT_F32 0
#define FMT_F16 1
#define FMT_BF16 2 /* the high half of a float32: decoding is a shift, exact */

DEVICE float decode16(unsigned int h, int fmt)
{
    return fmt == FMT_F16 ? f16_to_f32(h) : AS_FLOAT(h << 16);
}

/* Element i of an array in format fmt: a16 holds F16/BF16 bits, a32 float32 (the other pointer is a dummy). */
DEVICE float load_elem(const GLOBAL unsigned short* RESTRICT a16, const GLOBAL float* RESTRICT a32, int fmt, size_t i)
{
    return fmt == FMT_F32 ? a32[i] : decode16(a16[i], fmt);
}

/* v into element i of an array in format fmt, rounding to nearest even. */
DEVICE void store_elem(GLOBAL unsigned short* RESTRICT a16, GLOBAL float* RESTRICT a32, int fmt, size_t i, float v)
{
    if (fmt == FMT_F32) a32[i] = v;
    else a16[i] = (unsigned short)(fmt == FMT_F16 ? f32_to_f16(v) : f32_to_bf16(v));
}

/* Elements i..i+7 of the table, as float. `vec`: cols % 8 == 0, so they are 16-byte aligned and, with
 * HAS_WIDE_LOADS, load as 128-bit words; so do the activations (load8_f32). */
DEVICE void load8_weights(float* w, const GLOBAL unsigned short* RESTRICT w16, const GLOBAL float* RESTRICT w32,
                          int fmt, size_t i, int vec)
{
#ifdef HAS_WIDE_LOADS
    if (vec && fmt == FMT_F32) {
        const float4 a = ((const GLOBAL float4*)(w32 + i))[0], b = ((const GLOBAL float4*)(w32 + i))[1];
        w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w; w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
        return;
    }
    if (vec) {
        const uint4 u = *(const GLOBAL uint4*)(w16 + i);
        w[0] = decode16(u.x & 0xffffu, fmt); w[1] = decode16(u.x >> 16, fmt);
        w[2] = decode16(u.y & 0xffffu, fmt); w[3] = decode16(u.y >> 16, fmt);
        w[4] = decode16(u.z & 0xffffu, fmt); w[5] = decode16(u.z >> 16, fmt);
        w[6] = decode16(u.w & 0xffffu, fmt); w[7] = decode16(u.w >> 16, fmt);
        return;
    }
#endif
    for (int j = 0; j < 8; ++j) w[j] = load_elem(w16, w32, fmt, i + j);
}

DEVICE void load8_f32(float* v, const GLOBAL float* RESTRICT x, int vec)
{
#ifdef HAS_WIDE_LOADS
    if (vec) {
        const float4 a = ((const GLOBAL float4*)x)[0], b = ((const GLOBAL float4*)x)[1];
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
        return;
    }
#endif
    for (int j = 0; j < 8; ++j) v[j] = x[j];
}

/* Same tiling as ternary_tile. The lanes of a row take 8 consecutive elements each in turn (16 or 32
 * contiguous bytes per lane, coalesced across lanes on a GPU); the 8 products are summed as a tree,
 * an order a CPU compiler may vectorize without reassociating. A scalar tail covers cols % 8. */
DEVICE void dense_tile(const GLOBAL unsigned short* RESTRICT w16, const GLOBAL float* RESTRICT w32,
                       int fmt, const GLOBAL float* RESTRICT x, GLOBAL float* RESTRICT y, int rows,
                       int cols, int n, int lanes, LOCAL_PTR float* red)
{
    const int lane = TID % lanes, row = GROUP_X * (LSIZE / lanes) + TID / lanes;
    const int tok0 = GROUP_Y * TILE_N, nt = min(TILE_N, n - tok0);
    const int active = TID < (LSIZE / lanes) * lanes && row < rows;
    float acc[TILE_N];
#pragma unroll
    for (int t = 0; t < TILE_N; ++t) acc[t] = 0.0f;
    const int vec = cols % 8 == 0;
    for (int c = lane; active && c < cols / 8; c += lanes) {
        const size_t we = (size_t)row * cols + 8 * c;
        float w[8];
        load8_weights(w, w16, w32, fmt, we, vec);
#pragma unroll
        for (int t = 0; t < TILE_N; ++t) {
            if (t < nt) {
                float xt[8];
                load8_f32(xt, x + (size_t)(tok0 + t) * cols + 8 * c, vec);
                acc[t] += ((w[0] * xt[0] + w[1] * xt[1]) + (w[2] * xt[2] + w[3] * xt[3]))
                        + ((w[4] * xt[4] + w[5] * xt[5]) + (w[6] * xt[6] + w[7] * xt[7]));
            }
        }
    }
    for (int e = cols / 8 * 8 + lane; active && e < cols; e += lanes) {
        const size_t we = (size_t)row * cols + e;
        const float w = load_elem(w16, w32, fmt, we);
#pragma unroll
        for (int t = 0; t < TILE_N; ++t)
            if (t < nt) acc[t] += w * x[(size_t)(tok0 + t) * cols + e];
    }
    store_tile(red, acc, y, row, rows, lanes, tok0, nt, active);
}

KERNEL lm_head_f16(const GLOBAL unsigned short* RESTRICT w, const GLOBAL float* RESTRICT x,
                   GLOBAL float* RESTRICT y, int rows, int cols, int n, int lanes)
{
    LOCAL float red[MAX_WG * TILE_N];
    dense_tile(w, 0, FMT_F16, x, y, rows, cols, n, lanes, red);
}

KERNEL lm_head_bf16(const GLOBAL unsigned short* RESTRICT w, const GLOBAL float* RESTRICT x,
                    GLOBAL float* RESTRICT y, int rows, int cols, int n, int lanes)
{
    LOCAL float red[MAX_WG * TILE_N];
    dense_tile(w, 0, FMT_BF16, x, y, rows, cols, n, lanes, red);
}

KERNEL lm_head_f32(const GLOBAL float* RESTRICT w, const GLOBAL float* RESTRICT x, GLOBAL float* RESTRICT y,
                   int rows, int cols, int n, int lanes)
{
    LOCAL float red[MAX_WG * TILE_N];
    dense_tile(0, w, FMT_F32, x, y, rows, cols, n, lanes, red);
}

/* An uploaded table re-encoded once for the LM head (a host may pick the format per device): src in
 * format src_fmt, dst in dst_fmt, rounding to nearest even. The unused pointer of each pair is a dummy. */
KERNEL convert_table(const GLOBAL unsigned short* RESTRICT src16, const GLOBAL float* RESTRICT src32, int src_fmt,
                     GLOBAL unsigned short* RESTRICT dst16, GLOBAL float* RESTRICT dst32, int dst_fmt, U64 count)
{
    for (size_t i = (size_t)GLOBAL_X; i < count; i += (size_t)LSIZE * NUM_GROUPS_X)
        store_elem(dst16, dst32, dst_fmt, i, load_elem(src16, src32, src_fmt, i));
}

/* Index of the largest value of each row (group = row), first on ties; NaN is skipped. */
KERNEL argmax_f32(const GLOBAL float* RESTRICT x, GLOBAL int* RESTRICT out, int cols)
{
    LOCAL float rv[MAX_WG];
    LOCAL int ri[MAX_WG];
    const GLOBAL float* xr = x + (size_t)GROUP_X * cols;
    float bv = NEG_INF;
    int bi = cols; /* "none yet": loses every tie against a real index */
    for (int e = TID; e < cols; e += LSIZE) {
        const float v = xr[e];
        if (v == v && (v > bv || bi == cols)) { bv = v; bi = e; }
    }
#ifdef HAS_SUBGROUP_REDUCE
    /* (larger value, then smaller index) is a total order here (NaN never enters), so the subgroup's
     * largest value and the smallest index holding it are the winner the tree below finds. */
    const float mv = SG_MAX(bv);
    bi = SG_MIN(bv == mv ? bi : cols);
    bv = mv;
    if (SG_COUNT > 1) {
        if (SG_LANE == 0) { rv[SG_ID] = bv; ri[SG_ID] = bi; }
        BARRIER();
        bv = rv[0];
        bi = ri[0];
        for (int s = 1; s < SG_COUNT; ++s)
            if (rv[s] > bv || (rv[s] == bv && ri[s] < bi)) { bv = rv[s]; bi = ri[s]; }
    }
    if (TID == 0) out[GROUP_X] = bi < cols ? bi : 0;
#else
    rv[TID] = bv;
    ri[TID] = bi;
    BARRIER();
    for (int s = LSIZE / 2; s > 0; s >>= 1) {
        if (TID < s) {
            const float ov = rv[TID + s];
            const int oi = ri[TID + s];
            if (ov > rv[TID] || (ov == rv[TID] && oi < ri[TID])) { rv[TID] = ov; ri[TID] = oi; }
        }
        BARRIER();
    }
    if (TID == 0) out[GROUP_X] = ri[0] < cols ? ri[0] : 0;
#endif
}

/* ---- row-wise and element-wise ops ------------------------------------------------------------------ */

KERNEL rmsnorm_f32(const GLOBAL float* RESTRICT x, const GLOBAL float* RESTRICT w, GLOBAL float* RESTRICT out,
                   int cols, float eps)
{
    LOCAL float red[MAX_WG];
    const GLOBAL float* xr = x + (size_t)GROUP_X * cols;
    GLOBAL float* o = out + (size_t)GROUP_X * cols;
    float ss = 0.0f;
    for (int e = TID; e < cols; e += LSIZE) ss += xr[e] * xr[e];
    const float r = 1.0f / sqrtf(group_sum(red, ss) / (float)cols + eps);
    for (int e = TID; e < cols; e += LSIZE) o[e] = xr[e] * r * w[e];
}

/* NEOX rotary embedding: the pair (j, j + head_dim / 2) of each head turns by the angle of its row's
 * position (positions[i]: the rows of a batch may belong to different sequences); cos and sin come from
 * [position][head_dim / 2] tables the host computes once, in float64. */
KERNEL rope_neox_f32(const GLOBAL float* RESTRICT x, GLOBAL float* RESTRICT out,
                     const GLOBAL float* RESTRICT cos_t, const GLOBAL float* RESTRICT sin_t,
                     const GLOBAL int* RESTRICT positions, int n_heads, int head_dim)
{
    const int i = GROUP_Y, e = GLOBAL_X, pairs = head_dim / 2;
    if (e >= n_heads * pairs) return;
    const size_t a = (size_t)i * n_heads * head_dim + (size_t)(e / pairs) * head_dim + e % pairs;
    const size_t at = (size_t)positions[i] * pairs + e % pairs;
    const float c = cos_t[at], s = sin_t[at], x0 = x[a], x1 = x[a + pairs];
    out[a] = x0 * c - x1 * s;
    out[a + pairs] = x1 * c + x0 * s;
}

/* The first element of KV head `kv_head` of sequence slot `slot` in `layer`: the cache is laid out
 * [layer][slot][kv_head][position][dim], so that attention reads each head's history contiguously. */
DEVICE size_t kv_head_base(int layer, int slot, int kv_head, int n_seqs, int n_kv_heads, int n_ctx, int head_dim)
{
    return (((size_t)layer * n_seqs + slot) * n_kv_heads + kv_head) * n_ctx * head_dim;
}

/* Row i's K and V into slot slots[i] at position positions[i] (group y = row), in the cache's format
 * (F32 or F16; the pointers of the other format are dummies). */
DEVICE void kv_store(const GLOBAL float* RESTRICT k, const GLOBAL float* RESTRICT v,
                     GLOBAL unsigned short* RESTRICT kc16, GLOBAL float* RESTRICT kc32,
                     GLOBAL unsigned short* RESTRICT vc16, GLOBAL float* RESTRICT vc32, int fmt,
                     const GLOBAL int* RESTRICT slots, const GLOBAL int* RESTRICT positions, int layer, int n_seqs,
                     int n_kv_heads, int head_dim, int n_ctx)
{
    const int i = GROUP_Y, e = GLOBAL_X, width = n_kv_heads * head_dim;
    if (e >= width) return;
    const size_t at = kv_head_base(layer, slots[i], e / head_dim, n_seqs, n_kv_heads, n_ctx, head_dim)
                    + (size_t)positions[i] * head_dim + e % head_dim;
    store_elem(kc16, kc32, fmt, at, k[(size_t)i * width + e]);
    store_elem(vc16, vc32, fmt, at, v[(size_t)i * width + e]);
}

KERNEL kv_store_f32(const GLOBAL float* RESTRICT k, const GLOBAL float* RESTRICT v, GLOBAL float* RESTRICT kc,
                    GLOBAL float* RESTRICT vc, const GLOBAL int* RESTRICT slots,
                    const GLOBAL int* RESTRICT positions, int layer, int n_seqs, int n_kv_heads, int head_dim,
                    int n_ctx)
{
    kv_store(k, v, 0, kc, 0, vc, FMT_F32, slots, positions, layer, n_seqs, n_kv_heads, head_dim, n_ctx);
}

KERNEL kv_store_f16(const GLOBAL float* RESTRICT k, const GLOBAL float* RESTRICT v,
                    GLOBAL unsigned short* RESTRICT kc, GLOBAL unsigned short* RESTRICT vc,
                    const GLOBAL int* RESTRICT slots, const GLOBAL int* RESTRICT positions, int layer, int n_seqs,
                    int n_kv_heads, int head_dim, int n_ctx)
{
    kv_store(k, v, kc, 0, vc, 0, FMT_F16, slots, positions, layer, n_seqs, n_kv_heads, head_dim, n_ctx);
}

/* Causal grouped-query attention of query row i, head h (group (h, i)) over positions 0..positions[i] of
 * its own slot, slots[i]: nothing a row computes depends on the other rows of the batch. One pass over the
 * head's positions in chunks of LSIZE with an online softmax (running max m and sum l; the output row,
 * owned by this group, is rescaled when m grows), so no n_ctx-sized score buffer exists. Thread t scores
 * position c0 + t; then threads take dimensions and accumulate p * V. */
DEVICE void attention(const GLOBAL float* RESTRICT q, const GLOBAL unsigned short* RESTRICT kc16,
                      const GLOBAL float* RESTRICT kc32, const GLOBAL unsigned short* RESTRICT vc16,
                      const GLOBAL float* RESTRICT vc32, int fmt, GLOBAL float* RESTRICT out,
                      const GLOBAL int* RESTRICT slots, const GLOBAL int* RESTRICT positions, int layer, int n_seqs,
                      int n_heads, int n_kv_heads, int head_dim, int n_ctx, float scale, LOCAL_PTR float* p,
                      LOCAL_PTR float* red)
{
    const int h = GROUP_X, i = GROUP_Y, n_kv = positions[i] + 1;
    const size_t head = kv_head_base(layer, slots[i], h / (n_heads / n_kv_heads), n_seqs, n_kv_heads, n_ctx,
                                     head_dim);
    const GLOBAL float* qh = q + ((size_t)i * n_heads + h) * head_dim;
    GLOBAL float* o = out + ((size_t)i * n_heads + h) * head_dim;
    float m = NEG_INF, l = 0.0f;
    for (int d = TID; d < head_dim; d += LSIZE) o[d] = 0.0f;
    for (int c0 = 0; c0 < n_kv; c0 += LSIZE) {
        const int pos = c0 + TID;
        float s = NEG_INF;
        if (pos < n_kv) {
            s = 0.0f;
            const size_t at = head + (size_t)pos * head_dim;
            for (int d = 0; d < head_dim; ++d) s += qh[d] * load_elem(kc16, kc32, fmt, at + d);
            s *= scale;
        }
        const float m_new = fmaxf(m, group_max(red, s));
        const float alpha = expf(m - m_new); /* 0 on the first chunk */
        p[TID] = pos < n_kv ? expf(s - m_new) : 0.0f;
        l = l * alpha + group_sum(red, p[TID]); /* its barriers also publish p */
        const int cnt = min(LSIZE, n_kv - c0);
        for (int d = TID; d < head_dim; d += LSIZE) {
            float acc = o[d] * alpha;
            for (int j = 0; j < cnt; ++j)
                acc += p[j] * load_elem(vc16, vc32, fmt, head + (size_t)(c0 + j) * head_dim + d);
            o[d] = acc;
        }
        m = m_new;
        BARRIER(); /* p is rewritten by the next chunk */
    }
    for (int d = TID; d < head_dim; d += LSIZE) o[d] /= l;
}

KERNEL attention_f32(const GLOBAL float* RESTRICT q, const GLOBAL float* RESTRICT kc,
                     const GLOBAL float* RESTRICT vc, GLOBAL float* RESTRICT out, const GLOBAL int* RESTRICT slots,
                     const GLOBAL int* RESTRICT positions, int layer, int n_seqs, int n_heads, int n_kv_heads,
                     int head_dim, int n_ctx, float scale)
{
    LOCAL float p[MAX_WG];
    LOCAL float red[MAX_WG];
    attention(q, 0, kc, 0, vc, FMT_F32, out, slots, positions, layer, n_seqs, n_heads, n_kv_heads, head_dim, n_ctx,
              scale, p, red);
}

/* The same over an F16 cache (half the bytes read per position). */
KERNEL attention_f16(const GLOBAL float* RESTRICT q, const GLOBAL unsigned short* RESTRICT kc,
                     const GLOBAL unsigned short* RESTRICT vc, GLOBAL float* RESTRICT out,
                     const GLOBAL int* RESTRICT slots, const GLOBAL int* RESTRICT positions, int layer, int n_seqs,
                     int n_heads, int n_kv_heads, int head_dim, int n_ctx, float scale)
{
    LOCAL float p[MAX_WG];
    LOCAL float red[MAX_WG];
    attention(q, kc, 0, vc, 0, FMT_F16, out, slots, positions, layer, n_seqs, n_heads, n_kv_heads, head_dim, n_ctx,
              scale, p, red);
}

KERNEL silu_mul_f32(const GLOBAL float* RESTRICT g, const GLOBAL float* RESTRICT u,
                    GLOBAL float* RESTRICT out, int count)
{
    const int e = GLOBAL_X;
    if (e < count) out[e] = g[e] / (1.0f + expf(-g[e])) * u[e];
}

KERNEL relu2_mul_f32(const GLOBAL float* RESTRICT g, const GLOBAL float* RESTRICT u,
                     GLOBAL float* RESTRICT out, int count)
{
    const int e = GLOBAL_X;
    if (e < count) {
        const float r = fmaxf(g[e], 0.0f);
        out[e] = r * r * u[e];
    }
}

KERNEL add_f32(const GLOBAL float* RESTRICT a, const GLOBAL float* RESTRICT b, GLOBAL float* RESTRICT out,
               int count)
{
    const int e = GLOBAL_X;
    if (e < count) out[e] = a[e] + b[e];
}

/* Rows of x [n, width] into out [n, cols], zeros beyond width (group y = row): bitlinear's input for a
 * weight held zero-extended to whole 256-blocks (1bitLLM 3B's 3200 and 8640). The zeros change
 * neither a row's sums nor its largest magnitude, so every activation mode gives the unpadded result. */
KERNEL zero_extend_f32(const GLOBAL float* RESTRICT x, GLOBAL float* RESTRICT out, int width, int cols)
{
    const int e = GLOBAL_X, i = GROUP_Y;
    if (e < cols) out[(size_t)i * cols + e] = e < width ? x[(size_t)i * width + e] : 0.0f;
}

/* Row ids[i] of a [vocab, dim] table into row i of out (group y = i). */
KERNEL embed_f16(const GLOBAL unsigned short* RESTRICT table, const GLOBAL int* RESTRICT ids,
                 GLOBAL float* RESTRICT out, int dim)
{
    const int e = GLOBAL_X, i = GROUP_Y;
    if (e < dim) out[(size_t)i * dim + e] = f16_to_f32(table[(size_t)ids[i] * dim + e]);
}

KERNEL embed_f32(const GLOBAL float* RESTRICT table, const GLOBAL int* RESTRICT ids,
                 GLOBAL float* RESTRICT out, int dim)
{
    const int e = GLOBAL_X, i = GROUP_Y;
    if (e < dim) out[(size_t)i * dim + e] = table[(size_t)ids[i] * dim + e];
}
