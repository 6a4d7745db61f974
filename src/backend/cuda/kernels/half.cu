// Kernels for f16 (__half) and bf16 (__nv_bfloat16): a second NVRTC program, compiled the first
// time a half-precision kernel is looked up (it needs the toolkit's cuda_fp16.h/cuda_bf16.h,
// which f32 users need not have). Names and parameters are those of the main program's kernels
// of the same op (the call sites are the same), except the optimizer steps, whose coefficients
// are f32.
//
// Semantics follow the CPU backend (src/backend/cpu/num.rs, wide.rs): every elementwise
// operation converts its operands to f32 (exactly), computes there and rounds the result once
// to nearest even; comparisons, maximum/minimum, neg and abs are exact. Composites (softmax,
// softmax cross-entropy, the optimizer steps, the bias gradient) run the f32 kernel's operations
// on the widened values and round each stored value once. Values made from an f64 (fill scalars,
// arange, random numbers, casts from f64 and integers, sums) are rounded once from the f64.
// Casts out of a half go exactly to f32, then as Rust's `as`.

typedef __half f16;
typedef __nv_bfloat16 bf16;

#define FOR_HALF(M) M(f16) M(bf16)

// ---- conversions ----

__device__ __forceinline__ f32 to_f(f16 x) { return __half2float(x); }
__device__ __forceinline__ f32 to_f(bf16 x) { return __bfloat162float(x); }
template <typename H> __device__ __forceinline__ H from_f(f32 v);
template <> __device__ __forceinline__ f16 from_f<f16>(f32 v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ bf16 from_f<bf16>(f32 v) { return __float2bfloat16_rn(v); }
template <typename H> __device__ __forceinline__ H from_d(f64 v);
template <> __device__ __forceinline__ f16 from_d<f16>(f64 v) { return __double2half(v); }
template <> __device__ __forceinline__ bf16 from_d<bf16>(f64 v) { return __double2bfloat16(v); }
__device__ __forceinline__ u16 bits_of(f16 x) { return __half_as_ushort(x); }
__device__ __forceinline__ u16 bits_of(bf16 x) { return __bfloat16_as_ushort(x); }
template <typename H> __device__ __forceinline__ H of_bits(u16 b);
template <> __device__ __forceinline__ f16 of_bits<f16>(u16 b) { return __ushort_as_half(b); }
template <> __device__ __forceinline__ bf16 of_bits<bf16>(u16 b) { return __ushort_as_bfloat16(b); }

// A half's f32 value `v` as `D` (casts out of a half): exact to f32 and f64, Rust's `as` to
// integers, one rounding to the other half type.
template <typename D> __device__ __forceinline__ D half_to(f32 v);
template <> __device__ __forceinline__ f32 half_to<f32>(f32 v) { return v; }
template <> __device__ __forceinline__ f64 half_to<f64>(f32 v) { return (f64)v; }
template <> __device__ __forceinline__ i32 half_to<i32>(f32 v) { return from_f64<i32>((f64)v); }
template <> __device__ __forceinline__ i64 half_to<i64>(f32 v) { return from_f64<i64>((f64)v); }
template <> __device__ __forceinline__ u8 half_to<u8>(f32 v) { return from_f64<u8>((f64)v); }
template <> __device__ __forceinline__ f16 half_to<f16>(f32 v) { return from_f<f16>(v); }
template <> __device__ __forceinline__ bf16 half_to<bf16>(f32 v) { return from_f<bf16>(v); }

// Casts into a half: f32 rounds once, everything else once from its f64 value.
template <typename H> __device__ __forceinline__ H to_half(f32 v) { return from_f<H>(v); }
template <typename H> __device__ __forceinline__ H to_half(f64 v) { return from_d<H>(v); }
template <typename H> __device__ __forceinline__ H to_half(i32 v) { return from_d<H>((f64)v); }
// An i64 beyond 2^53 would round twice through f64: CUDA's integer conversion rounds once.
__device__ __forceinline__ f16 i64_to_half(i64 v, f16) { return __ll2half_rn((long long)v); }
__device__ __forceinline__ bf16 i64_to_half(i64 v, bf16) { return __ll2bfloat16_rn((long long)v); }
template <typename H> __device__ __forceinline__ H to_half(i64 v) { return i64_to_half(v, H()); }
template <typename H> __device__ __forceinline__ H to_half(u8 v) { return from_d<H>((f64)v); }

// ---- element arithmetic: in f32, rounded once ----

#define HALF_ARITH(H)                                                                              \
    __device__ __forceinline__ H op_add(H a, H b) { return from_f<H>(to_f(a) + to_f(b)); }        \
    __device__ __forceinline__ H op_sub(H a, H b) { return from_f<H>(to_f(a) - to_f(b)); }        \
    __device__ __forceinline__ H op_mul(H a, H b) { return from_f<H>(to_f(a) * to_f(b)); }        \
    __device__ __forceinline__ H op_div(H a, H b) { return from_f<H>(to_f(a) / to_f(b)); }        \
    __device__ __forceinline__ H op_max(H a, H b) {                                               \
        f32 x = to_f(a), y = to_f(b);                                                              \
        return (x > y || x != x) ? a : b;                                                          \
    }                                                                                              \
    __device__ __forceinline__ H op_min(H a, H b) {                                               \
        f32 x = to_f(a), y = to_f(b);                                                              \
        return (x < y || x != x) ? a : b;                                                          \
    }                                                                                              \
    __device__ __forceinline__ H op_neg(H a) { return of_bits<H>((u16)(bits_of(a) ^ 0x8000u)); } \
    __device__ __forceinline__ H op_abs(H a) { return of_bits<H>((u16)(bits_of(a) & 0x7fffu)); } \
    __device__ __forceinline__ H half_zero(H) { return of_bits<H>((u16)0); }                      \
    __device__ __forceinline__ H half_one(H) { return from_f<H>(1.0f); }                          \
    __device__ __forceinline__ H pow_elem(H x, f64 e) { return from_f<H>(powf(to_f(x), (f32)e)); } \
    __device__ __forceinline__ H exp_elem(H x) { return from_f<H>(expf(to_f(x))); }               \
    __device__ __forceinline__ H log_elem(H x) { return from_f<H>(logf(to_f(x))); }               \
    __device__ __forceinline__ H sqrt_elem(H x) { return from_f<H>(sqrtf(to_f(x))); }             \
    __device__ __forceinline__ H tanh_elem(H x) { return from_f<H>(tanhf(to_f(x))); }             \
    __device__ __forceinline__ H sigmoid_elem(H x) { return from_f<H>(sigmoid_elem(to_f(x))); }   \
    __device__ __forceinline__ H gelu_elem(H x) { return from_f<H>(gelu_elem(to_f(x))); }
FOR_HALF(HALF_ARITH)


// The largest value below `x` (`x` itself for NaN and -inf; the smallest negative subnormal
// for ±0): the CPU's `next_below`.
template <typename H> __device__ __forceinline__ H next_below(H x) {
    f32 f = to_f(x);
    if (f != f || f == __int_as_float(0xff800000)) return x;
    u16 b = bits_of(x);
    if ((b & 0x7fffu) == 0) return of_bits<H>((u16)0x8001u);
    if ((b & 0x8000u) == 0) return of_bits<H>((u16)(b - 1));
    return of_bits<H>((u16)(b + 1));
}

// ---- casts ----

#define HCAST_OUT(S, D)                                                                            \
    extern "C" __global__ void cast_##S##_##D(const S* a, D* out, u64 n) {                         \
        GRID_STRIDE(i, n) out[i] = half_to<D>(to_f(a[i]));                                         \
    }
