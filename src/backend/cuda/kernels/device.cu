// Device functions both NVRTC programs use (the main one and the half-precision one of
// half.cu): random numbers, float element functions, the fold of the reductions and the
// block-reduction adaptors. No kernels.

// ---- random numbers (the same functions as src/backend/cpu/random.rs, operation for operation,
// so every device draws the same numbers) ----

__device__ __forceinline__ u64 mix(u64 z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ u64 random_bits(u64 seed, u64 counter) {
    return mix(mix(seed ^ 0x9E3779B97F4A7C15ull) + counter * 0x9E3779B97F4A7C15ull);
}

__device__ __forceinline__ f64 uniform(u64 seed, u64 counter) {
    return (f64)(random_bits(seed, counter) >> 11) * (1.0 / 9007199254740992.0);
}

// ln(x) for a positive normal x: x = 2^e·m with m in [√½, √2), ln m = 2·atanh(s) with
// s = (m − 1)/(m + 1), summed as a series in s².
__device__ f64 portable_ln(f64 x) {
    u64 bits = (u64)__double_as_longlong(x);
    i64 e = (i64)((bits >> 52) & 0x7ff) - 1023;
    f64 m = __longlong_as_double((i64)((bits & 0x000fffffffffffffull) | 0x3ff0000000000000ull));
    if (m > 1.4142135623730951) {
        m = m * 0.5;
        e = e + 1;
    }
    f64 s = (m - 1.0) / (m + 1.0);
    f64 s2 = s * s;
    f64 p = 1.0 / 23.0;
    p = p * s2 + 1.0 / 21.0;
    p = p * s2 + 1.0 / 19.0;
    p = p * s2 + 1.0 / 17.0;
    p = p * s2 + 1.0 / 15.0;
    p = p * s2 + 1.0 / 13.0;
    p = p * s2 + 1.0 / 11.0;
    p = p * s2 + 1.0 / 9.0;
    p = p * s2 + 1.0 / 7.0;
    p = p * s2 + 1.0 / 5.0;
    p = p * s2 + 1.0 / 3.0;
    p = p * s2 + 1.0;
    return (f64)e * 0.6931471805599453 + 2.0 * s * p;
}

// cos(2π·u) for u in [0, 1): u = (q + r)/4 with q a whole quadrant and r in [−½, ½], then a
// Taylor series of sin or cos of r·π/2 (|r·π/2| ≤ π/4).
__device__ f64 portable_cos_turn(f64 u) {
    f64 t = 4.0 * u;
    f64 q = floor(t + 0.5);
    f64 r = t - q;
    f64 a = r * 1.5707963267948966;
    f64 a2 = a * a;
    f64 c = 1.0 / 20922789888000.0;             // 1/16!
    c = c * -a2 + 1.0 / 87178291200.0;          // 1/14!
    c = c * -a2 + 1.0 / 479001600.0;            // 1/12!
    c = c * -a2 + 1.0 / 3628800.0;              // 1/10!
    c = c * -a2 + 1.0 / 40320.0;                // 1/8!
    c = c * -a2 + 1.0 / 720.0;                  // 1/6!
    c = c * -a2 + 1.0 / 24.0;                   // 1/4!
    c = c * -a2 + 1.0 / 2.0;                    // 1/2!
    c = c * -a2 + 1.0;
    f64 s = 1.0 / 355687428096000.0;            // 1/17!
    s = s * -a2 + 1.0 / 1307674368000.0;        // 1/15!
    s = s * -a2 + 1.0 / 6227020800.0;           // 1/13!
    s = s * -a2 + 1.0 / 39916800.0;             // 1/11!
    s = s * -a2 + 1.0 / 362880.0;               // 1/9!
    s = s * -a2 + 1.0 / 5040.0;                 // 1/7!
    s = s * -a2 + 1.0 / 120.0;                  // 1/5!
    s = s * -a2 + 1.0 / 6.0;                    // 1/3!
    s = s * -a2 + 1.0;
    s = s * a;
    int quadrant = ((int)q) & 3;
    if (quadrant == 0) return c;
    if (quadrant == 1) return -s;
    if (quadrant == 2) return -c;
    return s;
}

__device__ __forceinline__ f64 normal(u64 seed, u64 counter) {
    f64 u1 = 1.0 - uniform(seed, counter * 2);
    f64 u2 = uniform(seed, counter * 2 + 1);
    return sqrt(-2.0 * portable_ln(u1)) * portable_cos_turn(u2);
}

__device__ __forceinline__ bool is_float_type(f32) { return true; }
__device__ __forceinline__ bool is_float_type(f64) { return true; }
__device__ __forceinline__ bool is_float_type(i32) { return false; }
__device__ __forceinline__ bool is_float_type(i64) { return false; }
__device__ __forceinline__ bool is_float_type(u8) { return false; }

__device__ __forceinline__ f32 sigmoid_elem(f32 x) {
    if (x >= 0.0f) return 1.0f / (1.0f + expf(-x));
    f32 e = expf(x);
    return e / (1.0f + e);
}
__device__ __forceinline__ f64 sigmoid_elem(f64 x) {
    if (x >= 0.0) return 1.0 / (1.0 + exp(-x));
    f64 e = exp(x);
    return e / (1.0 + e);
}
// The exact GELU, 0.5·x·(1 + erf(x/√2)) (PyTorch's default form), in the element's own
// precision: the operations of the CPU's `Float::gelu`.
__device__ __forceinline__ f32 gelu_elem(f32 x) {
    return 0.5f * x * (1.0f + erff(x * 0.70710678118654752440f));
}
__device__ __forceinline__ f64 gelu_elem(f64 x) {
    return 0.5 * x * (1.0 + erf(x * 0.70710678118654752440));
}

// ---- reductions over x seen as [outer, n, inner]: see reduce.cu for the launch shapes ----

template <typename In, typename Acc, typename Out, typename Conv, typename Comb, typename Fin>
__device__ void fold(const In* x, Out* out, u64 outer, u64 n, u64 inner, u64 chunks, u32 tpr,
                     Acc zero, Conv conv, Comb comb, Fin fin) {
    __shared__ Acc shared[256];
    u64 len = (n + chunks - 1) / chunks;
    if (inner == 1) {
        u32 per = blockDim.x / tpr, lane = threadIdx.x & (tpr - 1), slot = threadIdx.x / tpr;
        u64 segments = outer * chunks;
        for (u64 base = (u64)blockIdx.x * per; base < segments; base += (u64)gridDim.x * per) {
            u64 b = base + slot;
            Acc acc = zero;
            if (b < segments) {
                u64 row = b / chunks, c = b % chunks;
                u64 begin = c * len, end = begin + len < n ? begin + len : n;
                const In* p = x + row * n;
                for (u64 i = begin + lane; i < end; i += tpr) acc = comb(acc, conv(p[i]));
            }
            acc = group_reduce(acc, shared, tpr, comb);
            if (lane == 0 && b < segments) out[b] = fin(acc);
        }
    } else {
        u64 columns = outer * inner, groups = (columns + 31) / 32;
        for (u64 b = blockIdx.x; b < groups * chunks; b += gridDim.x) {
            u64 g = b / chunks, c = b % chunks;
            u64 col = g * 32 + threadIdx.x;
            u64 begin = c * len, end = begin + len < n ? begin + len : n;
            Acc acc = zero;
            if (col < columns) {
                u64 o = col / inner, j = col % inner;
                const In* p = x + o * n * inner + j;
                for (u64 i = begin + threadIdx.y; i < end; i += blockDim.y) acc = comb(acc, conv(p[i * inner]));
            }
            acc = column_reduce(acc, shared, comb);
            if (threadIdx.y == 0 && col < columns) {
                u64 o = col / inner, j = col % inner;
                out[(o * chunks + c) * inner + j] = fin(acc);
            }
        }
    }
}

struct AddF { __device__ f64 operator()(f64 a, f64 b) const { return a + b; } };
struct AddI { __device__ u64 operator()(u64 a, u64 b) const { return a + b; } };

__device__ __forceinline__ f32 lowest(f32) { return __int_as_float(0xff800000); }
__device__ __forceinline__ f64 lowest(f64) { return __longlong_as_double((i64)0xfff0000000000000ull); }
__device__ __forceinline__ i32 lowest(i32) { return (i32)0x80000000u; }
__device__ __forceinline__ i64 lowest(i64) { return (i64)0x8000000000000000ull; }
__device__ __forceinline__ u8 lowest(u8) { return 0; }

// argmax: (value, index) pairs; NaN beats everything, larger beats smaller, ties keep the
// smaller index, so the order of combination does not matter.
template <typename T> struct Best {
    T v;
    i64 i;
};
template <typename T> __device__ __forceinline__ Best<T> better(Best<T> a, Best<T> b) {
    if (b.i < 0) return a;
    if (a.i < 0) return b;
    bool an = is_nan(a.v), bn = is_nan(b.v);
    if (bn && !an) return b;
    if (an && !bn) return a;
    if (!an && b.v > a.v) return b;
    if (!an && a.v > b.v) return a;
    return b.i < a.i ? b : a;
}
template <typename T> struct Better {
    __device__ Best<T> operator()(Best<T> a, Best<T> b) const { return better(a, b); }
};
template <typename T> struct MaxOf {
    __device__ T operator()(T a, T b) const { return op_max(a, b); }
};
struct GroupReduce {
    u32 width;
    template <typename A, typename F> __device__ A operator()(A v, A* shared, F comb) const {
        return group_reduce(v, shared, width, comb);
    }
};
struct ColumnReduce {
    template <typename A, typename F> __device__ A operator()(A v, A* shared, F comb) const {
        return column_reduce(v, shared, comb);
    }
};

// ---- the fused optimizer steps (optim.cu, half.cu): flags and the multi-tensor list ----

#define SGD_WEIGHT_DECAY 1 // g = grad + wd·p
#define SGD_VELOCITY 2     // vel is a velocity to update
#define SGD_NESTEROV 4     // d = g + mu·v instead of v
#define SGD_ZERO_GRAD 8    // grad[i] = 0 once read

#define ADAM_COUPLED 1   // g = grad + wd·p
#define ADAM_DECOUPLED 2 // p = p·decay first
#define ADAM_ZERO_GRAD 4 // grad[i] = 0 once read

// A multi-tensor launch: the tensors of one step, passed by value (no copy to the device, so
// the launch may be captured into a graph). Block b works on elements
// [(b - first) · MT_CHUNK, +MT_CHUNK) of the tensor t with first = block_end[t - 1] (0 for
// t = 0) ≤ b < block_end[t]. `TensorList` of `cuda/ops/optim.rs`, field for field.
#define MT_TENSORS 64 // tensors per launch: the parameter block stays within 4 KiB
#define MT_DEPTH 4    // buffers per tensor: grad, p, state 0, state 1
#define MT_CHUNK 4096 // elements per block

struct TensorList {
    void* ptr[MT_DEPTH][MT_TENSORS];
    u64 n[MT_TENSORS];
    u32 block_end[MT_TENSORS];
    int count;
    // The step's skip flag (one f32; null: none): anything but 0 (NaN included) skips the
    // step, which then only zeroes the gradients it zeroes.
    const float* skip;
};

// Whether the list's step is skipped by its flag (read on the device: no host round trip).
__device__ __forceinline__ bool mt_skipped(const TensorList& l) {
    return l.skip != 0 && *l.skip != 0.0f;
}

// The tensor block `b` works on: the first t with b < block_end[t] (binary search).
__device__ __forceinline__ int mt_tensor(const TensorList& l, u32 b) {
    int lo = 0;
    int hi = l.count - 1;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (b < l.block_end[mid]) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    return lo;
}

// Runs the body for each element i of this block's part of tensor t, with `l` the list.
#define MT_FOR(l, t, i)                                                                            \
    int t = mt_tensor(l, blockIdx.x);                                                              \
    u32 mt_first = t == 0 ? 0u : l.block_end[t - 1];                                               \
    u64 mt_start = (u64)(blockIdx.x - mt_first) * MT_CHUNK;                                        \
    u64 mt_end = mt_start + MT_CHUNK < l.n[t] ? mt_start + MT_CHUNK : l.n[t];                      \
    for (u64 i = mt_start + threadIdx.x; i < mt_end; i += blockDim.x)

