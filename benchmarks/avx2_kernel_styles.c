// Three ways to multiply ternary weights by int8 activations with AVX2, exactly, timed on one thread:
//
//   madd   codes 0..2 (2 bits) times activations with vpmaddubsw, minus each block's sum of activations:
//          the CPU plugin's prefill loop (dot_ir.py), written here in C;
//   lut    vpshufb lookups: per token and pair of columns a 16-entry table of the 9 sums w0*q0 + w1*q1
//          (int16, split into a low-byte and a high-byte table), indexed by 4-bit codes of 32 rows at once;
//   fused  half of each row's columns the madd way, half the lut way, in one loop body, so that the
//          out-of-order core can run vpmaddubsw and vpshufb side by side.
//
// On Zen 1 vpmaddubsw has one pipe and vpshufb others, so `fused` would beat `madd` if that pipe were the
// only limit; a vpsadbw loop (`sad`, another multiply-free way to sum bytes) shows whether it shares that
// pipe. Every kernel's results are checked against a scalar reference before it is timed.
//
//   gcc -O3 -march=native -DT=4 -o /tmp/styles benchmarks/avx2_kernel_styles.c && /tmp/styles
//
// `/tmp/styles check` only checks the kernels (tests/test_bench_scripts.py runs that); a build with
// -DBREAK_TABLE gives one token one wrong table entry, which the check must catch.
//
// T is the number of tokens per pass (2, 4 or 8). R x K weights (160 KB) and T token rows stay in L2, so
// this measures the instructions, not memory.
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifndef T
#define T 4
#endif
#define R 256
#define K 2560

static int8_t W[R][K], Q[T][K];
static int32_t ref[R][T], out[R][T];
static uint8_t WA[R][K / 4];              // madd: per 256-block 64 bytes, field s of byte b = column 64 s + b
static int32_t qsum[T][K / 256];
static uint8_t WB[R / 32][K / 4][32];     // lut: byte r of group g = row r's columns 4g..4g+3 as two indices
static uint8_t LUTlo[T][K / 2][16], LUThi[T][K / 2][16];

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static inline __m256i table(const uint8_t *p) { return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p)); }

static inline int32_t hsum(__m256i v) {
    __m128i x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    x = _mm_hadd_epi32(x, x);
    return _mm_cvtsi128_si32(_mm_hadd_epi32(x, x));
}

// One madd block (256 columns from block b of row r) into each token's int16 sums.
static inline void madd_block(int r, int b, __m256i s16[T]) {
    const __m256i m3 = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; h++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)&WA[r][b * 64 + 32 * h]);
        for (int s = 0; s < 4; s++) {
            __m256i c = _mm256_and_si256(s ? _mm256_srli_epi16(v, 2 * s) : v, m3);
            for (int t = 0; t < T; t++)
                s16[t] = _mm256_add_epi16(s16[t], _mm256_maddubs_epi16(c, _mm256_loadu_si256((const __m256i *)&Q[t][b * 256 + 64 * s + 32 * h])));
        }
    }
}

// One lut column group (4 columns of 32 rows) into each token's int16 sums: lo holds rows 0-7 and 16-23, hi 8-15 and 24-31.
static inline void lut_group(int g32, int g, __m256i lo[T], __m256i hi[T]) {
    const __m256i m15 = _mm256_set1_epi8(15);
    __m256i u = _mm256_loadu_si256((const __m256i *)WB[g32][g]);
    __m256i i0 = _mm256_and_si256(u, m15), i1 = _mm256_and_si256(_mm256_srli_epi16(u, 4), m15);
    for (int t = 0; t < T; t++) {
        __m256i l0 = _mm256_shuffle_epi8(table(LUTlo[t][2 * g]), i0), h0 = _mm256_shuffle_epi8(table(LUThi[t][2 * g]), i0);
        __m256i l1 = _mm256_shuffle_epi8(table(LUTlo[t][2 * g + 1]), i1), h1 = _mm256_shuffle_epi8(table(LUThi[t][2 * g + 1]), i1);
        lo[t] = _mm256_add_epi16(lo[t], _mm256_add_epi16(_mm256_unpacklo_epi8(l0, h0), _mm256_unpacklo_epi8(l1, h1)));
        hi[t] = _mm256_add_epi16(hi[t], _mm256_add_epi16(_mm256_unpackhi_epi8(l0, h0), _mm256_unpackhi_epi8(l1, h1)));
    }
}

