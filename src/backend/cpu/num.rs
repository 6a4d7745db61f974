//! Arithmetic over the element types: wrapping for integers (as NumPy and PyTorch), IEEE for
//! floats, with NaN propagating through `maximum`/`minimum` (as PyTorch).

use crate::Element;

/// Arithmetic every element type has: among it the CPU kernels of the binary ops and of the
/// unary ops on every dtype, named after the op (the rows of `backend::op_table`).
pub(crate) trait Num: Element {
    fn add(self, other: Self) -> Self;
    fn sub(self, other: Self) -> Self;
    fn mul(self, other: Self) -> Self;
    /// Integer division truncates toward zero and wraps (`MIN / -1 == MIN`); division by zero
    /// gives 0, which front-ends refuse before computing.
    fn div(self, other: Self) -> Self;
    fn maximum(self, other: Self) -> Self;
    fn minimum(self, other: Self) -> Self;
    fn neg(self) -> Self;
    fn abs(self) -> Self;
    #[inline(always)]
    fn square(self) -> Self {
        self.mul(self)
    }
    /// `max(self, 0)`, NaN staying NaN.
    #[inline(always)]
    fn relu(self) -> Self {
        self.maximum(Self::ZERO)
    }
    fn is_zero(self) -> bool;
    /// `true` for a float NaN; never for integers.
    fn is_nan(self) -> bool;
    /// As `i64`: exact for every integer (unlike going through `f64`, which rounds `i64` values
    /// beyond 2^53); floats truncate toward zero and saturate.
    fn to_i64(self) -> i64;
    /// `self` raised to a float power (integers through f64, rounded toward zero).
    fn pow_f64(self, exponent: f64) -> Self;
    /// The largest value below `self` (`self` for integers' and wider floats' callers, which
    /// never ask: only half-precision uniform draws use it).
    #[inline(always)]
    fn next_below(self) -> Self {
        self
    }
}

/// `x^e` for integer arrays: a whole exponent in `0..=64` by repeated squaring in f64 (exact
/// while the result fits 2⁵³, and the same bits as CUDA's `pow_whole` in `kernels.cu`, which
/// does the same multiplications), any other exponent by `powf`.
#[inline(always)]
pub(crate) fn powi_exact(x: f64, e: f64) -> f64 {
    if !(0.0..=64.0).contains(&e) || e.fract() != 0.0 {
        return x.powf(e);
    }
    let (mut base, mut k, mut acc) = (x, e as u32, 1.0f64);
    while k > 0 {
        if k & 1 == 1 {
            acc *= base;
        }
        base *= base;
        k >>= 1;
    }
    acc
}

/// Arithmetic only floats have: the CPU kernels of the float-only unary ops, named after the op
/// (the rows of `backend::op_table`).
pub(crate) trait Float: Num {
    fn exp(self) -> Self;
    /// The natural logarithm.
    fn log(self) -> Self;
    fn sqrt(self) -> Self;
    fn tanh(self) -> Self;
    fn sigmoid(self) -> Self;
    /// The exact GELU, `0.5·x·(1 + erf(x/√2))` (PyTorch's default form, computed in the
    /// element's own precision as PyTorch does; CUDA's `gelu_elem` does the same operations).
    fn gelu(self) -> Self;
}

/// `a` where `wins` or `a` is NaN, else `b`: the floats' `maximum`/`minimum`, NaN propagating
/// as PyTorch's.
#[inline(always)]
fn nan_first<T: Num>(wins: bool, a: T, b: T) -> T {
    if wins || a.is_nan() {
        a
    } else {
        b
    }
}

