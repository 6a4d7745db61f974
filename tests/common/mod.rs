//! Helpers shared by the op tests: deterministic test data and reading arrays back as f64.

#![allow(dead_code)] // each test binary uses a different subset

use ndscope::{DType, Manager, NDArray};

/// The number of elements of a shape.
pub fn size(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// `n` deterministic integers in `-span..=span`, different for each `seed`.
pub fn values(n: usize, seed: u64, span: i64) -> Vec<i64> {
    let mut s = seed ^ 0x9E37_79B9_7F4A_7C15;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) % (2 * span as u64 + 1)) as i64 - span
        })
        .collect()
}

/// An array of `dtype` holding `vals`: floats scaled by `scale` (a power of two keeps every
/// sum exact), unsigned bytes as absolute values.
pub fn array(m: &Manager, dtype: DType, shape: &[usize], vals: &[i64], scale: f64) -> NDArray {
    match dtype {
        DType::F32 => m.from_vec(
            vals.iter().map(|&v| (v as f64 * scale) as f32).collect(),
            shape,
        ),
        DType::F64 => m.from_vec(vals.iter().map(|&v| v as f64 * scale).collect(), shape),
        DType::I32 => m.from_vec(vals.iter().map(|&v| v as i32).collect(), shape),
        DType::I64 => m.from_vec(vals.to_vec(), shape),
        DType::U8 => m.from_vec(
            vals.iter().map(|&v| v.unsigned_abs() as u8).collect(),
            shape,
        ),
    }
    .unwrap()
}

/// The elements of any array as f64.
pub fn as_f64(a: &NDArray) -> Vec<f64> {
    match a.dtype() {
        DType::F32 => a
            .to_vec::<f32>()
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect(),
        DType::F64 => a.to_vec::<f64>().unwrap(),
        DType::I32 => a
            .to_vec::<i32>()
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect(),
        DType::I64 => a
            .to_vec::<i64>()
            .unwrap()
            .into_iter()
            .map(|v| v as f64)
            .collect(),
        DType::U8 => a
            .to_vec::<u8>()
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect(),
    }
}
