/* attnzoo's native kernels: linear and efficient attention, whose least work is a few
 * products of each row with a small (DK x DV) state.
 *
 * Linear attention with elu + 1 features (Katharopoulos et al., ICML 2020), per (batch, head):
 * causal in its recurrent form, for t = 0 .. L-1,
 *     S += phi(k_t) v_t^T,  z += phi(k_t),  out_t = phi(q_t)^T S / (phi(q_t) . z + eps)
 * (causal_linear); non-causal, S and z over all keys (linear_keys), then each query's
 * out = phi(q)^T S / (phi(q) . z + eps) (linear_queries). phi(x) = e^min(x, 0) + max(x, 0),
 * the exponent clamped at log(the smallest normal number), as attnzoo's eager map. The state
 * S (DK x DV) and z stay in L1 cache; two positions go through S per pass (half its loads
 * and stores); the loops over DV are vectorised by the compiler. DK, DV and REAL (float or
 * double) are set when it is compiled (attnzoo/_native.py). Work: 2 DK DV multiply-adds per
 * key and per query, the algorithm's least (the FLOP floor of issue 8). The non-causal
 * backward (linear_queries_grad, linear_keys_grad) likewise: 4 DK DV a position.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#ifndef DK
#error "compile with -DDK=<key features> -DDV=<value width> -DREAL=<float|double>"
#endif

#define IS_FLOAT (sizeof(REAL) == 4)
#define LANES 16 /* partial sums of the normaliser: a vector's worth, so that they vectorise */
#define DKP ((DK + LANES - 1) / LANES * LANES)

static inline REAL exp_nonpositive(REAL x, REAL floor_) {
    /* e^x for floor_ <= x <= 0; float: a branch-free polynomial (Cephes' expf), vectorisable */
    x = x < floor_ ? floor_ : x;
    if (!IS_FLOAT) return exp(x);
    const float big = 12582912.0f; /* 1.5 * 2^23: adding and subtracting it rounds to an integer */
    float xf = (float)x;
    float n = (xf * 1.44269504088896341f + big) - big;
    float r = xf - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { float f; int32_t i; } two_n;
    two_n.i = ((int32_t)n + 127) << 23;
    return (REAL)(p * two_n.f);
}

static inline REAL phi(REAL x, REAL floor_) {
    return (x > 0 ? x : 0) + exp_nonpositive(x < 0 ? x : 0, floor_);
}

/* The features of two rows (phi; 0 for a row that takes no part: a fill, not a product, since
 * a padded key may hold anything), padded with zeros to whole lanes. */
static inline __attribute__((always_inline)) void two_features(
        const REAL *restrict xa, const REAL *restrict xb, int a_ok, int b_ok, REAL *restrict fa,
        REAL *restrict fb, REAL floor_) {
    for (int d = 0; d < DK; d++) {
        fa[d] = a_ok ? phi(xa[d], floor_) : 0;
        fb[d] = b_ok ? phi(xb[d], floor_) : 0;
    }
    for (int d = DK; d < DKP; d++) fa[d] = fb[d] = 0;
}

/* init + a . b over DKP values (zero past DK), summed lane by lane (so that it vectorises). */
static inline REAL dot_lanes(const REAL *restrict a, const REAL *restrict b, REAL init) {
    REAL l[LANES] = {0};
    for (int d0 = 0; d0 < DKP; d0 += LANES)
        for (int j = 0; j < LANES; j++) l[j] += a[d0 + j] * b[d0 + j];
    for (int j = 0; j < LANES; j++) init += l[j];
    return init;
}

/* Steps a and b (b right after a) from the state (S, z) in place: their outputs into oa, ob.
 * ka_ok, kb_ok: whether each key takes part (0: padded, or b is no step at all). */
