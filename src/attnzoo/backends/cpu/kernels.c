/* attnzoo's native kernels: linear and efficient attention, whose least work is a few
 * products of each row with a small (DK x DV) state, and the forward of LSH attention's
 * rounds (at the end of the file).
 *
 * Linear attention with elu + 1 features (Katharopoulos et al., ICML 2020), per (batch, head):
 * causal in its recurrent form, for t = 0 .. L-1,
 *     S += phi(k_t) v_t^T,  z += phi(k_t),  out_t = phi(q_t)^T S / (phi(q_t) . z + eps)
 * (causal_linear); non-causal, S and z over all keys (linear_keys), then each query's
 * out = phi(q)^T S / (phi(q) . z + eps) (linear_queries). phi(x) = e^min(x, 0) + max(x, 0),
 * the exponent clamped at log(the smallest normal number), as attnzoo's eager map. The state
 * S (DK x DV) and z stay in L1 cache; two positions go through S per pass (half its loads
 * and stores); the loops over DV are vectorised by the compiler. DK, DV and REAL (float or
 * double) are set when it is compiled (attnzoo/backends/cpu/native.py). Work: 2 DK DV multiply-adds per
 * key and per query, the algorithm's least (its FLOP floor). The non-causal
 * backward (linear_queries_grad, linear_keys_grad) likewise: 4 DK DV a position; the causal
 * one (causal_linear_grad) runs the recurrence forward for dq, then backward: 6 DK DV.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#ifndef DK
#error "compile with -DDK=<key features> -DDV=<value width> -DREAL=<float|double> -DFAMILY_<name>"
#endif

/* A build holds one family's entry points, FAMILY_CAUSAL_LINEAR, FAMILY_LINEAR, FAMILY_EFFICIENT,
 * FAMILY_FEW_KEYS, FAMILY_FEW_QUERIES, FAMILY_LSH or FAMILY_LSH_HASH (LSH's hash and sort, which
 * use no DK or DV) (each entry point below is guarded by its family's name); the compiler drops
 * the static helpers the build does not call, so a first call waits for its own family's
 * compile only, a fraction of the whole file's. */
#if !(defined(FAMILY_CAUSAL_LINEAR) || defined(FAMILY_LINEAR) || defined(FAMILY_EFFICIENT) \
      || defined(FAMILY_FEW_KEYS) || defined(FAMILY_FEW_QUERIES) || defined(FAMILY_LSH) \
      || defined(FAMILY_LSH_HASH))
#error "compile with -DFAMILY_<name>: one of the families above"
#endif

/* Linear's and efficient's heads are split among the threads of the OpenMP runtime that torch's
 * own parallel ops use, where the build has one (-fopenmp: libgomp.so.1, the one torch loaded):
 * a region of its threads, still spinning from torch's last op, took ~1 us to hand out and
 * join, against ~85 us for a Python thread pool's (attnzoo/backends/cpu/native.py). Without it the heads
 * run one after another here, and Python splits them among its own threads. */
#ifdef _OPENMP
#define OVER_HEADS _Pragma("omp parallel for schedule(static) if(!serial)")
#define OVER_HEADS_STATUS _Pragma("omp parallel for schedule(static) if(!serial) reduction(|:status)")
#else
#define OVER_HEADS
#define OVER_HEADS_STATUS
#endif

/* Room for n values of ``size`` bytes from a cache line's start (64 bytes), freed with free(): at
 * malloc's 16-byte alignment most 64-byte vectors of a state's rows straddled two lines, and the
 * backward's products ran at ~60 % of the FMA peak (efficient's keys' gradient, one thread,
 * L = 4096: 9.3 ms; 7.5 ms aligned). */
static void *lines_alloc(size_t n, size_t size) {
    const size_t bytes = (n * size + 63) / 64 * 64;
    return aligned_alloc(64, bytes ? bytes : 64);
}

