//! Counter-based random numbers: value `i` of a draw is a pure function of the seed and the
//! draw's counter offset, so every device (and every thread split) produces the same numbers.

use super::num::Num;
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

/// `ln(x)` for a positive normal `x`, in plain IEEE arithmetic that CUDA's `portable_ln`
/// (`src/backend/cuda/kernels.cu`) repeats operation for operation, so both devices get the
/// same bits (the platform's `ln` and CUDA's `log` may differ in the last place): `x = 2^e·m`
/// with `m` in [√½, √2), and `ln m = 2·atanh(s)` with `s = (m − 1)/(m + 1)`, summed as a series
/// in `s²` (|s| ≤ 0.172, so eleven terms reach double precision).
#[inline(always)]
fn portable_ln(x: f64) -> f64 {
    let bits = x.to_bits();
    let mut e = ((bits >> 52) & 0x7ff) as i64 - 1023;
    let mut m = f64::from_bits((bits & 0x000f_ffff_ffff_ffff) | 0x3ff0_0000_0000_0000);
    if m > std::f64::consts::SQRT_2 {
        m *= 0.5;
        e += 1;
    }
    let s = (m - 1.0) / (m + 1.0);
    let s2 = s * s;
    let mut p = 1.0 / 23.0;
    for k in (0..11).rev() {
        p = p * s2 + 1.0 / (2 * k + 1) as f64;
    }
    e as f64 * std::f64::consts::LN_2 + 2.0 * s * p
}

/// `cos(2π·u)` for `u` in [0, 1), as CUDA's `portable_cos_turn`: `4u = q + r` with a whole
/// quadrant `q` and `r` in [−½, ½], then Taylor series of sin and cos of `r·π/2`.
#[inline(always)]
fn portable_cos_turn(u: f64) -> f64 {
    let t = 4.0 * u;
    let q = (t + 0.5).floor();
    let r = t - q;
    let a = r * std::f64::consts::FRAC_PI_2;
    let a2 = a * a;
    // 1/k! for the even (cos) and odd (sin) k, highest first.
    const COS: [f64; 9] = [
        1.0 / 20922789888000.0,
        1.0 / 87178291200.0,
        1.0 / 479001600.0,
        1.0 / 3628800.0,
        1.0 / 40320.0,
        1.0 / 720.0,
        1.0 / 24.0,
        1.0 / 2.0,
        1.0,
    ];
    const SIN: [f64; 9] = [
        1.0 / 355687428096000.0,
        1.0 / 1307674368000.0,
        1.0 / 6227020800.0,
        1.0 / 39916800.0,
        1.0 / 362880.0,
        1.0 / 5040.0,
        1.0 / 120.0,
        1.0 / 6.0,
        1.0,
    ];
    let c = COS[1..].iter().fold(COS[0], |acc, &k| acc * -a2 + k);
    let s = SIN[1..].iter().fold(SIN[0], |acc, &k| acc * -a2 + k) * a;
    match (q as i64) & 3 {
        0 => c,
        1 => -s,
        2 => -c,
        _ => s,
    }
}

/// A standard normal (Box–Muller on counters 2c and 2c+1), with the portable `ln` and `cos`
/// above, so every device draws the same numbers.
#[inline(always)]
pub(crate) fn normal(seed: u64, counter: u64) -> f64 {
    // 1 - u is in (0, 1], so the logarithm is finite.
    let u1 = 1.0 - uniform(seed, counter.wrapping_mul(2));
    let u2 = uniform(seed, counter.wrapping_mul(2).wrapping_add(1));
    (-2.0 * portable_ln(u1)).sqrt() * portable_cos_turn(u2)
}

fn fill<T: Element>(out: &mut [T], start: u64, value: impl Fn(u64) -> T + Sync) {
    if out.len() < PAR_MIN {
        for (i, o) in out.iter_mut().enumerate() {
            *o = value(start + i as u64);
        }
        return;
    }
    let chunk = chunk_len(out.len());
    // A counter-based draw costs tens of cycles per element, far more than writing it: the
    // policy counts it as 8 passes over `out`.
    let work = super::Work::pass::<T>(out.len(), 8);
    pool::for_each_chunk_mut(out, chunk, work, |c, o| {
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
pub(crate) fn fill_uniform<T: Num>(out: &mut [T], seed: u64, start: u64, low: f64, high: f64) {
    if T::DTYPE.is_half() {
        // A draw just below `high` can round up to it in 8 or 11 mantissa bits: it becomes the
        // largest value below `high` instead, so draws stay in [low, high) (as PyTorch's
        // `rand` for half types keeps them).
        let span = high - low;
        let top = T::from_f64(high);
        let below = top.next_below().maximum(T::from_f64(low));
        fill(out, start, |c| {
            let v = T::from_f64(low + span * uniform(seed, c));
            if span > 0.0 && v >= top {
                below
            } else {
                v
            }
        });
    } else if T::DTYPE.is_float() {
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
    fn portable_functions_match_the_platform_to_the_last_places() {
        for i in 1..=10_000u64 {
            let x = i as f64 / 10_000.0;
            let (mine, std) = (portable_ln(x), x.ln());
            assert!(
                (mine - std).abs() <= 4.0 * f64::EPSILON * std.abs().max(1.0),
                "ln {x}: {mine} vs {std}"
            );
            let u = (i - 1) as f64 / 10_000.0;
            let (mine, std) = (portable_cos_turn(u), (std::f64::consts::TAU * u).cos());
            assert!(
                (mine - std).abs() <= 4.0 * f64::EPSILON,
                "cos {u}: {mine} vs {std}"
            );
        }
        assert_eq!(portable_ln(1.0), 0.0);
        assert_eq!(portable_cos_turn(0.0), 1.0);
    }

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
