// ndscope's CUDA kernels. NVRTC compiles this file at run time for the device's own
// architecture, with --fmad=false: additions and multiplications are never fused, so elementwise
// float arithmetic rounds exactly as on the CPU. Every kernel is `extern "C"` and named
// `<op>_<dtype>` (`<op>_<dtype>_<dtype>` for two element types), with the dtype names of
// ndscope's `DType` (f32, f64, i32, i64, u8). Loops are grid-stride loops, so any grid size
// covers any length.
//
// Semantics follow the CPU backend: integer arithmetic wraps (done in unsigned types, where C++
// defines it), integer division by zero gives 0 (and is reported: `report_bad`), MIN / -1 wraps
// to MIN, maximum/minimum let NaN win, float-to-integer conversions truncate toward zero and
// saturate (NaN gives 0) like Rust's `as`, integer-to-integer conversions wrap.

typedef unsigned char u8;
typedef int i32;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;
typedef float f32;
typedef double f64;

#define MAXR 8

// An n-d iteration over an output of `rank` dims (row-major), with the strides (in elements)
// of up to two operands; 0 where an operand is broadcast.
struct Strided {
    int rank;
    u64 dims[MAXR];
    u64 sa[MAXR];
    u64 sb[MAXR];
};

// Operand addressing modes of the elementwise kernels.
#define MODE_SAME 0      // both operands have the output's shape
#define MODE_B_ONE 1     // b is one element
#define MODE_A_ONE 2     // a is one element
#define MODE_STRIDED32 3 // strides; every index fits 32 bits
#define MODE_STRIDED64 4 // strides; 64-bit indices
#define MODE_SELF 5      // in place with the target itself as the operand

#define GRID_STRIDE(i, n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (u64)blockDim.x * gridDim.x)

__device__ __forceinline__ void offsets64(const Strided& s, u64 i, u64& oa, u64& ob) {
    oa = 0;
    ob = 0;
    for (int d = s.rank - 1; d >= 0; --d) {
        u64 q = i / s.dims[d];
        u64 r = i - q * s.dims[d];
        oa += r * s.sa[d];
        ob += r * s.sb[d];
        i = q;
    }
}

__device__ __forceinline__ void offsets32(const Strided& s, u64 i64v, u64& oa, u64& ob) {
    u32 i = (u32)i64v;
    u32 a = 0, b = 0;
    for (int d = s.rank - 1; d >= 0; --d) {
        u32 dim = (u32)s.dims[d];
        u32 q = i / dim;
        u32 r = i - q * dim;
        a += r * (u32)s.sa[d];
        b += r * (u32)s.sb[d];
        i = q;
    }
    oa = a;
    ob = b;
}

__device__ __forceinline__ void operand_offsets(int mode, const Strided& s, u64 i, u64& oa, u64& ob) {
    switch (mode) {
    case MODE_SAME: oa = i; ob = i; break;
    case MODE_B_ONE: oa = i; ob = 0; break;
    case MODE_A_ONE: oa = 0; ob = i; break;
    case MODE_STRIDED32: offsets32(s, i, oa, ob); break;
    default: offsets64(s, i, oa, ob); break;
    }
}

// ---- checks reported at the host's next wait ----
//
// A kernel that finds bad input (an index outside its range, an integer divisor of 0) never
// reads or divides with it, and records where: atomicMin(flag, key + position). The host gives
// each checked launch a key above every earlier one's positions, so the smallest value names
// the first launch, and its first position, that failed.
__device__ __forceinline__ void report_bad(u64* flag, u64 key, u64 position) {
    const u64 span = 1ull << 40;
    atomicMin(flag, key + (position < span - 1 ? position : span - 1));
}

// ---- element arithmetic ----

__device__ __forceinline__ bool is_nan(f32 x) { return x != x; }
__device__ __forceinline__ bool is_nan(f64 x) { return x != x; }
template <typename T> __device__ __forceinline__ bool is_nan(T) { return false; }

#define SIGNED_ARITH(T, U)                                                                       \
    __device__ __forceinline__ T op_add(T a, T b) { return (T)((U)a + (U)b); }                  \
    __device__ __forceinline__ T op_sub(T a, T b) { return (T)((U)a - (U)b); }                  \
    __device__ __forceinline__ T op_mul(T a, T b) { return (T)((U)a * (U)b); }                  \
    __device__ __forceinline__ T op_neg(T a) { return (T)((U)0 - (U)a); }                       \
    __device__ __forceinline__ T op_div(T a, T b) {                                             \
        return b == 0 ? (T)0 : (b == (T)-1 ? op_neg(a) : (T)(a / b));                          \
    }                                                                                           \
    __device__ __forceinline__ T op_abs(T a) { return a < 0 ? op_neg(a) : a; }                  \
    __device__ __forceinline__ T op_max(T a, T b) { return a > b ? a : b; }                     \
    __device__ __forceinline__ T op_min(T a, T b) { return a < b ? a : b; }
