// Kernels of the neural-network ops: softmax (whole rows and split rows), `one_hot`, `pick`, the
// fused softmax cross-entropy.

// ---- neural-network ops ----

// Softmax (log-softmax with `log`) along the middle axis of [outer, n, inner], with the launch
// shapes of `fold` (no chunks): `tpr` threads per row for inner == 1, 32 columns per block
// otherwise. As the CPU: subtract the maximum (NaN wins), sum exp in f64.
template <typename T, typename Reduce>
__device__ __forceinline__ void softmax_line(const T* p, T* q, u64 n, u64 stride, u64 first,
                                             u64 step, bool live, int log_, T* smax, f64* ssum,
                                             Reduce reduce) {
    T m = lowest((T)0);
    if (live)
        for (u64 i = first; i < n; i += step) m = op_max(m, p[i * stride]);
    m = reduce(m, smax, MaxOf<T>());
    f64 s = 0.0;
    if (live)
        for (u64 i = first; i < n; i += step) {
            T e = e_exp(p[i * stride] - m);
            if (!log_) q[i * stride] = e;
            s += (f64)e;
        }
    s = reduce(s, ssum, AddF());
    if (!live) return;
    if (log_) {
        T shift = m + (T)log(s);
        for (u64 i = first; i < n; i += step) q[i * stride] = p[i * stride] - shift;
    } else {
        T scale = (T)(1.0 / s);
        for (u64 i = first; i < n; i += step) q[i * stride] = q[i * stride] * scale;
    }
}
#define SOFTMAX(T)                                                                                 \
    extern "C" __global__ void softmax_##T(const T* x, T* out, u64 outer, u64 n, u64 inner,       \
                                           int log_, u32 tpr) {                                    \
        __shared__ T smax[256];                                                                    \
        __shared__ f64 ssum[256];                                                                  \
        if (inner == 1) {                                                                          \
            u32 per = blockDim.x / tpr, lane = threadIdx.x & (tpr - 1), slot = threadIdx.x / tpr;  \
            for (u64 base = (u64)blockIdx.x * per; base < outer; base += (u64)gridDim.x * per) {  \
                u64 row = base + slot;                                                             \
                bool live = row < outer;                                                           \
                u64 at = live ? row * n : 0;                                                       \
                softmax_line(x + at, out + at, n, 1, lane, tpr, live, log_, smax, ssum,            \
                             GroupReduce{tpr});                                                    \
            }                                                                                      \
        } else {                                                                                   \
            u64 columns = outer * inner;                                                           \
            for (u64 g = blockIdx.x; g * 32 < columns; g += gridDim.x) {                           \
                u64 col = g * 32 + threadIdx.x;                                                    \
                bool live = col < columns;                                                         \
                u64 at = live ? (col / inner) * n * inner + col % inner : 0;                       \
                softmax_line(x + at, out + at, n, inner, threadIdx.y, blockDim.y, live, log_,      \
                             smax, ssum, ColumnReduce());                                          \
            }                                                                                      \
        }                                                                                          \
    }
FOR_FLOAT(SOFTMAX)

