//! Half-precision operands through the f32 kernels: `f16` and `bf16` arrays are widened to f32
//! (exactly), computed on by the f32 kernel, and each result is rounded once, to nearest even.
//! The composite kernels (products, softmax, losses, the optimizers' steps, a dense layer's
//! backward) run this way, so their sums and intermediate values stay in f32 as PyTorch's CPU
//! kernels keep them; the elementwise kernels convert per element instead (`num.rs`).

use super::elementwise;
use super::num::Float;

/// A 16-bit float: converts to f32 exactly and back with one rounding to nearest even.
pub(crate) trait Half: Float {
    fn widen(self) -> f32;
    fn narrow(value: f32) -> Self;
}

impl Half for half::f16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn narrow(value: f32) -> Self {
        half::f16::from_f32(value)
    }
}

impl Half for half::bf16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn narrow(value: f32) -> Self {
        half::bf16::from_f32(value)
    }
}

/// `x` as f32 (exact), in a new vector.
pub(crate) fn widen<H: Half>(x: &[H]) -> Vec<f32> {
    let mut out = vec![0.0f32; x.len()];
    elementwise::map(x, &mut out, H::widen);
    out
}

/// `out[i] = x[i]` rounded to nearest even.
pub(crate) fn narrow<H: Half>(x: &[f32], out: &mut [H]) {
    elementwise::map(x, out, H::narrow);
}

/// Runs `$body` with `$h` bound to the Rust type of a half-precision `$dtype` (`F16`, `BF16`);
/// `$other` runs for the rest.
macro_rules! dispatch_half {
    ($dtype:expr, $h:ident => $body:expr, _ => $other:expr) => {
        match $dtype {
            $crate::DType::F16 => {
                type $h = half::f16;
                $body
            }
            $crate::DType::BF16 => {
                type $h = half::bf16;
                $body
            }
            _ => $other,
        }
    };
}
pub(crate) use dispatch_half;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widening_is_exact_and_narrowing_rounds_to_nearest_even() {
        let bits: Vec<u16> = (0..=u16::MAX).step_by(7).collect();
        let h: Vec<half::bf16> = bits.iter().map(|&b| half::bf16::from_bits(b)).collect();
        let w = widen(&h);
        let mut back = vec![half::bf16::ZERO; h.len()];
        narrow(&w, &mut back);
        for (a, b) in h.iter().zip(&back) {
            assert!(a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()));
        }
        // 1 + 2^-8 lies halfway between bf16 1 and 1 + 2^-7: ties go to the even mantissa (1).
        let mut one = [half::bf16::ZERO; 2];
        narrow(&[1.0 + 2f32.powi(-8), 1.0 + 3.0 * 2f32.powi(-8)], &mut one);
        assert_eq!(one[0].to_f32(), 1.0);
        assert_eq!(one[1].to_f32(), 1.0 + 2f32.powi(-6));
    }
}