SIGNED_ARITH(i32, u32)
SIGNED_ARITH(i64, u64)

__device__ __forceinline__ u8 op_add(u8 a, u8 b) { return (u8)(a + b); }
__device__ __forceinline__ u8 op_sub(u8 a, u8 b) { return (u8)(a - b); }
__device__ __forceinline__ u8 op_mul(u8 a, u8 b) { return (u8)((u32)a * (u32)b); }
__device__ __forceinline__ u8 op_neg(u8 a) { return (u8)(0u - (u32)a); }
__device__ __forceinline__ u8 op_div(u8 a, u8 b) { return b == 0 ? (u8)0 : (u8)(a / b); }
__device__ __forceinline__ u8 op_abs(u8 a) { return a; }
__device__ __forceinline__ u8 op_max(u8 a, u8 b) { return a > b ? a : b; }
__device__ __forceinline__ u8 op_min(u8 a, u8 b) { return a < b ? a : b; }

// The float functions by element type (the `f` functions for f32).
__device__ __forceinline__ f32 e_abs(f32 x) { return fabsf(x); }
__device__ __forceinline__ f64 e_abs(f64 x) { return fabs(x); }
__device__ __forceinline__ f32 e_exp(f32 x) { return expf(x); }
__device__ __forceinline__ f64 e_exp(f64 x) { return exp(x); }
__device__ __forceinline__ f32 e_log(f32 x) { return logf(x); }
__device__ __forceinline__ f64 e_log(f64 x) { return log(x); }
__device__ __forceinline__ f32 e_sqrt(f32 x) { return sqrtf(x); }
__device__ __forceinline__ f64 e_sqrt(f64 x) { return sqrt(x); }
__device__ __forceinline__ f32 e_tanh(f32 x) { return tanhf(x); }
__device__ __forceinline__ f64 e_tanh(f64 x) { return tanh(x); }

#define FLOAT_ARITH(T)                                                                           \
    __device__ __forceinline__ T op_add(T a, T b) { return a + b; }                              \
    __device__ __forceinline__ T op_sub(T a, T b) { return a - b; }                              \
    __device__ __forceinline__ T op_mul(T a, T b) { return a * b; }                              \
    __device__ __forceinline__ T op_neg(T a) { return -a; }                                      \
    __device__ __forceinline__ T op_div(T a, T b) { return a / b; }                              \
    __device__ __forceinline__ T op_abs(T a) { return e_abs(a); }                                \
    __device__ __forceinline__ T op_max(T a, T b) { return (a > b || is_nan(a)) ? a : b; }       \
    __device__ __forceinline__ T op_min(T a, T b) { return (a < b || is_nan(a)) ? a : b; }
FLOAT_ARITH(f32)
FLOAT_ARITH(f64)

// Rust's `as` from f64: truncate toward zero, saturate, NaN gives 0.
template <typename T> __device__ __forceinline__ T from_f64(f64 v);
template <> __device__ __forceinline__ f32 from_f64<f32>(f64 v) { return (f32)v; }
template <> __device__ __forceinline__ f64 from_f64<f64>(f64 v) { return v; }
template <> __device__ __forceinline__ i32 from_f64<i32>(f64 v) {
    if (v != v) return 0;
    if (v <= -2147483648.0) return (i32)0x80000000u;
    if (v >= 2147483647.0) return 2147483647;
    return (i32)v;
}
template <> __device__ __forceinline__ i64 from_f64<i64>(f64 v) {
    if (v != v) return 0;
    if (v <= -9223372036854775808.0) return (i64)0x8000000000000000ull;
    if (v >= 9223372036854775808.0) return (i64)0x7fffffffffffffffull;
    return (i64)v;
}
template <> __device__ __forceinline__ u8 from_f64<u8>(f64 v) {
    if (v != v || v <= 0.0) return 0;
    if (v >= 255.0) return 255;
    return (u8)(u32)v;
}