#define HCAST_IN(S, D)                                                                             \
    extern "C" __global__ void cast_##S##_##D(const S* a, D* out, u64 n) {                         \
        GRID_STRIDE(i, n) out[i] = to_half<D>(a[i]);                                               \
    }
#define HCAST_SAME(H)                                                                              \
    extern "C" __global__ void cast_##H##_##H(const H* a, H* out, u64 n) {                         \
        GRID_STRIDE(i, n) out[i] = a[i];                                                           \
    }
#define HCASTS(H)                                                                                  \
    HCAST_OUT(H, f32) HCAST_OUT(H, f64) HCAST_OUT(H, i32) HCAST_OUT(H, i64) HCAST_OUT(H, u8)      \
    HCAST_IN(f32, H) HCAST_IN(f64, H) HCAST_IN(i32, H) HCAST_IN(i64, H) HCAST_IN(u8, H)           \
    HCAST_SAME(H)
FOR_HALF(HCASTS)
HCAST_OUT(f16, bf16)
HCAST_OUT(bf16, f16)

// ---- fill and random numbers ----

#define HFILL(H)                                                                                   \
    extern "C" __global__ void fill_##H(H* out, u64 n, H v) { GRID_STRIDE(i, n) out[i] = v; }     \
    extern "C" __global__ void arange_##H(H* out, u64 n, f64 start, f64 step) {                    \
        GRID_STRIDE(i, n) out[i] = from_d<H>(start + (f64)i * step);                               \
    }                                                                                              \
    extern "C" __global__ void eye_##H(H* out, u64 side) {                                         \
        GRID_STRIDE(i, side * side) out[i] = from_f<H>((i / side == i % side) ? 1.0f : 0.0f);      \
    }                                                                                              \
    extern "C" __global__ void randn_##H(H* out, u64 n, u64 seed, u64 start) {                    \
        GRID_STRIDE(i, n) out[i] = from_d<H>(normal(seed, start + i));                             \
    }                                                                                              \
    /* A draw that rounds up to `high` becomes the largest value below it (the CPU's rule). */     \
    extern "C" __global__ void rand_##H(H* out, u64 n, u64 seed, u64 start, f64 low, f64 high) {   \
        f64 span = high - low;                                                                     \
        H top = from_d<H>(high);                                                                   \
        H below = op_max(next_below(top), from_d<H>(low));                                         \
        GRID_STRIDE(i, n) {                                                                        \
            H v = from_d<H>(low + span * uniform(seed, start + i));                                \
            out[i] = (span > 0.0 && to_f(v) >= to_f(top)) ? below : v;                             \
        }                                                                                          \
    }
FOR_HALF(HFILL)

// ---- binary ops, comparisons, unary ops ----