macro_rules! int_num {
    ($t:ty) => {
        impl Num for $t {
            #[inline(always)]
            fn add(self, o: Self) -> Self {
                self.wrapping_add(o)
            }
            #[inline(always)]
            fn sub(self, o: Self) -> Self {
                self.wrapping_sub(o)
            }
            #[inline(always)]
            fn mul(self, o: Self) -> Self {
                self.wrapping_mul(o)
            }
            #[inline(always)]
            fn div(self, o: Self) -> Self {
                // `MIN / -1` wraps to `MIN`, as every other integer operation wraps.
                if o == 0 {
                    0
                } else {
                    self.wrapping_div(o)
                }
            }
            #[inline(always)]
            fn maximum(self, o: Self) -> Self {
                Ord::max(self, o)
            }
            #[inline(always)]
            fn minimum(self, o: Self) -> Self {
                Ord::min(self, o)
            }
            #[inline(always)]
            fn neg(self) -> Self {
                self.wrapping_neg()
            }
            #[inline(always)]
            #[allow(unused_comparisons)]
            fn abs(self) -> Self {
                if self < 0 {
                    self.wrapping_neg()
                } else {
                    self
                }
            }
            #[inline(always)]
            fn is_zero(self) -> bool {
                self == 0
            }
            #[inline(always)]
            fn is_nan(self) -> bool {
                false
            }
            #[inline(always)]
            fn to_i64(self) -> i64 {
                self as i64
            }
            #[inline(always)]
            fn pow_f64(self, exponent: f64) -> Self {
                powi_exact(self as f64, exponent) as $t
            }
        }
    };
}

int_num!(i32);
int_num!(i64);
int_num!(u8);

macro_rules! float_num {
    ($t:ident, $erf:path) => {
        impl Num for $t {
            #[inline(always)]
            fn add(self, o: Self) -> Self {
                self + o
            }
            #[inline(always)]
            fn sub(self, o: Self) -> Self {
                self - o
            }
            #[inline(always)]
            fn mul(self, o: Self) -> Self {
                self * o
            }
            #[inline(always)]
            fn div(self, o: Self) -> Self {
                self / o
            }
            #[inline(always)]
            fn maximum(self, o: Self) -> Self {
                nan_first(self > o, self, o)
            }
            #[inline(always)]
            fn minimum(self, o: Self) -> Self {
                nan_first(self < o, self, o)
            }
            #[inline(always)]
            fn neg(self) -> Self {
                -self
            }
            #[inline(always)]
            fn abs(self) -> Self {
                <$t>::abs(self)
            }
            #[inline(always)]
            fn is_zero(self) -> bool {
                self == 0.0
            }
            #[inline(always)]
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
            #[inline(always)]
            fn to_i64(self) -> i64 {
                self as i64
            }
            #[inline(always)]
            fn pow_f64(self, exponent: f64) -> Self {
                <$t>::powf(self, exponent as $t)
            }
        }

        impl Float for $t {
            #[inline(always)]
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            #[inline(always)]
            fn log(self) -> Self {
                <$t>::ln(self)
            }
            #[inline(always)]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline(always)]
            fn tanh(self) -> Self {
                <$t>::tanh(self)
            }
            #[inline(always)]
            fn sigmoid(self) -> Self {
                // Stable on both tails: exp of a non-positive number only.
                if self >= 0.0 {
                    1.0 / (1.0 + (-self).exp())
                } else {
                    let e = self.exp();
                    e / (1.0 + e)
                }
            }
            #[inline(always)]
            fn gelu(self) -> Self {
                0.5 * self * (1.0 + $erf(self * std::$t::consts::FRAC_1_SQRT_2))
            }
        }
    };
}

float_num!(f32, libm::erff);
float_num!(f64, libm::erf);