// Element conversion of `to_dtype`: floats to integers as `from_f64`, everything else as C++
// converts (integers wrap, integers to floats round to nearest).
template <typename D, typename S> __device__ __forceinline__ D convert(S x) { return (D)x; }
#define FLOAT_TO_INT(D, S) \
    template <> __device__ __forceinline__ D convert<D, S>(S x) { return from_f64<D>((f64)x); }
FLOAT_TO_INT(i32, f32)
FLOAT_TO_INT(i64, f32)
FLOAT_TO_INT(u8, f32)
FLOAT_TO_INT(i32, f64)
FLOAT_TO_INT(i64, f64)
FLOAT_TO_INT(u8, f64)

template <typename T> __device__ __forceinline__ f64 to_f64(T x) { return (f64)x; }

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

// ---- block reductions ----

// Reduces `v` over the threads of a 1-d block of at most 256 threads with `comb`; thread 0 gets
// the result.
template <typename A, typename F>
__device__ __forceinline__ A block_reduce(A v, A* shared, F comb) {
    shared[threadIdx.x] = v;
    __syncthreads();
    for (unsigned width = blockDim.x / 2; width > 0; width /= 2) {
        if (threadIdx.x < width) shared[threadIdx.x] = comb(shared[threadIdx.x], shared[threadIdx.x + width]);
        __syncthreads();
    }
    A r = shared[0];
    __syncthreads();
    return r;
}

// Reduces v over groups of `width` adjacent threads (`width` a power of two dividing
// blockDim.x): every thread of the block calls it (barriers) and gets its group's result.
template <typename A, typename F>
__device__ __forceinline__ A group_reduce(A v, A* shared, u32 width, F comb) {
    u32 t = threadIdx.x;
    shared[t] = v;
    __syncthreads();
    for (u32 s = width / 2; s > 0; s /= 2) {
        if ((t & (width - 1)) < s) shared[t] = comb(shared[t], shared[t + s]);
        __syncthreads();
    }
    A r = shared[t & ~(width - 1)];
    __syncthreads();
    return r;
}

// Reduces v over the rows (threadIdx.y) of a 32-wide block: every thread calls it and gets its
// column's result.
template <typename A, typename F>
__device__ __forceinline__ A column_reduce(A v, A* shared, F comb) {
    shared[threadIdx.y * 32 + threadIdx.x] = v;
    __syncthreads();
    if (threadIdx.y == 0) {
        A total = shared[threadIdx.x];
        for (u32 y = 1; y < blockDim.y; ++y) total = comb(total, shared[y * 32 + threadIdx.x]);
        shared[threadIdx.x] = total;
    }
    __syncthreads();
    A r = shared[threadIdx.x];
    __syncthreads();
    return r;
}

// ---- kernels per dtype ----

#define FOR_ALL(M) M(f32) M(f64) M(i32) M(i64) M(u8)
#define FOR_FLOAT(M) M(f32) M(f64)
#define FOR_INT(M) M(i32) M(i64) M(u8)

#define FILL(T)                                                                                   \
    extern "C" __global__ void fill_##T(T* out, u64 n, T v) { GRID_STRIDE(i, n) out[i] = v; }    \
    extern "C" __global__ void arange_##T(T* out, u64 n, f64 start, f64 step) {                  \
        GRID_STRIDE(i, n) out[i] = from_f64<T>(start + (f64)i * step);                           \
    }                                                                                             \
    extern "C" __global__ void eye_##T(T* out, u64 side) {                                       \
        GRID_STRIDE(i, side * side) out[i] = (i / side == i % side) ? (T)1 : (T)0;               \
    }                                                                                             \
    extern "C" __global__ void randn_##T(T* out, u64 n, u64 seed, u64 start) {                  \
        GRID_STRIDE(i, n) out[i] = from_f64<T>(normal(seed, start + i));                         \
    }                                                                                             \
    extern "C" __global__ void rand_##T(T* out, u64 n, u64 seed, u64 start, f64 low, f64 high) { \
        GRID_STRIDE(i, n) {                                                                       \
            f64 u = uniform(seed, start + i);                                                     \
            f64 v;                                                                                \
            if (is_float_type((T)0)) {                                                            \
                v = low + (high - low) * u;                                                       \
            } else {                                                                              \
                f64 first = ceil(low), count = ceil(high) - ceil(low);                            \
                v = first + fmin(floor(count * u), count - 1.0);                                  \
            }                                                                                     \
            out[i] = from_f64<T>(v);                                                              \
        }                                                                                         \
    }