// The f32 arithmetic of an array op with a scalar: the scalar is an f32 (PyTorch's opmath, as
// the CPU computes `x op s` for halves), the result rounded once.
__device__ __forceinline__ f32 fop_add(f32 a, f32 b) { return a + b; }
__device__ __forceinline__ f32 fop_sub(f32 a, f32 b) { return a - b; }
__device__ __forceinline__ f32 fop_mul(f32 a, f32 b) { return a * b; }
__device__ __forceinline__ f32 fop_div(f32 a, f32 b) { return a / b; }
__device__ __forceinline__ f32 fop_max(f32 a, f32 b) { return (a > b || a != a) ? a : b; }
__device__ __forceinline__ f32 fop_min(f32 a, f32 b) { return (a < b || a != a) ? a : b; }

#define HBINARY_OP(NAME, FN, H)                                                                    \
    extern "C" __global__ void NAME##_##H(const H* a, const H* b, H* out, u64 n, int mode,         \
                                          Strided s) {                                             \
        GRID_STRIDE(i, n) {                                                                        \
            u64 oa, ob;                                                                            \
            operand_offsets(mode, s, i, oa, ob);                                                   \
            out[i] = FN(a[oa], b[ob]);                                                             \
        }                                                                                          \
    }                                                                                              \
    extern "C" __global__ void NAME##_scalar_##H(const H* a, H* out, u64 n, f32 v) {               \
        GRID_STRIDE(i, n) out[i] = from_f<H>(f##FN(to_f(a[i]), v));                                \
    }                                                                                              \
    extern "C" __global__ void NAME##_inplace_##H(H* x, const H* b, u64 n, int mode, Strided s) {  \
        GRID_STRIDE(i, n) {                                                                        \
            u64 oa, ob;                                                                            \
            if (mode == MODE_SELF) { x[i] = FN(x[i], x[i]); continue; }                            \
            operand_offsets(mode, s, i, oa, ob);                                                   \
            x[i] = FN(x[i], b[ob]);                                                                \
        }                                                                                          \
    }
#define HBINARY_ALL(H)                                                                             \
    HBINARY_OP(add, op_add, H)                                                                     \
    HBINARY_OP(sub, op_sub, H)                                                                     \
    HBINARY_OP(mul, op_mul, H)                                                                     \
    HBINARY_OP(div, op_div, H)                                                                     \
    HBINARY_OP(maximum, op_max, H)                                                                 \
    HBINARY_OP(minimum, op_min, H)
FOR_HALF(HBINARY_ALL)

// Comparisons in f32 (exact); a scalar is first rounded to the array's type, as on the CPU.
#define HCOMPARE_OP(NAME, EXPR, H)                                                                 \
    extern "C" __global__ void NAME##_##H(const H* a, const H* b, u8* out, u64 n, int mode,        \
                                          Strided s) {                                             \
        GRID_STRIDE(i, n) {                                                                        \
            u64 oa, ob;                                                                            \
            operand_offsets(mode, s, i, oa, ob);                                                   \
            f32 x = to_f(a[oa]), y = to_f(b[ob]);                                                  \
            out[i] = (EXPR) ? 1 : 0;                                                               \
        }                                                                                          \
    }                                                                                              \
    extern "C" __global__ void NAME##_scalar_##H(const H* a, u8* out, u64 n, f64 value) {          \
        f32 y = to_f(from_d<H>(value));                                                            \
        GRID_STRIDE(i, n) {                                                                        \
            f32 x = to_f(a[i]);                                                                    \
            out[i] = (EXPR) ? 1 : 0;                                                               \
        }                                                                                          \
    }
#define HCOMPARE_ALL(H)                                                                            \
    HCOMPARE_OP(gt, x > y, H)                                                                      \
    HCOMPARE_OP(lt, x < y, H)                                                                      \
    HCOMPARE_OP(eq, x == y, H)
FOR_HALF(HCOMPARE_ALL)

#define HUNARY_OP(NAME, EXPR, H)                                                                   \
    extern "C" __global__ void NAME##_##H(const H* a, H* out, u64 n) {                             \
        GRID_STRIDE(i, n) {                                                                        \
            H x = a[i];                                                                            \
            out[i] = (EXPR);                                                                       \
        }                                                                                          \
    }
#define HUNARY_ALL(H)                                                                              \
    HUNARY_OP(neg, op_neg(x), H)                                                                   \
    HUNARY_OP(abs, op_abs(x), H)                                                                   \
    HUNARY_OP(square, op_mul(x, x), H)                                                             \
    HUNARY_OP(relu, op_max(x, half_zero(x)), H)                                                    \
    HUNARY_OP(exp, exp_elem(x), H)                                                                 \
    HUNARY_OP(log, log_elem(x), H)                                                                 \
    HUNARY_OP(sqrt, sqrt_elem(x), H)                                                               \
    HUNARY_OP(tanh, tanh_elem(x), H)                                                               \
    HUNARY_OP(sigmoid, sigmoid_elem(x), H)                                                         \
    HUNARY_OP(gelu, gelu_elem(x), H)                                                               \
    extern "C" __global__ void pow_##H(const H* a, H* out, u64 n, f64 e) {                         \
        GRID_STRIDE(i, n) out[i] = pow_elem(a[i], e);                                              \
    }                                                                                              \
    extern "C" __global__ void scale_##H(H* x, u64 n, f32 v) {                                     \
        GRID_STRIDE(i, n) x[i] = from_f<H>(to_f(x[i]) * v);                                        \
    }                                                                                              \
    extern "C" __global__ void axpy_##H(H* x, const H* b, u64 n, f32 alpha, int mode, Strided s) { \
        GRID_STRIDE(i, n) {                                                                        \
            u64 oa, ob;                                                                            \
            if (mode == MODE_SELF) { x[i] = from_f<H>(to_f(x[i]) + alpha * to_f(x[i])); continue; } \
            operand_offsets(mode, s, i, oa, ob);                                                   \
            x[i] = from_f<H>(to_f(x[i]) + alpha * to_f(b[ob]));                                    \
        }                                                                                          \
    }