// The int16 sums of lut_group, sign-extended into int32 rows 0-7, 8-15, 16-23, 24-31, and cleared.
static inline void lut_widen(__m256i lo[T], __m256i hi[T], __m256i a32[T][4]) {
    for (int t = 0; t < T; t++) {
        a32[t][0] = _mm256_add_epi32(a32[t][0], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(lo[t])));
        a32[t][1] = _mm256_add_epi32(a32[t][1], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(hi[t])));
        a32[t][2] = _mm256_add_epi32(a32[t][2], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(lo[t], 1)));
        a32[t][3] = _mm256_add_epi32(a32[t][3], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(hi[t], 1)));
        lo[t] = hi[t] = _mm256_setzero_si256();
    }
}

static void lut_store(int g32, __m256i a32[T][4]) {
    for (int t = 0; t < T; t++)
        for (int part = 0; part < 4; part++) {
            int32_t v[8];
            _mm256_storeu_si256((__m256i *)v, a32[t][part]);
            for (int i = 0; i < 8; i++) out[g32 * 32 + 8 * part + i][t] += v[i];
        }
}

static void madd(void) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < R; r++) {
        __m256i acc[T];
        for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_si256();
        for (int b = 0; b < K / 256; b++) {
            __m256i s16[T];
            for (int t = 0; t < T; t++) s16[t] = _mm256_setzero_si256();
            madd_block(r, b, s16);  // a lane stays within 8 * 2 * 2 * 127
            for (int t = 0; t < T; t++) acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(s16[t], ones));
        }
        for (int t = 0; t < T; t++) {
            int32_t s = hsum(acc[t]);
            for (int b = 0; b < K / 256; b++) s -= qsum[t][b];
            out[r][t] = s;
        }
    }
}

static void lut(void) {
    for (int g32 = 0; g32 < R / 32; g32++) {
        __m256i lo[T], hi[T], a32[T][4];
        memset(a32, 0, sizeof a32);
        for (int t = 0; t < T; t++) lo[t] = hi[t] = _mm256_setzero_si256();
        for (int g = 0; g < K / 4; g++) {
            lut_group(g32, g, lo, hi);
            if (g % 64 == 63) lut_widen(lo, hi, a32);  // 64 groups: a lane within 64 * 2 * 254 < 2^15
        }
        lut_widen(lo, hi, a32);
        for (int r = 0; r < 32; r++) memset(out[g32 * 32 + r], 0, sizeof out[0]);
        lut_store(g32, a32);
    }
}

// Columns [0, K/2) the madd way row by row, [K/2, K) the lut way for the row's group, one lut group per half block.
static void fused(void) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int g32 = 0; g32 < R / 32; g32++) {
        __m256i lo[T], hi[T], a32[T][4];
        memset(a32, 0, sizeof a32);
        for (int t = 0; t < T; t++) lo[t] = hi[t] = _mm256_setzero_si256();
        int g = K / 8;
        for (int rr = 0; rr < 32; rr++) {
            int r = g32 * 32 + rr;
            __m256i acc[T];
            for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_si256();
            for (int b = 0; b < K / 2 / 256; b++) {
                __m256i s16[T];
                for (int t = 0; t < T; t++) s16[t] = _mm256_setzero_si256();
                madd_block(r, b, s16);
                lut_group(g32, g++, lo, hi);
                lut_group(g32, g++, lo, hi);
                for (int t = 0; t < T; t++) acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(s16[t], ones));
            }
            if (rr % 4 == 3) lut_widen(lo, hi, a32);  // 4 rows: 40 groups
            for (int t = 0; t < T; t++) {
                int32_t s = hsum(acc[t]);
                for (int b = 0; b < K / 2 / 256; b++) s -= qsum[t][b];
                out[r][t] = s;
            }
        }
        lut_store(g32, a32);
    }
}

static void check(const char *name) {
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++)
            if (out[r][t] != ref[r][t]) {
                printf("%s: row %d token %d is %d, not %d\n", name, r, t, out[r][t], ref[r][t]);
                exit(1);
            }
}