__device__ __forceinline__ bool is_float_type(f32) { return true; }
__device__ __forceinline__ bool is_float_type(f64) { return true; }
__device__ __forceinline__ bool is_float_type(i32) { return false; }
__device__ __forceinline__ bool is_float_type(i64) { return false; }
__device__ __forceinline__ bool is_float_type(u8) { return false; }
FOR_ALL(FILL)

#define CAST(S, D)                                                                     \
    extern "C" __global__ void cast_##S##_##D(const S* a, D* out, u64 n) {             \
        GRID_STRIDE(i, n) out[i] = convert<D, S>(a[i]);                                \
    }
#define CAST_FROM(S) CAST(S, f32) CAST(S, f64) CAST(S, i32) CAST(S, i64) CAST(S, u8)
FOR_ALL(CAST_FROM)

#define BINARY_OP(NAME, FN, T)                                                                 \
    extern "C" __global__ void NAME##_##T(const T* a, const T* b, T* out, u64 n, int mode,   \
                                          Strided s) {                                        \
        GRID_STRIDE(i, n) {                                                                    \
            u64 oa, ob;                                                                        \
            operand_offsets(mode, s, i, oa, ob);                                               \
            out[i] = FN(a[oa], b[ob]);                                                         \
        }                                                                                      \
    }                                                                                          \
    extern "C" __global__ void NAME##_scalar_##T(const T* a, T* out, u64 n, T v) {            \
        GRID_STRIDE(i, n) out[i] = FN(a[i], v);                                                \
    }                                                                                          \
    extern "C" __global__ void NAME##_inplace_##T(T* x, const T* b, u64 n, int mode,          \
                                                  Strided s) {                                 \
        GRID_STRIDE(i, n) {                                                                    \
            u64 oa, ob;                                                                        \
            if (mode == MODE_SELF) { x[i] = FN(x[i], x[i]); continue; }                        \
            operand_offsets(mode, s, i, oa, ob);                                               \
            x[i] = FN(x[i], b[ob]);                                                            \
        }                                                                                      \
    }
#define BINARY_ALL(T)                      \
    BINARY_OP(add, op_add, T)              \
    BINARY_OP(sub, op_sub, T)              \
    BINARY_OP(mul, op_mul, T)              \
    BINARY_OP(div, op_div, T)              \
    BINARY_OP(maximum, op_max, T)          \
    BINARY_OP(minimum, op_min, T)
FOR_ALL(BINARY_ALL)

// Integer division with the divisor checked in the kernel: a divisor of 0 gives 0 (never a
// division by 0) and is reported (`report_bad`, the output position).
#define DIV_CHECKED(T)                                                                           \
    extern "C" __global__ void div_checked_##T(const T* a, const T* b, T* out, u64 n, int mode, \
                                               Strided s, u64* flag, u64 key) {                 \
        GRID_STRIDE(i, n) {                                                                    \
            u64 oa, ob;                                                                        \
            operand_offsets(mode, s, i, oa, ob);                                               \
            T d = b[ob];                                                                       \
            if (d == (T)0) report_bad(flag, key, i);                                           \
            out[i] = op_div(a[oa], d);                                                         \
        }                                                                                      \
    }                                                                                          \
    extern "C" __global__ void div_checked_inplace_##T(T* x, const T* b, u64 n, int mode,      \
                                                       Strided s, u64* flag, u64 key) {        \
        GRID_STRIDE(i, n) {                                                                    \
            u64 oa, ob;                                                                        \
            T d;                                                                               \
            if (mode == MODE_SELF) {                                                           \
                d = x[i];                                                                      \
            } else {                                                                           \
                operand_offsets(mode, s, i, oa, ob);                                           \
                d = b[ob];                                                                     \
            }                                                                                  \
            if (d == (T)0) report_bad(flag, key, i);                                           \
            x[i] = op_div(x[i], d);                                                            \
        }                                                                                      \
    }
FOR_INT(DIV_CHECKED)

#define COMPARE_OP(NAME, EXPR, T)                                                                \
    extern "C" __global__ void NAME##_##T(const T* a, const T* b, u8* out, u64 n, int mode,     \
                                          Strided s) {                                          \
        GRID_STRIDE(i, n) {                                                                      \
            u64 oa, ob;                                                                          \
            operand_offsets(mode, s, i, oa, ob);                                                 \
            T x = a[oa], y = b[ob];                                                              \
            out[i] = (EXPR) ? 1 : 0;                                                             \
        }                                                                                        \
    }                                                                                            \
    extern "C" __global__ void NAME##_scalar_##T(const T* a, u8* out, u64 n, f64 value) {       \
        /* floats compare in their own precision, integers against the exact value */            \
        GRID_STRIDE(i, n) {                                                                      \
            if (is_float_type((T)0)) {                                                           \
                T x = a[i], y = (T)value;                                                        \
                out[i] = (EXPR) ? 1 : 0;                                                         \
            } else {                                                                             \
                f64 x = (f64)a[i], y = value;                                                    \
                out[i] = (EXPR) ? 1 : 0;                                                         \
            }                                                                                    \
        }                                                                                        \
    }
