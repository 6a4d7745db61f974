// The fused optimizer steps, one thread per element: SGD (momentum, Nesterov, weight decay) and
// Adam/AdamW, the operations of the CPU's `cpu/optim.rs` one for one (no fused multiply-adds).

#define SGD_WEIGHT_DECAY 1 // g = grad + wd·p
#define SGD_VELOCITY 2     // vel is a velocity to update
#define SGD_NESTEROV 4     // d = g + mu·v instead of v
#define SGD_ZERO_GRAD 8    // grad[i] = 0 once read

#define ADAM_COUPLED 1   // g = grad + wd·p
#define ADAM_DECOUPLED 2 // p = p·decay first
#define ADAM_ZERO_GRAD 4 // grad[i] = 0 once read

#define OPTIM(T)                                                                                   \
    extern "C" __global__ void sgd_update_##T(T* p, T* grad, T* vel, u64 n, T lr, T mu,           \
                                              T wd, int flags) {                                   \
        GRID_STRIDE(i, n) {                                                                        \
            T x = p[i];                                                                            \
            T g = grad[i];                                                                         \
            if (flags & SGD_ZERO_GRAD) grad[i] = (T)0;                                             \
            if (flags & SGD_WEIGHT_DECAY) g = g + wd * x;                                          \
            T d = g;                                                                               \
            if (flags & SGD_VELOCITY) {                                                            \
                T v = mu * vel[i] + g;                                                             \
                vel[i] = v;                                                                        \
                d = (flags & SGD_NESTEROV) ? g + mu * v : v;                                       \
            }                                                                                      \
            p[i] = x - lr * d;                                                                     \
        }                                                                                          \
    }                                                                                              \
    extern "C" __global__ void adam_update_##T(T* p, T* grad, T* m1, T* m2, u64 n, T b1,          \
                                               T c1, T b2, T c2, T eps, T wd, T decay,             \
                                               T step_size, T bias2, int mode) {                   \
        GRID_STRIDE(i, n) {                                                                        \
            T x = p[i];                                                                            \
            T g = grad[i];                                                                         \
            if (mode & ADAM_ZERO_GRAD) grad[i] = (T)0;                                             \
            if (mode & ADAM_COUPLED) g = g + wd * x;                                               \
            if (mode & ADAM_DECOUPLED) x = x * decay;                                              \
            T m = b1 * m1[i] + c1 * g;                                                             \
            T v = b2 * m2[i] + c2 * (g * g);                                                       \
            m1[i] = m;                                                                             \
            m2[i] = v;                                                                             \
            T denom = e_sqrt(v) / bias2 + eps;                                                     \
            p[i] = x - step_size * (m / denom);                                                    \
        }                                                                                          \
    }
FOR_FLOAT(OPTIM)
