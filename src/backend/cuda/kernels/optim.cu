// The fused optimizer steps, one thread per element: SGD (momentum, Nesterov, weight decay) and
// Adam/AdamW, the operations of the CPU's `cpu/optim.rs` one for one (no fused multiply-adds).
// Each comes as a kernel over one tensor and a multi-tensor kernel over up to MT_TENSORS
// tensors in one launch; both run the same per-element device function.

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
};

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
        MT_FOR(l, t, i) {                                                                          \
            sgd_element_##T((T*)l.ptr[1][t], (T*)l.ptr[0][t], (T*)l.ptr[2][t], i, lr, mu, wd,      \
                            flags);                                                                \
        }                                                                                          \
    }                                                                                              \
    extern "C" __global__ void adam_multi_##T(TensorList l, T b1, T c1, T b2, T c2, T eps, T wd,  \
                                              T decay, T step_size, T bias2, int mode) {           \
        MT_FOR(l, t, i) {                                                                          \
            adam_element_##T((T*)l.ptr[1][t], (T*)l.ptr[0][t], (T*)l.ptr[2][t],                   \
                             (T*)l.ptr[3][t], i, b1, c1, b2, c2, eps, wd, decay, step_size, bias2, \
                             mode);                                                                \
        }                                                                                          \
    }
FOR_FLOAT(OPTIM)
