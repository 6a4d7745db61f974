//! Counter-based random numbers: value `i` of a draw is a pure function of the seed and the
//! draw's counter offset, so every device (and every thread split) produces the same numbers.

use super::{chunk_len, pool, PAR_MIN};
use crate::Element;

/// SplitMix64's finaliser: a bijective 64-bit mix.
#[inline(always)]
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// 64 random bits for `counter` under `seed`.
#[inline(always)]
pub(crate) fn bits(seed: u64, counter: u64) -> u64 {
    mix(mix(seed ^ 0x9E37_79B9_7F4A_7C15).wrapping_add(counter.wrapping_mul(0x9E37_79B9_7F4A_7C15)))
}

/// A uniform f64 in [0, 1) with 53 random bits.
#[inline(always)]
pub(crate) fn uniform(seed: u64, counter: u64) -> f64 {
    (bits(seed, counter) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// A standard normal (Box–Muller on counters 2c and 2c+1).
#[inline(always)]
pub(crate) fn normal(seed: u64, counter: u64) -> f64 {
    // 1 - u is in (0, 1], so the logarithm is finite.
    let u1 = 1.0 - uniform(seed, counter.wrapping_mul(2));
    let u2 = uniform(seed, counter.wrapping_mul(2).wrapping_add(1));
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

fn fill<T: Element>(out: &mut [T], start: u64, value: impl Fn(u64) -> T + Sync) {
    if out.len() < PAR_MIN {
        for (i, o) in out.iter_mut().enumerate() {
            *o = value(start + i as u64);
        }
        return;
    }
    let chunk = chunk_len(out.len());
    pool::for_each_chunk_mut(out, chunk, |c, o| {
        let base = start + (c * chunk) as u64;
        for (i, o) in o.iter_mut().enumerate() {
            *o = value(base + i as u64);
        }
    });
}

/// Fills `out` with normals drawn at counters `start..`.
pub(crate) fn fill_normal<T: Element>(out: &mut [T], seed: u64, start: u64) {
    fill(out, start, |c| T::from_f64(normal(seed, c)));
}

/// Fills `out` with uniforms in [low, high) drawn at counters `start..`; integer types get the
/// integers of [low, high), each equally likely.
pub(crate) fn fill_uniform<T: Element>(out: &mut [T], seed: u64, start: u64, low: f64, high: f64) {
    if T::DTYPE.is_float() {
        let span = high - low;
        fill(out, start, |c| T::from_f64(low + span * uniform(seed, c)));
    } else {
        let (first, count) = (low.ceil(), high.ceil() - low.ceil());
        fill(out, start, |c| {
            T::from_f64(first + (count * uniform(seed, c)).floor().min(count - 1.0))
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_are_reproducible_and_split_independent() {
        let mut whole = vec![0.0f64; 100_000];
        fill_normal(&mut whole, 7, 0);
        let mut tail = vec![0.0f64; 50_000];
        fill_normal(&mut tail, 7, 50_000);
        assert_eq!(&whole[50_000..], &tail[..]);
        let mean = whole.iter().sum::<f64>() / whole.len() as f64;
        let var = whole.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / whole.len() as f64;
        assert!(
            mean.abs() < 0.02 && (var - 1.0).abs() < 0.02,
            "{mean} {var}"
        );
        let mut ints = vec![0i32; 10_000];
        fill_uniform(&mut ints, 1, 0, -3.5, 4.0);
        assert!(ints.iter().all(|&v| (-3..4).contains(&v)));
        assert!((-3..4).all(|v| ints.contains(&v)));
    }
}
