// Kernels of the elementwise family: fill and random numbers, binary ops (and the checked
// integer division), comparisons, unary ops, `pow`, and the in-place `scale` and `axpy`.

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
FOR_ALL(FILL)

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

#define FLOAT_UNARY(T)                         \
    UNARY_OP(exp, e_exp(x), T)                 \
    UNARY_OP(log, e_log(x), T)                 \
    UNARY_OP(sqrt, e_sqrt(x), T)               \
    UNARY_OP(tanh, e_tanh(x), T)               \
    UNARY_OP(sigmoid, sigmoid_elem(x), T)      \
    UNARY_OP(gelu, gelu_elem(x), T)
FOR_FLOAT(FLOAT_UNARY)
