// Kernels that move elements by size: `gather` (assign, broadcast, permute), `transpose`,
// and the pitched row copies of narrow and concat.

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
COPY_ROWS(b2, u16)
COPY_ROWS(b4, u32)
COPY_ROWS(b8, u64)
GATHER(b1, u8)
GATHER(b2, u16)
GATHER(b4, u32)
GATHER(b8, u64)
