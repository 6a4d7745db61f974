// Kernels of the matrix products: the integer product (cuBLAS does the floats).

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
