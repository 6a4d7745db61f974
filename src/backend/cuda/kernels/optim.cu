// The fused optimizer steps, one thread per element: SGD (momentum, Nesterov, weight decay) and
// Adam/AdamW, the operations of the CPU's `cpu/optim.rs` one for one (no fused multiply-adds).
// Each comes as a kernel over one tensor and a multi-tensor kernel over up to MT_TENSORS
// tensors in one launch; both run the same per-element device function.

// The flags, `TensorList` and `MT_FOR` are in device.cu (the half-precision program uses them
// too).

#define OPTIM(T)                                                                                   \
    __device__ __forceinline__ void sgd_element_##T(T* p, T* grad, T* vel, u64 i, T lr, T mu,     \
                                                    T wd, int flags) {                             \
        T x = p[i];                                                                                \
        T g = grad[i];                                                                             \
        if (flags & SGD_ZERO_GRAD) grad[i] = (T)0;                                                 \
        if (flags & SGD_WEIGHT_DECAY) g = g + wd * x;                                              \
        T d = g;                                                                                   \
        if (flags & SGD_VELOCITY) {                                                                \
            T v = mu * vel[i] + g;                                                                 \
            vel[i] = v;                                                                            \
            d = (flags & SGD_NESTEROV) ? g + mu * v : v;                                           \
        }                                                                                          \
        p[i] = x - lr * d;                                                                         \
    }                                                                                              \
    __device__ __forceinline__ void adam_element_##T(T* p, T* grad, T* m1, T* m2, u64 i, T b1,    \
                                                     T c1, T b2, T c2, T eps, T wd, T decay,       \
                                                     T step_size, T bias2, int mode) {             \
        T x = p[i];                                                                                \
        T g = grad[i];                                                                             \
        if (mode & ADAM_ZERO_GRAD) grad[i] = (T)0;                                                 \
        if (mode & ADAM_COUPLED) g = g + wd * x;                                                   \
        if (mode & ADAM_DECOUPLED) x = x * decay;                                                  \
        T m = b1 * m1[i] + c1 * g;                                                                 \
        T v = b2 * m2[i] + c2 * (g * g);                                                           \
        m1[i] = m;                                                                                 \
        m2[i] = v;                                                                                 \
        T denom = e_sqrt(v) / bias2 + eps;                                                         \
        p[i] = x - step_size * (m / denom);                                                        \
    }                                                                                              \
    extern "C" __global__ void sgd_update_##T(T* p, T* grad, T* vel, u64 n, T lr, T mu,           \
                                              T wd, int flags) {                                   \
        GRID_STRIDE(i, n) { sgd_element_##T(p, grad, vel, i, lr, mu, wd, flags); }                 \
    }                                                                                              \
    extern "C" __global__ void adam_update_##T(T* p, T* grad, T* m1, T* m2, u64 n, T b1,          \
                                               T c1, T b2, T c2, T eps, T wd, T decay,             \
                                               T step_size, T bias2, int mode) {                   \
        GRID_STRIDE(i, n) {                                                                        \
            adam_element_##T(p, grad, m1, m2, i, b1, c1, b2, c2, eps, wd, decay, step_size,        \
                             bias2, mode);                                                         \
        }                                                                                          \
    }                                                                                              \
    extern "C" __global__ void sgd_multi_##T(TensorList l, T lr, T mu, T wd, int flags) {         \
        bool skip = mt_skipped(l);                                                                 \
        MT_FOR(l, t, i) {                                                                          \
            if (skip) {                                                                            \
                if (flags & SGD_ZERO_GRAD) ((T*)l.ptr[0][t])[i] = (T)0;                            \
                continue;                                                                          \
            }                                                                                      \
            sgd_element_##T((T*)l.ptr[1][t], (T*)l.ptr[0][t], (T*)l.ptr[2][t], i, lr, mu, wd,      \
                            flags);                                                                \
        }                                                                                          \
    }                                                                                              \
    extern "C" __global__ void adam_multi_##T(TensorList l, T b1, T c1, T b2, T c2, T eps, T wd,  \
                                              T decay, T step_size, T bias2, int mode,             \
                                              const double* count, double lr, double b1d,          \
                                              double b2d) {                                        \
        bool skip = mt_skipped(l);                                                                 \
        if (count != 0) {                                                                          \
            /* The bias corrections of the step the device counts (see adam_count). */             \
            double steps = count[0] + 1.0;                                                         \
            step_size = (T)(lr / (1.0 - pow(b1d, steps)));                                         \
            bias2 = (T)sqrt(1.0 - pow(b2d, steps));                                                \
        }                                                                                          \
        MT_FOR(l, t, i) {                                                                          \
            if (skip) {                                                                            \
                if (mode & ADAM_ZERO_GRAD) ((T*)l.ptr[0][t])[i] = (T)0;                            \
                continue;                                                                          \
            }                                                                                      \
            adam_element_##T((T*)l.ptr[1][t], (T*)l.ptr[0][t], (T*)l.ptr[2][t],                   \
                             (T*)l.ptr[3][t], i, b1, c1, b2, c2, eps, wd, decay, step_size, bias2, \
                             mode);                                                                \
        }                                                                                          \
    }
FOR_FLOAT(OPTIM)

// An Adam step's device-side count of the steps taken, after the step's launches: one more
// unless the step's flag skipped it (a loss scaler's non-finite gradient), so that the bias
// corrections follow the steps taken without the host learning which were skipped.
#define ADAM_COUNT(T)                                                                              \
    extern "C" __global__ void adam_count_##T(double* count, const float* skip) {                 \
        if (blockIdx.x == 0 && threadIdx.x == 0 && !(skip != 0 && *skip != 0.0f)) {                \
            count[0] = count[0] + 1.0;                                                             \
        }                                                                                          \
    }
FOR_FLOAT(ADAM_COUNT)