FOR_HALF(HUNARY_ALL)

// ---- reductions (launch shapes: reduce.cu) ----

// sum_<in>_<out>: accumulated in f64 (exact for sums of halves of moderate range and count),
// each output rounded once from the f64 sum (or mean); partial sums pass through f64.
#define HSUM(IN, OUT, CONV, FIN)                                                                   \
    extern "C" __global__ void sum_##IN##_##OUT(const IN* x, OUT* out, u64 outer, u64 n,           \
                                               u64 inner, u64 chunks, int mean, f64 count,        \
                                               u32 tpr) {                                          \
        fold<IN, f64, OUT>(x, out, outer, n, inner, chunks, tpr, 0.0,                              \
            [](IN v) { return CONV; }, AddF(),                                                     \
            [=](f64 a) { f64 r = mean ? a / count : a; return FIN; });                             \
    }
#define HSUMS(H)                                                                                   \
    HSUM(H, H, (f64)to_f(v), from_d<H>(r))                                                         \
    HSUM(H, f64, (f64)to_f(v), r)                                                                  \
    HSUM(f64, H, v, from_d<H>(r))
FOR_HALF(HSUMS)

// max: in f32 (exact), NaN wins.
#define HMAX(H)                                                                                    \
    extern "C" __global__ void max_##H(const H* x, H* out, u64 outer, u64 n, u64 inner,            \
                                       u64 chunks, u32 tpr) {                                      \
        fold<H, f32, H>(x, out, outer, n, inner, chunks, tpr, lowest(0.0f),                        \
            [](H v) { return to_f(v); }, MaxOf<f32>(),                                             \
            [](f32 a) { return from_f<H>(a); });                                                   \
    }
FOR_HALF(HMAX)

