// Kernels of the transfer family: dtype conversion (`cast`).

#define CAST(S, D)                                                                     \
    extern "C" __global__ void cast_##S##_##D(const S* a, D* out, u64 n) {             \
        GRID_STRIDE(i, n) out[i] = convert<D, S>(a[i]);                                \
    }
#define CAST_FROM(S) CAST(S, f32) CAST(S, f64) CAST(S, i32) CAST(S, i64) CAST(S, u8)
FOR_ALL(CAST_FROM)