/* Whether this build splits heads itself (OVER_HEADS). */
int parallel_build(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* A process forked after its parent ran OpenMP regions has the parent's record of their
 * threads, not the threads: a region of more than one thread waits for them for ever (torch's
 * own ops too). There each call runs its heads on the calling thread alone, and Python splits
 * them among threads of its own. */
static int serial;
void serial_heads(void) { serial = 1; }

#define IS_FLOAT (sizeof(REAL) == 4)
#define AI inline __attribute__((always_inline))
#define LANES 16 /* partial sums of the normaliser: a vector's worth, so that they vectorise */
#define DKP ((DK + LANES - 1) / LANES * LANES)

/* e^x for floor_ <= x <= 0. Float: e^r 2^n with n = round(x log2 e) and r = x - n ln 2 (ln 2 in
 * two parts, Cephes' expf's reduction: exact without an FMA), e^r on [-ln2/2, ln2/2] a degree-6
 * polynomial (minimax in relative error, fitted for attnzoo), n added into its exponent bits:
 * branch-free and vectorisable, within 1.5 ulp of e^x. Cephes' seventh-degree polynomial and
 * product with a built 2^n (1.4 ulp) took 1.5x as long on the benchmark's CPU. Clamped at
 * EXP_LEAST at the lowest, where e^r 2^n is still a normal number. */
#define EXP_LEAST -87.3365402f /* log of the smallest normal float, rounded up */
static inline REAL exp_nonpositive(REAL x, REAL floor_) {
    if (!IS_FLOAT) return exp(x < floor_ ? floor_ : x);
    const float least = floor_ > EXP_LEAST ? floor_ : EXP_LEAST;
    const float big = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer, n in the low bits */
    const float xf = (float)x < least ? least : (float)x;
    union { float f; uint32_t u; } y, p; /* (unsigned: the shift below wraps) */
    y.f = xf * 1.44269504088896341f + big;
    const float n = y.f - big;
    const float r = xf - n * 0.693359375f + n * 2.12194440e-4f;
    float q = 1.3843651800e-3f;
    q = q * r + 8.3741554716e-3f;
    q = q * r + 4.1668002078e-2f;
    q = q * r + 1.6666431261e-1f;
    q = q * r + 4.9999994210e-1f;
    q = q * r + 1.0000000322f;
    p.f = q * r + 1.0f;
    p.u += y.u << 23; /* 2^n (y's bits above n's shift out) */
    return (REAL)p.f;
}

/* phi = elu + 1: x + 1 above 0, else e^x. Both sides computed, one taken (e^x of x > 0 is
 * garbage, never used): as (x > 0 ? x : 0) + e^min(x, 0), GCC masked the exponential's steps
 * and the features took 1.4x as long. A NaN stays NaN. */
static inline REAL phi(REAL x, REAL floor_) {
    const REAL e = exp_nonpositive(x, floor_);
    return x > 0 ? x + 1 : e;
}

/* A row of a large result, x * s into o (``width`` values: DK or DV), written once and not read
 * again here: with ``stream`` (see can_stream), by non-temporal stores, which skip reading each
 * line into the caches before writing it (efficient's queries, one thread, L = 4096: 2.9 ->
 * 2.2 ms; a product read the output after them faster too). A kernel that streams ends with
 * streams_done(). */
#if defined(__AVX512F__)
#define STREAM_LANES (64 / (int)sizeof(REAL)) /* a 64-byte line */
#else
#define STREAM_LANES 0 /* (none) */
#endif
static AI void put_row(REAL *restrict o, const REAL *restrict x, REAL s, int width, int stream) {
#if defined(__AVX512F__)
    if (stream && width % STREAM_LANES == 0) {
        for (int e = 0; e < width; e += STREAM_LANES) {
            if (IS_FLOAT)
                _mm512_stream_ps((float *)(o + e), _mm512_mul_ps(_mm512_loadu_ps((const float *)(x + e)),
                                                                 _mm512_set1_ps((float)s)));
            else
                _mm512_stream_pd((double *)(o + e), _mm512_mul_pd(_mm512_loadu_pd((const double *)(x + e)),
                                                                  _mm512_set1_pd((double)s)));
        }
        return;
    }
#else
    (void)stream;
#endif
    for (int e = 0; e < width; e++) o[e] = x[e] * s;
}

/* Whether rows of ``width`` values from ``base`` can be streamed: whole 64-byte lines, aligned. */
static int can_stream(const void *base, int width) {
    return STREAM_LANES && width % STREAM_LANES == 0 && ((uintptr_t)base & 63) == 0;
}

/* Streamed stores are weakly ordered: fenced before the kernel returns (and its result is read). */
static void streams_done(void) {
#if defined(__AVX512F__)
    _mm_sfence();
#endif
}

/* The features of two rows (phi; 0 for a row that takes no part: a fill after, not a product,
 * since a padded key may hold anything; a choice inside the loop was masked, step by step),
 * padded with zeros to whole lanes. */
static AI void two_features(
        const REAL *restrict xa, const REAL *restrict xb, int a_ok, int b_ok, REAL *restrict fa,
        REAL *restrict fb, REAL floor_) {
    for (int d = 0; d < DK; d++) {
        fa[d] = phi(xa[d], floor_);
        fb[d] = phi(xb[d], floor_);
    }
    for (int d = DK; d < DKP; d++) fa[d] = fb[d] = 0;
    if (!a_ok) memset(fa, 0, sizeof(REAL) * DK);
    if (!b_ok) memset(fb, 0, sizeof(REAL) * DK);
}

/* A vector's worth of lanes, and its halves: partial sums and maxima that the compiler keeps in
 * vector registers, folded in halves at the end (a loop over an array of lanes went through
 * memory, one scalar step a lane). */
typedef REAL lanes_v __attribute__((vector_size(LANES * sizeof(REAL))));
typedef REAL lanes_8 __attribute__((vector_size(8 * sizeof(REAL))));
typedef REAL lanes_4 __attribute__((vector_size(4 * sizeof(REAL))));
typedef REAL lanes_2 __attribute__((vector_size(2 * sizeof(REAL))));

#define HALVES(type, from, lo, hi) \
    type lo, hi;                    \
    memcpy(&lo, &from, sizeof lo);  \
    memcpy(&hi, (const REAL *)&from + sizeof lo / sizeof(REAL), sizeof hi)
/* a = max(a, b) lane by lane (by a mask: the ternary operator takes no vectors in C) */
#define MAX_INTO(a, b)                                                                             \
    do {                                                                                           \
        const __typeof__(a > b) take_b = b > a;                                                    \
        a = (__typeof__(a))(((__typeof__(take_b))b & take_b) | ((__typeof__(take_b))a & ~take_b)); \
    } while (0)

static inline REAL lanes_sum(const lanes_v *v) {
    HALVES(lanes_8, *v, a, b);
    a += b;
    HALVES(lanes_4, a, c, d);
    c += d;
    HALVES(lanes_2, c, e, f);
    e += f;
    return e[0] + e[1];
}

static inline REAL lanes_max(const lanes_v *v) {
    HALVES(lanes_8, *v, a, b);
    MAX_INTO(a, b);
    HALVES(lanes_4, a, c, d);
    MAX_INTO(c, d);
    HALVES(lanes_2, c, e, f);
    MAX_INTO(e, f);
    return e[1] > e[0] ? e[1] : e[0];
}

/* init + a . b over n values, summed lane by lane where whole lanes go (so that it vectorises). */
static AI REAL dot_n(const REAL *restrict a, const REAL *restrict b, int n, REAL init) {
    lanes_v l = {0}, x, y;
    int i = 0;
    for (; i + LANES <= n; i += LANES) {
        memcpy(&x, a + i, sizeof x);
        memcpy(&y, b + i, sizeof y);
        l += x * y;
    }
    for (; i < n; i++) init += a[i] * b[i];
    return init + lanes_sum(&l);
}

/* init + a . b over DKP values (zero past DK). */
static inline REAL dot_lanes(const REAL *restrict a, const REAL *restrict b, REAL init) {
    return dot_n(a, b, DKP, init);
}

/* Two positions' rank-one updates of a state's row m (n values), each followed by its product:
 * m += a0 x0, then y0 += b0 m; m += a1 x1, then y1 += b1 m. One pass through m. */
static AI void two_updates(REAL *restrict m, int n, REAL a0, const REAL *restrict x0, REAL b0,
                           REAL *restrict y0, REAL a1, const REAL *restrict x1, REAL b1, REAL *restrict y1) {
    for (int i = 0; i < n; i++) {
        REAL s = m[i] + a0 * x0[i];
        y0[i] += b0 * s;
        s += a1 * x1[i];
        y1[i] += b1 * s;
        m[i] = s;
    }
}

/* Steps a and b (b right after a) from the state (S, z) in place: their outputs into oa, ob.
 * ka_ok, kb_ok: whether each key takes part (0: padded, or b is no step at all). */
static AI void two_steps(
        const REAL *restrict qa, const REAL *restrict ka, const REAL *restrict va,
        const REAL *restrict qb, const REAL *restrict kb, const REAL *restrict vb, int ka_ok, int kb_ok,
        REAL *restrict S, REAL *restrict z, REAL *restrict oa, REAL *restrict ob, REAL eps, REAL floor_) {
    REAL fqa[DKP], fka[DKP], fqb[DKP], fkb[DKP], na[DV], nb[DV];
    two_features(qa, qb, 1, 1, fqa, fqb, floor_);
    two_features(ka, kb, ka_ok, kb_ok, fka, fkb, floor_);
#if DK % LANES
    REAL zp[DKP] = {0}; /* z padded to whole lanes */
    for (int d = 0; d < DK; d++) zp[d] = z[d];
#else
    REAL *restrict zp = z;
#endif
    REAL la[LANES] = {0}, lb[LANES] = {0}; /* the normalisers' sums, lane by lane */
    for (int d0 = 0; d0 < DKP; d0 += LANES)
        for (int j = 0; j < LANES; j++) { /* z after a, after b; each query's φ(q)·z */
            const REAL za = zp[d0 + j] + fka[d0 + j], zb = za + fkb[d0 + j];
            la[j] += fqa[d0 + j] * za;
            lb[j] += fqb[d0 + j] * zb;
            zp[d0 + j] = zb;
        }
#if DK % LANES
    for (int d = 0; d < DK; d++) z[d] = zp[d];
#endif
    lanes_v sa, sb; /* (folded in halves in vector registers: a chain of LANES steps held up each pair) */
    memcpy(&sa, la, sizeof sa);
    memcpy(&sb, lb, sizeof sb);
    const REAL dena = eps + lanes_sum(&sa), denb = eps + lanes_sum(&sb);
    for (int e = 0; e < DV; e++) na[e] = nb[e] = 0;
    for (int d = 0; d < DK; d++) /* one pass through S for both steps */
        two_updates(S + d * DV, DV, fka[d], va, fqa[d], na, fkb[d], vb, fqb[d], nb);
    const REAL ia = 1 / dena, ib = 1 / denb; /* (a vector division is ~16 multiplications) */
    for (int e = 0; e < DV; e++) {
        oa[e] = na[e] * ia;
        ob[e] = nb[e] * ib;
    }
}

/* n_heads (batch, head) pairs; q, k (n_heads, L, DK) and v (n_heads, L, DV) with rows of
 * DK (DV) contiguous values, heads q_head (k_head, v_head) values apart; key_ok (n_heads, L)
 * or null: 0 for a padded key (no part in the state); out (n_heads, L, DV) contiguous;
 * S (n_heads, DK, DV) and z (n_heads, DK): the state before, overwritten by the state after. */
#ifdef FAMILY_CAUSAL_LINEAR
void causal_linear(const REAL *q, const REAL *k, const REAL *v, const uint8_t *key_ok,
                   int64_t q_head, int64_t k_head, int64_t v_head, REAL *out, REAL *S, REAL *z,
                   int64_t n_heads, int64_t L, REAL eps, REAL floor_) {
    OVER_HEADS
    for (int64_t h = 0; h < n_heads; h++) {
        const REAL *Q = q + h * q_head, *K = k + h * k_head, *V = v + h * v_head;
        const uint8_t *ok = key_ok ? key_ok + h * L : 0;
        REAL *O = out + h * L * DV, *Sh = S + h * DK * DV, *zh = z + h * DK;
        int64_t t = 0;
        for (; t + 1 < L; t += 2)
            two_steps(Q + t * DK, K + t * DK, V + t * DV, Q + (t + 1) * DK, K + (t + 1) * DK,
                      V + (t + 1) * DV, ok ? ok[t] : 1, ok ? ok[t + 1] : 1, Sh, zh, O + t * DV,
                      O + (t + 1) * DV, eps, floor_);
        if (t < L) { /* an odd length's last step: b repeats a without its key, its output dropped */
            REAL spare[DV];
            two_steps(Q + t * DK, K + t * DK, V + t * DV, Q + t * DK, K + t * DK, V + t * DV,
                      ok ? ok[t] : 1, 0, Sh, zh, O + t * DV, spare, eps, floor_);
        }
    }
}
#endif

/* Row r of a group of four starting at t: its address (the last row's past the end, where
 * it takes no part) and whether it takes part. */
#define ROW(base, t, r, L, width) ((base) + ((t) + (r) < (L) ? (t) + (r) : (L) - 1) * (width))
#define TAKES_PART(ok, t, r, L) ((t) + (r) < (L) && (!(ok) || (ok)[(t) + (r)]))

/* The four rows of X (rows of DV values) from t into x; a row past the end: zeros. */
static AI void four_rows(const REAL *X, int64_t t, int64_t L, REAL (*restrict x)[DV]) {
    for (int r = 0; r < 4; r++) {
        const REAL *row = ROW(X, t, r, L, DV);
        const int real = t + r < L;
        for (int e = 0; e < DV; e++) x[r][e] = real ? row[e] : 0; /* (a select: no 0 * inf) */
    }
}

/* The four rows of X from t, read only: X's own (4, DV) block where all four are in it, else
 * their copy into buf (four_rows). */
typedef REAL row_dv[DV];
static AI const row_dv *four_rows_at(const REAL *X, int64_t t, int64_t L, row_dv *buf) {
    if (t + 4 <= L) return (const row_dv *)(X + t * DV);
    four_rows(X, t, L, buf);
    return buf;
}

/* The four-row products' vectors held in registers where there are 32 of 64 bytes (AVX-512) and
 * a row of the product is four of them at most: in GCC's own code every multiply-add read its
 * vector of M from memory, once for each of the four rows (5 loads to 4 multiply-adds, more than
 * the load ports take; efficient's forward, L = 4096, 2 threads: its queries 1.83 -> 1.49 ms, its
 * keys 1.55 -> 1.47, its backward 7.2 -> 6.3). IN_REGISTER(x): x is in a register here (an empty
 * asm that may change it). */
#if defined(__AVX512F__)
#define REG_LANES (64 / (int)sizeof(REAL))
typedef REAL reg_v __attribute__((vector_size(64)));
#define IN_REGISTER(x) __asm__("" : "+v"(x))
#define IN_REGISTERS(width) ((width) % REG_LANES == 0 && (width) <= 4 * REG_LANES)
#endif

/* out[r] = (add ? out[r] : 0) + sum_i a[r][i] M[i] for four rows r, one pass through M (inner rows
 * of width values, m_row apart): a's rows (inner values) a_row apart, out's out_row apart. */
static AI void four_rows_times(const REAL *restrict a, int a_row, int inner, const REAL *restrict M, int m_row,
                               int width, REAL *restrict out, int out_row, int add) {
#if defined(__AVX512F__)
    if (IN_REGISTERS(width)) {
        reg_v acc[4][4];
        if (add)
            for (int r = 0; r < 4; r++)
                for (int c = 0; c < width / REG_LANES; c++)
                    memcpy(&acc[r][c], out + r * out_row + c * REG_LANES, sizeof(reg_v));
        else
            memset(acc, 0, sizeof acc);
        for (int i = 0; i < inner; i++)
            for (int c = 0; c < width / REG_LANES; c++) {
                reg_v m;
                memcpy(&m, M + i * m_row + c * REG_LANES, sizeof m);
                IN_REGISTER(m);
                for (int r = 0; r < 4; r++) acc[r][c] += a[r * a_row + i] * m;
            }
        for (int r = 0; r < 4; r++)
            for (int c = 0; c < width / REG_LANES; c++)
                memcpy(out + r * out_row + c * REG_LANES, &acc[r][c], sizeof(reg_v));
        return;
    }
#endif
    if (!add)
        for (int r = 0; r < 4; r++)
            for (int e = 0; e < width; e++) out[r * out_row + e] = 0;
    for (int i = 0; i < inner; i++) {
        const REAL *restrict Mi = M + i * m_row;
        const REAL a0 = a[i], a1 = a[a_row + i], a2 = a[2 * a_row + i], a3 = a[3 * a_row + i];
        for (int e = 0; e < width; e++) {
            const REAL m = Mi[e];
            out[e] += a0 * m;
            out[out_row + e] += a1 * m;
            out[2 * out_row + e] += a2 * m;
            out[3 * out_row + e] += a3 * m;
        }
    }
}

/* out[r] = a[r]^T M for four rows: M (DK x DV). */
static AI void times(REAL (*restrict a)[DKP], const REAL *restrict M, REAL (*restrict out)[DV]) {
    four_rows_times(a[0], DKP, DK, M, DV, DV, out[0], DV, 0);
}

/* out[r] += M w[r] for four rows, from Mt = M^T (DV x DK). */
static AI void times_t(const row_dv *restrict w, const REAL *restrict Mt, REAL (*restrict out)[DKP]) {
    four_rows_times(w[0], DV, DV, Mt, DK, DK, out[0], DKP, 1);
}

/* M[i] += sum_r a[r][i] b[r] for the rows i < rows of M (width values each, contiguous), one pass
 * through M, each element by one chain of four multiply-adds (paired sums took two more
 * operations: efficient's keys' pass 18 % slower); b's rows in registers where they fit
 * (IN_REGISTERS). a's rows (rows values) a_row apart, b's (width values) b_row apart. */
static AI void four_outer(REAL *restrict M, int rows, int width, const REAL *restrict a, int a_row,
                          const REAL *restrict b, int b_row) {
#if defined(__AVX512F__)
    if (IN_REGISTERS(width)) {
        reg_v bv[4][4];
        for (int r = 0; r < 4; r++)
            for (int c = 0; c < width / REG_LANES; c++) {
                memcpy(&bv[r][c], b + r * b_row + c * REG_LANES, sizeof(reg_v));
                IN_REGISTER(bv[r][c]);
            }
        for (int i = 0; i < rows; i++) {
            const REAL a0 = a[i], a1 = a[a_row + i], a2 = a[2 * a_row + i], a3 = a[3 * a_row + i];
            for (int c = 0; c < width / REG_LANES; c++) {
                reg_v m;
                memcpy(&m, M + i * width + c * REG_LANES, sizeof m);
                m = m + a0 * bv[0][c] + a1 * bv[1][c] + a2 * bv[2][c] + a3 * bv[3][c];
                memcpy(M + i * width + c * REG_LANES, &m, sizeof m);
            }
        }
        return;
    }
#endif
    for (int i = 0; i < rows; i++) {
        REAL *restrict Mi = M + i * width;
        const REAL a0 = a[i], a1 = a[a_row + i], a2 = a[2 * a_row + i], a3 = a[3 * a_row + i];
        for (int e = 0; e < width; e++)
            Mi[e] = Mi[e] + a0 * b[e] + a1 * b[b_row + e] + a2 * b[2 * b_row + e] + a3 * b[3 * b_row + e];
    }
}

/* M += sum_r a[r] b[r]^T for four rows: M (DK x DV). */
static AI void add_outer(REAL *restrict M, REAL (*restrict a)[DKP], const row_dv *restrict b) {
    four_outer(M, DK, DV, a[0], DKP, b[0], DV);
}

/* m += sum_r a[r] c[r], in a pass of its own (within add_outer's, its scalar steps held up the
 * multiply-adds and took their broadcasts: efficient's keys 15 % slower). */
static AI void add_weighted(REAL *restrict m, REAL (*restrict a)[DKP], const REAL *restrict c) {
    for (int d = 0; d < DK; d++) m[d] += (a[0][d] * c[0] + a[1][d] * c[1]) + (a[2][d] * c[2] + a[3][d] * c[3]);
}

/* The features of four rows of X (DK values each) from t: phi, 0 where a row takes no part. */
static AI void four_features(const REAL *X, const uint8_t *ok, int64_t t, int64_t L, REAL (*restrict f)[DKP],
                             REAL floor_) {
    two_features(ROW(X, t, 0, L, DK), ROW(X, t, 1, L, DK), TAKES_PART(ok, t, 0, L), TAKES_PART(ok, t, 1, L),
                 f[0], f[1], floor_);
    two_features(ROW(X, t, 2, L, DK), ROW(X, t, 3, L, DK), TAKES_PART(ok, t, 2, L), TAKES_PART(ok, t, 3, L),
                 f[2], f[3], floor_);
}

/* Transpose of a (rows x cols) matrix into t (cols x rows). */
static void transpose(const REAL *restrict a, REAL *restrict t, int rows, int cols) {
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++) t[j * rows + i] = a[i * cols + j];
}

static const REAL ONES[4] = {1, 1, 1, 1};

/* Non-causal keys: S = sum_j phi(k_j) v_j^T (n_heads, DK, DV) and z = sum_j phi(k_j)
 * (n_heads, DK), written (not added), over the keys key_ok keeps (null: all); layout as
 * causal_linear's. Four keys a pass through S. */
