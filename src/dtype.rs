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
}

impl DType {
    /// Every dtype, in declaration order.
    pub const ALL: [DType; 5] = [DType::F32, DType::F64, DType::I32, DType::I64, DType::U8];

    /// Bytes per element.
    pub const fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::U8 => 1,
        }
    }

    /// `true` for `F32` and `F64`.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64)
    }

    /// The name as Rust spells the element type: `"f32"`, `"f64"`, `"i32"`, `"i64"`, `"u8"`.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
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
}

/// A Rust type that can be an array element: `f32, f64, i32, i64, u8`. Sealed.
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
    /// Converts from `f64` as Rust's `as` does: floats round, integers truncate toward zero and
    /// saturate at their bounds, NaN becomes 0.
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
            _ => $other,
        }
    };
}
pub(crate) use dispatch_float;
