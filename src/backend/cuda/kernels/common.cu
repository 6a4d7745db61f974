// ndscope's CUDA kernels, the shared part: element types, operand addressing, the check report,
// element arithmetic and conversions, block reductions, the dtype lists. NVRTC compiles the
// kernel files at run time as one program (this file first, then device.cu, transfer,
// elementwise, shape, reduce, nn, matmul and optim: the order of `SOURCE` in kernels.rs) for the
// device's own architecture,
// with --fmad=false: additions and multiplications are never fused, so elementwise float
// arithmetic rounds exactly as on the CPU. Every kernel is `extern "C"` and named `<op>_<dtype>`
// (`<op>_<dtype>_<dtype>` for two element types), with the dtype names of ndscope's `DType`
// (f32, f64, i32, i64, u8; f16 and bf16 in the second program, half.cu, which needs the CUDA
// toolkit's cuda_fp16.h and cuda_bf16.h). Loops are grid-stride loops, so any grid size covers
// any length.
//
// Semantics follow the CPU backend: integer arithmetic wraps (done in unsigned types, where C++
// defines it), integer division by zero gives 0 (and is reported: `report_bad`), MIN / -1 wraps
// to MIN, maximum/minimum let NaN win, float-to-integer conversions truncate toward zero and
// saturate (NaN gives 0) like Rust's `as`, integer-to-integer conversions wrap.

typedef unsigned char u8;
typedef int i32;
typedef unsigned short u16;
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
