"""The C source of backend ``"native"`` (:mod:`.native`): the Trellis op's per-token recurrence
(design page, section 1) for CPUs, built on the user's machine by :mod:`..native_build`.

Held as a Python string, not a ``.c`` file, so that a checkpoint's flat remote code (which
carries the package's Python modules only, :mod:`trellis_lm.remote_code`) carries it too.

Why a C loop: on a CPU the chunk form's time goes mostly to the dispatch of small tensor
operations and to its forward substitution, a sequential loop over each chunk's tokens on
M-vectors. Run per token, per (sequence, head) pair, with the pair's two memories kept in the
core's caches, the same function costs about six M x D multiply-adds per token and head.

The file is read twice by the preprocessor: once for the shared declarations, then included into
itself once per scalar type, with ``REAL`` and ``NAME(x)`` set (float: ``_f32``, double: ``_f64``).
"""

SOURCE = r"""
#ifndef REAL
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { COMPRESS_IDENTITY = 0, COMPRESS_L2NORM = 1, COMPRESS_LAYERNORM = 2 };
enum { MIX_LN_SILU = 0, MIX_L2_SILU = 1, MIX_SOFTMAX = 2 };
/* Tensors addressed by (row, token, head) strides: the six inputs, then the output. */
enum { T_Q, T_K, T_V, T_ALPHA, T_LOG_BETA, T_GAMMA, T_OUT, TENSORS };
/* The state's four tensors, [N, H, M, D] each, every row's [H, M, D] contiguous. */
enum { S_MK, S_MV, S_AK, S_AV, STATES };

typedef struct {
    const void *inputs[T_OUT];
    void *out;
    int64_t strides[TENSORS][3];
    const int64_t *starts;  /* per row: the token index of its first token along T (NULL: 0) */
    const int64_t *lengths; /* per row: its number of tokens (NULL: tokens) */
    const int64_t *offsets; /* per row: its position in its first chunk */
    int64_t *offsets_out;   /* per row: its position after its tokens */
    const void *state_in[STATES];
    void *state_out[STATES]; /* may be state_in's own (the state written in place) */
    int64_t state_in_rows[STATES], state_out_rows[STATES]; /* entries from one row to the next (0: one row for all) */
    int64_t rows, tokens, heads, slots, dk, dv, chunk;
    int compress, mix;
    int read_anchors; /* each write reads its anchor, not the current memory */
    int keep_anchors; /* anchors are refreshed at chunk starts and returned */
    double eps;
} trellis_job;

/* Columns per block of the products, their sums held in registers (four AVX-512 vectors of floats):
 * the fastest of 16, 32, 64 and 128 at M = 64 (0.65x the time of 32; BENCHMARKS.md, "The C loop"). */
#define COLUMN_BLOCK 64

typedef struct {
    const trellis_job *job;
    int thread, threads, f64, failed;
} worker_arg;

#define REAL float
#define NAME(x) x##_f32
#define EXP expf
#define SQRT sqrtf
#include __FILE__
#undef REAL
#undef NAME
#undef LANES
#undef EXP
#undef SQRT
#define REAL double
#define NAME(x) x##_f64
#define EXP exp
#define SQRT sqrt
#include __FILE__

/* A thread's share: every threads-th (row, head) pair from its own. */
static void *work(void *arg) {
    worker_arg *w = (worker_arg *)arg;
    const trellis_job *job = w->job;
    const int64_t pairs = job->rows * job->heads;
    /* run_pair's scratch; run_token's, 3 M, fits in it */
    const int64_t entries = 3 * job->slots + (job->slots > job->dk ? job->slots : job->dk)
                            + (1 + job->keep_anchors) * job->slots * job->dk;
    void *scratch = malloc((w->f64 ? sizeof(double) : sizeof(float)) * (size_t)entries);
    if (scratch == NULL) {
        w->failed = 1;
        return NULL;
    }
    for (int64_t p = w->thread; p < pairs; p += w->threads) {
        if (w->f64)
            run_pair_f64(job, p / job->heads, p % job->heads, (double *)scratch);
        else
            run_pair_f32(job, p / job->heads, p % job->heads, (float *)scratch);
    }
    free(scratch);
    return NULL;
}

#define MAX_THREADS 256

/* Runs the job on up to `threads` threads (this one among them); a thread that cannot be started
 * has its share run here afterwards. Returns 0, or 1 where scratch memory could not be had. */
int trellis_recurrence(const trellis_job *job, int f64, int threads) {
    const int64_t pairs = job->rows * job->heads;
    if (threads > pairs) threads = (int)pairs;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads < 1) threads = 1;
    worker_arg args[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int i = 0; i < threads; i++) args[i] = (worker_arg){job, i, threads, f64, 0};
    for (int i = 1; i < threads; i++) started[i] = pthread_create(&ids[i], NULL, work, &args[i]) == 0;
    work(&args[0]);
    int failed = args[0].failed;
    for (int i = 1; i < threads; i++) {
        if (started[i])
            pthread_join(ids[i], NULL);
        else
            work(&args[i]);
        failed |= args[i].failed;
    }
    return failed;
}
#else

/* The norms without affine: returns 1 / sigma (biased variance) and the mean with `centre` (layer
 * norm), else 1 / |x| and a mean of 0 (L2 norm); eps inside the root either way. x [M]. */
static REAL NAME(normaliser)(const REAL *restrict x, int64_t slots, int centre, REAL eps, REAL *mean_out) {
    REAL mean = 0, squares = 0;
    if (centre) {
        for (int64_t m = 0; m < slots; m++) mean += x[m];
        mean /= (REAL)slots;
    }
    for (int64_t m = 0; m < slots; m++) squares += (x[m] - mean) * (x[m] - mean);
    *mean_out = mean;
    return (REAL)1 / SQRT((centre ? squares / (REAL)slots : squares) + eps);
}

/* u = vjp_phi(z, phi(z) - alpha), phi the compression function (layer norm or L2 norm without
 * affine, or the identity); z, alpha, u [M]. */
static void NAME(residual)(int compress, const REAL *restrict z, const REAL *restrict alpha, REAL *restrict u,
                           int64_t slots, REAL eps) {
    if (compress == COMPRESS_IDENTITY) {
        for (int64_t m = 0; m < slots; m++) u[m] = z[m] - alpha[m];
        return;
    }
    int centre = compress == COMPRESS_LAYERNORM;
    REAL mean, scale = NAME(normaliser)(z, slots, centre, eps, &mean);
    REAL e_sum = 0, ze_sum = 0;
    for (int64_t m = 0; m < slots; m++) {
        REAL zh = (z[m] - mean) * scale, e = zh - alpha[m];
        u[m] = e;
        e_sum += e;
        ze_sum += zh * e;
    }
    /* J^T e = (e - mean(e) - zh mean(zh e)) / sigma, or (e - zh (zh . e)) / |z| */
    REAL e_mean = centre ? e_sum / (REAL)slots : 0, ze = centre ? ze_sum / (REAL)slots : ze_sum;
    for (int64_t m = 0; m < slots; m++) u[m] = (u[m] - e_mean - (z[m] - mean) * scale * ze) * scale;
}

/* y <- f(y), the mixing function, in place; y [M]. */
static void NAME(mix)(int mix, REAL *restrict y, int64_t slots, REAL eps) {
    if (mix == MIX_SOFTMAX) {
        REAL top = y[0], total = 0;
        for (int64_t m = 1; m < slots; m++) top = y[m] > top ? y[m] : top;
        for (int64_t m = 0; m < slots; m++) {
            y[m] = EXP(y[m] - top);
            total += y[m];
        }
        for (int64_t m = 0; m < slots; m++) y[m] /= total;
        return;
    }
    for (int64_t m = 0; m < slots; m++) y[m] = y[m] / ((REAL)1 + EXP(-y[m])); /* SiLU */
    REAL mean, scale = NAME(normaliser)(y, slots, mix == MIX_LN_SILU, eps, &mean);
    for (int64_t m = 0; m < slots; m++) y[m] = (y[m] - mean) * scale;
}

/* dst [cols, rows] = src [rows, cols] transposed. */
static void NAME(transpose)(const REAL *restrict src, REAL *restrict dst, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) dst[c * rows + r] = src[r * cols + c];
}

/* Vectors of 64 bytes (GCC's and clang's vector extension: one AVX-512 register, two AVX2 ones),
 * loaded and stored by memcpy, which compiles to unaligned moves. */
typedef REAL NAME(vec) __attribute__((vector_size(64)));
#define LANES ((int64_t)(64 / sizeof(REAL)))

static inline NAME(vec) NAME(load)(const REAL *p) {
    NAME(vec) v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void NAME(store)(REAL *p, NAME(vec) v) { memcpy(p, &v, sizeof v); }

/* z[c] = sum_r x[r] s[r, c], s [rows, cols]: a block of COLUMN_BLOCK columns at a time with its
 * sums in registers across the rows (vectors named as such: a compiler keeps a plain array of
 * sums in memory), the last columns one by one. */
static void NAME(sum_rows)(const REAL *restrict s, const REAL *restrict x, REAL *restrict z, int64_t rows,
                           int64_t cols) {
    int64_t c = 0;
    for (; c + COLUMN_BLOCK <= cols; c += COLUMN_BLOCK) {
        NAME(vec) acc[COLUMN_BLOCK / LANES] = {0};
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < COLUMN_BLOCK / LANES; i++) acc[i] += NAME(load)(s + r * cols + c + i * LANES) * x[r];
        for (int64_t i = 0; i < COLUMN_BLOCK / LANES; i++) NAME(store)(z + c + i * LANES, acc[i]);
    }
    for (; c < cols; c++) {
        REAL acc = 0;
        for (int64_t r = 0; r < rows; r++) acc += s[r * cols + c] * x[r];
        z[c] = acc;
    }
}

/* The write and the read that follows it: dst = beta src - a b^T and out[c] = sum_r w[r] dst[r, c]
 * (src, dst [rows, cols], dst may be src), in blocks of columns as sum_rows. */
static void NAME(write_read)(const REAL *src, REAL *dst, REAL beta, const REAL *restrict a,
                             const REAL *restrict b, const REAL *restrict w, REAL *restrict out, int64_t rows,
                             int64_t cols) {
    int64_t c = 0;
    for (; c + COLUMN_BLOCK <= cols; c += COLUMN_BLOCK) {
        NAME(vec) acc[COLUMN_BLOCK / LANES] = {0}, bs[COLUMN_BLOCK / LANES];
        for (int64_t i = 0; i < COLUMN_BLOCK / LANES; i++) bs[i] = NAME(load)(b + c + i * LANES);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < COLUMN_BLOCK / LANES; i++) {
                NAME(vec) value = beta * NAME(load)(src + r * cols + c + i * LANES) - a[r] * bs[i];
                NAME(store)(dst + r * cols + c + i * LANES, value);
                acc[i] += w[r] * value;
            }
        for (int64_t i = 0; i < COLUMN_BLOCK / LANES; i++) NAME(store)(out + c + i * LANES, acc[i]);
    }
    for (; c < cols; c++) {
        REAL acc = 0;
        for (int64_t r = 0; r < rows; r++) {
            REAL value = beta * src[r * cols + c] - a[r] * b[c];
            dst[r * cols + c] = value;
            acc += w[r] * value;
        }
        out[c] = acc;
    }
}

/* Copies n entries where the two places differ (a state written in place is its own copy). */
static void NAME(copy)(REAL *dst, const REAL *src, int64_t n) {
    if (dst != src) memcpy(dst, src, sizeof(REAL) * (size_t)n);
}

/* sum_d a[d] b[d], a and b [n]. */
static inline REAL NAME(dot)(const REAL *a, const REAL *b, int64_t n) {
    NAME(vec) acc = {0};
    int64_t d = 0;
    for (; d + LANES <= n; d += LANES) acc += NAME(load)(a + d) * NAME(load)(b + d);
    REAL total = 0;
    for (int64_t i = 0; i < LANES; i++) total += acc[i];
    for (; d < n; d++) total += a[d] * b[d];
    return total;
}

/* The write of one memory row, dst = beta src - a b (src, dst, b [n]; dst may be src), returning
 * sum_d dst[d] w[d] (the key memory's read at q). */
static inline REAL NAME(write_row_dot)(const REAL *src, REAL *dst, REAL beta, REAL a, const REAL *b, const REAL *w,
                                       int64_t n) {
    NAME(vec) acc = {0};
    int64_t d = 0;
    for (; d + LANES <= n; d += LANES) {
        NAME(vec) value = beta * NAME(load)(src + d) - a * NAME(load)(b + d);
        NAME(store)(dst + d, value);
        acc += value * NAME(load)(w + d);
    }
    REAL total = 0;
    for (int64_t i = 0; i < LANES; i++) total += acc[i];
    for (; d < n; d++) {
        dst[d] = beta * src[d] - a * b[d];
        total += dst[d] * w[d];
    }
    return total;
}

/* The same write, adding c dst to into [n] (the output's sum over the value memory's rows). */
static inline void NAME(write_row_add)(const REAL *src, REAL *dst, REAL beta, REAL a, const REAL *b, REAL c,
                                       REAL *restrict into, int64_t n) {
    int64_t d = 0;
    for (; d + LANES <= n; d += LANES) {
        NAME(vec) value = beta * NAME(load)(src + d) - a * NAME(load)(b + d);
        NAME(store)(dst + d, value);
        NAME(store)(into + d, NAME(load)(into + d) + c * value);
    }
    for (; d < n; d++) {
        dst[d] = beta * src[d] - a * b[d];
        into[d] += c * dst[d];
    }
}

/* One token of a pair (what every decode step runs): the memories read and written in their own
 * [M, D] layout, row by row (a token reads each row at most twice: run_pair's transposition pays
 * off over several tokens only), in place where the state out is the state in. The anchors out
 * hold the anchors in already; at a chunk start they become the memories in, before any write.
 * at: the inputs at the token; scratch: 3 M entries. */
static void NAME(run_token)(const trellis_job *job, const REAL *mk_in, const REAL *mv_in, REAL *mk, REAL *mv,
                            REAL *ak, REAL *av, int starts_chunk, const REAL *const *at, REAL *o, REAL *scratch) {
    const int64_t M = job->slots, DK = job->dk, DV = job->dv;
    const REAL eps = (REAL)job->eps, beta = EXP(at[T_LOG_BETA][0]), gamma = at[T_GAMMA][0];
    const REAL *q = at[T_Q], *k = at[T_K], *v = at[T_V], *alpha = at[T_ALPHA];
    REAL *z = scratch, *u = z + M, *y = u + M;
    if (job->keep_anchors && starts_chunk) {
        NAME(copy)(ak, mk_in, M * DK);
        NAME(copy)(av, mv_in, M * DV);
    }
    /* Key pass: z = A k, u = vjp_phi, then M_K <- beta M_K - gamma u k^T and y = M_K q. */
    const REAL *read = job->read_anchors ? ak : mk_in;
    for (int64_t m = 0; m < M; m++) z[m] = NAME(dot)(read + m * DK, k, DK);
    NAME(residual)(job->compress, z, alpha, u, M, eps);
    for (int64_t m = 0; m < M; m++)
        y[m] = NAME(write_row_dot)(mk_in + m * DK, mk + m * DK, beta, gamma * u[m], k, q, DK);
    NAME(mix)(job->mix, y, M, eps); /* h = f(y) */
    /* Value pass: z = A v (the value memory before its write), u, then M_V <- beta M_V - gamma u v^T
     * and o = M_V^T h. */
    read = job->read_anchors ? av : mv_in;
    for (int64_t m = 0; m < M; m++) z[m] = NAME(dot)(read + m * DV, v, DV);
    NAME(residual)(job->compress, z, alpha, u, M, eps);
    for (int64_t d = 0; d < DV; d++) o[d] = 0;
    for (int64_t m = 0; m < M; m++)
        NAME(write_row_add)(mv_in + m * DV, mv + m * DV, beta, gamma * u[m], v, y[m], o, DV);
}

/* One (row, head) pair over all its tokens. The key memory is kept transposed ([Dk, M]) in the
 * scratch, so that both of its products (the read at k, and q's read of the written memory) sum
 * rows of M entries rather than reduce across them; the value memory stays [M, Dv], where the
 * output is the sum of rows. A single token runs run_token instead. scratch: 3 M + max(M, Dk) +
 * (1 + keep_anchors) Dk M entries. */
static void NAME(run_pair)(const trellis_job *job, int64_t n, int64_t h, REAL *scratch) {
    const int64_t M = job->slots, DK = job->dk, DV = job->dv;
    const int64_t k_size = M * DK, v_size = M * DV;
    const int64_t length = job->lengths ? job->lengths[n] : job->tokens, start = job->starts ? job->starts[n] : 0;
    if (h == 0) job->offsets_out[n] = (job->offsets[n] + length) % job->chunk;
    const REAL *in[STATES];
    REAL *state[STATES];
    for (int i = 0; i < (job->keep_anchors ? STATES : S_AK); i++) {
        const int64_t size = i == S_MK || i == S_AK ? k_size : v_size;
        in[i] = (const REAL *)job->state_in[i] + n * job->state_in_rows[i] + h * size;
        state[i] = (REAL *)job->state_out[i] + n * job->state_out_rows[i] + h * size;
    }
    const REAL *mk_in = in[S_MK], *mv_in = in[S_MV];
    REAL *mk_out = state[S_MK], *mv = state[S_MV];
    REAL *ak_out = job->keep_anchors ? state[S_AK] : NULL, *av = job->keep_anchors ? state[S_AV] : NULL;
    if (job->keep_anchors) {
        NAME(copy)(ak_out, in[S_AK], k_size);
        NAME(copy)(av, in[S_AV], v_size);
    }
    if (length == 0) { /* the state passes through */
        NAME(copy)(mk_out, mk_in, k_size);
        NAME(copy)(mv, mv_in, v_size);
        return;
    }
    const REAL *at[T_OUT];
    for (int i = 0; i < T_OUT; i++)
        at[i] = (const REAL *)job->inputs[i] + n * job->strides[i][0] + start * job->strides[i][1]
                + h * job->strides[i][2];
    REAL *out = (REAL *)job->out + n * job->strides[T_OUT][0] + start * job->strides[T_OUT][1]
                + h * job->strides[T_OUT][2];
    if (length == 1) {
        NAME(run_token)(job, mk_in, mv_in, mk_out, mv, ak_out, av, job->offsets[n] % job->chunk == 0, at, out, scratch);
        return;
    }
    REAL *z = scratch, *u = z + M, *y = u + M, *scaled = y + M, *kt = scaled + (M > DK ? M : DK);
    REAL *akt = kt + k_size;
    NAME(transpose)(mk_in, kt, M, DK);
    if (job->keep_anchors) NAME(transpose)(ak_out, akt, M, DK);
    const REAL eps = (REAL)job->eps;
    const REAL *cv = mv_in; /* the value memory before this token: the input state's at first */
    for (int64_t t = 0; t < length; t++) {
        const REAL *q = at[T_Q] + t * job->strides[T_Q][1], *k = at[T_K] + t * job->strides[T_K][1];
        const REAL *v = at[T_V] + t * job->strides[T_V][1], *alpha = at[T_ALPHA] + t * job->strides[T_ALPHA][1];
        const REAL beta = EXP(at[T_LOG_BETA][t * job->strides[T_LOG_BETA][1]]);
        const REAL gamma = at[T_GAMMA][t * job->strides[T_GAMMA][1]];
        REAL *o = out + t * job->strides[T_OUT][1];
        if (job->keep_anchors && (job->offsets[n] + t) % job->chunk == 0) { /* a chunk starts */
            memcpy(akt, kt, sizeof(REAL) * k_size);
            memcpy(av, cv, sizeof(REAL) * v_size);
        }
        /* Key pass: z = A k, u = vjp_phi, then M_K <- beta M_K - gamma u k^T and y = M_K q. */
        NAME(sum_rows)(job->read_anchors ? akt : kt, k, z, DK, M);
        NAME(residual)(job->compress, z, alpha, u, M, eps);
        for (int64_t d = 0; d < DK; d++) scaled[d] = gamma * k[d];
        NAME(write_read)(kt, kt, beta, scaled, u, q, y, DK, M);
        NAME(mix)(job->mix, y, M, eps); /* h = f(y) */
        /* Value pass: z = A v, u = vjp_phi, then M_V <- beta M_V - gamma u v^T and o = M_V^T h. */
        const REAL *read = job->read_anchors ? av : cv;
        for (int64_t m = 0; m < M; m++) {
            const REAL *row = read + m * DV;
            REAL dot = 0;
            for (int64_t d = 0; d < DV; d++) dot += row[d] * v[d];
            z[m] = dot;
        }
        NAME(residual)(job->compress, z, alpha, u, M, eps);
        for (int64_t m = 0; m < M; m++) scaled[m] = gamma * u[m];
        NAME(write_read)(cv, mv, beta, scaled, v, y, o, M, DV);
        cv = mv;
    }
    NAME(transpose)(kt, mk_out, DK, M);
    if (job->keep_anchors) NAME(transpose)(akt, ak_out, DK, M);
}
#endif
"""
