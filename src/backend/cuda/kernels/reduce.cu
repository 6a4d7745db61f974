// Kernels of the reductions: `fold` and the sums, maxima and argmax built on it.

// ---- reductions over x seen as [outer, n, inner] ----
//
// Launch shapes fill the device for short and long rows alike:
// inner == 1 (1-d blocks of 256): `tpr` threads (a power of two) per row segment, 256 / tpr
// segments per block; segment b is slice b % chunks of row b / chunks (chunks > 1 writes
// partial results [outer, chunks], reduced by a second launch), so short rows share a block
// and long rows few in number are split over many blocks.
// inner > 1 (32 × 8 blocks): each block takes 32 adjacent columns (coalesced reads) and slice
// b % chunks of the reduced axis, its 8 rows of threads splitting the slice; chunks > 1 writes
// partial results [outer, chunks, inner].

// sum_<in>_<out>: floats accumulate in f64, integers in wrapping 64 bits; `mean` divides by
// `count` at the end.
#define SUM(IN, OUT, ACC, ADD)                                                                    \
    extern "C" __global__ void sum_##IN##_##OUT(const IN* x, OUT* out, u64 outer, u64 n,          \
                                               u64 inner, u64 chunks, int mean, f64 count,        \
                                               u32 tpr) {                                          \
        fold<IN, ACC, OUT>(x, out, outer, n, inner, chunks, tpr, (ACC)0,                          \
            [](IN v) { return (ACC)v; }, ADD(),                                       \
            [=](ACC a) { return sum_finish<OUT>(a, mean, count); });                  \
    }
template <typename Out> __device__ __forceinline__ Out sum_finish(f64 a, int mean, f64 count) {
    return (Out)(mean ? a / count : a);
}
template <typename Out> __device__ __forceinline__ Out sum_finish(u64 a, int mean, f64 count) {
    return mean ? (Out)((f64)(i64)a / count) : (Out)(i64)a;
}
SUM(f32, f32, f64, AddF)
SUM(f32, f64, f64, AddF)
SUM(f64, f64, f64, AddF)
SUM(f64, f32, f64, AddF)
SUM(i32, i64, u64, AddI)
SUM(i32, f64, u64, AddI)
SUM(i64, i64, u64, AddI)
SUM(i64, f64, u64, AddI)
SUM(u8, i64, u64, AddI)
SUM(u8, f64, u64, AddI)

#define MAX(T)                                                                                     \
    extern "C" __global__ void max_##T(const T* x, T* out, u64 outer, u64 n, u64 inner,           \
                                       u64 chunks, u32 tpr) {                                      \
        /* the identity: the first element of each row would do, the lowest value is simpler */   \
        fold<T, T, T>(x, out, outer, n, inner, chunks, tpr, lowest((T)0),                          \
            [](T v) { return v; },                                                     \
            [](T a, T b) { return op_max(a, b); },                                     \
            [](T a) { return a; });                                                    \
    }
FOR_ALL(MAX)

// argmax along the middle axis of [outer, n, inner], with the launch shapes of `fold`: `tpr`
// threads per row segment for inner == 1, 32 columns per block otherwise. With chunks > 1
// (inner == 1, few long rows) segment b = (row, slice) writes its best value and index to
// part_v[b], part_i[b], and `argmax_parts` reduces those.
#define ARGMAX(T)                                                                                  \
    extern "C" __global__ void argmax_##T(const T* x, i64* out, u64 outer, u64 n, u64 inner,      \
                                          u32 tpr, u64 chunks, T* part_v, i64* part_i) {          \
        __shared__ Best<T> shared[256];                                                            \
        if (inner == 1) {                                                                          \
            u32 per = blockDim.x / tpr, lane = threadIdx.x & (tpr - 1), slot = threadIdx.x / tpr;  \
            u64 segments = outer * chunks, len = (n + chunks - 1) / chunks;                        \
            for (u64 base = (u64)blockIdx.x * per; base < segments; base += (u64)gridDim.x * per) { \
                u64 b = base + slot;                                                               \
                Best<T> best = {(T)0, -1};                                                         \
                if (b < segments) {                                                                \
                    u64 row = b / chunks, c = b % chunks;                                          \
                    u64 begin = c * len, end = begin + len < n ? begin + len : n;                  \
                    for (u64 i = begin + lane; i < end; i += tpr)                                  \
                        best = better(best, Best<T>{x[row * n + i], (i64)i});                      \
                }                                                                                  \
                best = group_reduce(best, shared, tpr, Better<T>());                               \
                if (lane == 0 && b < segments) {                                                   \
                    if (chunks == 1) {                                                             \
                        out[b] = best.i;                                                           \
                    } else {                                                                       \
                        part_v[b] = best.v;                                                        \
                        part_i[b] = best.i;                                                        \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
        } else {                                                                                   \
            u64 columns = outer * inner;                                                           \
            for (u64 g = blockIdx.x; g * 32 < columns; g += gridDim.x) {                           \
                u64 col = g * 32 + threadIdx.x;                                                    \
                Best<T> best = {(T)0, -1};                                                         \
                if (col < columns) {                                                               \
                    const T* p = x + (col / inner) * n * inner + col % inner;                      \
                    for (u64 i = threadIdx.y; i < n; i += blockDim.y)                              \
                        best = better(best, Best<T>{p[i * inner], (i64)i});                        \
                }                                                                                  \
                best = column_reduce(best, shared, Better<T>());                                   \
                if (threadIdx.y == 0 && col < columns) out[col] = best.i;                          \
            }                                                                                      \
        }                                                                                          \
    }
FOR_ALL(ARGMAX)

// The second pass of a split argmax: out[row] = the index of the best of the `chunks` partial
// results of the row (an empty slice's index is -1 and loses).
#define ARGMAX_PARTS(T)                                                                            \
    extern "C" __global__ void argmax_parts_##T(const T* part_v, const i64* part_i, i64* out,     \
                                                u64 outer, u64 chunks, u32 tpr) {                  \
        __shared__ Best<T> shared[256];                                                            \
        u32 per = blockDim.x / tpr, lane = threadIdx.x & (tpr - 1), slot = threadIdx.x / tpr;      \
        for (u64 base = (u64)blockIdx.x * per; base < outer; base += (u64)gridDim.x * per) {      \
            u64 row = base + slot;                                                                 \
            Best<T> best = {(T)0, -1};                                                             \
            if (row < outer)                                                                       \
                for (u64 c = lane; c < chunks; c += tpr)                                           \
                    best = better(best, Best<T>{part_v[row * chunks + c], part_i[row * chunks + c]}); \
            best = group_reduce(best, shared, tpr, Better<T>());                                   \
            if (lane == 0 && row < outer) out[row] = best.i;                                       \
        }                                                                                          \
    }
FOR_ALL(ARGMAX_PARTS)