/// `f16` and `bf16`: every operation converts its operands to f32 (exactly), computes there and
/// rounds the result once, to nearest even, as PyTorch's CPU kernels and CUDA's `__half`
/// arithmetic do; comparisons and `maximum`/`minimum` are exact.
macro_rules! half_num {
    ($t:ty) => {
        impl Num for $t {
            #[inline(always)]
            fn add(self, o: Self) -> Self {
                <$t>::from_f32(self.to_f32() + o.to_f32())
            }
            #[inline(always)]
            fn sub(self, o: Self) -> Self {
                <$t>::from_f32(self.to_f32() - o.to_f32())
            }
            #[inline(always)]
            fn mul(self, o: Self) -> Self {
                <$t>::from_f32(self.to_f32() * o.to_f32())
            }
            #[inline(always)]
            fn div(self, o: Self) -> Self {
                <$t>::from_f32(self.to_f32() / o.to_f32())
            }
            #[inline(always)]
            fn maximum(self, o: Self) -> Self {
                nan_first(self > o, self, o)
            }
            #[inline(always)]
            fn minimum(self, o: Self) -> Self {
                nan_first(self < o, self, o)
            }
            #[inline(always)]
            fn neg(self) -> Self {
                -self
            }
            #[inline(always)]
            fn abs(self) -> Self {
                <$t>::from_bits(self.to_bits() & 0x7fff)
            }
            #[inline(always)]
            fn is_zero(self) -> bool {
                self.to_bits() & 0x7fff == 0
            }
            #[inline(always)]
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
            #[inline(always)]
            fn to_i64(self) -> i64 {
                self.to_f32() as i64
            }
            #[inline(always)]
            fn pow_f64(self, exponent: f64) -> Self {
                <$t>::from_f32(self.to_f32().powf(exponent as f32))
            }
            #[inline(always)]
            fn next_below(self) -> Self {
                let bits = self.to_bits();
                if self.is_nan() || bits == <$t>::NEG_INFINITY.to_bits() {
                    self
                } else if bits & 0x7fff == 0 {
                    // ±0: the smallest negative subnormal.
                    <$t>::from_bits(0x8001)
                } else if bits & 0x8000 == 0 {
                    <$t>::from_bits(bits - 1)
                } else {
                    <$t>::from_bits(bits + 1)
                }
            }
        }

        impl Float for $t {
            #[inline(always)]
            fn exp(self) -> Self {
                <$t>::from_f32(self.to_f32().exp())
            }
            #[inline(always)]
            fn log(self) -> Self {
                <$t>::from_f32(self.to_f32().ln())
            }
            #[inline(always)]
            fn sqrt(self) -> Self {
                <$t>::from_f32(self.to_f32().sqrt())
            }
            #[inline(always)]
            fn tanh(self) -> Self {
                <$t>::from_f32(self.to_f32().tanh())
            }
            #[inline(always)]
            fn sigmoid(self) -> Self {
                <$t>::from_f32(Float::sigmoid(self.to_f32()))
            }
            #[inline(always)]
            fn gelu(self) -> Self {
                <$t>::from_f32(Float::gelu(self.to_f32()))
            }
        }
    };
}

half_num!(half::f16);
half_num!(half::bf16);

/// Element conversion by Rust's `as`, the rule of `to_dtype` (and of the CUDA kernels'
/// `convert`): integers to integers wrap (two's complement truncation, as NumPy's `astype` and
/// PyTorch's `to`), integers to floats round to nearest, floats to integers truncate toward zero
/// and saturate at the bounds (NaN gives 0), floats to floats round to nearest.
pub(crate) trait CastTo<D> {
    fn cast(self) -> D;
}

macro_rules! cast_to {
    ($from:ty => $($to:ty),*) => {
        $(impl CastTo<$to> for $from {
            #[inline(always)]
            fn cast(self) -> $to {
                self as $to
            }
        })*
    };
}

cast_to!(f32 => f32, f64, i32, i64, u8);
cast_to!(f64 => f32, f64, i32, i64, u8);
cast_to!(i32 => f32, f64, i32, i64, u8);
cast_to!(i64 => f32, f64, i32, i64, u8);
cast_to!(u8 => f32, f64, i32, i64, u8);