#ifdef FAMILY_LINEAR
void linear_keys(const REAL *k, const REAL *v, const uint8_t *key_ok, int64_t k_head, int64_t v_head,
                 REAL *S, REAL *z, int64_t n_heads, int64_t L, REAL floor_) {
    OVER_HEADS
    for (int64_t h = 0; h < n_heads; h++) {
        const uint8_t *ok = key_ok ? key_ok + h * L : 0;
        REAL *Sh = S + h * DK * DV, *zh = z + h * DK;
        for (int i = 0; i < DK * DV; i++) Sh[i] = 0;
        for (int d = 0; d < DK; d++) zh[d] = 0;
        for (int64_t t = 0; t < L; t += 4) {
            REAL f[4][DKP], buf[4][DV];
            four_features(k + h * k_head, ok, t, L, f, floor_);
            add_outer(Sh, f, four_rows_at(v + h * v_head, t, L, buf));
            add_weighted(zh, f, ONES);
        }
    }
}
#endif

/* Non-causal queries: out = phi(q)^T S / (phi(q) . z + eps) from linear_keys' S and z, four
 * queries a pass through S. */
#ifdef FAMILY_LINEAR
void linear_queries(const REAL *q, int64_t q_head, const REAL *S, const REAL *z, REAL *out,
                    int64_t n_heads, int64_t L, REAL eps, REAL floor_) {
    const int stream = can_stream(out, DV);
    OVER_HEADS
    for (int64_t h = 0; h < n_heads; h++) {
        REAL *O = out + h * L * DV, zp[DKP] = {0};
        for (int d = 0; d < DK; d++) zp[d] = z[h * DK + d];
        for (int64_t t = 0; t < L; t += 4) {
            REAL f[4][DKP], n[4][DV];
            four_features(q + h * q_head, 0, t, L, f, floor_);
            times(f, S + h * DK * DV, n);
            for (int r = 0; r < 4 && t + r < L; r++)
                put_row(O + (t + r) * DV, n[r], 1 / dot_lanes(f[r], zp, eps), DV, stream);
        }
        streams_done(); /* (each thread its own) */
    }
}
#endif

/* phi'(x) from phi(x): 1 above 0, e^x = phi(x) below. */
static inline REAL phi_slope(REAL f) { return f < 1 ? f : 1; }

/* Non-causal backward, query side, from the output's gradient g (rows of DV, heads g_head
 * apart): with f = phi(q), den = f . z + eps, gn = g / den, df = S gn and gden = -(f . df) / den:
 * dq = (df + gden z) * phi'(q) (n_heads, L, DK); dS = sum f gn^T (n_heads, DK, DV) and
 * dz = sum f gden (n_heads, DK), written. Four queries a pass through S^T and dS.
 * Returns 0, or -1 where memory for S^T could not be had. */
#ifdef FAMILY_LINEAR
int linear_queries_grad(const REAL *q, const REAL *g, int64_t q_head, int64_t g_head, const REAL *S,
                        const REAL *z, REAL *dq, REAL *dS, REAL *dz, int64_t n_heads, int64_t L,
                        REAL eps, REAL floor_) {
    const int stream = can_stream(dq, DK);
    int status = 0;
    OVER_HEADS_STATUS
    for (int64_t h = 0; h < n_heads; h++) {
        REAL *St = lines_alloc(DK * DV, sizeof(REAL)); /* (a head's own: heads run side by side) */
        if (!St) {
            status = -1;
            continue;
        }
        const REAL *zh = z + h * DK;
        REAL *dSh = dS + h * DK * DV, *dzh = dz + h * DK, *DQ = dq + h * L * DK, zp[DKP] = {0};
        for (int d = 0; d < DK; d++) zp[d] = zh[d];
        transpose(S + h * DK * DV, St, DK, DV);
        for (int i = 0; i < DK * DV; i++) dSh[i] = 0;
        for (int d = 0; d < DK; d++) dzh[d] = 0;
        for (int64_t t = 0; t < L; t += 4) {
            REAL f[4][DKP], df[4][DKP] = {{0}}, gn[4][DV], gden[4], den[4];
            four_features(q + h * q_head, 0, t, L, f, floor_);
            four_rows(g + h * g_head, t, L, gn); /* (a row past the end: g = 0) */
            for (int r = 0; r < 4; r++) {
                den[r] = dot_lanes(f[r], zp, eps);
                const REAL inv = t + r < L ? 1 / den[r] : 0; /* (past the end f = 0: den may be 0) */
                for (int e = 0; e < DV; e++) gn[r][e] *= inv;
            }
            times_t((const row_dv *)gn, St, df); /* df = S gn */
            for (int r = 0; r < 4; r++) gden[r] = t + r < L ? -dot_lanes(f[r], df[r], 0) / den[r] : 0;
            add_outer(dSh, f, (const row_dv *)gn);
            add_weighted(dzh, f, gden);
            for (int r = 0; r < 4 && t + r < L; r++) {
                for (int d = 0; d < DK; d++) df[r][d] = (df[r][d] + gden[r] * zh[d]) * phi_slope(f[r][d]);
                put_row(DQ + (t + r) * DK, df[r], 1, DK, stream);
            }
        }
        streams_done();
        free(St);
    }
    return status;
}
#endif

/* The key side of a backward, four keys at a time from t, given their weights w (phi(k), or
 * E): dv = dS^T w into the rows of DV_ and dk = slope(w) * (dS v + dz) into those of DK_, 0 for
 * a key that takes no part (slope: e^x's, w itself, with exp_weights; else phi's); dSt = dS^T. */
static AI void keys_grad_rows(const REAL *V, int64_t t, int64_t L, const int *part, REAL (*restrict w)[DKP],
                              const REAL *restrict dS, const REAL *restrict dSt, const REAL *restrict dz,
                              int exp_weights, REAL *DK_, REAL *DV_, int stream_dk, int stream_dv) {
    REAL buf[4][DV], o[4][DV], dw[4][DKP];
    times(w, dS, o); /* dv = dS^T w */
    const row_dv *vr = four_rows_at(V, t, L, buf);
    for (int r = 0; r < 4; r++)
        for (int d = 0; d < DK; d++) dw[r][d] = dz[d];
    times_t(vr, dSt, dw); /* dS v + dz */
    for (int r = 0; r < 4 && t + r < L; r++) {
        put_row(DV_ + (t + r) * DV, o[r], 1, DV, stream_dv);
        for (int d = 0; d < DK; d++) { /* (a select: a padded key's v may hold anything) */
            const REAL slope = exp_weights ? w[r][d] : phi_slope(w[r][d]);
            dw[r][d] = part[r] ? dw[r][d] * slope : 0;
        }
        put_row(DK_ + (t + r) * DK, dw[r], 1, DK, stream_dk);
    }
}

/* Non-causal backward, key side, from dS and dz: dv = dS^T phi(k) (n_heads, L, DV) and
 * dk = (dS v + dz) * phi'(k) (n_heads, L, DK), 0 for a key key_ok leaves out. Four keys a
 * pass through dS and dS^T. Returns 0, or -1 where memory for dS^T could not be had. */
#ifdef FAMILY_LINEAR
int linear_keys_grad(const REAL *k, const REAL *v, const uint8_t *key_ok, int64_t k_head, int64_t v_head,
                     const REAL *dS, const REAL *dz, REAL *dk, REAL *dv, int64_t n_heads, int64_t L,
                     REAL floor_) {
    const int stream_dk = can_stream(dk, DK), stream_dv = can_stream(dv, DV);
    int status = 0;
    OVER_HEADS_STATUS
    for (int64_t h = 0; h < n_heads; h++) {
        REAL *dSt = lines_alloc(DK * DV, sizeof(REAL));
        if (!dSt) {
            status = -1;
            continue;
        }
        const uint8_t *ok = key_ok ? key_ok + h * L : 0;
        transpose(dS + h * DK * DV, dSt, DK, DV);
        for (int64_t t = 0; t < L; t += 4) {
            REAL f[4][DKP];
            int part[4];
            for (int r = 0; r < 4; r++) part[r] = TAKES_PART(ok, t, r, L);
            four_features(k + h * k_head, ok, t, L, f, floor_);
            keys_grad_rows(v + h * v_head, t, L, part, f, dS + h * DK * DV, dSt, dz + h * DK, 0,
                           dk + h * L * DK, dv + h * L * DV, stream_dk, stream_dv);
        }
        streams_done();
        free(dSt);
    }
    return status;
}
#endif

/* The features of one row x (DK values): phi, padded with zeros to whole lanes; all 0 where the
 * row takes no part (a fill after, as two_features). */
static AI void features_of(const REAL *restrict x, int ok, REAL *restrict f, REAL floor_) {
    for (int d = 0; d < DK; d++) f[d] = phi(x[d], floor_);
    for (int d = DK; d < DKP; d++) f[d] = 0;
    if (!ok) memset(f, 0, sizeof(REAL) * DK);
}

/* Causal backward of causal_linear from the output's gradient g (rows of DV, heads g_head apart),
 * the output out (n_heads, L, DV) and the state before, S0 (n_heads, DK, DV) and z0 (n_heads, DK).
 * With f = phi(q_t), den_t = f . z_t + eps, gn_t = g_t / den_t and gden_t = -(gn_t . out_t):
 * forward through the positions, the state (S_t, z_t) again, dq_t = (S_t gn_t + gden_t z_t) * phi'(q_t);
 * then backward, R_t = dS + sum_{i >= t} f_i gn_i^T and r_t = dz + sum_{i >= t} f_i gden_i:
 * dk_t = (R_t v_t + r_t) * phi'(k_t), dv_t = R_t^T phi(k_t) (0 for a key key_ok leaves out).
 * dS (n_heads, DK, DV) and dz (n_heads, DK) hold the gradients of the state after on entry and
 * those of the state before on return (R and r at t = 0). The forward pass keeps S^T (each
 * update and product along DK: no sums across lanes); the backward keeps R and R^T, updated
 * alike, so that R^T phi(k) and R v are both such products. Two positions a pass through each
 * state, as two_steps (an odd length's last: a second position with no key and no gradient,
 * its results dropped). Work: 6 DK DV multiply-adds a position, with the forward's 2 the step's
 * 8 (its floor: 6). Returns 0, or -1 without memory for S^T, R^T and the positions' 1/den and gden. */