#define COMPARE_ALL(T)                 \
    COMPARE_OP(gt, x > y, T)           \
    COMPARE_OP(lt, x < y, T)           \
    COMPARE_OP(eq, x == y, T)
FOR_ALL(COMPARE_ALL)

#define UNARY_OP(NAME, EXPR, T)                                              \
    extern "C" __global__ void NAME##_##T(const T* a, T* out, u64 n) {      \
        GRID_STRIDE(i, n) {                                                  \
            T x = a[i];                                                      \
            out[i] = (EXPR);                                                 \
        }                                                                    \
    }
#define UNARY_ALL(T)                                   \
    UNARY_OP(neg, op_neg(x), T)                        \
    UNARY_OP(abs, op_abs(x), T)                        \
    UNARY_OP(square, op_mul(x, x), T)                  \
    UNARY_OP(relu, op_max(x, (T)0), T)                 \
    extern "C" __global__ void pow_##T(const T* a, T* out, u64 n, f64 e) { \
        GRID_STRIDE(i, n) out[i] = pow_elem(a[i], e);                      \
    }                                                                       \
    extern "C" __global__ void scale_##T(T* x, u64 n, T v) {               \
        GRID_STRIDE(i, n) x[i] = op_mul(x[i], v);                           \
    }                                                                       \
    extern "C" __global__ void axpy_##T(T* x, const T* b, u64 n, T alpha, int mode, Strided s) { \
        GRID_STRIDE(i, n) {                                                 \
            u64 oa, ob;                                                     \
            if (mode == MODE_SELF) { x[i] = op_add(x[i], op_mul(alpha, x[i])); continue; } \
            operand_offsets(mode, s, i, oa, ob);                            \
            x[i] = op_add(x[i], op_mul(alpha, b[ob]));                      \
        }                                                                   \
    }
__device__ __forceinline__ f32 pow_elem(f32 x, f64 e) { return powf(x, (f32)e); }
__device__ __forceinline__ f64 pow_elem(f64 x, f64 e) { return pow(x, e); }
// x^e for integers: a whole exponent in 0..=64 by repeated squaring (the CPU's `powi_exact`,
// multiplication for multiplication, so both devices give the same bits), else pow.
__device__ __forceinline__ f64 pow_whole(f64 x, f64 e) {
    if (!(e >= 0.0 && e <= 64.0) || e != floor(e)) return pow(x, e);
    f64 base = x, acc = 1.0;
    for (u32 k = (u32)e; k > 0; k >>= 1) {
        if (k & 1) acc = acc * base;
        base = base * base;
    }
    return acc;
}
__device__ __forceinline__ i32 pow_elem(i32 x, f64 e) { return from_f64<i32>(pow_whole((f64)x, e)); }
__device__ __forceinline__ i64 pow_elem(i64 x, f64 e) { return from_f64<i64>(pow_whole((f64)x, e)); }
__device__ __forceinline__ u8 pow_elem(u8 x, f64 e) { return from_f64<u8>(pow_whole((f64)x, e)); }
FOR_ALL(UNARY_ALL)

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
#define FLOAT_UNARY(T)                         \
    UNARY_OP(exp, e_exp(x), T)                 \
    UNARY_OP(log, e_log(x), T)                 \
    UNARY_OP(sqrt, e_sqrt(x), T)               \
    UNARY_OP(tanh, e_tanh(x), T)               \
    UNARY_OP(sigmoid, sigmoid_elem(x), T)
FOR_FLOAT(FLOAT_UNARY)

