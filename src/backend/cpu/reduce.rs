//! Reductions. Float sums accumulate in eight lanes per 4096-element block (vectorised), blocks
//! are combined in f64, and large inputs are split across the pool; integer sums wrap in i64.

use rayon::prelude::*;

use super::{chunk_len, PAR_MIN};
use crate::Element;

const BLOCK: usize = 4096;

fn block_sum_f64<T: Element>(block: &[T]) -> f64 {
    // Eight independent accumulators in the element type let the compiler vectorise; the
    // block is short enough that f32 rounding stays at the level of pairwise summation.
    let mut lanes = [0.0f64; 8];
    let mut chunks = block.chunks_exact(8);
    if T::DTYPE == crate::DType::F32 {
        let mut acc = [0.0f32; 8];
        for c in &mut chunks {
            for (l, &x) in acc.iter_mut().zip(c) {
                *l += x.to_f64() as f32;
            }
        }
        for (l, a) in lanes.iter_mut().zip(acc) {
            *l = a as f64;
        }
    } else {
        for c in &mut chunks {
            for (l, &x) in lanes.iter_mut().zip(c) {
                *l += x.to_f64();
            }
        }
    }
    let tail: f64 = chunks.remainder().iter().map(|x| x.to_f64()).sum();
    lanes.iter().sum::<f64>() + tail
}

/// The sum of a float slice, in f64.
pub(crate) fn sum_float<T: Element>(x: &[T]) -> f64 {
    if x.len() < PAR_MIN {
        return x.chunks(BLOCK).map(block_sum_f64).sum();
    }
    let chunk = chunk_len(x.len()).next_multiple_of(BLOCK);
    x.par_chunks(chunk)
        .map(|c| c.chunks(BLOCK).map(block_sum_f64).sum::<f64>())
        .collect::<Vec<f64>>()
        .into_iter()
        .sum()
}

/// The wrapping sum of an integer slice, in i64.
pub(crate) fn sum_int<T: Element>(x: &[T]) -> i64 {
    let int = |v: T| v.to_f64() as i64;
    if x.len() < PAR_MIN {
        return x.iter().fold(0i64, |acc, &v| acc.wrapping_add(int(v)));
    }
    x.par_chunks(chunk_len(x.len()))
        .map(|c| c.iter().fold(0i64, |acc, &v| acc.wrapping_add(int(v))))
        .reduce(|| 0, i64::wrapping_add)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_sums_are_accurate_and_parallel_sums_agree() {
        let x: Vec<f32> = (0..1_000_003).map(|i| ((i % 97) as f32) * 0.01).collect();
        let exact: f64 = x.iter().map(|&v| v as f64).sum();
        assert!((sum_float(&x) - exact).abs() < 1e-6 * exact);
        let small: Vec<f64> = vec![0.5; 17];
        assert_eq!(sum_float(&small), 8.5);
        let ints: Vec<i32> = (0..100_000).collect();
        assert_eq!(sum_int(&ints), 4_999_950_000);
    }
}