#ifdef FAMILY_CAUSAL_LINEAR
int causal_linear_grad(const REAL *q, const REAL *k, const REAL *v, const uint8_t *key_ok, const REAL *g,
                       const REAL *out, int64_t q_head, int64_t k_head, int64_t v_head, int64_t g_head,
                       const REAL *S0, const REAL *z0, REAL *dq, REAL *dk, REAL *dv, REAL *dS, REAL *dz,
                       int64_t n_heads, int64_t L, REAL eps, REAL floor_) {
    const int stream_dq = can_stream(dq, DK), stream_dk = can_stream(dk, DK), stream_dv = can_stream(dv, DV);
    int status = 0;
    OVER_HEADS_STATUS
    for (int64_t h = 0; h < n_heads; h++) {
        REAL *T = lines_alloc(DV * DKP, sizeof(REAL)), *per = malloc(sizeof(REAL) * 2 * (L > 0 ? L : 1));
        if (!T || !per) {
            free(T);
            free(per);
            status = -1;
            continue;
        }
        const REAL *Q = q + h * q_head, *K = k + h * k_head, *V = v + h * v_head, *G = g + h * g_head;
        const REAL *O = out + h * L * DV;
        const uint8_t *ok = key_ok ? key_ok + h * L : 0;
        REAL *R = dS + h * DK * DV, z[2][DKP] = {{0}}, r[DKP] = {0};
        REAL fq[2][DKP], fk[2][DKP], df[2][DKP], gn[2][DV], dvt[2][DV], gden[2];
        for (int d = 0; d < DK; d++) z[1][d] = z0[h * DK + d], r[d] = dz[h * DK + d];
        for (int e = 0; e < DV; e++) /* T = S0^T, rows padded to whole lanes */
            for (int d = 0; d < DKP; d++) T[e * DKP + d] = d < DK ? S0[h * DK * DV + d * DV + e] : 0;
        for (int64_t t = 0; t < L; t += 2) { /* forward: S_t, z_t; dq. Positions t and t + 1 */
            const int64_t at[2] = {t, t + 1 < L ? t + 1 : t};
            int part[2];
            for (int i = 0; i < 2; i++) {
                const int real = i == 0 || t + 1 < L;
                part[i] = real && (!ok || ok[at[i]]);
                features_of(Q + at[i] * DK, 1, fq[i], floor_);
                features_of(K + at[i] * DK, part[i], fk[i], floor_);
                for (int d = 0; d < DKP; d++) z[i][d] = z[1 - i][d] + fk[i][d]; /* (z[1]: the carry) */
                const REAL inv = real ? 1 / dot_lanes(fq[i], z[i], eps) : 0;
                for (int e = 0; e < DV; e++) gn[i][e] = real ? G[at[i] * DV + e] * inv : 0;
                gden[i] = -dot_n(gn[i], O + at[i] * DV, DV, 0);
                if (real) per[2 * at[i]] = inv, per[2 * at[i] + 1] = gden[i];
                for (int d = 0; d < DKP; d++) df[i][d] = gden[i] * z[i][d];
            }
            for (int e = 0; e < DV; e++) { /* S^T += v phi(k)^T, then S gn: t, then t + 1 */
                const REAL v0 = part[0] ? V[at[0] * DV + e] : 0; /* (selects: a padded v may hold anything) */
                const REAL v1 = part[1] ? V[at[1] * DV + e] : 0;
                two_updates(T + e * DKP, DKP, v0, fk[0], gn[0][e], df[0], v1, fk[1], gn[1][e], df[1]);
            }
            for (int i = 0; i < 1 + (t + 1 < L); i++) {
                for (int d = 0; d < DK; d++) df[i][d] *= phi_slope(fq[i][d]);
                put_row(dq + (h * L + at[i]) * DK, df[i], 1, DK, stream_dq);
            }
        }
        for (int e = 0; e < DV; e++) /* T = R^T */
            for (int d = 0; d < DKP; d++) T[e * DKP + d] = d < DK ? R[d * DV + e] : 0;
        for (int64_t t = L - 1; t >= 0; t -= 2) { /* backward: R_t, r_t; dk, dv. Positions t and t - 1 */
            const int64_t at[2] = {t, t >= 1 ? t - 1 : t};
            int part[2];
            for (int i = 0; i < 2; i++) {
                const int real = i == 0 || t >= 1;
                part[i] = real && (!ok || ok[at[i]]);
                features_of(Q + at[i] * DK, 1, fq[i], floor_);
                features_of(K + at[i] * DK, part[i], fk[i], floor_);
                const REAL inv = real ? per[2 * at[i]] : 0, gd = real ? per[2 * at[i] + 1] : 0;
                for (int e = 0; e < DV; e++) gn[i][e] = real ? G[at[i] * DV + e] * inv : 0, dvt[i][e] = 0;
                for (int d = 0; d < DKP; d++) r[d] += gd * fq[i][d], df[i][d] = r[d];
            }
            for (int d = 0; d < DK; d++) /* R += phi(q) gn^T, then R^T phi(k): t, then t - 1 */
                two_updates(R + d * DV, DV, fq[0][d], gn[0], fk[0][d], dvt[0], fq[1][d], gn[1], fk[1][d], dvt[1]);
            for (int e = 0; e < DV; e++) { /* R^T likewise, then R v */
                const REAL v0 = part[0] ? V[at[0] * DV + e] : 0, v1 = part[1] ? V[at[1] * DV + e] : 0;
                two_updates(T + e * DKP, DKP, gn[0][e], fq[0], v0, df[0], gn[1][e], fq[1], v1, df[1]);
            }
            for (int i = 0; i < 1 + (t >= 1); i++) {
                for (int d = 0; d < DK; d++) df[i][d] = part[i] ? df[i][d] * phi_slope(fk[i][d]) : 0;
                put_row(dk + (h * L + at[i]) * DK, df[i], 1, DK, stream_dk);
                put_row(dv + (h * L + at[i]) * DV, dvt[i], 1, DV, stream_dv);
            }
        }
        for (int d = 0; d < DK; d++) dz[h * DK + d] = r[d];
        streams_done();
        free(T);
        free(per);
    }
    return status;
}
#endif

/* ---- Efficient attention (Shen et al., WACV 2021): out = softmax_features(q) G with
 * G = sum_j E_j v_j^T / z, E_j = exp(k_j - c) (c: each feature's max over the kept keys,
 * 0 where none), z = sum_j E_j (at least the smallest normal number). */

/* E = exp(k - c) of four keys from t (0 for a key that takes no part). */
static AI void four_weights(const REAL *K, const uint8_t *ok, int64_t t, int64_t L, const REAL *restrict c,
                            REAL (*restrict E)[DKP], int *part, REAL floor_) {
    for (int r = 0; r < 4; r++) {
        const REAL *kr = ROW(K, t, r, L, DK);
        part[r] = TAKES_PART(ok, t, r, L);
        for (int d = 0; d < DK; d++) E[r][d] = part[r] ? exp_nonpositive(kr[d] - c[d], floor_) : 0;
    }
}

/* One head's keys: G (DK, DV), z (DK, unclamped) and c (DK), written. */
static void keys_head(const REAL *K, const REAL *V, const uint8_t *ok, REAL *G, REAL *z, REAL *c, int64_t L,
                      REAL tiny, REAL floor_) {
    REAL top[DK]; /* (a local array, kept in registers: c[] was stored row by row) */
    for (int d = 0; d < DK; d++) top[d] = -INFINITY;
    for (int64_t t = 0; t < L; t++)
        if (!ok || ok[t])
            for (int d = 0; d < DK; d++) top[d] = K[t * DK + d] > top[d] ? K[t * DK + d] : top[d];
    for (int d = 0; d < DK; d++) c[d] = isfinite(top[d]) ? top[d] : 0;
    for (int i = 0; i < DK * DV; i++) G[i] = 0;
    for (int d = 0; d < DK; d++) z[d] = 0;
    for (int64_t t = 0; t < L; t += 4) {
        REAL E[4][DKP], buf[4][DV];
        int part[4];
        four_weights(K, ok, t, L, c, E, part, floor_);
        add_outer(G, E, four_rows_at(V, t, L, buf));
        add_weighted(z, E, ONES);
    }
    for (int d = 0; d < DK; d++) {
        const REAL inv = 1 / (z[d] > tiny ? z[d] : tiny);
        for (int e = 0; e < DV; e++) G[d * DV + e] *= inv;
    }
}

/* Four query rows' exponentials over their features, exp(x - max x), into p (zero past DK);
 * inv[r] = 1 / row r's sum and, where ``shift`` is not null, shift[r] = max + log(sum), by which
 * softmax(x) = exp(x - shift) (for the backward). x: the rows. Each step for the four rows
 * before the next (their maxima, then their exponentials, then their sums): one row at a time,
 * each step's folds of lanes waited on the last, and efficient's queries took 13 % longer. */
static AI void four_row_exps(const REAL *const *x, REAL (*restrict p)[DKP], REAL *restrict inv, REAL *shift,
                              REAL floor_) {
    lanes_v top[4], sum[4], c;
    REAL m[4];
    for (int r = 0; r < 4; r++) {
#if DK % LANES
        REAL xp[DKP]; /* (padded with x[0]: no new max) */
        for (int d = 0; d < DKP; d++) xp[d] = x[r][d < DK ? d : 0];
#else
        const REAL *restrict xp = x[r];
#endif
        memcpy(&top[r], xp, sizeof c);
        for (int d0 = LANES; d0 < DKP; d0 += LANES) {
            memcpy(&c, xp + d0, sizeof c);
            MAX_INTO(top[r], c);
        }
    }
    for (int r = 0; r < 4; r++) m[r] = lanes_max(&top[r]);
    for (int r = 0; r < 4; r++) {
        for (int d = 0; d < DK; d++) p[r][d] = exp_nonpositive(x[r][d] - m[r], floor_);
        for (int d = DK; d < DKP; d++) p[r][d] = 0;
        memset(&sum[r], 0, sizeof c);
        for (int d0 = 0; d0 < DKP; d0 += LANES) {
            memcpy(&c, p[r] + d0, sizeof c);
            sum[r] += c;
        }
    }
    for (int r = 0; r < 4; r++) {
        const REAL s = lanes_sum(&sum[r]);
        inv[r] = 1 / s;
        if (shift) shift[r] = m[r] + (IS_FLOAT ? logf(s) : log(s));
    }
}

/* The four query rows of Q from t (the last repeated past the end). */
#define FOUR_ROWS(Q, t, L) {ROW(Q, t, 0, L, DK), ROW(Q, t, 1, L, DK), ROW(Q, t, 2, L, DK), ROW(Q, t, 3, L, DK)}

/* One head's queries: O = softmax(Q) G (L, DV), four queries a pass through G; where ``shift``
 * (L) is not null, each row's shift (four_row_exps) too. ``next``: the next head's keys (or
 * null), read into L2 meanwhile (its max pass then reads no DRAM). */
static void queries_head(const REAL *Q, const REAL *G, REAL *O, REAL *shift, int64_t L, const char *next,
                         int stream, REAL floor_) {
    for (int64_t t = 0; t < L; t += 4) {
        const REAL *rows[4] = FOUR_ROWS(Q, t, L);
        REAL p[4][DKP], n[4][DV], shifts[4];
        REAL inv[4]; /* (the softmax's normaliser, applied to the product: off its path) */
        if (next && t + 4 <= L)
            for (int64_t at = 0; at < 4 * DK * (int64_t)sizeof(REAL); at += 64)
                __builtin_prefetch(next + t * DK * (int64_t)sizeof(REAL) + at, 0, 2);
        four_row_exps(rows, p, inv, shift ? shifts : 0, floor_);
        times(p, G, n);
        for (int r = 0; r < 4 && t + r < L; r++) {
            put_row(O + (t + r) * DV, n[r], inv[r], DV, stream);
            if (shift) shift[t + r] = shifts[r];
        }
    }
    streams_done(); /* (each thread its own) */
}

/* Forward: per head its keys' G (n_heads, DK, DV), z (n_heads, DK, unclamped) and c (n_heads,
 * DK), then its queries' out = softmax(q) G (n_heads, Lq, DV), all written, and where ``shift``
 * is not null the queries' row shifts (n_heads, Lq) for the backward. A head's keys and
 * queries in one pass of a thread (G still in L1; one parallel region, not two: the forward at
 * L = 4096 ~0.1 ms shorter, within this VM's noise). */
#ifdef FAMILY_EFFICIENT
void efficient_forward(const REAL *q, const REAL *k, const REAL *v, const uint8_t *key_ok, int64_t q_head,
                       int64_t k_head, int64_t v_head, REAL *G, REAL *z, REAL *c, REAL *out, REAL *shift,
                       int64_t n_heads, int64_t Lq, int64_t Lk, REAL tiny, REAL floor_) {
    const int stream = can_stream(out, DV);
    OVER_HEADS
    for (int64_t h = 0; h < n_heads; h++) {
        REAL *Gh = G + h * DK * DV;
        keys_head(k + h * k_head, v + h * v_head, key_ok ? key_ok + h * Lk : 0, Gh, z + h * DK, c + h * DK, Lk,
                  tiny, floor_);
        const char *next = h + 1 < n_heads ? (const char *)(k + (h + 1) * k_head) : 0;
        queries_head(q + h * q_head, Gh, out + h * Lq * DV, shift ? shift + h * Lq : 0, Lq, next, stream,
                     floor_);
    }
}
#endif

/* Rows t + PREFETCH_AHEAD .. + 4 of X (rows of ``width`` values, L of them) into the caches: the
 * backward's rows arrive before they are read (its passes at L = 4096 ~3 % shorter; the forward's
 * gained nothing). */
#define PREFETCH_AHEAD 16
static AI void prefetch_ahead(const REAL *X, int64_t t, int64_t L, int width) {
    if (t + PREFETCH_AHEAD + 4 <= L)
        for (int64_t at = 0; at < 4 * width * (int64_t)sizeof(REAL); at += 64)
            __builtin_prefetch((const char *)(X + (t + PREFETCH_AHEAD) * width) + at, 0, 3);
}

/* Backward, one head's query side: with p = softmax(Q) = exp(Q - shift) (shift: the forward's,
 * one a row) and dp = G g, dQ = p * (dp - p . dp) (L, DK) and dG = sum p g^T (DK, DV), written;
 * Gt: room for G^T. */
static void queries_grad_head(const REAL *Q, const REAL *g, const REAL *shift, const REAL *G, REAL *Gt,
                              REAL *DQ, REAL *dG, int64_t L, int stream, REAL floor_) {
    transpose(G, Gt, DK, DV);
    for (int i = 0; i < DK * DV; i++) dG[i] = 0;
    for (int64_t t = 0; t < L; t += 4) {
        const REAL *rows[4] = FOUR_ROWS(Q, t, L);
        REAL p[4][DKP], dp[4][DKP] = {{0}}, buf[4][DV];
        prefetch_ahead(Q, t, L, DK);
        prefetch_ahead(g, t, L, DV);
        for (int r = 0; r < 4; r++) { /* p = softmax(q): no max or sum to take again */
            const REAL sr = shift[t + r < L ? t + r : L - 1];
            for (int d = 0; d < DK; d++) p[r][d] = exp_nonpositive(rows[r][d] - sr, floor_);
            for (int d = DK; d < DKP; d++) p[r][d] = 0;
        }
        const row_dv *gr = four_rows_at(g, t, L, buf); /* (a row past the end: g = 0) */
        times_t(gr, Gt, dp); /* dp = G g */
        add_outer(dG, p, gr);
        for (int r = 0; r < 4 && t + r < L; r++) {
            const REAL pdp = dot_lanes(p[r], dp[r], 0);
            for (int d = 0; d < DK; d++) dp[r][d] = p[r][d] * (dp[r][d] - pdp);
            put_row(DQ + (t + r) * DK, dp[r], 1, DK, stream);
        }
    }
}