// vpmaddubsw alone, vpsadbw alone, and both interleaved: G instructions per second. Each loop keeps its own
// accumulators (in registers: sums carried through memory would time the store-to-load latency instead).
#define MADD(s, x) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(x, one))
#define SAD(s, x) s = _mm256_add_epi64(s, _mm256_sad_epu8(x, z))
#define OPAQUE() __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3))
static void pipes(void) {
    const long n = 100000000L;
    __m256i a0 = _mm256_set1_epi8(3), a1 = _mm256_set1_epi8(5), a2 = _mm256_set1_epi8(7), a3 = _mm256_set1_epi8(9);
    const __m256i one = _mm256_set1_epi8(1), z = _mm256_setzero_si256();
    __m256i sink = z;
    double t0 = now();
    {
        __m256i s0 = z, s1 = z, s2 = z, s3 = z;
        for (long i = 0; i < n; i++) { MADD(s0, a0); MADD(s1, a1); MADD(s2, a2); MADD(s3, a3); OPAQUE(); }
        sink = _mm256_add_epi64(sink, _mm256_add_epi64(_mm256_add_epi64(s0, s1), _mm256_add_epi64(s2, s3)));
    }
    double tm = now() - t0;
    t0 = now();
    {
        __m256i s0 = z, s1 = z, s2 = z, s3 = z;
        for (long i = 0; i < n; i++) { SAD(s0, a0); SAD(s1, a1); SAD(s2, a2); SAD(s3, a3); OPAQUE(); }
        sink = _mm256_add_epi64(sink, _mm256_add_epi64(_mm256_add_epi64(s0, s1), _mm256_add_epi64(s2, s3)));
    }
    double ts = now() - t0;
    t0 = now();
    {
        __m256i s0 = z, s1 = z, s2 = z, s3 = z;
        for (long i = 0; i < n; i++) { MADD(s0, a0); SAD(s1, a1); MADD(s2, a2); SAD(s3, a3); OPAQUE(); }
        sink = _mm256_add_epi64(sink, _mm256_add_epi64(_mm256_add_epi64(s0, s1), _mm256_add_epi64(s2, s3)));
    }
    double tb = now() - t0;
    printf("pipes: vpmaddubsw %.2f, vpsadbw %.2f, both %.2f G instructions/s (%d)\n", 4 * n / tm / 1e9,
           4 * n / ts / 1e9, 4 * n / tb / 1e9, (int)(_mm256_extract_epi64(sink, 0) & 1));
}

int main(int argc, char **argv) {
    srand(1);
    for (int r = 0; r < R; r++)
        for (int c = 0; c < K; c++) W[r][c] = rand() % 3 - 1;
    for (int t = 0; t < T; t++)
        for (int c = 0; c < K; c++) Q[t][c] = rand() % 255 - 127;
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) {
            int32_t s = 0;
            for (int c = 0; c < K; c++) s += W[r][c] * Q[t][c];
            ref[r][t] = s;
        }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < K / 256; b++)
            for (int i = 0; i < 64; i++) {
                uint8_t v = 0;
                for (int s = 0; s < 4; s++) v |= (uint8_t)((W[r][b * 256 + 64 * s + i] + 1) << (2 * s));
                WA[r][b * 64 + i] = v;
            }
    for (int t = 0; t < T; t++)
        for (int b = 0; b < K / 256; b++) {
            qsum[t][b] = 0;
            for (int i = 0; i < 256; i++) qsum[t][b] += Q[t][b * 256 + i];
        }
    for (int r = 0; r < R; r++)
        for (int g = 0; g < K / 4; g++) {
            int i0 = (W[r][4 * g] + 1) * 3 + W[r][4 * g + 1] + 1, i1 = (W[r][4 * g + 2] + 1) * 3 + W[r][4 * g + 3] + 1;
            WB[r / 32][g][r % 32] = (uint8_t)(i0 | i1 << 4);
        }
    for (int t = 0; t < T; t++)
        for (int p = 0; p < K / 2; p++)
            for (int i = 0; i < 16; i++) {
                int v = i < 9 ? (i / 3 - 1) * Q[t][2 * p] + (i % 3 - 1) * Q[t][2 * p + 1] : 0;
                LUTlo[t][p][i] = (uint8_t)(v & 255);
                LUThi[t][p][i] = (uint8_t)((v >> 8) & 255);
            }
#ifdef BREAK_TABLE
    LUTlo[T - 1][K / 4][4] ^= 1;  // the entry of columns (K/2, K/2 + 1) both 0 for the last token
#endif
    struct { const char *name; void (*run)(void); } kernels[] = {{"madd", madd}, {"lut", lut}, {"fused", fused}};
    for (int k = 0; k < 3; k++) {
        memset(out, 0x55, sizeof out);
        kernels[k].run();
        check(kernels[k].name);
    }
    if (argc > 1 && strcmp(argv[1], "check") == 0) {
        printf("T=%d tokens: madd, lut and fused give the reference's sums\n", T);
        return 0;
    }
    const int reps = 400, rounds = 5;
    double best[3] = {0, 0, 0};
    for (int round = 0; round < rounds; round++)
        for (int k = 0; k < 3; k++) {
            double t0 = now();
            for (int i = 0; i < reps; i++) kernels[k].run();
            double rate = (double)R * K * T * reps / (now() - t0) / 1e9;
            if (rate > best[k]) best[k] = rate;
        }
    printf("T=%d tokens: madd %.1f, lut %.1f, fused %.1f G products/s (best of %d)\n", T, best[0], best[1], best[2], rounds);
    pipes();
    return 0;
}
