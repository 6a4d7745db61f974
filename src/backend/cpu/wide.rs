//! Half-precision operands through the f32 kernels: `f16` and `bf16` arrays are widened to f32
//! (exactly), computed on by the f32 kernel, and each result is rounded once, to nearest even.
//! The composite kernels (products, softmax, losses, the optimizers' steps, a dense layer's
//! backward) run this way, so their sums and intermediate values stay in f32 as PyTorch's CPU
//! kernels keep them; the elementwise kernels convert per element instead (`num.rs`). bf16
//! products (`matmul`, `gemm`, `linear`) skip the widening of their operands where the CPU has
//! AVX512-BF16: `bf16.rs` computes them into an f32 buffer of this module's, rounded as here.

use std::cell::RefCell;

use half::slice::HalfFloatSliceExt;

use super::elementwise::map_chunks;
use crate::backend::cpu::num::Float;

/// A 16-bit float: converts to f32 exactly and back with one rounding to nearest even, one
/// element or a slice at a time (the slices vectorised: F16C for f16, shifts for bf16).
pub(crate) trait Half: Float {
    fn widen(self) -> f32;
    fn narrow(value: f32) -> Self;
    fn widen_slice(src: &[Self], dst: &mut [f32]);
    fn narrow_slice(src: &[f32], dst: &mut [Self]);
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
    fn widen_slice(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn narrow_slice(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
}

/// bf16 → f32: the bits moved up (exact, NaN payloads kept).
#[inline(always)]
fn bf16_bits_to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// f32 → bf16 bits, rounded to nearest even; NaN stays NaN (made quiet), overflow becomes
/// infinity (the carry runs into the exponent).
#[inline(always)]
fn f32_to_bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x0040) as u16;
    }
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

impl Half for half::bf16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        bf16_bits_to_f32(self.to_bits())
    }
    #[inline(always)]
    fn narrow(value: f32) -> Self {
        half::bf16::from_bits(f32_to_bf16_bits(value))
    }
    fn widen_slice(src: &[Self], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src.reinterpret_cast()) {
            *d = bf16_bits_to_f32(*s);
        }
    }
    fn narrow_slice(src: &[f32], dst: &mut [Self]) {
        for (d, &s) in dst.reinterpret_cast_mut().iter_mut().zip(src) {
            *d = f32_to_bf16_bits(s);
        }
    }
}

thread_local! {
    /// The calling thread's f32 buffers, kept between ops: a product of halves reuses the
    /// memory (and the pages) of the last one instead of faulting in fresh pages every call.
    /// At most `KEEP` of at most `KEEP_ELEMENTS` each.
    static SPARE: RefCell<Vec<Vec<f32>>> = const { RefCell::new(Vec::new()) };
}

/// Most buffers a thread keeps.
const KEEP: usize = 4;

/// The largest buffer a thread keeps, in f32 elements (8 MiB): larger ones (a product of more
/// than 2M-element operands) are freed when the op ends, so a thread holds at most 32 MiB of
/// them outside the memory accounting.
const KEEP_ELEMENTS: usize = 1 << 21;

/// An f32 buffer of the calling thread's, returned to it when dropped.
pub(crate) struct Wide(Vec<f32>);

impl Wide {
    /// `len` zeros.
    pub(crate) fn zeros(len: usize) -> Wide {
        let mut v = Wide::kept(len);
        v.clear();
        v.resize(len, 0.0);
        Wide(v)
    }

    /// `len` elements of unspecified value (those left in the buffer by its last use, zeros
    /// past them): for a buffer the caller writes entirely before reading it, which spares
    /// the zeroing pass of [`Wide::zeros`] over the elements a kept buffer already has.
    pub(crate) fn scratch(len: usize) -> Wide {
        let mut v = Wide::kept(len);
        v.truncate(len);
        v.resize(len, 0.0);
        Wide(v)
    }