// Softmax of few long rows (inner == 1), split into `chunks` slices per row over the device, in
// three launches of one kernel: phase 0 writes each slice's maximum to part_m; phase 1 takes
// the row's maximum m from those and writes each slice's sum of exp(x - m) (f64) to part_s
// (and exp(x - m) to out unless `log_`); phase 2 takes m and the row's sum s (the slices' sums
// added in order) and writes the result as `softmax_line` does. One segment (row, slice) per
// block at a time, 1-d blocks.
template <typename T>
__device__ __forceinline__ T row_max(const T* part_m, u64 row, u64 chunks) {
    T m = lowest((T)0);
    for (u64 c = 0; c < chunks; ++c) m = op_max(m, part_m[row * chunks + c]);
    return m;
}
#define SOFTMAX_SPLIT(T)                                                                           \
    extern "C" __global__ void softmax_split_##T(const T* x, T* out, u64 outer, u64 n, u64 chunks, \
                                                 int log_, int phase, T* part_m, f64* part_s) {   \
        __shared__ T smax[256];                                                                    \
        __shared__ f64 ssum[256];                                                                  \
        u64 len = (n + chunks - 1) / chunks;                                                       \
        for (u64 b = blockIdx.x; b < outer * chunks; b += gridDim.x) {                             \
            u64 row = b / chunks, c = b % chunks;                                                  \
            u64 begin = c * len, end = begin + len < n ? begin + len : n;                          \
            const T* p = x + row * n;                                                              \
            T* q = out + row * n;                                                                  \
            if (phase == 0) {                                                                      \
                T m = lowest((T)0);                                                                \
                for (u64 i = begin + threadIdx.x; i < end; i += blockDim.x) m = op_max(m, p[i]);  \
                m = block_reduce(m, smax, MaxOf<T>());                                             \
                if (threadIdx.x == 0) part_m[b] = m;                                               \
            } else if (phase == 1) {                                                               \
                T m = row_max(part_m, row, chunks);                                                \
                f64 s = 0.0;                                                                       \
                for (u64 i = begin + threadIdx.x; i < end; i += blockDim.x) {                      \
                    T e = e_exp(p[i] - m);                                                         \
                    if (!log_) q[i] = e;                                                           \
                    s += (f64)e;                                                                   \
                }                                                                                  \
                s = block_reduce(s, ssum, AddF());                                                 \
                if (threadIdx.x == 0) part_s[b] = s;                                               \
            } else {                                                                               \
                T m = row_max(part_m, row, chunks);                                                \
                f64 s = 0.0;                                                                       \
                for (u64 k = 0; k < chunks; ++k) s += part_s[row * chunks + k];                    \
                if (log_) {                                                                        \
                    T shift = m + (T)log(s);                                                       \
                    for (u64 i = begin + threadIdx.x; i < end; i += blockDim.x) q[i] = p[i] - shift; \
                } else {                                                                           \
                    T scale = (T)(1.0 / s);                                                        \
                    for (u64 i = begin + threadIdx.x; i < end; i += blockDim.x) q[i] = q[i] * scale; \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }
FOR_FLOAT(SOFTMAX_SPLIT)

// out[p, c] = (idx[p] == c) for out of [count, depth]; an index outside the range gives a row of
// zeros and is reported (`report_bad`, position p).
#define ONE_HOT(I, T)                                                                              \
    extern "C" __global__ void one_hot_##I##_##T(const I* idx, T* out, u64 count, u64 depth,      \
                                                 u64* flag, u64 key) {                             \
        GRID_STRIDE(q, count * depth) {                                                            \
            i64 v = (i64)idx[q / depth];                                                           \
            if (q % depth == 0 && (v < 0 || (u64)v >= depth)) report_bad(flag, key, q / depth);    \
            out[q] = (v == (i64)(q % depth)) ? (T)1 : (T)0;                                        \
        }                                                                                          \
    }
#define ONE_HOT_TO(I) ONE_HOT(I, f32) ONE_HOT(I, f64) ONE_HOT(I, i32) ONE_HOT(I, i64) ONE_HOT(I, u8)
ONE_HOT_TO(i32)
ONE_HOT_TO(i64)
ONE_HOT_TO(u8)

// out[o, j] = x[o, idx[o, j], j] for x of [outer, n, inner]; an index outside gives 0 and is
// reported (`report_bad`, position p).
#define PICK(T, I)                                                                                 \
    extern "C" __global__ void pick_##T##_##I(const T* x, const I* idx, T* out, u64 count, u64 n, \
                                              u64 inner, u64* flag, u64 key) {                    \
        GRID_STRIDE(p, count) {                                                                    \
            i64 v = (i64)idx[p];                                                                   \
            u64 o = p / inner, j = p % inner;                                                      \
            bool ok = v >= 0 && (u64)v < n;                                                        \
            if (!ok) report_bad(flag, key, p);                                                     \
            out[p] = ok ? x[(o * n + (u64)v) * inner + j] : (T)0;                                  \
        }                                                                                          \
    }
#define PICK_OF(T) PICK(T, i32) PICK(T, i64) PICK(T, u8)
FOR_ALL(PICK_OF)

// Softmax cross-entropy of x [rows, classes] against labels [rows], in one launch of one block
// (so the mean needs no second pass and no atomics): groups of `tpr` threads (a power of two
// dividing blockDim.x) take the rows in turn, each group one row at a time, as the CPU does it:
// the maximum m, e = exp(x - m) in T summed in f64 (s), the row's log-probability
// (x[label] - m) - log(s) in f64. Lane 0 of a group adds it to its own f64 total; the block then
// adds the totals in a fixed tree, so the result is the same whatever order the threads run in.
// With `grad` (may be null) it writes (e / s - [i == label]) / rows, in f64. A label outside
// 0..classes adds nothing, gives a row of the plain softmax / rows and is reported
// (`report_bad`, its row).
#define SOFTMAX_CE(T, I)                                                                           \
    extern "C" __global__ void softmax_ce_##T##_##I(const T* x, const I* labels, T* loss,         \
                                                    T* grad, u64 rows, u64 classes, u32 tpr,      \
                                                    u64* flag, u64 key) {                          \
        __shared__ T smax[256];                                                                    \
        __shared__ f64 ssum[256];                                                                  \
        u32 per = blockDim.x / tpr, lane = threadIdx.x & (tpr - 1), slot = threadIdx.x / tpr;      \
        f64 inv = 1.0 / (f64)rows;                                                                 \
        f64 total = 0.0;                                                                           \
        for (u64 base = 0; base < rows; base += per) {                                             \
            u64 row = base + slot;                                                                 \
            bool live = row < rows;                                                                \
            const T* p = x + (live ? row * classes : 0);                                           \
            T m = lowest((T)0);                                                                    \
            if (live)                                                                              \
                for (u64 i = lane; i < classes; i += tpr) m = op_max(m, p[i]);                     \
            m = group_reduce(m, smax, tpr, MaxOf<T>());                                            \
            f64 s = 0.0;                                                                           \
            if (live)                                                                              \
                for (u64 i = lane; i < classes; i += tpr) s += (f64)e_exp(p[i] - m);               \
            s = group_reduce(s, ssum, tpr, AddF());                                                \
            if (!live) continue;                                                                   \
            i64 v = (i64)labels[row];                                                              \
            bool ok = v >= 0 && (u64)v < classes;                                                  \
            if (lane == 0) {                                                                       \
                if (ok) total += (f64)(p[v] - m) - log(s);                                         \
                else report_bad(flag, key, row);                                                   \
            }                                                                                      \
            if (grad) {                                                                            \
                T* q = grad + row * classes;                                                       \
                for (u64 i = lane; i < classes; i += tpr) {                                        \
                    f64 hot = (ok && (u64)v == i) ? 1.0 : 0.0;                                     \
                    q[i] = (T)(((f64)e_exp(p[i] - m) / s - hot) * inv);                            \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        total = block_reduce(total, ssum, AddF());                                                 \
        if (threadIdx.x == 0) loss[0] = (T)(-(total / (f64)rows));                                 \
    }
#define SOFTMAX_CE_OF(T) SOFTMAX_CE(T, i32) SOFTMAX_CE(T, i64) SOFTMAX_CE(T, u8)
FOR_FLOAT(SOFTMAX_CE_OF)

// A dense layer's bias and activation on its product `out` ([rows, cols], in place), for a
// device without cuBLASLt epilogues and for k = 0: as `add` then `relu` (NaN stays NaN).
#define BIAS_ACT(T)                                                                                \
    extern "C" __global__ void bias_act_##T(T* out, const T* bias, u64 rows, u64 cols, int relu) { \
        u64 n = rows * cols;                                                                       \
        for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;                            \
             i += (u64)gridDim.x * blockDim.x) {                                                   \
            T v = out[i];                                                                          \
            if (bias) v = v + bias[i % cols];                                                      \
            if (relu) v = op_max(v, (T)0);                                                         \
            out[i] = v;                                                                            \
        }                                                                                          \
    }
BIAS_ACT(f32)
BIAS_ACT(f64)

// The backward of a dense layer's bias and activation over g [rows, cols]: one thread per
// column, down the rows in order (the CPU's order, so both give the same bits): with `relu`,
// dz = g where y > 0 and 0 elsewhere (written to dz); the bias gradient, the column's sum of dz
// (or g), written to db or added to it with `acc`. Adjacent threads read adjacent columns.
#define BIAS_ACT_GRAD(T)                                                                           \
    extern "C" __global__ void bias_act_grad_##T(const T* g, const T* y, T* dz, T* db, u64 rows,  \
                                                 u64 cols, int relu, int acc) {                    \
        for (u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x; j < cols;                         \
             j += (u64)gridDim.x * blockDim.x) {                                                   \
            T s = acc ? db[j] : (T)0;                                                              \
            for (u64 r = 0; r < rows; ++r) {                                                       \
                u64 at = r * cols + j;                                                             \
                T v = g[at];                                                                       \
                if (relu) {                                                                        \
                    v = y[at] > (T)0 ? v : (T)0;                                                   \
                    dz[at] = v;                                                                    \
                }                                                                                  \
                s = s + v;                                                                         \
            }                                                                                      \
            db[j] = s;                                                                             \
        }                                                                                          \
    }
BIAS_ACT_GRAD(f32)
BIAS_ACT_GRAD(f64)