/* Backward, one head's key side, from dG: dS = dG / z and dz = -(dG . G) / z per feature (0
 * where z is clamped: no kept key); per key E = exp(k - c): dk = E * (dS v + dz), dv = dS^T E
 * (0 for a key ok leaves out). dS, dSt: room for dS and dS^T. */
static void keys_grad_head(const REAL *K, const REAL *V, const uint8_t *ok, const REAL *G, const REAL *z,
                           const REAL *c, const REAL *dG, REAL *dS, REAL *dSt, REAL *DK_, REAL *DV_, int64_t L,
                           int stream_dk, int stream_dv, REAL tiny, REAL floor_) {
    REAL dz[DK];
    for (int d = 0; d < DK; d++) {
        const REAL zc = z[d] > tiny ? z[d] : tiny;
        REAL dGG = 0;
        for (int e = 0; e < DV; e++) {
            dGG += dG[d * DV + e] * G[d * DV + e];
            dS[d * DV + e] = dG[d * DV + e] / zc;
        }
        dz[d] = z[d] >= tiny ? -dGG / z[d] : 0;
    }
    transpose(dS, dSt, DK, DV);
    for (int64_t t = 0; t < L; t += 4) {
        REAL E[4][DKP];
        int part[4];
        prefetch_ahead(K, t, L, DK);
        prefetch_ahead(V, t, L, DV);
        four_weights(K, ok, t, L, c, E, part, floor_);
        keys_grad_rows(V, t, L, part, E, dS, dSt, dz, 1, DK_, DV_, stream_dk, stream_dv);
    }
}

/* Backward from the output's gradient g (rows of DV, heads g_head apart) and the forward's G, z,
 * c and row shifts: per head its query side, dq (n_heads, Lq, DK) and dG (n_heads, DK, DV),
 * then its key side, dk (n_heads, Lk, DK) and dv (n_heads, Lk, DV), all written (one parallel
 * region, as the forward's). Returns 0, or -1 without memory for G^T, dS and dS^T. */
#ifdef FAMILY_EFFICIENT
int efficient_backward(const REAL *q, const REAL *k, const REAL *v, const uint8_t *key_ok, const REAL *g,
                       int64_t q_head, int64_t k_head, int64_t v_head, int64_t g_head, const REAL *G,
                       const REAL *z, const REAL *c, const REAL *shift, REAL *dG, REAL *dq, REAL *dk, REAL *dv,
                       int64_t n_heads, int64_t Lq, int64_t Lk, REAL tiny, REAL floor_) {
    const int stream_dq = can_stream(dq, DK), stream_dk = can_stream(dk, DK), stream_dv = can_stream(dv, DV);
    int status = 0;
    OVER_HEADS_STATUS
    for (int64_t h = 0; h < n_heads; h++) {
        REAL *Gt = lines_alloc(DK * DV, sizeof(REAL)), *dS = lines_alloc(DK * DV, sizeof(REAL)),
             *dSt = lines_alloc(DK * DV, sizeof(REAL));
        if (Gt && dS && dSt) {
            const REAL *Gh = G + h * DK * DV;
            REAL *dGh = dG + h * DK * DV;
            queries_grad_head(q + h * q_head, g + h * g_head, shift + h * Lq, Gh, Gt, dq + h * Lq * DK, dGh, Lq,
                              stream_dq, floor_);
            keys_grad_head(k + h * k_head, v + h * v_head, key_ok ? key_ok + h * Lk : 0, Gh, z + h * DK,
                           c + h * DK, dGh, dS, dSt, dk + h * Lk * DK, dv + h * Lk * DV, Lk, stream_dk, stream_dv,
                           tiny, floor_);
            streams_done();
        } else {
            status = -1;
        }
        free(Gt);
        free(dS);
        free(dSt);
    }
    return status;
}
#endif

/* LSH's hash of n positions of n_heads heads from their rotations x R, laid out (n_heads, R,
 * half, n) (positions in lanes: every reduction runs across rows, not along them): per round
 * the argmax of [xR; -xR] with the first-maximum rule of torch's argmax of the concatenation,
 * i.e. the first c with xR_c = max(xR) where max(xR) >= -min(xR), else half + the first c
 * with xR_c = min(xR). Written to buckets (n_heads, R, L) at positions start.. . Returns 0,
 * or -1 without memory for four rows of n. */
#ifdef FAMILY_LSH_HASH
int lsh_buckets(const REAL *rotated, int64_t n_heads, int64_t n, int64_t R, int64_t half, int64_t *buckets,
                int64_t L, int64_t start) {
    REAL *top = malloc(sizeof(REAL) * n), *low = malloc(sizeof(REAL) * n);
    int64_t *first = malloc(sizeof(int64_t) * n), *second_half = malloc(sizeof(int64_t) * n);
    const int status = top && low && first && second_half ? 0 : -1;
    for (int64_t hr = 0; hr < n_heads * R && !status; hr++) {
        const REAL *restrict X = rotated + hr * half * n;
        for (int64_t i = 0; i < n; i++) top[i] = low[i] = X[i], first[i] = half;
        for (int64_t c = 1; c < half; c++)
            for (int64_t i = 0; i < n; i++) {
                top[i] = X[c * n + i] > top[i] ? X[c * n + i] : top[i];
                low[i] = X[c * n + i] < low[i] ? X[c * n + i] : low[i];
            }
        for (int64_t i = 0; i < n; i++) { /* the target: the maximum, or the minimum in -xR's half */
            second_half[i] = top[i] >= -low[i] ? 0 : half;
            top[i] = second_half[i] ? low[i] : top[i];
        }
        for (int64_t c = half - 1; c >= 0; c--) /* (downwards: the first c that hits is the last written) */
            for (int64_t i = 0; i < n; i++) first[i] = X[c * n + i] == top[i] ? c : first[i];
        int64_t *out = buckets + hr * L + start;
        for (int64_t i = 0; i < n; i++) out[i] = first[i] + second_half[i];
    }
    free(top);
    free(low);
    free(first);
    free(second_half);
    return status;
}
#endif

/* Each row's positions sorted by bucket, stably (by position within a bucket): a counting
 * sort of rows of L buckets in [0, n_buckets) into order (rows, L). Returns 0, or -1 without
 * memory or for a bucket out of range (the caller sorts instead). */
#ifdef FAMILY_LSH_HASH
int lsh_order(const int64_t *buckets, int64_t rows, int64_t L, int64_t n_buckets, int64_t *order) {
    int64_t *next = malloc(sizeof(int64_t) * (n_buckets + 1));
    int status = next ? 0 : -1;
    for (int64_t row = 0; row < rows && !status; row++) {
        const int64_t *b = buckets + row * L;
        for (int64_t j = 0; j <= n_buckets; j++) next[j] = 0;
        for (int64_t i = 0; i < L && !status; i++)
            if ((uint64_t)b[i] < (uint64_t)n_buckets) next[b[i] + 1]++;
            else status = -1;
        for (int64_t j = 1; j <= n_buckets; j++) next[j] += next[j - 1]; /* the first slot of each bucket */
        for (int64_t i = 0; i < L && !status; i++) order[row * L + next[b[i]]++] = i;
    }
    free(next);
    return status;
}
#endif

/* ---- Few keys (linformer's projected keys, nystrom's landmarks): out = softmax(q K^T scale) V over
 * every one of a head's n keys, n a few hundred, for many queries. Four queries a pass: their
 * scores (4, n) in a buffer, the products by four_rows_times and four_outer (K^T and V, 128 KiB
 * a head at n = 256 and D = 64, stay in the L2 cache): the products run at the FMA units'
 * peak, the scores' softmax takes about a quarter of the forward. L = 4096, n = 256, 8 heads of 64, 2 threads:
 * forward 13.0 ms, training step 40.1, against SDPA's fused CPU kernel's 14.6 and 48.9 (L =
 * 16384: 50.9 and 159 against 73.8 and 219). The queries, the output and their gradients in any
 * layout of rows of contiguous values: row i of head h at (h / H) l[1] + (h % H) l[2] + i l[0]
 * for the layout l (the strides of the positions, the batch entries and the heads; SDPA's
 * (B, L, H, D), where a layer's merge of the heads is a view, among them). */

#define AT(base, l, h, H) ((base) + ((h) / (H)) * (l)[1] + ((h) % (H)) * (l)[2])
#define SCORE_COLUMNS 64 /* scores a product computes a row: four rows of 64 floats in registers */

/* Whether rows of ``width`` values from ``base`` in the layout l can be streamed (can_stream). */
static int can_stream_rows(const void *base, int width, const int64_t *l) {
    const int64_t bytes = (int64_t)sizeof(REAL);
    return can_stream(base, width) && l[0] * bytes % 64 == 0 && l[1] * bytes % 64 == 0 && l[2] * bytes % 64 == 0;
}

/* The four rows of X (width values, ``row`` apart) from t, times s, into buf (4, width): zeros
 * past the end (a row there adds nothing to a gradient). */
static AI void four_rows_copy(const REAL *X, int64_t t, int64_t L, int64_t row, int width, REAL s,
                              REAL *restrict buf) {
    for (int r = 0; r < 4; r++) {
        const int real = t + r < L;
        const REAL *x = X + (real ? t + r : L - 1) * row;
        for (int e = 0; e < width; e++) buf[r * width + e] = real ? x[e] * s : 0; /* (a select: no 0 * inf) */
    }
}

/* out (4, n) = a Mt for four rows a (inner values each, contiguous) and Mt (inner x n): the
 * scores a K^T, or g V^T; SCORE_COLUMNS columns a product. */
static AI void four_rows_by_columns(const REAL *a, int inner, const REAL *Mt, int64_t n, REAL *out) {
    int64_t c = 0;
    for (; c + SCORE_COLUMNS <= n; c += SCORE_COLUMNS)
        four_rows_times(a, inner, inner, Mt + c, (int)n, SCORE_COLUMNS, out + c, (int)n, 0);
    if (c < n) four_rows_times(a, inner, inner, Mt + c, (int)n, (int)(n - c), out + c, (int)n, 0);
}

/* The largest of each of four rows of n values (rows n apart; -inf for none) into m, by lanes,
 * the rows' chains of folds interleaved: a row at a time, each fold waited on the last (few_keys'
 * forward at L = 4096, 256 keys, 8 heads, 2 threads: 12.6 -> 11.6-11.9 ms). */
static void four_maxima(const REAL *x, int64_t n, REAL *restrict m) {
    int64_t i = 0;
    for (int r = 0; r < 4; r++) m[r] = -INFINITY;
    if (n >= LANES) {
        lanes_v top[4], c;
        for (int r = 0; r < 4; r++) memcpy(&top[r], x + r * n, sizeof c);
        for (i = LANES; i + LANES <= n; i += LANES)
            for (int r = 0; r < 4; r++) {
                memcpy(&c, x + r * n + i, sizeof c);
                MAX_INTO(top[r], c);
            }
        for (int r = 0; r < 4; r++) m[r] = lanes_max(&top[r]);
    }
    for (int r = 0; r < 4; r++)
        for (int64_t j = i; j < n; j++) m[r] = x[r * n + j] > m[r] ? x[r * n + j] : m[r];
}

/* exp(x - top) over x[0..n) in place; returns their sum (by lanes). */
static REAL exp_shifted(REAL *restrict x, int64_t n, REAL top, REAL floor_) {
    lanes_v acc = {0};
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES) {
        lanes_v c;
        for (int u = 0; u < LANES; u++) c[u] = x[j + u] = exp_nonpositive(x[j + u] - top, floor_);
        acc += c;
    }
    REAL sum = lanes_sum(&acc); /* (the sum by lanes: a scalar chain otherwise) */
    for (; j < n; j++) sum += x[j] = exp_nonpositive(x[j] - top, floor_);
    return sum;
}

/* One head's queries: O = softmax(Q K^T scale) V (Lq, DV), rows o_row apart, and where lse is not
 * null each row's log-sum-exp (Lq). Kt: room for K^T (DK, n); p: for four rows of n. */
static void few_keys_head(const REAL *Q, int64_t q_row, const REAL *K, const REAL *V, REAL *O, int64_t o_row,
                          REAL *lse, REAL *Kt, REAL *p, int64_t Lq, int64_t n, REAL scale, int stream, REAL floor_) {
    transpose(K, Kt, (int)n, DK);
    for (int64_t t = 0; t < Lq; t += 4) {
        REAL q4[4][DK], o[4][DV], inv[4], top[4];
        four_rows_copy(Q, t, Lq, q_row, DK, scale, q4[0]);
        four_rows_by_columns(q4[0], DK, Kt, n, p); /* the scores */
        four_maxima(p, n, top);
        for (int r = 0; r < 4; r++) {
            const REAL sum = exp_shifted(p + r * n, n, top[r], floor_); /* (sum >= 1) */
            inv[r] = 1 / sum;
            top[r] += IS_FLOAT ? logf(sum) : log(sum);
        }
        four_rows_times(p, (int)n, (int)n, V, DV, DV, o[0], DV, 0);
        for (int r = 0; r < 4 && t + r < Lq; r++) {
            put_row(O + (t + r) * o_row, o[r], inv[r], DV, stream);
            if (lse) lse[t + r] = top[r];
        }
    }
    streams_done(); /* (each thread its own) */
}