    /// The smallest kept buffer that holds `len`, else the largest (it grows), else a new one;
    /// with the elements it had.
    fn kept(len: usize) -> Vec<f32> {
        SPARE
            .with(|s| {
                let mut s = s.borrow_mut();
                let fit = (0..s.len())
                    .filter(|&i| s[i].capacity() >= len)
                    .min_by_key(|&i| s[i].capacity())
                    .or_else(|| (0..s.len()).max_by_key(|&i| s[i].capacity()));
                fit.map(|i| s.swap_remove(i))
            })
            .unwrap_or_default()
    }
}

impl std::ops::Deref for Wide {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.0
    }
}

impl std::ops::DerefMut for Wide {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.0
    }
}

impl Drop for Wide {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.0);
        if v.capacity() > KEEP_ELEMENTS {
            return;
        }
        // During thread teardown the list may be gone: the buffer is then simply freed.
        let _ = SPARE.try_with(|s| {
            let mut s = s.borrow_mut();
            if s.len() < KEEP {
                s.push(v);
            } else if let Some(small) = s.iter_mut().min_by_key(|b| b.capacity()) {
                if small.capacity() < v.capacity() {
                    *small = v;
                }
            }
        });
    }
}

/// `x` as f32 (exact), in a buffer of the calling thread's.
pub(crate) fn widen<H: Half>(x: &[H]) -> Wide {
    let mut out = Wide::zeros(x.len());
    map_chunks(x, &mut out, H::widen_slice);
    out
}

/// f32 values rounded to `H` (as `to_dtype` rounds them) and widened back, exactly: what a half
/// copy of `x` would widen to, with no copy made. `transpose = Some((rows, cols))` reads `x` as
/// `[rows, cols]` and gives its transpose `[cols, rows]` (so a product reads it as stored).
pub(crate) fn widen_rounded<H: Half>(x: &[f32], transpose: Option<(usize, usize)>) -> Wide {
    let mut rounded = Wide::scratch(x.len()); // every element written below
    map_chunks(x, &mut rounded, |src, dst| {
        // Through a small buffer of halves: the slice conversions are vectorised.
        let mut halves = [H::narrow(0.0); 256];
        for (src, dst) in src.chunks(256).zip(dst.chunks_mut(256)) {
            let halves = &mut halves[..src.len()];
            H::narrow_slice(src, halves);
            H::widen_slice(halves, dst);
        }
    });
    let Some((rows, cols)) = transpose else {
        return rounded;
    };
    assert_eq!(
        x.len(),
        rows * cols,
        "widen_rounded: {} values for [{rows}, {cols}]",
        x.len()
    );
    let mut out = Wide::scratch(x.len()); // every element written by the transpose
    super::shape::transpose(&rounded, rows, cols, &mut out);
    out
}

/// `out[i] = x[i]` rounded to nearest even.
pub(crate) fn narrow<H: Half>(x: &[f32], out: &mut [H]) {
    map_chunks(x, out, H::narrow_slice);
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
    use crate::backend::cpu::num::ROUNDING_CASES;

    #[test]
    fn widening_a_rounded_f32_gives_what_its_half_copy_widens_to() {
        fn check<H: Half>() {
            // 5000 bit patterns spread over the whole f32 range (more than one chunk of the
            // pool's), the first ones the cases that matter: ties of both types, values that
            // round into the next binade or overflow, subnormals, infinities and NaN.
            let special = ROUNDING_CASES;
            let x: Vec<f32> = (0..5000u32)
                .map(|i| match special.get(i as usize) {
                    Some(&v) => v,
                    None => f32::from_bits(i.wrapping_mul(858_993_459) ^ (i << 3)),
                })
                .collect();
            let want: Vec<u32> = x.iter().map(|&v| H::narrow(v).widen().to_bits()).collect();
            let got = widen_rounded::<H>(&x, None);
            assert_eq!(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want);
            let (rows, cols) = (50, 100);
            let t = widen_rounded::<H>(&x, Some((rows, cols)));
            for r in 0..rows {
                for c in 0..cols {
                    assert_eq!(t[c * rows + r].to_bits(), want[r * cols + c], "({r}, {c})");
                }
            }
        }
        check::<half::bf16>();
        check::<half::f16>();
    }

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
