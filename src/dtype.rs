//! Element types.

use std::fmt;

/// The element type of an array. Comparison results are [`DType::U8`] holding 0 or 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// 64-bit IEEE float.
    F64,
    /// 32-bit signed integer.
    I32,
    /// 64-bit signed integer.
    I64,
    /// 8-bit unsigned integer; also the boolean type (0 or 1).
    U8,
    /// 16-bit IEEE half-precision float ([`half::f16`]: 5 exponent bits, 10 mantissa bits).
    /// Arithmetic computes in f32 and rounds each result once, to nearest even.
    F16,
    /// 16-bit brain float ([`half::bf16`]: f32's 8 exponent bits, 7 mantissa bits). Arithmetic
    /// computes in f32 and rounds each result once, to nearest even.
    BF16,
}

impl DType {
    /// Every dtype, in declaration order.
    pub const ALL: [DType; 7] = [
        DType::F32,
        DType::F64,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::F16,
        DType::BF16,
    ];

    /// Bytes per element.
    pub const fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::U8 => 1,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// `true` for `F32`, `F64`, `F16` and `BF16`.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    /// `true` for the 16-bit floats `F16` and `BF16`, which compute in f32.
    pub const fn is_half(self) -> bool {
        matches!(self, DType::F16 | DType::BF16)
    }

    /// The name as Rust spells the element type: `"f32"`, `"f64"`, `"i32"`, `"i64"`, `"u8"`,
    /// `"f16"`, `"bf16"` (the last two as the `half` crate names them).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
    impl Sealed for i32 {}
    impl Sealed for i64 {}
    impl Sealed for u8 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// A Rust type that can be an array element: `f32, f64, i32, i64, u8`, and `half`'s `f16` and
/// `bf16`. Sealed.
pub trait Element:
    sealed::Sealed
    + Copy
    + Send
    + Sync
    + PartialEq
    + PartialOrd
    + Default
    + fmt::Debug
    + fmt::Display
    + 'static
{
    /// The matching [`DType`].
    const DTYPE: DType;
    /// Zero.
    const ZERO: Self;
    /// One.
    const ONE: Self;
    /// Converts to `f64` (exact for every value except large `i64`).
    fn to_f64(self) -> f64;
    /// Converts from `f64` as Rust's `as` does: floats round (to nearest even, once: `f16` and
    /// `bf16` straight from the f64, as CUDA's `__double2half_rn` does), integers truncate
    /// toward zero and saturate at their bounds, NaN becomes 0.
    fn from_f64(value: f64) -> Self;
}

macro_rules! element {
    ($t:ty, $d:expr, $zero:expr, $one:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            const ZERO: Self = $zero;
            const ONE: Self = $one;
            #[inline(always)]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline(always)]
            fn from_f64(value: f64) -> Self {
                value as $t
            }
        }
    };
}

element!(f32, DType::F32, 0.0, 1.0);
element!(f64, DType::F64, 0.0, 1.0);
element!(i32, DType::I32, 0, 1);
element!(i64, DType::I64, 0, 1);
element!(u8, DType::U8, 0, 1);

/// `value` rounded to f32 by rounding to odd: truncated toward zero, with the last mantissa bit
/// set when anything was cut off. Rounding that once more to nearest even in a format at least
/// two bits narrower (f16's 11 bits, bf16's 8) gives the correctly rounded result of `value`,
/// which rounding to nearest twice (f64 → f32 → half) does not always (and `half`'s own f64
/// conversions read only the top 32 bits of the f64). NaN and infinities pass through.
#[inline]
pub(crate) fn f32_round_to_odd(value: f64) -> f32 {
    let f = value as f32;
    if !value.is_finite() || f as f64 == value {
        return f;
    }
    // Inexact (or beyond f32's range): the f32 toward zero, its last bit set.
    let mut bits = f.to_bits();
    if f.is_infinite() || (f as f64).abs() > value.abs() {
        bits -= 1;
    }
    f32::from_bits(bits | 1)
}

macro_rules! half_element {
    ($t:ty, $d:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            const ZERO: Self = <$t>::ZERO;
            const ONE: Self = <$t>::ONE;
            #[inline(always)]
            fn to_f64(self) -> f64 {
                self.to_f64()
            }
            #[inline(always)]
            fn from_f64(value: f64) -> Self {
                <$t>::from_f32(f32_round_to_odd(value))
            }
        }
    };
}

half_element!(half::f16, DType::F16);
half_element!(half::bf16, DType::BF16);

/// Runs `$body` with `$t` bound to the Rust type of `$dtype`.
macro_rules! dispatch {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $t = f32;
                $body
            }
            $crate::DType::F64 => {
                type $t = f64;
                $body
            }
            $crate::DType::I32 => {
                type $t = i32;
                $body
            }
            $crate::DType::I64 => {
                type $t = i64;
                $body
            }
            $crate::DType::U8 => {
                type $t = u8;
                $body
            }
            $crate::DType::F16 => {
                type $t = half::f16;
                $body
            }
            $crate::DType::BF16 => {
                type $t = half::bf16;
                $body
            }
        }
    };
}
pub(crate) use dispatch;

/// Like [`dispatch`], for the float dtypes only; `$other` runs for the rest.
macro_rules! dispatch_float {
    ($dtype:expr, $t:ident => $body:expr, _ => $other:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $t = f32;
                $body
            }
            $crate::DType::F64 => {
                type $t = f64;
                $body
            }
            $crate::DType::F16 => {
                type $t = half::f16;
                $body
            }
            $crate::DType::BF16 => {
                type $t = half::bf16;
                $body
            }
            _ => $other,
        }
    };
}
pub(crate) use dispatch_float;

#[cfg(test)]
mod tests {
    use super::*;

    /// Into a half type, an f64 is rounded once: a value just above the midpoint of two halves
    /// whose nearest f32 is that midpoint rounds up (twice rounded, it would go to the even one).
    #[test]
    fn f64_to_half_rounds_once() {
        let above = 1.0 + 2f64.powi(-11) + 2f64.powi(-40);
        assert_eq!(half::f16::from_f64_rounded(above), 1.0 + 2f64.powi(-10));
        let below = 1.0 + 2f64.powi(-11) - 2f64.powi(-40);
        assert_eq!(half::f16::from_f64_rounded(below), 1.0);
        let above = 1.0 + 2f64.powi(-8) + 2f64.powi(-40);
        assert_eq!(half::bf16::from_f64_rounded(above), 1.0 + 2f64.powi(-7));
        // Exact ties still go to even, exact values stay, specials pass.
        assert_eq!(half::f16::from_f64_rounded(1.0 + 2f64.powi(-11)), 1.0);
        assert_eq!(half::f16::from_f64_rounded(-3.5), -3.5);
        assert_eq!(half::f16::from_f64_rounded(1e10), f64::INFINITY);
        assert_eq!(half::f16::from_f64_rounded(-1e-30), 0.0);
        assert!(half::bf16::from_f64_rounded(f64::NAN).is_nan());
    }

    trait Rounded {
        fn from_f64_rounded(v: f64) -> f64;
    }

    impl<T: Element> Rounded for T {
        fn from_f64_rounded(v: f64) -> f64 {
            T::from_f64(v).to_f64()
        }
    }
}