/* One head's gradients from g (the output's, rows g_row apart), the output O and lse: dQ (Lq, DK;
 * rows dq_row apart), dK (n, DK) and dV (n, DV), written. With P = exp(S - lse) and
 * dS = P * (g V^T - g . o): dQ = dS K scale, dK = dS^T Q scale, dV = P^T g. Kt, Vt: room for
 * K^T and V^T; p, ds: for four rows of n. */
static void few_keys_grad_head(const REAL *Q, int64_t q_row, const REAL *K, const REAL *V, const REAL *G,
                               int64_t g_row, const REAL *O, int64_t o_row, const REAL *lse, REAL *DQ, int64_t dq_row,
                               REAL *DK_, REAL *DV_, REAL *Kt, REAL *Vt, REAL *p, REAL *ds, int64_t Lq, int64_t n,
                               REAL scale, int stream, REAL floor_) {
    transpose(K, Kt, (int)n, DK);
    transpose(V, Vt, (int)n, DV);
    memset(DK_, 0, sizeof(REAL) * n * DK);
    memset(DV_, 0, sizeof(REAL) * n * DV);
    for (int64_t t = 0; t < Lq; t += 4) {
        REAL q4[4][DK], g4[4][DV], o4[4][DV], dq[4][DK];
        four_rows_copy(Q, t, Lq, q_row, DK, scale, q4[0]);
        four_rows_copy(G, t, Lq, g_row, DV, 1, g4[0]);
        four_rows_copy(O, t, Lq, o_row, DV, 1, o4[0]);
        four_rows_by_columns(q4[0], DK, Kt, n, p);  /* the scores, as the forward's */
        four_rows_by_columns(g4[0], DV, Vt, n, ds); /* dP = g V^T */
        for (int r = 0; r < 4; r++) {
            const REAL l = lse[t + r < Lq ? t + r : Lq - 1], delta = dot_n(g4[r], o4[r], DV, 0);
            REAL *pr = p + r * n, *dsr = ds + r * n;
            for (int64_t j = 0; j < n; j++) {
                pr[j] = exp_nonpositive(pr[j] - l, floor_);
                dsr[j] = pr[j] * (dsr[j] - delta);
            }
        }
        four_rows_times(ds, (int)n, (int)n, K, DK, DK, dq[0], DK, 0);
        for (int r = 0; r < 4 && t + r < Lq; r++) put_row(DQ + (t + r) * dq_row, dq[r], scale, DK, stream);
        four_outer(DV_, (int)n, DV, p, (int)n, g4[0], DV);
        four_outer(DK_, (int)n, DK, ds, (int)n, q4[0], DK); /* (q4: the queries times scale) */
    }
    streams_done();
}

/* Forward, heads first .. first + count - 1 (H of them a batch entry): q (layout ql), k (n, DK) and
 * v (n, DV) contiguous, a head after another; out (layout ol) and, where not null, lse (Lq a
 * head, contiguous) written. Returns 0, or -1 without memory for K^T and the scores. */
#ifdef FAMILY_FEW_KEYS
int few_keys_forward(const REAL *q, const int64_t *ql, const REAL *k, const REAL *v, REAL *out, const int64_t *ol,
                     REAL *lse, int64_t first, int64_t count, int64_t H, int64_t Lq, int64_t n, REAL scale,
                     REAL floor_) {
    const int stream = can_stream_rows(out, DV, ol);
    int status = 0;
    OVER_HEADS_STATUS
    for (int64_t h = first; h < first + count; h++) {
        REAL *Kt = lines_alloc(DK * n, sizeof(REAL)), *p = lines_alloc(4 * n, sizeof(REAL));
        if (Kt && p)
            few_keys_head(AT(q, ql, h, H), ql[0], k + h * n * DK, v + h * n * DV, AT(out, ol, h, H), ol[0],
                          lse ? lse + h * Lq : 0, Kt, p, Lq, n, scale, stream, floor_);
        else
            status = -1;
        free(Kt);
        free(p);
    }
    return status;
}
#endif

/* Backward of few_keys_forward from g (layout gl), its out (ol) and lse: dq (layout dql), dk and dv
 * (as k and v) written. Returns 0, or -1 without memory for K^T, V^T and the rows' buffers. */
#ifdef FAMILY_FEW_KEYS
int few_keys_backward(const REAL *q, const int64_t *ql, const REAL *k, const REAL *v, const REAL *g, const int64_t *gl,
                      const REAL *out, const int64_t *ol, const REAL *lse, REAL *dq, const int64_t *dql, REAL *dk,
                      REAL *dv, int64_t first, int64_t count, int64_t H, int64_t Lq, int64_t n, REAL scale,
                      REAL floor_) {
    const int stream = can_stream_rows(dq, DK, dql);
    int status = 0;
    OVER_HEADS_STATUS
    for (int64_t h = first; h < first + count; h++) {
        REAL *Kt = lines_alloc(DK * n, sizeof(REAL)), *Vt = lines_alloc(DV * n, sizeof(REAL)),
             *p = lines_alloc(4 * n, sizeof(REAL)), *ds = lines_alloc(4 * n, sizeof(REAL));
        if (Kt && Vt && p && ds)
            few_keys_grad_head(AT(q, ql, h, H), ql[0], k + h * n * DK, v + h * n * DV, AT(g, gl, h, H), gl[0],
                               AT(out, ol, h, H), ol[0], lse + h * Lq, AT(dq, dql, h, H), dql[0], dk + h * n * DK,
                               dv + h * n * DV, Kt, Vt, p, ds, Lq, n, scale, stream, floor_);
        else
            status = -1;
        free(Kt);
        free(Vt);
        free(p);
        free(ds);
    }
    return status;
}
#endif

/* ---- Few queries (nystrom's landmark queries, m a few hundred) over every one of a head's Lk
 * keys that key_ok keeps, Lk in the thousands: out = softmax(Q K^T scale) V, each row's
 * log-sum-exp kept where lse is not null. Flash attention's order with one tile of all the
 * queries: the keys in blocks of FEW_QUERIES_KEYS, each block's kept keys gathered once (K^T and
 * V, 32 KiB each at D = 64, beside the queries and their running sums in the L2 cache), every
 * query's four rows a pass over it: the scores (four_rows_by_columns), their exponentials
 * against the running maximum, the values added by four_rows_times; the next block's rows
 * prefetched as the passes go (the gather waited on memory for ~20 % of the time without).
 * Padded keys are skipped as the blocks are gathered: no mask in the inner loops. A query with
 * no key gets 0 (lse -inf). Work 2 m Lk (DK + DV) multiply-adds, the least; memory
 * O(m (DK + DV)) a head beside the output. The backward likewise, block by block: each block's
 * dK and dV summed over the queries in the cache, then written once. 256 queries over 4096
 * keys, 8 heads of 64, 2 threads: forward 12.2 ms in nystrom's layer against SDPA's fused CPU
 * kernel's 16.2 (blocks of 256 keys, 512: ~1 ms slower); backward 28.4 ms against 43.5 for
 * FewQueries' torch blocks (16384 keys: 49.4 and 86.0 ms forward). */
#define FEW_QUERIES_KEYS 128

/* The next block of at most FEW_QUERIES_KEYS kept keys from *j into idx, *j moved past them.
 * Returns their number kb (0: none left). */
static int64_t next_keys(const uint8_t *ok, int64_t *j, int64_t Lk, int64_t *idx) {
    int64_t kb = 0;
    for (; *j < Lk && kb < FEW_QUERIES_KEYS; ++*j)
        if (!ok || ok[*j]) idx[kb++] = *j;
    return kb;
}

/* Rows idx[0..kb) of X (width values each, ``row`` apart) as the columns of Xt (width, kb). */
static void columns_of(const REAL *X, int64_t row, const int64_t *idx, int64_t kb, int width, REAL *restrict Xt) {
    for (int64_t c0 = 0; c0 < kb; c0 += 16) { /* (16 keys at a time: each row of Xt written by vectors) */
        const int64_t c1 = c0 + 16 < kb ? c0 + 16 : kb;
        for (int d = 0; d < width; d++)
            for (int64_t c = c0; c < c1; c++) Xt[d * kb + c] = X[idx[c] * row + d];
    }
}

/* Rows idx[0..kb) of X (width values each, ``row`` apart) into Xb (kb, width). */
static void rows_of(const REAL *X, int64_t row, const int64_t *idx, int64_t kb, int width, REAL *restrict Xb) {
    for (int64_t c = 0; c < kb; c++) memcpy(Xb + c * width, X + idx[c] * row, sizeof(REAL) * width);
}

/* The rows of Xb (kb, width) into rows idx[0..kb) of X (``row`` apart). */
static void rows_to(REAL *X, int64_t row, const int64_t *idx, int64_t kb, int width, const REAL *restrict Xb) {
    for (int64_t c = 0; c < kb; c++) memcpy(X + idx[c] * row, Xb + c * width, sizeof(REAL) * width);
}

/* Four queries' running softmax (rows of p: their scores against kb keys) moved on by a block:
 * p becomes the weights exp(score - top), the rows of acc, sums and tops rescaled to the new top. */
static AI void four_running(REAL *restrict p, int64_t kb, REAL *restrict acc, REAL *restrict sum,
                            REAL *restrict top, REAL floor_) {
    REAL m[4];
    four_maxima(p, kb, m);
    for (int r = 0; r < 4; r++) {
        const REAL old = top[r], t = m[r] > old ? m[r] : old;
        const REAL s = exp_shifted(p + r * kb, kb, t, floor_);
        if (t != old) { /* (the first block: old -inf, acc and sum 0) */
            const REAL c = old == -INFINITY ? 0 : exp_nonpositive(old - t, floor_);
            for (int e = 0; e < DV; e++) acc[r * DV + e] *= c;
            sum[r] *= c;
        }
        sum[r] += s;
        top[r] = t;
    }
}

/* A key's rows of K and V into the caches. */
static AI void prefetch_row(const REAL *k, const REAL *v) {
    for (int64_t at = 0; at < DK * (int64_t)sizeof(REAL); at += 64) __builtin_prefetch((const char *)k + at, 0, 3);
    for (int64_t at = 0; at < DV * (int64_t)sizeof(REAL); at += 64) __builtin_prefetch((const char *)v + at, 0, 3);
}

/* One head: m queries (rows q_row apart) over the keys ok keeps; out (m, DV), contiguous; lse (m)
 * where not null. buf: room for few_queries_room(m) values. */
static void few_queries_head(const REAL *Q, int64_t q_row, const REAL *K, int64_t k_row, const REAL *V,
                             int64_t v_row, const uint8_t *ok, REAL *O, REAL *lse, REAL *buf, int64_t m,
                             int64_t Lk, REAL scale, REAL floor_) {
    const int64_t m4 = (m + 3) / 4 * 4;
    REAL *Qs = buf, *acc = Qs + m4 * DK, *sum = acc + m4 * DV, *top = sum + m4, *Kt = top + m4,
         *Vb = Kt + DK * FEW_QUERIES_KEYS, *p = Vb + FEW_QUERIES_KEYS * DV;
    int64_t *idx = (int64_t *)(p + 4 * FEW_QUERIES_KEYS);
    for (int64_t i = 0; i < m4; i += 4) four_rows_copy(Q, i, m, q_row, DK, scale, Qs + i * DK);
    memset(acc, 0, sizeof(REAL) * m4 * (DV + 1));
    for (int64_t i = 0; i < m4; i++) top[i] = -INFINITY;
    const int64_t quads = m4 > 0 ? m4 / 4 : 1, ahead = (FEW_QUERIES_KEYS + quads - 1) / quads; /* a pass's prefetches */
    int64_t kb;
    for (int64_t j = 0; (kb = next_keys(ok, &j, Lk, idx)) > 0;) {
        columns_of(K, k_row, idx, kb, DK, Kt);
        rows_of(V, v_row, idx, kb, DV, Vb);
        for (int64_t i = 0; i < m4; i += 4) {
            for (int64_t a = j + i / 4 * ahead; a < j + (i / 4 + 1) * ahead && a < Lk; a++)
                prefetch_row(K + a * k_row, V + a * v_row); /* the next block's, on the way */
            four_rows_by_columns(Qs + i * DK, DK, Kt, kb, p); /* the scores (4, kb) */
            four_running(p, kb, acc + i * DV, sum + i, top + i, floor_);
            four_rows_times(p, (int)kb, (int)kb, Vb, DV, DV, acc + i * DV, DV, 1);
        }
    }
    for (int64_t i = 0; i < m; i++) {
        const REAL inv = sum[i] > 0 ? 1 / sum[i] : 0; /* (no key: 0) */
        for (int e = 0; e < DV; e++) O[i * DV + e] = acc[i * DV + e] * inv;
        if (lse) lse[i] = sum[i] > 0 ? top[i] + (IS_FLOAT ? logf(sum[i]) : log(sum[i])) : -INFINITY;
    }
}