// `dst[i] = src[offset(i)]` with the source strides in `s.sa`: assign_, broadcast_to, permute.
// By element size, since only bits move.
#define GATHER(B, T)                                                                             \
    extern "C" __global__ void gather_##B(const T* src, T* dst, u64 n, int mode, Strided s) {    \
        GRID_STRIDE(i, n) {                                                                      \
            u64 oa, ob;                                                                          \
            operand_offsets(mode, s, i, oa, ob);                                                 \
            dst[i] = src[oa];                                                                    \
        }                                                                                        \
    }                                                                                            \
    extern "C" __global__ void transpose_##B(const T* src, T* dst, u64 rows, u64 cols) {         \
        __shared__ T tile[32][33];                                                               \
        u64 tiles_c = (cols + 31) / 32, tiles_r = (rows + 31) / 32;                              \
        for (u64 t = blockIdx.x; t < tiles_c * tiles_r; t += gridDim.x) {                        \
            u64 r0 = (t / tiles_c) * 32, c0 = (t % tiles_c) * 32;                               \
            for (u32 y = threadIdx.y; y < 32; y += blockDim.y) {                                \
                u64 r = r0 + y, c = c0 + threadIdx.x;                                            \
                if (r < rows && c < cols) tile[y][threadIdx.x] = src[r * cols + c];              \
            }                                                                                    \
            __syncthreads();                                                                     \
            for (u32 y = threadIdx.y; y < 32; y += blockDim.y) {                                \
                u64 c = c0 + y, r = r0 + threadIdx.x;                                            \
                if (r < rows && c < cols) dst[c * rows + r] = tile[threadIdx.x][y];              \
            }                                                                                    \
            __syncthreads();                                                                     \
        }                                                                                        \
    }
// Rows of a 2-d copy between pitched layouts (narrow, concat, stack): `rows` rows of `cols`
// elements, `src_pitch` and `dst_pitch` elements apart.
#define COPY_ROWS(B, T)                                                                          \
    extern "C" __global__ void copy_rows_##B(const T* src, T* dst, u64 rows, u64 cols,          \
                                             u64 src_pitch, u64 dst_pitch) {                     \
        GRID_STRIDE(q, rows * cols) {                                                            \
            u64 r = q / cols, c = q % cols;                                                      \
            dst[r * dst_pitch + c] = src[r * src_pitch + c];                                     \
        }                                                                                        \
    }
COPY_ROWS(b1, u8)
COPY_ROWS(b4, u32)
COPY_ROWS(b8, u64)
GATHER(b1, u8)
GATHER(b4, u32)
GATHER(b8, u64)

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
__device__ __forceinline__ f32 lowest(f32) { return __int_as_float(0xff800000); }
__device__ __forceinline__ f64 lowest(f64) { return __longlong_as_double((i64)0xfff0000000000000ull); }
__device__ __forceinline__ i32 lowest(i32) { return (i32)0x80000000u; }
__device__ __forceinline__ i64 lowest(i64) { return (i64)0x8000000000000000ull; }
__device__ __forceinline__ u8 lowest(u8) { return 0; }
FOR_ALL(MAX)

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

// ---- neural-network ops ----

// Softmax (log-softmax with `log`) along the middle axis of [outer, n, inner], with the launch
// shapes of `fold` (no chunks): `tpr` threads per row for inner == 1, 32 columns per block
// otherwise. As the CPU: subtract the maximum (NaN wins), sum exp in f64.
template <typename T> struct MaxOf {
    __device__ T operator()(T a, T b) const { return op_max(a, b); }
};
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

// Integer matrix products (cuBLAS does the floats): c[b] = beta·c[b] + alpha·op(a[b])·op(b[b])
// with element (i, p) of op(a) at a[i·a_rs + p·a_cs] and (p, j) of op(b) at b[p·b_rs + j·b_cs];
// `accumulate` 0 ignores beta, alpha and the old c.
#define MATMUL_INT(T)                                                                              \
    extern "C" __global__ void matmul_##T(const T* a, const T* b, T* c, u64 m, u64 k, u64 n,      \
                                          u64 a_rs, u64 a_cs, u64 b_rs, u64 b_cs, u64 batch,      \
                                          u64 a_step, u64 b_step, int accumulate, T beta,          \
                                          T alpha) {                                               \
        GRID_STRIDE(q, batch * m * n) {                                                            \
            u64 bi = q / (m * n), r = q % (m * n), i = r / n, j = r % n;                            \
            const T* pa = a + bi * a_step;                                                         \
            const T* pb = b + bi * b_step;                                                         \
            T acc = 0;                                                                             \
            for (u64 p = 0; p < k; ++p) acc = op_add(acc, op_mul(pa[i * a_rs + p * a_cs], pb[p * b_rs + j * b_cs])); \
            c[q] = accumulate ? op_add(op_mul(c[q], beta), op_mul(acc, alpha)) : acc;              \
        }                                                                                          \
    }
FOR_INT(MATMUL_INT)