static inline __attribute__((always_inline)) void two_steps(
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
    REAL dena = eps, denb = eps;
    for (int j = 0; j < LANES; j++) {
        dena += la[j];
        denb += lb[j];
    }
    for (int e = 0; e < DV; e++) na[e] = nb[e] = 0;
    for (int d = 0; d < DK; d++) { /* one pass through S for both steps */
        REAL *restrict Sd = S + d * DV;
        const REAL kad = fka[d], qad = fqa[d], kbd = fkb[d], qbd = fqb[d];
        for (int e = 0; e < DV; e++) {
            REAL s = Sd[e] + kad * va[e];
            na[e] += qad * s;
            s += kbd * vb[e];
            nb[e] += qbd * s;
            Sd[e] = s;
        }
    }
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
void causal_linear(const REAL *q, const REAL *k, const REAL *v, const uint8_t *key_ok,
                   int64_t q_head, int64_t k_head, int64_t v_head, REAL *out, REAL *S, REAL *z,
                   int64_t n_heads, int64_t L, REAL eps, REAL floor_) {
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

/* Row r of a group of four starting at t: its address (the last row's past the end, where
 * it takes no part) and whether it takes part. */
#define ROW(base, t, r, L, width) ((base) + ((t) + (r) < (L) ? (t) + (r) : (L) - 1) * (width))
#define TAKES_PART(ok, t, r, L) ((t) + (r) < (L) && (!(ok) || (ok)[(t) + (r)]))

/* Non-causal keys: S = sum_j phi(k_j) v_j^T (n_heads, DK, DV) and z = sum_j phi(k_j)
 * (n_heads, DK), written (not added), over the keys key_ok keeps (null: all); layout as
 * causal_linear's. Four keys a pass through S. */
void linear_keys(const REAL *k, const REAL *v, const uint8_t *key_ok, int64_t k_head, int64_t v_head,
                 REAL *S, REAL *z, int64_t n_heads, int64_t L, REAL floor_) {
    for (int64_t h = 0; h < n_heads; h++) {
        const REAL *K = k + h * k_head, *V = v + h * v_head;
        const uint8_t *ok = key_ok ? key_ok + h * L : 0;
        REAL *restrict Sh = S + h * DK * DV, *restrict zh = z + h * DK;
        for (int i = 0; i < DK * DV; i++) Sh[i] = 0;
        for (int d = 0; d < DK; d++) zh[d] = 0;
        for (int64_t t = 0; t < L; t += 4) {
            const REAL *restrict v0 = ROW(V, t, 0, L, DV), *restrict v1 = ROW(V, t, 1, L, DV);
            const REAL *restrict v2 = ROW(V, t, 2, L, DV), *restrict v3 = ROW(V, t, 3, L, DV);
            REAL f0[DKP], f1[DKP], f2[DKP], f3[DKP];
            two_features(ROW(K, t, 0, L, DK), ROW(K, t, 1, L, DK), TAKES_PART(ok, t, 0, L),
                         TAKES_PART(ok, t, 1, L), f0, f1, floor_);
            two_features(ROW(K, t, 2, L, DK), ROW(K, t, 3, L, DK), TAKES_PART(ok, t, 2, L),
                         TAKES_PART(ok, t, 3, L), f2, f3, floor_);
            for (int d = 0; d < DK; d++) {
                REAL *restrict Sd = Sh + d * DV;
                const REAL a0 = f0[d], a1 = f1[d], a2 = f2[d], a3 = f3[d];
                zh[d] += (a0 + a1) + (a2 + a3);
                for (int e = 0; e < DV; e++) Sd[e] += (a0 * v0[e] + a1 * v1[e]) + (a2 * v2[e] + a3 * v3[e]);
            }
        }
    }
}

/* Non-causal queries: out = phi(q)^T S / (phi(q) . z + eps) from linear_keys' S and z, four
 * queries a pass through S. */
void linear_queries(const REAL *q, int64_t q_head, const REAL *S, const REAL *z, REAL *out,
                    int64_t n_heads, int64_t L, REAL eps, REAL floor_) {
    for (int64_t h = 0; h < n_heads; h++) {
        const REAL *Q = q + h * q_head, *restrict Sh = S + h * DK * DV;
        REAL *O = out + h * L * DV, zp[DKP] = {0};
        for (int d = 0; d < DK; d++) zp[d] = z[h * DK + d];
        for (int64_t t = 0; t < L; t += 4) {
            REAL f[4][DKP], n[4][DV], l[4][LANES] = {{0}}, inv[4];
            two_features(ROW(Q, t, 0, L, DK), ROW(Q, t, 1, L, DK), 1, 1, f[0], f[1], floor_);
            two_features(ROW(Q, t, 2, L, DK), ROW(Q, t, 3, L, DK), 1, 1, f[2], f[3], floor_);
            for (int r = 0; r < 4; r++) {
                for (int d0 = 0; d0 < DKP; d0 += LANES)
                    for (int j = 0; j < LANES; j++) l[r][j] += f[r][d0 + j] * zp[d0 + j];
                REAL den = eps;
                for (int j = 0; j < LANES; j++) den += l[r][j];
                inv[r] = 1 / den;
            }
            for (int e = 0; e < DV; e++) n[0][e] = n[1][e] = n[2][e] = n[3][e] = 0;
            for (int d = 0; d < DK; d++) {
                const REAL *restrict Sd = Sh + d * DV;
                const REAL a0 = f[0][d], a1 = f[1][d], a2 = f[2][d], a3 = f[3][d];
                for (int e = 0; e < DV; e++) {
                    const REAL s = Sd[e];
                    n[0][e] += a0 * s;
                    n[1][e] += a1 * s;
                    n[2][e] += a2 * s;
                    n[3][e] += a3 * s;
                }
            }
            for (int r = 0; r < 4 && t + r < L; r++)
                for (int e = 0; e < DV; e++) O[(t + r) * DV + e] = n[r][e] * inv[r];
        }
    }
}

/* Transpose of a (rows x cols) matrix into t (cols x rows). */
static void transpose(const REAL *restrict a, REAL *restrict t, int rows, int cols) {
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++) t[j * rows + i] = a[i * cols + j];
}

/* phi'(x) from phi(x): 1 above 0, e^x = phi(x) below. */
static inline REAL phi_slope(REAL f) { return f < 1 ? f : 1; }

/* Non-causal backward, query side, from the output's gradient g (rows of DV, heads g_head
 * apart): with f = phi(q), den = f . z + eps, gn = g / den, df = S gn and gden = -(f . df) / den:
 * dq = (df + gden z) * phi'(q) (n_heads, L, DK); dS = sum f gn^T (n_heads, DK, DV) and
 * dz = sum f gden (n_heads, DK), written. Four queries a pass through S^T and dS.
 * Returns 0, or -1 where memory for S^T could not be had. */
int linear_queries_grad(const REAL *q, const REAL *g, int64_t q_head, int64_t g_head, const REAL *S,
                        const REAL *z, REAL *dq, REAL *dS, REAL *dz, int64_t n_heads, int64_t L,
                        REAL eps, REAL floor_) {
    REAL *St = malloc(sizeof(REAL) * DK * DV);
    if (!St) return -1;
    for (int64_t h = 0; h < n_heads; h++) {
        const REAL *Q = q + h * q_head, *G = g + h * g_head, *zh = z + h * DK;
        REAL *restrict dSh = dS + h * DK * DV, *restrict dzh = dz + h * DK, *DQ = dq + h * L * DK;
        REAL zp[DKP] = {0};
        for (int d = 0; d < DK; d++) zp[d] = zh[d];
        transpose(S + h * DK * DV, St, DK, DV);
        for (int i = 0; i < DK * DV; i++) dSh[i] = 0;
        for (int d = 0; d < DK; d++) dzh[d] = 0;
        for (int64_t t = 0; t < L; t += 4) {
            REAL f[4][DKP], df[4][DKP], gn[4][DV], gden[4], den[4];
            two_features(ROW(Q, t, 0, L, DK), ROW(Q, t, 1, L, DK), 1, 1, f[0], f[1], floor_);
            two_features(ROW(Q, t, 2, L, DK), ROW(Q, t, 3, L, DK), 1, 1, f[2], f[3], floor_);
            for (int r = 0; r < 4; r++) {
                const int real = t + r < L; /* a row past the end takes no part: gn = 0 */
                const REAL *gr = ROW(G, t, r, L, DV);
                den[r] = dot_lanes(f[r], zp, eps);
                const REAL inv = real ? 1 / den[r] : 0;
                for (int e = 0; e < DV; e++) gn[r][e] = gr[e] * inv;
                for (int d = 0; d < DKP; d++) df[r][d] = 0; /* (zero past DK: dot_lanes reads it) */
            }
            for (int e = 0; e < DV; e++) { /* df = S gn, four rows a pass through S^T */
                const REAL *restrict Ste = St + e * DK;
                const REAL w0 = gn[0][e], w1 = gn[1][e], w2 = gn[2][e], w3 = gn[3][e];
                for (int d = 0; d < DK; d++) {
                    df[0][d] += w0 * Ste[d];
                    df[1][d] += w1 * Ste[d];
                    df[2][d] += w2 * Ste[d];
                    df[3][d] += w3 * Ste[d];
                }
            }
            for (int r = 0; r < 4; r++) gden[r] = t + r < L ? -dot_lanes(f[r], df[r], 0) / den[r] : 0;
            for (int d = 0; d < DK; d++) {
                REAL *restrict dSd = dSh + d * DV;
                const REAL a0 = f[0][d], a1 = f[1][d], a2 = f[2][d], a3 = f[3][d];
                dzh[d] += (a0 * gden[0] + a1 * gden[1]) + (a2 * gden[2] + a3 * gden[3]);
                for (int e = 0; e < DV; e++)
                    dSd[e] += (a0 * gn[0][e] + a1 * gn[1][e]) + (a2 * gn[2][e] + a3 * gn[3][e]);
            }
            for (int r = 0; r < 4 && t + r < L; r++)
                for (int d = 0; d < DK; d++)
                    DQ[(t + r) * DK + d] = (df[r][d] + gden[r] * zh[d]) * phi_slope(f[r][d]);
        }
    }
    free(St);
    return 0;
}

/* Non-causal backward, key side, from dS and dz: dv = dS^T phi(k) (n_heads, L, DV) and
 * dk = (dS v + dz) * phi'(k) (n_heads, L, DK), 0 for a key key_ok leaves out. Four keys a
 * pass through dS and dS^T. Returns 0, or -1 where memory for dS^T could not be had. */
int linear_keys_grad(const REAL *k, const REAL *v, const uint8_t *key_ok, int64_t k_head, int64_t v_head,
                     const REAL *dS, const REAL *dz, REAL *dk, REAL *dv, int64_t n_heads, int64_t L,
                     REAL floor_) {
    REAL *dSt = malloc(sizeof(REAL) * DK * DV);
    if (!dSt) return -1;
    for (int64_t h = 0; h < n_heads; h++) {
        const REAL *K = k + h * k_head, *V = v + h * v_head, *restrict dSh = dS + h * DK * DV;
        const REAL *dzh = dz + h * DK;
        const uint8_t *ok = key_ok ? key_ok + h * L : 0;
        REAL *DK_ = dk + h * L * DK, *DV_ = dv + h * L * DV;
        transpose(dSh, dSt, DK, DV);
        for (int64_t t = 0; t < L; t += 4) {
            REAL f[4][DKP], df[4][DK], o[4][DV];
            int part[4];
            for (int r = 0; r < 4; r++) part[r] = TAKES_PART(ok, t, r, L);
            two_features(ROW(K, t, 0, L, DK), ROW(K, t, 1, L, DK), part[0], part[1], f[0], f[1], floor_);
            two_features(ROW(K, t, 2, L, DK), ROW(K, t, 3, L, DK), part[2], part[3], f[2], f[3], floor_);
            for (int r = 0; r < 4; r++)
                for (int e = 0; e < DV; e++) o[r][e] = 0;
            for (int d = 0; d < DK; d++) {
                const REAL *restrict dSd = dSh + d * DV;
                const REAL a0 = f[0][d], a1 = f[1][d], a2 = f[2][d], a3 = f[3][d];
                for (int e = 0; e < DV; e++) {
                    const REAL s = dSd[e];
                    o[0][e] += a0 * s;
                    o[1][e] += a1 * s;
                    o[2][e] += a2 * s;
                    o[3][e] += a3 * s;
                }
            }
            const REAL *v0 = ROW(V, t, 0, L, DV), *v1 = ROW(V, t, 1, L, DV);
            const REAL *v2 = ROW(V, t, 2, L, DV), *v3 = ROW(V, t, 3, L, DV);
            for (int r = 0; r < 4; r++)
                for (int d = 0; d < DK; d++) df[r][d] = dzh[d];
            for (int e = 0; e < DV; e++) { /* df = dS v + dz, four rows a pass through dS^T */
                const REAL *restrict dSte = dSt + e * DK;
                const REAL w0 = v0[e], w1 = v1[e], w2 = v2[e], w3 = v3[e];
                for (int d = 0; d < DK; d++) {
                    df[0][d] += w0 * dSte[d];
                    df[1][d] += w1 * dSte[d];
                    df[2][d] += w2 * dSte[d];
                    df[3][d] += w3 * dSte[d];
                }
            }
            for (int r = 0; r < 4 && t + r < L; r++) {
                for (int e = 0; e < DV; e++) DV_[(t + r) * DV + e] = o[r][e];
                for (int d = 0; d < DK; d++) /* (a select: a padded key's v may hold anything) */
                    DK_[(t + r) * DK + d] = part[r] ? df[r][d] * phi_slope(f[r][d]) : 0;
            }
        }
    }
    free(dSt);
    return 0;
}

/* ---- Efficient attention (Shen et al., WACV 2021): out = softmax_features(q) G with
 * G = sum_j E_j v_j^T / z, E_j = exp(k_j - c) (c: each feature's max over the kept keys,
 * 0 where none), z = sum_j E_j (at least the smallest normal number). */

/* Keys: G (n_heads, DK, DV), z (n_heads, DK, unclamped) and c (n_heads, DK), written. */
void efficient_keys(const REAL *k, const REAL *v, const uint8_t *key_ok, int64_t k_head, int64_t v_head,
                    REAL *G, REAL *z, REAL *c, int64_t n_heads, int64_t L, REAL tiny, REAL floor_) {
    for (int64_t h = 0; h < n_heads; h++) {
        const REAL *K = k + h * k_head, *V = v + h * v_head;
        const uint8_t *ok = key_ok ? key_ok + h * L : 0;
        REAL *restrict Gh = G + h * DK * DV, *restrict zh = z + h * DK, *restrict ch = c + h * DK;
        for (int d = 0; d < DK; d++) ch[d] = -INFINITY;
        for (int64_t t = 0; t < L; t++)
            if (!ok || ok[t])
                for (int d = 0; d < DK; d++) ch[d] = K[t * DK + d] > ch[d] ? K[t * DK + d] : ch[d];
        for (int d = 0; d < DK; d++) ch[d] = isfinite(ch[d]) ? ch[d] : 0;
        for (int i = 0; i < DK * DV; i++) Gh[i] = 0;
        for (int d = 0; d < DK; d++) zh[d] = 0;
        for (int64_t t = 0; t < L; t += 4) {
            const REAL *restrict v0 = ROW(V, t, 0, L, DV), *restrict v1 = ROW(V, t, 1, L, DV);
            const REAL *restrict v2 = ROW(V, t, 2, L, DV), *restrict v3 = ROW(V, t, 3, L, DV);
            REAL E[4][DK];
            for (int r = 0; r < 4; r++) {
                const REAL *kr = ROW(K, t, r, L, DK);
                const int part = TAKES_PART(ok, t, r, L);
                for (int d = 0; d < DK; d++) E[r][d] = part ? exp_nonpositive(kr[d] - ch[d], floor_) : 0;
            }
            for (int d = 0; d < DK; d++) {
                REAL *restrict Gd = Gh + d * DV;
                const REAL a0 = E[0][d], a1 = E[1][d], a2 = E[2][d], a3 = E[3][d];
                zh[d] += (a0 + a1) + (a2 + a3);
                for (int e = 0; e < DV; e++) Gd[e] += (a0 * v0[e] + a1 * v1[e]) + (a2 * v2[e] + a3 * v3[e]);
            }
        }
        for (int d = 0; d < DK; d++) {
            const REAL inv = 1 / (zh[d] > tiny ? zh[d] : tiny);
            for (int e = 0; e < DV; e++) Gh[d * DV + e] *= inv;
        }
    }
}

/* A query row's softmax over its features into p (zero past DK). */
static inline void row_softmax(const REAL *restrict x, REAL *restrict p, REAL floor_) {
    REAL xp[DKP], lane[LANES], top, sum[LANES] = {0}, total = 0; /* max and sum lane by lane */
    for (int d = 0; d < DKP; d++) xp[d] = x[d < DK ? d : 0]; /* (padded with x[0]: no new max) */
    for (int j = 0; j < LANES; j++) lane[j] = xp[j];
    for (int d0 = LANES; d0 < DKP; d0 += LANES)
        for (int j = 0; j < LANES; j++) lane[j] = xp[d0 + j] > lane[j] ? xp[d0 + j] : lane[j];
    top = lane[0];
    for (int j = 1; j < LANES; j++) top = lane[j] > top ? lane[j] : top;
    for (int d = 0; d < DK; d++) p[d] = exp_nonpositive(x[d] - top, floor_);
    for (int d = DK; d < DKP; d++) p[d] = 0;
    for (int d0 = 0; d0 < DKP; d0 += LANES)
        for (int j = 0; j < LANES; j++) sum[j] += p[d0 + j];
    for (int j = 0; j < LANES; j++) total += sum[j];
    const REAL inv = 1 / total;
    for (int d = 0; d < DK; d++) p[d] *= inv;
}

/* Queries: out = softmax(q) G (n_heads, L, DV), four queries a pass through G. */
void efficient_queries(const REAL *q, int64_t q_head, const REAL *G, REAL *out, int64_t n_heads, int64_t L,
                       REAL floor_) {
    for (int64_t h = 0; h < n_heads; h++) {
        const REAL *Q = q + h * q_head, *restrict Gh = G + h * DK * DV;
        REAL *O = out + h * L * DV;
        for (int64_t t = 0; t < L; t += 4) {
            REAL p[4][DKP], n[4][DV];
            for (int r = 0; r < 4; r++) row_softmax(ROW(Q, t, r, L, DK), p[r], floor_);
            for (int e = 0; e < DV; e++) n[0][e] = n[1][e] = n[2][e] = n[3][e] = 0;
            for (int d = 0; d < DK; d++) {
                const REAL *restrict Gd = Gh + d * DV;
                const REAL a0 = p[0][d], a1 = p[1][d], a2 = p[2][d], a3 = p[3][d];
                for (int e = 0; e < DV; e++) {
                    n[0][e] += a0 * Gd[e];
                    n[1][e] += a1 * Gd[e];
                    n[2][e] += a2 * Gd[e];
                    n[3][e] += a3 * Gd[e];
                }
            }
            for (int r = 0; r < 4 && t + r < L; r++)
                for (int e = 0; e < DV; e++) O[(t + r) * DV + e] = n[r][e];
        }
    }
}

/* Backward, query side: with p = softmax(q) and dp = G g, dq = p * (dp - p . dp) (n_heads, L, DK)
 * and dG = sum p g^T (n_heads, DK, DV), written. Returns 0, or -1 without memory for G^T. */
int efficient_queries_grad(const REAL *q, const REAL *g, int64_t q_head, int64_t g_head, const REAL *G,
                           REAL *dq, REAL *dG, int64_t n_heads, int64_t L, REAL floor_) {
    REAL *Gt = malloc(sizeof(REAL) * DK * DV);
    if (!Gt) return -1;
    for (int64_t h = 0; h < n_heads; h++) {
        const REAL *Q = q + h * q_head, *Gr = g + h * g_head;
        REAL *restrict dGh = dG + h * DK * DV, *DQ = dq + h * L * DK;
        transpose(G + h * DK * DV, Gt, DK, DV);
        for (int i = 0; i < DK * DV; i++) dGh[i] = 0;
        for (int64_t t = 0; t < L; t += 4) {
            REAL p[4][DKP], dp[4][DKP], gr[4][DV];
            for (int r = 0; r < 4; r++) {
                row_softmax(ROW(Q, t, r, L, DK), p[r], floor_);
                const REAL *row = ROW(Gr, t, r, L, DV), real = t + r < L; /* past the end: g = 0 */
                for (int e = 0; e < DV; e++) gr[r][e] = row[e] * real;
                for (int d = 0; d < DKP; d++) dp[r][d] = 0;
            }
            for (int e = 0; e < DV; e++) { /* dp = G g, four rows a pass through G^T */
                const REAL *restrict Gte = Gt + e * DK;
                const REAL w0 = gr[0][e], w1 = gr[1][e], w2 = gr[2][e], w3 = gr[3][e];
                for (int d = 0; d < DK; d++) {
                    dp[0][d] += w0 * Gte[d];
                    dp[1][d] += w1 * Gte[d];
                    dp[2][d] += w2 * Gte[d];
                    dp[3][d] += w3 * Gte[d];
                }
            }
            for (int d = 0; d < DK; d++) {
                REAL *restrict dGd = dGh + d * DV;
                const REAL a0 = p[0][d], a1 = p[1][d], a2 = p[2][d], a3 = p[3][d];
                for (int e = 0; e < DV; e++)
                    dGd[e] += (a0 * gr[0][e] + a1 * gr[1][e]) + (a2 * gr[2][e] + a3 * gr[3][e]);
            }
            for (int r = 0; r < 4 && t + r < L; r++) {
                const REAL pdp = dot_lanes(p[r], dp[r], 0);
                for (int d = 0; d < DK; d++) DQ[(t + r) * DK + d] = p[r][d] * (dp[r][d] - pdp);
            }
        }
    }
    free(Gt);
    return 0;
}

/* Backward, key side, from dG: dS = dG / z and dz = -(dG . G) / z per feature (0 where z is
 * clamped: no kept key); per key E = exp(k - c): dk = E * (dS v + dz), dv = dS^T E
 * (0 for a key key_ok leaves out). Returns 0, or -1 without memory for dS^T. */
int efficient_keys_grad(const REAL *k, const REAL *v, const uint8_t *key_ok, int64_t k_head, int64_t v_head,
                        const REAL *G, const REAL *z, const REAL *c, const REAL *dG, REAL *dk, REAL *dv,
                        int64_t n_heads, int64_t L, REAL tiny, REAL floor_) {
    REAL *dS = malloc(sizeof(REAL) * DK * DV), *dSt = malloc(sizeof(REAL) * DK * DV);
    if (!dS || !dSt) {
        free(dS);
        free(dSt);
        return -1;
    }
    for (int64_t h = 0; h < n_heads; h++) {
        const REAL *K = k + h * k_head, *V = v + h * v_head, *Gh = G + h * DK * DV, *dGh = dG + h * DK * DV;
        const REAL *zh = z + h * DK, *ch = c + h * DK;
        const uint8_t *ok = key_ok ? key_ok + h * L : 0;
        REAL *DK_ = dk + h * L * DK, *DV_ = dv + h * L * DV, dz[DK];
        for (int d = 0; d < DK; d++) {
            const REAL zc = zh[d] > tiny ? zh[d] : tiny;
            REAL dGG = 0;
            for (int e = 0; e < DV; e++) {
                dGG += dGh[d * DV + e] * Gh[d * DV + e];
                dS[d * DV + e] = dGh[d * DV + e] / zc;
            }
            dz[d] = zh[d] >= tiny ? -dGG / zh[d] : 0;
        }
        transpose(dS, dSt, DK, DV);
        for (int64_t t = 0; t < L; t += 4) {
            REAL E[4][DK], dE[4][DK], o[4][DV];
            int part[4];
            for (int r = 0; r < 4; r++) {
                const REAL *kr = ROW(K, t, r, L, DK);
                part[r] = TAKES_PART(ok, t, r, L);
                for (int d = 0; d < DK; d++) {
                    E[r][d] = part[r] ? exp_nonpositive(kr[d] - ch[d], floor_) : 0;
                    dE[r][d] = dz[d];
                }
                for (int e = 0; e < DV; e++) o[r][e] = 0;
            }
            const REAL *v0 = ROW(V, t, 0, L, DV), *v1 = ROW(V, t, 1, L, DV);
            const REAL *v2 = ROW(V, t, 2, L, DV), *v3 = ROW(V, t, 3, L, DV);
            for (int e = 0; e < DV; e++) { /* dE = dS v + dz, four rows a pass through dS^T */
                const REAL *restrict dSte = dSt + e * DK;
                const REAL w0 = v0[e], w1 = v1[e], w2 = v2[e], w3 = v3[e];
                for (int d = 0; d < DK; d++) {
                    dE[0][d] += w0 * dSte[d];
                    dE[1][d] += w1 * dSte[d];
                    dE[2][d] += w2 * dSte[d];
                    dE[3][d] += w3 * dSte[d];
                }
            }
            for (int d = 0; d < DK; d++) { /* dv = dS^T E */
                const REAL *restrict dSd = dS + d * DV;
                const REAL a0 = E[0][d], a1 = E[1][d], a2 = E[2][d], a3 = E[3][d];
                for (int e = 0; e < DV; e++) {
                    o[0][e] += a0 * dSd[e];
                    o[1][e] += a1 * dSd[e];
                    o[2][e] += a2 * dSd[e];
                    o[3][e] += a3 * dSd[e];
                }
            }
            for (int r = 0; r < 4 && t + r < L; r++) {
                for (int e = 0; e < DV; e++) DV_[(t + r) * DV + e] = o[r][e];
                for (int d = 0; d < DK; d++) DK_[(t + r) * DK + d] = part[r] ? E[r][d] * dE[r][d] : 0;
            }
        }
    }
    free(dS);
    free(dSt);
    return 0;
}