/* few_queries_head's buffer, in values (REAL, the keys' indices as two of them at most). */
static size_t few_queries_room(int64_t m) {
    const int64_t m4 = (m + 3) / 4 * 4;
    return m4 * (DK + DV + 2) + (int64_t)FEW_QUERIES_KEYS * (DK + DV + 4 + 2);
}

/* Forward, heads first .. first + count - 1 (H of them a batch entry): q (layout ql), k (kl), v
 * (vl), key_ok (Lk bytes a head, as the other kernels'; null: every key); out (m, DV) and, where not null, lse
 * (m) a head, contiguous, written. Returns 0, or -1 without memory for a head's buffer. */
#ifdef FAMILY_FEW_QUERIES
int few_queries_forward(const REAL *q, const int64_t *ql, const REAL *k, const int64_t *kl, const REAL *v,
                        const int64_t *vl, const uint8_t *key_ok, REAL *out, REAL *lse, int64_t first,
                        int64_t count, int64_t H, int64_t m, int64_t Lk, REAL scale, REAL floor_) {
    int status = 0;
    OVER_HEADS_STATUS
    for (int64_t h = first; h < first + count; h++) {
        REAL *buf = lines_alloc(few_queries_room(m), sizeof(REAL));
        if (buf)
            few_queries_head(AT(q, ql, h, H), ql[0], AT(k, kl, h, H), kl[0], AT(v, vl, h, H), vl[0],
                             key_ok ? key_ok + h * Lk : 0, out + h * m * DV, lse ? lse + h * m : 0, buf, m,
                             Lk, scale, floor_);
        else
            status = -1;
        free(buf);
    }
    return status;
}
#endif

/* One head's gradients from g (the output's, rows g_row apart), the output O (m, DV, contiguous)
 * and lse: dQ (rows dq_row apart), dK and dV (rows dk_row and dv_row apart; 0 for a padded key),
 * written. Key block by key block, as the forward: P = exp(S - lse), dS = P * (g V^T - g . o),
 * dQ += dS K scale, the block's dK = dS^T Q scale and dV = P^T g summed over the queries in the
 * cache, then written to their rows. buf: room for few_queries_grad_room(m) values. */
static void few_queries_grad_head(const REAL *Q, int64_t q_row, const REAL *K, int64_t k_row, const REAL *V,
                                  int64_t v_row, const uint8_t *ok, const REAL *G, int64_t g_row, const REAL *O,
                                  const REAL *lse, REAL *DQ, int64_t dq_row, REAL *DK_, int64_t dk_row, REAL *DV_,
                                  int64_t dv_row, REAL *buf, int64_t m, int64_t Lk, REAL scale, int stream,
                                  REAL floor_) {
    const int64_t m4 = (m + 3) / 4 * 4, n = FEW_QUERIES_KEYS;
    REAL *Qs = buf, *Gc = Qs + m4 * DK, *dq = Gc + m4 * DV, *delta = dq + m4 * DK, *Kt = delta + m4,
         *Kb = Kt + DK * n, *Vt = Kb + n * DK, *dKb = Vt + DV * n, *dVb = dKb + n * DK, *p = dVb + n * DV,
         *ds = p + 4 * n;
    int64_t *idx = (int64_t *)(ds + 4 * n);
    for (int64_t i = 0; i < m4; i += 4) {
        four_rows_copy(Q, i, m, q_row, DK, scale, Qs + i * DK);
        four_rows_copy(G, i, m, g_row, DV, 1, Gc + i * DV);
    }
    for (int64_t i = 0; i < m4; i++) delta[i] = i < m ? dot_n(Gc + i * DV, O + i * DV, DV, 0) : 0;
    memset(dq, 0, sizeof(REAL) * m4 * DK);
    if (ok)
        for (int64_t j = 0; j < Lk; j++)
            if (!ok[j]) {
                memset(DK_ + j * dk_row, 0, sizeof(REAL) * DK);
                memset(DV_ + j * dv_row, 0, sizeof(REAL) * DV);
            }
    int64_t kb;
    for (int64_t j = 0; (kb = next_keys(ok, &j, Lk, idx)) > 0;) {
        columns_of(K, k_row, idx, kb, DK, Kt);
        rows_of(K, k_row, idx, kb, DK, Kb);
        columns_of(V, v_row, idx, kb, DV, Vt);
        memset(dKb, 0, sizeof(REAL) * kb * DK);
        memset(dVb, 0, sizeof(REAL) * kb * DV);
        for (int64_t i = 0; i < m4; i += 4) {
            four_rows_by_columns(Qs + i * DK, DK, Kt, kb, p);  /* the scores, as the forward's */
            four_rows_by_columns(Gc + i * DV, DV, Vt, kb, ds); /* dP = g V^T */
            for (int r = 0; r < 4; r++) {
                const REAL l = i + r < m ? lse[i + r] : 0; /* (a row past m: g 0, so dS 0) */
                REAL *pr = p + r * kb, *dsr = ds + r * kb;
                for (int64_t c = 0; c < kb; c++) {
                    pr[c] = exp_nonpositive(pr[c] - l, floor_);
                    dsr[c] = pr[c] * (dsr[c] - delta[i + r]);
                }
            }
            four_rows_times(ds, (int)kb, (int)kb, Kb, DK, DK, dq + i * DK, DK, 1);
            four_outer(dVb, (int)kb, DV, p, (int)kb, Gc + i * DV, DV);
            four_outer(dKb, (int)kb, DK, ds, (int)kb, Qs + i * DK, DK); /* (Qs: the queries times scale) */
        }
        rows_to(DK_, dk_row, idx, kb, DK, dKb);
        rows_to(DV_, dv_row, idx, kb, DV, dVb);
    }
    for (int64_t i = 0; i < m; i++) put_row(DQ + i * dq_row, dq + i * DK, scale, DK, stream);
    streams_done();
}

/* few_queries_grad_head's buffer, in values (REAL, the keys' indices as two of them at most). */
static size_t few_queries_grad_room(int64_t m) {
    const int64_t m4 = (m + 3) / 4 * 4;
    return m4 * (2 * DK + DV + 1) + (int64_t)FEW_QUERIES_KEYS * (3 * DK + 2 * DV + 8 + 2);
}

/* Backward of few_queries_forward from g (layout gl), its out and lse: dq (layout dql), dk (dkl)
 * and dv (dvl) written. Returns 0, or -1 without memory for a head's buffer. */
#ifdef FAMILY_FEW_QUERIES
int few_queries_backward(const REAL *q, const int64_t *ql, const REAL *k, const int64_t *kl, const REAL *v,
                         const int64_t *vl, const uint8_t *key_ok, const REAL *g, const int64_t *gl, const REAL *out,
                         const REAL *lse, REAL *dq, const int64_t *dql, REAL *dk, const int64_t *dkl, REAL *dv,
                         const int64_t *dvl, int64_t first, int64_t count, int64_t H, int64_t m, int64_t Lk,
                         REAL scale, REAL floor_) {
    const int stream = can_stream_rows(dq, DK, dql);
    int status = 0;
    OVER_HEADS_STATUS
    for (int64_t h = first; h < first + count; h++) {
        REAL *buf = lines_alloc(few_queries_grad_room(m), sizeof(REAL));
        if (buf)
            few_queries_grad_head(AT(q, ql, h, H), ql[0], AT(k, kl, h, H), kl[0], AT(v, vl, h, H), vl[0],
                                  key_ok ? key_ok + h * Lk : 0, AT(g, gl, h, H), gl[0], out + h * m * DV,
                                  lse + h * m, AT(dq, dql, h, H), dql[0], AT(dk, dkl, h, H), dkl[0],
                                  AT(dv, dvl, h, H), dvl[0], buf, m, Lk, scale, stream, floor_);
        else
            status = -1;
        free(buf);
    }
    return status;
}
#endif

/* ---- Reformer's LSH attention (Kitaev et al., ICLR 2020), forward without gradients. Per
 * (batch, head) and hash round r: the queries sorted by (bucket, position) in chunks of m, each
 * chunk against the window of sorted keys [(c - 1)m, (c + 1)m) (chunk 0: its own only). A key
 * is in a query's reach where it takes part (key_ok), and is in the query's bucket (unless
 * across), not after it (if causal), and was not met in an earlier round (codes, when given:
 * met in round t iff 0 <= q_code - k_code <= 1). Scores in base 2 (scale2 = scale log2 e),
 * the query's own key less self2 (shared QK). Each round's unnormalised softmax over its
 * window merges into the query's running numerator and sum, rescaled to the larger maximum
 * (flash attention's merge, in base 2): at the end, the softmax over the union of the rounds'
 * keys; 0 for a query with no key in reach in any round. A chunk's window is gathered once
 * (its first half is the chunk before's keys, kept), its scores key by query, so that the
 * masks, maxima and sums run along the queries in vector lanes; the next chunk's scattered
 * rows are prefetched. Work: 2 * 2m * (DK + DV) multiply-adds a query and round at most: within
 * buckets (sorted by bucket, a bucket's keys and queries are runs) only the tiles where keys
 * and queries share a bucket are computed, and, with one order and causal, none of the keys
 * after a query's own slot (the rest have no weight). */

/* S[w][i] = K[w] . Qt[., i] for KT keys from w0 and the queries from <= i < to, in tiles of QW
 * from a multiple of QW (Qt: DK x MP, queries as columns; S rows MP apart): KT keys by QW
 * queries in registers. */
#define KT 8           /* keys a tile of the scores */
#define QW (2 * LANES) /* queries a tile (KT x QW: 16 accumulators; 16 x 16 and 4 x 64 were slower) */
static AI void keys_scores(const REAL *restrict K, int64_t w0, const REAL *restrict Qt, int64_t MP,
                           int64_t from, int64_t to, REAL *restrict S) {
    for (int64_t i0 = from; i0 < to; i0 += QW) {
        REAL acc[KT][QW];
        for (int j = 0; j < KT; j++)
            for (int i = 0; i < QW; i++) acc[j][i] = 0;
        for (int d = 0; d < DK; d++) {
            const REAL *restrict qd = Qt + d * MP + i0;
            for (int j = 0; j < KT; j++) {
                const REAL kj = K[(w0 + j) * DK + d];
                for (int i = 0; i < QW; i++) acc[j][i] += kj * qd[i];
            }
        }
        for (int j = 0; j < KT; j++)
            for (int i = 0; i < QW; i++) S[(w0 + j) * MP + i0 + i] = acc[j][i];
    }
}

/* o[j] = sum_w P[w][i0 + j] V[w] for four queries from i0, from <= w < to (P rows MP apart,
 * V: rows of DV). */
static AI void four_queries_values(const REAL *restrict P, int64_t MP, int64_t i0, int64_t from, int64_t to,
                                   const REAL *restrict V, REAL (*restrict o)[DV]) {
    for (int e = 0; e < DV; e++) o[0][e] = o[1][e] = o[2][e] = o[3][e] = 0;
    for (int64_t w = from; w < to; w++) {
        const REAL *restrict vw = V + w * DV, *restrict pw = P + w * MP + i0;
        const REAL p0 = pw[0], p1 = pw[1], p2 = pw[2], p3 = pw[3];
        for (int e = 0; e < DV; e++) {
            o[0][e] += p0 * vw[e];
            o[1][e] += p1 * vw[e];
            o[2][e] += p2 * vw[e];
            o[3][e] += p3 * vw[e];
        }
    }
}

/* A round's unnormalised output o, its sum of weights and its top (base 2) merged into a
 * query's running numerator out, sum den and top mx: both rescaled to the larger top. */
static inline void merge_row(REAL *restrict out, REAL *restrict den, REAL *restrict mx, const REAL *restrict o,
                             REAL sum, REAL top, REAL floor_) {
    if (sum == 0) return; /* no key in reach this round */
    const REAL hi = top > *mx ? top : *mx;
    const REAL a = exp_nonpositive((*mx - hi) * (REAL)M_LN2, floor_);
    const REAL b = exp_nonpositive((top - hi) * (REAL)M_LN2, floor_);
    for (int e = 0; e < DV; e++) out[e] = out[e] * a + o[e] * b;
    *den = *den * a + sum * b;
    *mx = hi;
}