/// `x` rounded to f64 by rounding to odd (see `dtype::f32_round_to_odd`): exact up to 2^53,
/// beyond that truncated toward zero with the last mantissa bit set when bits were cut off.
#[inline]
fn f64_round_to_odd(x: i64) -> f64 {
    let f = x as f64;
    // `f` is a whole number of magnitude at most 2^63, so i128 holds it exactly.
    let back = f as i128;
    if back == i128::from(x) {
        return f;
    }
    let mut bits = f.to_bits();
    if back.abs() > i128::from(x).abs() {
        bits -= 1;
    }
    f64::from_bits(bits | 1)
}

/// Conversions to and from `f16`/`bf16`: into a half type with one rounding to nearest even
/// of the exact value (through f64 rounded to odd for i64), NaN and infinities kept, values
/// beyond the type's range becoming infinities (as CUDA's `__double2half_rn` and
/// `__ll2half_rn`); out of a half type exactly into f32, then by `as`.
macro_rules! cast_half {
    ($h:ty => $($to:ty),*) => {
        $(impl CastTo<$h> for $to {
            #[inline(always)]
            fn cast(self) -> $h {
                <$h as Element>::from_f64(self as f64)
            }
        }
        impl CastTo<$to> for $h {
            #[inline(always)]
            fn cast(self) -> $to {
                self.to_f32() as $to
            }
        })*
        impl CastTo<$h> for f32 {
            #[inline(always)]
            fn cast(self) -> $h {
                <$h>::from_f32(self)
            }
        }
        impl CastTo<f32> for $h {
            #[inline(always)]
            fn cast(self) -> f32 {
                self.to_f32()
            }
        }
        impl CastTo<$h> for $h {
            #[inline(always)]
            fn cast(self) -> $h {
                self
            }
        }
    };
}

cast_half!(half::f16 => f64, i32, u8);
cast_half!(half::bf16 => f64, i32, u8);

macro_rules! cast_i64_half {
    ($($h:ty),*) => {
        $(impl CastTo<$h> for i64 {
            #[inline(always)]
            fn cast(self) -> $h {
                <$h as Element>::from_f64(f64_round_to_odd(self))
            }
        }
        impl CastTo<i64> for $h {
            #[inline(always)]
            fn cast(self) -> i64 {
                self.to_f32() as i64
            }
        })*
    };
}

cast_i64_half!(half::f16, half::bf16);

impl CastTo<half::bf16> for half::f16 {
    #[inline(always)]
    fn cast(self) -> half::bf16 {
        half::bf16::from_f32(self.to_f32())
    }
}

impl CastTo<half::f16> for half::bf16 {
    #[inline(always)]
    fn cast(self) -> half::f16 {
        half::f16::from_f32(self.to_f32())
    }
}

/// f32 values that exercise rounding to f16 and bf16, for the tests of every path that rounds
/// (the bf16 kernel's packing, the widening path): ties to even both ways in each type, values
/// that round up into the next binade or overflow to infinity (65520 in f16, `f32::MAX` in
/// bf16), subnormals, infinities, NaN (quiet and signalling), and signed zeros.
#[cfg(test)]
pub(crate) const ROUNDING_CASES: [f32; 20] = [
    1.0 + 1.0 / 256.0,
    1.0 + 3.0 / 256.0,
    -(1.0 + 1.0 / 256.0),
    1.0 + 1.0 / 256.0 + 1.0 / 1_048_576.0,
    1.0 + 1.0 / 2048.0,
    -(1.0 + 3.0 / 2048.0),
    f32::from_bits(0x3fff_ffff),
    f32::MAX,
    -f32::MAX,
    65520.0,
    f32::from_bits(0x0000_8001),
    f32::from_bits(0x0000_7fff),
    f32::MIN_POSITIVE,
    f32::INFINITY,
    f32::NEG_INFINITY,
    f32::NAN,
    f32::from_bits(0x7f80_0001),
    f32::from_bits(0xff80_8000),
    0.0,
    -0.0,
];