// argmax and its second pass, as reduce.cu's on the values in f32 (exact).
#define HARGMAX(H)                                                                                 \
    extern "C" __global__ void argmax_##H(const H* x, i64* out, u64 outer, u64 n, u64 inner,       \
                                          u32 tpr, u64 chunks, H* part_v, i64* part_i) {           \
        __shared__ Best<f32> shared[256];                                                          \
        if (inner == 1) {                                                                          \
            u32 per = blockDim.x / tpr, lane = threadIdx.x & (tpr - 1), slot = threadIdx.x / tpr;  \
            u64 segments = outer * chunks, len = (n + chunks - 1) / chunks;                        \
            for (u64 base = (u64)blockIdx.x * per; base < segments; base += (u64)gridDim.x * per) { \
                u64 b = base + slot;                                                               \
                Best<f32> best = {0.0f, -1};                                                       \
                if (b < segments) {                                                                \
                    u64 row = b / chunks, c = b % chunks;                                          \
                    u64 begin = c * len, end = begin + len < n ? begin + len : n;                  \
                    for (u64 i = begin + lane; i < end; i += tpr)                                  \
                        best = better(best, Best<f32>{to_f(x[row * n + i]), (i64)i});              \
                }                                                                                  \
                best = group_reduce(best, shared, tpr, Better<f32>());                             \
                if (lane == 0 && b < segments) {                                                   \
                    if (chunks == 1) {                                                             \
                        out[b] = best.i;                                                           \
                    } else {                                                                       \
                        part_v[b] = from_f<H>(best.v);                                             \
                        part_i[b] = best.i;                                                        \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
        } else {                                                                                   \
            u64 columns = outer * inner;                                                           \
            for (u64 g = blockIdx.x; g * 32 < columns; g += gridDim.x) {                           \
                u64 col = g * 32 + threadIdx.x;                                                    \
                Best<f32> best = {0.0f, -1};                                                       \
                if (col < columns) {                                                               \
                    const H* p = x + (col / inner) * n * inner + col % inner;                      \
                    for (u64 i = threadIdx.y; i < n; i += blockDim.y)                              \
                        best = better(best, Best<f32>{to_f(p[i * inner]), (i64)i});                \
                }                                                                                  \
                best = column_reduce(best, shared, Better<f32>());                                 \
                if (threadIdx.y == 0 && col < columns) out[col] = best.i;                          \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    extern "C" __global__ void argmax_parts_##H(const H* part_v, const i64* part_i, i64* out,     \
                                                u64 outer, u64 chunks, u32 tpr) {                  \
        __shared__ Best<f32> shared[256];                                                          \
        u32 per = blockDim.x / tpr, lane = threadIdx.x & (tpr - 1), slot = threadIdx.x / tpr;      \
        for (u64 base = (u64)blockIdx.x * per; base < outer; base += (u64)gridDim.x * per) {      \
            u64 row = base + slot;                                                                 \
            Best<f32> best = {0.0f, -1};                                                           \
            if (row < outer)                                                                       \
                for (u64 c = lane; c < chunks; c += tpr)                                           \
                    best = better(best, Best<f32>{to_f(part_v[row * chunks + c]),                  \
                                                  part_i[row * chunks + c]});                      \
            best = group_reduce(best, shared, tpr, Better<f32>());                                 \
            if (lane == 0 && row < outer) out[row] = best.i;                                       \
        }                                                                                          \
    }
FOR_HALF(HARGMAX)

// ---- neural-network ops (launch shapes: nn.cu) ----

// Softmax of one line in f32, as nn.cu's `softmax_line` for f32 (maximum, exp in f32 summed in
// f64, the shift or the scale in f32), each output rounded once: exp is computed again for the
// output instead of being stored and scaled (the same f32 value, rounded once).
template <typename H, typename Reduce>
__device__ __forceinline__ void half_softmax_line(const H* p, H* q, u64 n, u64 stride, u64 first,
                                                  u64 step, bool live, int log_, f32* smax,
                                                  f64* ssum, Reduce reduce) {
    f32 m = lowest(0.0f);
    if (live)
        for (u64 i = first; i < n; i += step) m = op_max(m, to_f(p[i * stride]));
    m = reduce(m, smax, MaxOf<f32>());
    f64 s = 0.0;
    if (live)
        for (u64 i = first; i < n; i += step) s += (f64)expf(to_f(p[i * stride]) - m);
    s = reduce(s, ssum, AddF());
    if (!live) return;
    if (log_) {
        f32 shift = m + (f32)log(s);
        for (u64 i = first; i < n; i += step) q[i * stride] = from_f<H>(to_f(p[i * stride]) - shift);
    } else {
        f32 scale = (f32)(1.0 / s);
        for (u64 i = first; i < n; i += step)
            q[i * stride] = from_f<H>(expf(to_f(p[i * stride]) - m) * scale);
    }
}
#define HSOFTMAX(H)                                                                                \
    extern "C" __global__ void softmax_##H(const H* x, H* out, u64 outer, u64 n, u64 inner,        \
                                           int log_, u32 tpr) {                                    \
        __shared__ f32 smax[256];                                                                  \
        __shared__ f64 ssum[256];                                                                  \
        if (inner == 1) {                                                                          \
            u32 per = blockDim.x / tpr, lane = threadIdx.x & (tpr - 1), slot = threadIdx.x / tpr;  \
            for (u64 base = (u64)blockIdx.x * per; base < outer; base += (u64)gridDim.x * per) {  \
                u64 row = base + slot;                                                             \
                bool live = row < outer;                                                           \
                u64 at = live ? row * n : 0;                                                       \
                half_softmax_line(x + at, out + at, n, 1, lane, tpr, live, log_, smax, ssum,       \
                                  GroupReduce{tpr});                                               \
            }                                                                                      \
        } else {                                                                                   \
            u64 columns = outer * inner;                                                           \
            for (u64 g = blockIdx.x; g * 32 < columns; g += gridDim.x) {                           \
                u64 col = g * 32 + threadIdx.x;                                                    \
                bool live = col < columns;                                                         \
                u64 at = live ? (col / inner) * n * inner + col % inner : 0;                       \
                half_softmax_line(x + at, out + at, n, inner, threadIdx.y, blockDim.y, live, log_, \
                                  smax, ssum, ColumnReduce());                                     \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    extern "C" __global__ void softmax_split_##H(const H* x, H* out, u64 outer, u64 n, u64 chunks, \
                                                 int log_, int phase, H* part_m, f64* part_s) {   \
        __shared__ f32 smax[256];                                                                  \
        __shared__ f64 ssum[256];                                                                  \
        u64 len = (n + chunks - 1) / chunks;                                                       \
        for (u64 b = blockIdx.x; b < outer * chunks; b += gridDim.x) {                             \
            u64 row = b / chunks, c = b % chunks;                                                  \
            u64 begin = c * len, end = begin + len < n ? begin + len : n;                          \
            const H* p = x + row * n;                                                              \
            H* q = out + row * n;                                                                  \
            if (phase == 0) {                                                                      \
                f32 m = lowest(0.0f);                                                              \
                for (u64 i = begin + threadIdx.x; i < end; i += blockDim.x) m = op_max(m, to_f(p[i])); \
                m = block_reduce(m, smax, MaxOf<f32>());                                           \
                if (threadIdx.x == 0) part_m[b] = from_f<H>(m);                                    \
                continue;                                                                          \
            }                                                                                      \
            f32 m = lowest(0.0f);                                                                  \
            for (u64 k = 0; k < chunks; ++k) m = op_max(m, to_f(part_m[row * chunks + k]));        \
            if (phase == 1) {                                                                      \
                f64 s = 0.0;                                                                       \
                for (u64 i = begin + threadIdx.x; i < end; i += blockDim.x)                        \
                    s += (f64)expf(to_f(p[i]) - m);                                                \
                s = block_reduce(s, ssum, AddF());                                                 \
                if (threadIdx.x == 0) part_s[b] = s;                                               \
            } else {                                                                               \
                f64 s = 0.0;                                                                       \
                for (u64 k = 0; k < chunks; ++k) s += part_s[row * chunks + k];                    \
                if (log_) {                                                                        \
                    f32 shift = m + (f32)log(s);                                                   \
                    for (u64 i = begin + threadIdx.x; i < end; i += blockDim.x)                    \
                        q[i] = from_f<H>(to_f(p[i]) - shift);                                      \
                } else {                                                                           \
                    f32 scale = (f32)(1.0 / s);                                                    \
                    for (u64 i = begin + threadIdx.x; i < end; i += blockDim.x)                    \
                        q[i] = from_f<H>(expf(to_f(p[i]) - m) * scale);                            \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }
FOR_HALF(HSOFTMAX)

// one_hot into a half, pick from a half (nn.cu's, with the half's 0 and 1).
#define HONE_HOT(I, H)                                                                             \
    extern "C" __global__ void one_hot_##I##_##H(const I* idx, H* out, u64 count, u64 depth,       \
                                                 u64* flag, u64 key) {                             \
        GRID_STRIDE(q, count * depth) {                                                            \
            i64 v = (i64)idx[q / depth];                                                           \
            if (q % depth == 0 && (v < 0 || (u64)v >= depth)) report_bad(flag, key, q / depth);    \
            out[q] = from_f<H>((v == (i64)(q % depth)) ? 1.0f : 0.0f);                             \
        }                                                                                          \
    }
#define HPICK(H, I)                                                                                \
    extern "C" __global__ void pick_##H##_##I(const H* x, const I* idx, H* out, u64 count, u64 n, \
                                              u64 inner, u64* flag, u64 key) {                    \
        GRID_STRIDE(p, count) {                                                                    \
            i64 v = (i64)idx[p];                                                                   \
            u64 o = p / inner, j = p % inner;                                                      \
            bool ok = v >= 0 && (u64)v < n;                                                        \
            if (!ok) report_bad(flag, key, p);                                                     \
            out[p] = ok ? x[(o * n + (u64)v) * inner + j] : of_bits<H>((u16)0);                    \
        }                                                                                          \
    }
#define HINDEX(H)                                                                                  \
    HONE_HOT(i32, H) HONE_HOT(i64, H) HONE_HOT(u8, H) HPICK(H, i32) HPICK(H, i64) HPICK(H, u8)
FOR_HALF(HINDEX)

// Softmax cross-entropy as nn.cu's for f32 on the widened logits: the loss is the f32 loss
// rounded once more (the CPU rounds its f32 loss to the half type), the gradient each f32
// value rounded once.
#define HSOFTMAX_CE(H, I)                                                                          \
    extern "C" __global__ void softmax_ce_##H##_##I(const H* x, const I* labels, H* loss,         \
                                                    H* grad, u64 rows, u64 classes, u32 tpr,      \
                                                    u64* flag, u64 key) {                          \
        __shared__ f32 smax[256];                                                                  \
        __shared__ f64 ssum[256];                                                                  \
        u32 per = blockDim.x / tpr, lane = threadIdx.x & (tpr - 1), slot = threadIdx.x / tpr;      \
        f64 inv = 1.0 / (f64)rows;                                                                 \
        f64 total = 0.0;                                                                           \
        for (u64 base = 0; base < rows; base += per) {                                             \
            u64 row = base + slot;                                                                 \
            bool live = row < rows;                                                                \
            const H* p = x + (live ? row * classes : 0);                                           \
            f32 m = lowest(0.0f);                                                                  \
            if (live)                                                                              \
                for (u64 i = lane; i < classes; i += tpr) m = op_max(m, to_f(p[i]));               \
            m = group_reduce(m, smax, tpr, MaxOf<f32>());                                          \
            f64 s = 0.0;                                                                           \
            if (live)                                                                              \
                for (u64 i = lane; i < classes; i += tpr) s += (f64)expf(to_f(p[i]) - m);          \
            s = group_reduce(s, ssum, tpr, AddF());                                                \
            if (!live) continue;                                                                   \
            i64 v = (i64)labels[row];                                                              \
            bool ok = v >= 0 && (u64)v < classes;                                                  \
            if (lane == 0) {                                                                       \
                if (ok) total += (f64)(to_f(p[v]) - m) - log(s);                                   \
                else report_bad(flag, key, row);                                                   \
            }                                                                                      \
            if (grad) {                                                                            \
                H* q = grad + row * classes;                                                       \
                for (u64 i = lane; i < classes; i += tpr) {                                        \
                    f64 hot = (ok && (u64)v == i) ? 1.0 : 0.0;                                     \
                    q[i] = from_f<H>((f32)(((f64)expf(to_f(p[i]) - m) / s - hot) * inv));          \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        total = block_reduce(total, ssum, AddF());                                                 \
        if (threadIdx.x == 0) loss[0] = from_f<H>((f32)(-(total / (f64)rows)));                    \
    }
#define HSOFTMAX_CE_OF(H) HSOFTMAX_CE(H, i32) HSOFTMAX_CE(H, i64) HSOFTMAX_CE(H, u8)
FOR_HALF(HSOFTMAX_CE_OF)

// A dense layer's bias and ReLU on its product (in place), in f32, rounded once.
#define HBIAS_ACT(H)                                                                               \
    extern "C" __global__ void bias_act_##H(H* out, const H* bias, u64 rows, u64 cols, int relu) { \
        GRID_STRIDE(i, rows * cols) {                                                              \
            f32 v = to_f(out[i]);                                                                  \
            if (bias) v = v + to_f(bias[i % cols]);                                                \
            if (relu) v = op_max(v, 0.0f);                                                         \
            out[i] = from_f<H>(v);                                                                 \
        }                                                                                          \
    }
FOR_HALF(HBIAS_ACT)

// The backward of the bias and ReLU (nn.cu's): the column sums accumulate in f32, down the rows
// in order (the CPU's order); dz and db each rounded once.
#define HBIAS_ACT_GRAD(H)                                                                          \
    extern "C" __global__ void bias_act_grad_##H(const H* g, const H* y, H* dz, H* db, u64 rows,  \
                                                 u64 cols, int relu, int acc) {                    \
        for (u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x; j < cols;                         \
             j += (u64)gridDim.x * blockDim.x) {                                                   \
            f32 s = acc ? to_f(db[j]) : 0.0f;                                                      \
            for (u64 r = 0; r < rows; ++r) {                                                       \
                u64 at = r * cols + j;                                                             \
                f32 v = to_f(g[at]);                                                               \
                if (relu) {                                                                        \
                    v = to_f(y[at]) > 0.0f ? v : 0.0f;                                             \
                    dz[at] = from_f<H>(v);                                                         \
                }                                                                                  \
                s = s + v;                                                                         \
            }                                                                                      \
            db[j] = from_f<H>(s);                                                                  \
        }                                                                                          \
    }
FOR_HALF(HBIAS_ACT_GRAD)

// ---- products reading an f32 operand rounded (an autocast layer's weights, with no half copy) ----

// c = act(alpha·op(a)·op(round(b)) [+ beta·c] [+ bias]): `a`, `c` and the bias in H, `b` f32 with
// each value rounded to H as it is read (as `to_dtype` rounds it). Element (i, p) of op(a) is at
// a[i·a_rs + p·a_cs], (p, j) of op(b) at b[p·b_rs + j·b_cs]; `c` is [m, n] row-major. Each output
// is one chain of f32 fused multiply-adds in order of k from 0 (as the simulated cuBLAS sums; a
// GPU's cuBLAS tiles k in an order of its own), then alpha, beta·c (not read when `accumulate`
// is 0 or beta is 0), the bias and the ReLU (NaN kept, as `relu`) in f32, rounded once.
// A block of 16×16 threads computes 32×32 outputs (2×2 each), k in slices of 32 through shared
// memory; blocks stride over the tiles. Operand slices are read along whichever of their axes is
// contiguous.
#define RTILE 32
#define RSLICE 32
#define HGEMM_ROUNDED(H)                                                                           \
    extern "C" __global__ void gemm_rounded_##H(const H* a, const f32* b, H* c, const H* bias,    \
                                                u64 m, u64 k, u64 n, u64 a_rs, u64 a_cs,           \
                                                u64 b_rs, u64 b_cs, int accumulate, f32 beta,      \
                                                f32 alpha, int relu) {                             \
        __shared__ f32 sa[RSLICE][RTILE + 1];                                                      \
        __shared__ f32 sb[RSLICE][RTILE + 1];                                                      \
        const u32 tx = threadIdx.x, ty = threadIdx.y, t = ty * 16 + tx;                            \
        const u64 rows = (m + RTILE - 1) / RTILE, cols = (n + RTILE - 1) / RTILE;                  \
        for (u64 tile = blockIdx.x; tile < rows * cols; tile += gridDim.x) {                       \
            const u64 i0 = (tile / cols) * RTILE, j0 = (tile % cols) * RTILE;                      \
            f32 acc[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};                                          \
            for (u64 p0 = 0; p0 < k; p0 += RSLICE) {                                               \
                for (u32 e = t; e < RSLICE * RTILE; e += 256) {                                    \
                    u32 p = a_cs == 1 ? e % RSLICE : e / RTILE;                                    \
                    u32 r = a_cs == 1 ? e / RSLICE : e % RTILE;                                    \
                    u64 gi = i0 + r, gp = p0 + p;                                                  \
                    sa[p][r] = (gi < m && gp < k) ? to_f(a[gi * a_rs + gp * a_cs]) : 0.0f;         \
                    p = b_cs == 1 ? e / RTILE : e % RSLICE;                                        \
                    r = b_cs == 1 ? e % RTILE : e / RSLICE;                                        \
                    u64 gj = j0 + r;                                                               \
                    gp = p0 + p;                                                                   \
                    sb[p][r] = (gj < n && gp < k) ? to_f(from_f<H>(b[gp * b_rs + gj * b_cs]))      \
                                                  : 0.0f;                                          \
                }                                                                                  \
                __syncthreads();                                                                   \
                for (u32 p = 0; p < RSLICE; ++p) {                                                 \
                    f32 a0 = sa[p][ty], a1 = sa[p][ty + 16];                                       \
                    f32 b0 = sb[p][tx], b1 = sb[p][tx + 16];                                       \
                    acc[0][0] = fmaf(a0, b0, acc[0][0]);                                           \
                    acc[0][1] = fmaf(a0, b1, acc[0][1]);                                           \
                    acc[1][0] = fmaf(a1, b0, acc[1][0]);                                           \
                    acc[1][1] = fmaf(a1, b1, acc[1][1]);                                           \
                }                                                                                  \
                __syncthreads();                                                                   \
            }                                                                                      \
            for (u32 di = 0; di < 2; ++di) {                                                       \
                for (u32 dj = 0; dj < 2; ++dj) {                                                   \
                    u64 i = i0 + ty + 16 * di, j = j0 + tx + 16 * dj;                              \
                    if (i >= m || j >= n) continue;                                                \
                    f32 v = alpha * acc[di][dj];                                                   \
                    if (accumulate && beta != 0.0f) v = v + beta * to_f(c[i * n + j]);             \
                    if (bias) v = v + to_f(bias[j]);                                               \
                    if (relu) v = op_max(v, 0.0f);                                                 \
                    c[i * n + j] = from_f<H>(v);                                                   \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }
FOR_HALF(HGEMM_ROUNDED)

// ---- the fused optimizer steps: optim.cu's f32 operations on widened values ----

template <typename H>
__device__ __forceinline__ void half_sgd_element(H* p, H* grad, H* vel, u64 i, f32 lr, f32 mu,
                                                 f32 wd, int flags) {
    f32 x = to_f(p[i]);
    f32 g = to_f(grad[i]);
    if (flags & SGD_ZERO_GRAD) grad[i] = of_bits<H>((u16)0);
    if (flags & SGD_WEIGHT_DECAY) g = g + wd * x;
    f32 d = g;
    if (flags & SGD_VELOCITY) {
        f32 v = mu * to_f(vel[i]) + g;
        vel[i] = from_f<H>(v);
        d = (flags & SGD_NESTEROV) ? g + mu * v : v;
    }
    p[i] = from_f<H>(x - lr * d);
}
template <typename H>
__device__ __forceinline__ void half_adam_element(H* p, H* grad, H* m1, H* m2, u64 i, f32 b1,
                                                  f32 c1, f32 b2, f32 c2, f32 eps, f32 wd,
                                                  f32 decay, f32 step_size, f32 bias2, int mode) {
    f32 x = to_f(p[i]);
    f32 g = to_f(grad[i]);
    if (mode & ADAM_ZERO_GRAD) grad[i] = of_bits<H>((u16)0);
    if (mode & ADAM_COUPLED) g = g + wd * x;
    if (mode & ADAM_DECOUPLED) x = x * decay;
    f32 m = b1 * to_f(m1[i]) + c1 * g;
    f32 v = b2 * to_f(m2[i]) + c2 * (g * g);
    m1[i] = from_f<H>(m);
    m2[i] = from_f<H>(v);
    f32 denom = sqrtf(v) / bias2 + eps;
    p[i] = from_f<H>(x - step_size * (m / denom));
}
#define HOPTIM(H)                                                                                  \
    extern "C" __global__ void sgd_update_##H(H* p, H* grad, H* vel, u64 n, f32 lr, f32 mu,       \
                                              f32 wd, int flags) {                                 \
        GRID_STRIDE(i, n) { half_sgd_element(p, grad, vel, i, lr, mu, wd, flags); }                \
    }                                                                                              \
    extern "C" __global__ void adam_update_##H(H* p, H* grad, H* m1, H* m2, u64 n, f32 b1,        \
                                               f32 c1, f32 b2, f32 c2, f32 eps, f32 wd, f32 decay, \
                                               f32 step_size, f32 bias2, int mode) {               \
        GRID_STRIDE(i, n) {                                                                        \
            half_adam_element(p, grad, m1, m2, i, b1, c1, b2, c2, eps, wd, decay, step_size,       \
                              bias2, mode);                                                        \
        }                                                                                          \
    }                                                                                              \
    extern "C" __global__ void sgd_multi_##H(TensorList l, f32 lr, f32 mu, f32 wd, int flags) {   \
        bool skip = mt_skipped(l);                                                                 \
        MT_FOR(l, t, i) {                                                                          \
            if (skip) {                                                                            \
                if (flags & SGD_ZERO_GRAD) ((H*)l.ptr[0][t])[i] = from_f<H>(0.0f);                 \
                continue;                                                                          \
            }                                                                                      \
            half_sgd_element((H*)l.ptr[1][t], (H*)l.ptr[0][t], (H*)l.ptr[2][t], i, lr, mu, wd,     \
                             flags);                                                               \
        }                                                                                          \
    }                                                                                              \
    extern "C" __global__ void adam_multi_##H(TensorList l, f32 b1, f32 c1, f32 b2, f32 c2,       \
                                              f32 eps, f32 wd, f32 decay, f32 step_size,           \
                                              f32 bias2, int mode, const double* count, double lr, \
                                              double b1d, double b2d) {                            \
        bool skip = mt_skipped(l);                                                                 \
        if (count != 0) {                                                                          \
            double steps = count[0] + 1.0;                                                         \
            step_size = (f32)(lr / (1.0 - pow(b1d, steps)));                                       \
            bias2 = (f32)sqrt(1.0 - pow(b2d, steps));                                              \
        }                                                                                          \
        MT_FOR(l, t, i) {                                                                          \
            if (skip) {                                                                            \
                if (mode & ADAM_ZERO_GRAD) ((H*)l.ptr[0][t])[i] = from_f<H>(0.0f);                 \
                continue;                                                                          \
            }                                                                                      \
            half_adam_element((H*)l.ptr[1][t], (H*)l.ptr[0][t], (H*)l.ptr[2][t],                   \
                              (H*)l.ptr[3][t], i, b1, c1, b2, c2, eps, wd, decay, step_size,       \
                              bias2, mode);                                                        \
        }                                                                                          \
    }
FOR_HALF(HOPTIM)
#define HADAM_COUNT(H)                                                                             \
    extern "C" __global__ void adam_count_##H(double* count, const float* skip) {                 \
        if (blockIdx.x == 0 && threadIdx.x == 0 && !(skip != 0 && *skip != 0.0f)) {                \
            count[0] = count[0] + 1.0;                                                             \
        }                                                                                          \
    }
FOR_HALF(HADAM_COUNT)