/* The buffers of one chunk and its window: m queries (MP, padded to whole tiles), 2m keys. */
typedef struct {
    int64_t rows; /* the key side's: 2m + KT - 1 (the last group of keys reads up to KT - 1 past W) */
    REAL *Qt, *K, *V, *S, *top, *sum;
    int32_t *qp, *qb, *qc, *in, *kpos, *kb, *kok, *kc;
} Window;

#define N_BUFFERS 14
static void window_buffers(const Window *b, void **all) {
    void *each[N_BUFFERS] = {b->Qt, b->K, b->V, b->S, b->top, b->sum, b->qp, b->qb, b->qc, b->in,
                             b->kpos, b->kb, b->kok, b->kc};
    memcpy(all, each, sizeof(each));
}

static int window_alloc(Window *b, int64_t m, int64_t MP, int64_t R) {
    const int64_t W = b->rows = 2 * m + KT - 1, n_codes = R > 1 ? R - 1 : 1;
    b->Qt = malloc(sizeof(REAL) * DK * MP);
    b->K = calloc(W * DK, sizeof(REAL));
    b->V = calloc(W * DV, sizeof(REAL));
    b->S = malloc(sizeof(REAL) * W * MP);
    b->top = malloc(sizeof(REAL) * MP);
    b->sum = malloc(sizeof(REAL) * MP);
    b->qp = malloc(sizeof(int32_t) * MP);
    b->qb = malloc(sizeof(int32_t) * MP);
    b->qc = malloc(sizeof(int32_t) * n_codes * MP);
    b->in = malloc(sizeof(int32_t) * MP);
    b->kpos = malloc(sizeof(int32_t) * W);
    b->kb = malloc(sizeof(int32_t) * W);
    b->kok = malloc(sizeof(int32_t) * W);
    b->kc = malloc(sizeof(int32_t) * n_codes * W);
    void *all[N_BUFFERS];
    window_buffers(b, all);
    for (int i = 0; i < N_BUFFERS; i++)
        if (!all[i]) return -1;
    return 0;
}

static void window_free(Window *b) {
    void *all[N_BUFFERS];
    window_buffers(b, all);
    for (int i = 0; i < N_BUFFERS; i++) free(all[i]);
}

/* Prefetch the rows (width values each) at positions pos[0..n) of X: the next chunk's rows are
 * scattered over the head (L2 misses, each as long as a tile of products) while this one's
 * are computed. */
static void prefetch_rows(const REAL *X, const int64_t *pos, int64_t n, int64_t width, int for_write) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t at = 0; at < width * (int64_t)sizeof(REAL); at += 64) {
            const char *line = (const char *)(X + pos[i] * width) + at;
            if (for_write) __builtin_prefetch(line, 1);
            else __builtin_prefetch(line);
        }
}

/* Within buckets, the run of b[0..n) (ascending) whose buckets lie in [first, last], moved on
 * from the last group's run [*from, *to): both ends only grow, as the groups' buckets do. */
static inline void bucket_run(const int32_t *b, int64_t n, int32_t first, int32_t last, int64_t *from,
                              int64_t *to) {
    while (*from < n && b[*from] < first) ++*from;
    for (*to = *from > *to ? *from : *to; *to < n && b[*to] <= last;) ++*to;
}

/* The window's second half (chunk c - 1's m keys, values and their facts) into its first. */
static void window_shift(Window *b, int64_t m, int64_t n_codes) {
    memcpy(b->K, b->K + m * DK, sizeof(REAL) * m * DK);
    memcpy(b->V, b->V + m * DV, sizeof(REAL) * m * DV);
    int32_t *facts[] = {b->kpos, b->kb, b->kok};
    for (int f = 0; f < 3; f++) memcpy(facts[f], facts[f] + m, sizeof(int32_t) * m);
    for (int64_t t = 0; t < n_codes; t++)
        memcpy(b->kc + t * b->rows, b->kc + t * b->rows + m, sizeof(int32_t) * m);
}

/* The first query (by whole lanes) that key row w may be in reach of (see window_weights). */
static inline int64_t first_query(int64_t w, int64_t own) {
    return w >= own ? (w - own) & ~(int64_t)(LANES - 1) : 0;
}

/* Column i of S (W rows, MP apart) -> the weights 2^(s - top_i) of query i over the keys in
 * its reach (0 elsewhere, whatever S held there: scores not computed are out of reach), with
 * top and the sums of the weights by query: every loop runs along the queries, so that it
 * vectorises. Key row w >= own (the chunk's own keys, with one order, causal, within buckets;
 * else own = W) is out of reach of the queries before w - own: their columns there are
 * skipped, by whole lanes (four_queries_values does not read them). */
static void window_weights(Window *b, int64_t W, int64_t MP, int64_t nq, int64_t n_codes, int flags,
                           int64_t own, REAL self2, REAL floor_) {
    const int causal = flags & 1, shared = flags >> 1 & 1, across = flags >> 2 & 1;
    REAL *restrict top = b->top, *restrict sum = b->sum;
    const int32_t *restrict qp = b->qp, *restrict qb = b->qb;
    for (int64_t i = 0; i < MP; i++) top[i] = -INFINITY, sum[i] = 0;
    for (int64_t w = 0; w < W; w++) {
        REAL *restrict s = b->S + w * MP;
        int32_t *restrict in = b->in;
        const int32_t kp = b->kpos[w], kb = b->kb[w], kok = b->kok[w];
        const int64_t from = first_query(w, own);
        for (int64_t i = from; i < MP; i++)
            in[i] = kok & (i < nq) & (across | (qb[i] == kb)) & (!causal | (kp <= qp[i]));
        for (int64_t t = 0; t < n_codes; t++) { /* not met in an earlier round */
            const int32_t *restrict qc = b->qc + t * MP, kc = b->kc[t * b->rows + w];
            for (int64_t i = from; i < MP; i++) in[i] &= (qc[i] - kc < 0) | (qc[i] - kc > 1);
        }
        for (int64_t i = from; i < MP; i++) {
            const REAL x = in[i] ? s[i] - (shared && kp == qp[i] ? self2 : 0) : -INFINITY;
            s[i] = x;
            top[i] = x > top[i] ? x : top[i];
        }
    }
    for (int64_t w = 0; w < W; w++) {
        REAL *restrict s = b->S + w * MP;
        for (int64_t i = first_query(w, own); i < MP; i++) {
            const REAL p = s[i] == -INFINITY ? 0 : exp_nonpositive((s[i] - top[i]) * (REAL)M_LN2, floor_);
            s[i] = p;
            sum[i] += p;
        }
    }
}

/* q, k (n_heads, L, DK) rows, v (n_heads, L, DV), heads q_head, k_head, v_head values apart;
 * q_order, k_order (n_heads, R, L): each round's positions sorted by (bucket, position);
 * q_bucket, k_bucket (n_heads, R, L): each position's bucket; q_code, k_code (n_heads, R, L)
 * or null; key_ok (n_heads, L) or null; k_scale (n_heads, L) or null: each key row's factor
 * (shared QK: 1 / its norm, so that the keys need not be written normalised). flags: 1 causal,
 * 2 shared QK (self2 off the query's own key), 4 across buckets. Writes out (n_heads, L, DV).
 * Returns 0, or -1 without memory for the window's buffers. */
#ifdef FAMILY_LSH
int lsh_forward(const REAL *q, const REAL *k, const REAL *v, int64_t q_head, int64_t k_head, int64_t v_head,
                const int64_t *q_order, const int64_t *k_order, const int64_t *q_bucket, const int64_t *k_bucket,
                const int32_t *q_code, const int32_t *k_code, const uint8_t *key_ok, const REAL *k_scale,
                REAL *out, int64_t n_heads, int64_t L, int64_t R, int64_t m, int flags, REAL scale2, REAL self2,
                REAL floor_) {
    const int64_t MP = (m + QW - 1) / QW * QW, nc = (L + m - 1) / m;
    Window b;
    REAL *den = malloc(sizeof(REAL) * L), *mx = malloc(sizeof(REAL) * L);
    int status = window_alloc(&b, m, MP, R) || !den || !mx ? -1 : 0;
    for (int64_t h = 0; h < n_heads && !status; h++) {
        const REAL *Q = q + h * q_head, *K = k + h * k_head, *Vh = v + h * v_head;
        const uint8_t *ok = key_ok ? key_ok + h * L : 0;
        REAL *O = out + h * L * DV;
        for (int64_t i = 0; i < L * DV; i++) O[i] = 0;
        for (int64_t i = 0; i < L; i++) den[i] = 0, mx[i] = -INFINITY;
        for (int64_t r = 0; r < R; r++) {
            const int64_t *qo = q_order + (h * R + r) * L, *ko = k_order + (h * R + r) * L;
            const int64_t *qb = q_bucket + (h * R + r) * L, *kb = k_bucket + (h * R + r) * L;
            const int64_t n_codes = q_code ? r : 0; /* the earlier rounds' codes */
            for (int64_t c = 0; c < nc; c++) {
                const int64_t qs = c * m, nq = (c + 1) * m < L ? m : L - qs;
                const int64_t ws = c > 0 ? qs - m : 0, W = (qs + nq) - ws;
                if (c + 1 < nc) { /* chunk c + 1's rows, on their way */
                    const int64_t next = (c + 2) * m < L ? m : L - qs - m;
                    prefetch_rows(K, ko + qs + m, next, DK, 0);
                    prefetch_rows(Vh, ko + qs + m, next, DV, 0);
                    prefetch_rows(Q, qo + qs + m, next, DK, 0);
                    prefetch_rows(O, qo + qs + m, next, DV, 1);
                }
                if (c > 1) window_shift(&b, m, n_codes); /* chunk c - 1's keys: the window's first half */
                for (int64_t w = c > 0 ? m : 0; w < W; w++) { /* the chunk's keys and values, gathered */
                    const int64_t p = ko[ws + w];
                    b.kpos[w] = (int32_t)p;
                    b.kb[w] = (int32_t)kb[p];
                    b.kok[w] = !ok || ok[p];
                    const REAL factor = k_scale ? k_scale[h * L + p] : 1;
                    for (int d = 0; d < DK; d++) b.K[w * DK + d] = K[p * DK + d] * factor;
                    for (int e = 0; e < DV; e++) b.V[w * DV + e] = Vh[p * DV + e];
                    for (int64_t t = 0; t < n_codes; t++) b.kc[t * b.rows + w] = k_code[(h * R + t) * L + p];
                }
                for (int64_t i = 0; i < MP; i++) { /* the chunk's queries, as columns */
                    const int64_t p = qo[qs + (i < nq ? i : 0)];
                    b.qp[i] = (int32_t)p;
                    b.qb[i] = (int32_t)qb[p];
                    for (int d = 0; d < DK; d++) b.Qt[d * MP + i] = i < nq ? Q[p * DK + d] * scale2 : 0;
                    for (int64_t t = 0; t < n_codes; t++) b.qc[t * MP + i] = q_code[(h * R + t) * L + p];
                }
                /* with one order, causal, within buckets: no query sees a key after its own slot */
                const int64_t own = (flags & 7) == 3 ? qs - ws : W;
                int64_t q_from = 0, q_to = flags & 4 ? MP : 0; /* within buckets: the keys' buckets' queries */
                for (int64_t w0 = 0; w0 < W; w0 += KT) {
                    if (!(flags & 4)) {
                        const int64_t last = w0 + KT - 1 < W ? w0 + KT - 1 : W - 1;
                        bucket_run(b.qb, nq, b.kb[w0], b.kb[last], &q_from, &q_to);
                    }
                    const int64_t lo = w0 > own && w0 - own > q_from ? w0 - own : q_from; /* (causal) */
                    keys_scores(b.K, w0, b.Qt, MP, lo / QW * QW, q_to, b.S);
                }
                window_weights(&b, W, MP, nq, n_codes, flags, own, self2, floor_);
                int64_t from = 0, to = flags & 4 ? W : 0; /* within buckets: their buckets' keys, a run */
                for (int64_t i0 = 0; i0 < nq; i0 += 4) {
                    REAL o[4][DV];
                    if (!(flags & 4)) bucket_run(b.kb, W, b.qb[i0], b.qb[i0 + 3 < nq ? i0 + 3 : nq - 1], &from,
                                                 &to);
                    four_queries_values(b.S, MP, i0, from, own + i0 + 4 < to ? own + i0 + 4 : to, b.V, o);
                    for (int j = 0; j < 4 && i0 + j < nq; j++)
                        merge_row(O + b.qp[i0 + j] * DV, den + b.qp[i0 + j], mx + b.qp[i0 + j], o[j],
                                  b.sum[i0 + j], b.top[i0 + j], floor_);
                }
            }
        }
        for (int64_t i = 0; i < L; i++) { /* out / den; 0 where no key was in reach */
            const REAL inv = den[i] > 0 ? 1 / den[i] : 0;
            for (int e = 0; e < DV; e++) O[i * DV + e] *= inv;
        }
    }
    window_free(&b);
    free(den);
    free(mx);
    return status;
}
#endif
