//! The op tables of the elementwise families (unary, binary, comparison): one row per op, read
//! by every place that needs the list, so that adding an op is one row plus its kernels.
//!
//! Each table is an X-macro: `unary_ops!(consumer)` calls `consumer! { rows }`. The consumers:
//!
//! | consumer | where | what it makes of the rows |
//! |---|---|---|
//! | `define_unary`, `define_binary`, `define_compare` | here | the op enums, their kernel names and dtype classes |
//! | `cpu_unary`, `cpu_binary`, `cpu_compare` | `cpu/ops.rs` | the CPU dispatch: op → kernel, monomorphised per dtype |
//! | `unary_front_ends`, `binary_front_ends`, `compare_front_ends` | `ndarray/ops.rs` | the public `NDArray` methods, with the row's docs |
//! | [`Unary::kernel_name`], [`Binary::kernel_names`], [`Compare::kernel_names`] | `cuda/ops/elementwise.rs`, `cuda/kernels.rs` | the CUDA kernels `<name>_<dtype>` to launch, and to load from the compiled module ([`Unary::ALL`] and friends) |
//!
//! The conventions a row relies on, which the compiler (CPU) and the kernel loader (CUDA,
//! which reports a kernel it cannot find in the compiled module) check:
//!
//! - the CPU kernel of op `name` is the method `name` of `cpu::num::Num` (ops on every dtype)
//!   or `cpu::num::Float` (float ops);
//! - the CUDA kernel of op `name` is `<name>_<dtype>` in the family's `.cu` file (binary ops
//!   also have `<name>_scalar_<dtype>` and `<name>_inplace_<dtype>`, comparisons
//!   `<name>_scalar_<dtype>`).
//!
//! What comes next goes into the rows too: a gradient (the backward of each op) is one more
//! column naming what the backward reads (the input, the output, or both), served by a `Num`/
//! `Float` method `<name>_grad` and a CUDA kernel `<name>_grad_<dtype>` under the same
//! conventions; a fused epilogue (bias + activation after a matrix product) is generated from
//! the unary rows, one kernel per activation, by a consumer in the matmul family.

/// The unary elementwise ops. A row: its docs (those of the `NDArray` method), then
/// `(Variant, name, dtypes)`: `name` is the `NDArray` method, the op's name in errors, the CPU
/// kernel method and the CUDA kernel's base name; `dtypes` is `any` (every dtype: a `Num`
/// method) or `float` (f32 and f64: a `Float` method; the front-end refuses other dtypes with
/// `DTypeMismatch`).
macro_rules! unary_ops {
    ($consumer:ident) => {
        $consumer! {
            /// `-self` elementwise (integers wrap).
            (Neg, neg, any),
            /// `|self|` elementwise (integers wrap at their minimum).
            (Abs, abs, any),
            /// `self * self` elementwise.
            (Square, square, any),
            /// `max(self, 0)` elementwise.
            (Relu, relu, any),
            /// `e^x` elementwise (floats).
            (Exp, exp, float),
            /// The natural logarithm elementwise (floats).
            (Log, log, float),
            /// The square root elementwise (floats).
            (Sqrt, sqrt, float),
            /// The hyperbolic tangent elementwise (floats).
            (Tanh, tanh, float),
            /// `1 / (1 + e^-x)` elementwise (floats).
            (Sigmoid, sigmoid, float),
            /// The GELU activation `0.5·x·(1 + erf(x/√2))` elementwise, in its exact form
            /// (PyTorch's default, not the tanh approximation) (floats).
            (Gelu, gelu, float),
        }
    };
}
pub(crate) use unary_ops;

/// The binary elementwise ops. A row: its docs (those of the `NDArray` method taking an
/// array), then `(Variant, name)`: `name` is that method, the op's name in errors, the CPU
/// kernel (a `Num` method) and the CUDA kernels' base name.
macro_rules! binary_ops {
    ($consumer:ident) => {
        $consumer! {
            /// `self + other`, broadcasting.
            (Add, add),
            /// `self - other`, broadcasting.
            (Sub, sub),
            /// `self * other` elementwise, broadcasting.
            (Mul, mul),
            /// `self / other` elementwise, broadcasting. Integer division truncates toward zero;
            /// an integer divisor containing 0 gives `InvalidArgument`. On a CUDA device the
            /// kernel checks the divisor (no wait for the device): the error comes from the next
            /// wait on that device (a read such as `to_vec`, or `Device::synchronize`), naming
            /// `div` and this call's site, and the quotient holds 0 where the divisor did.
            (Div, div),
            /// The elementwise maximum, broadcasting; NaN wins.
            (Maximum, maximum),
            /// The elementwise minimum, broadcasting; NaN wins.
            (Minimum, minimum),
        }
    };
}
pub(crate) use binary_ops;

/// The elementwise comparisons (results are `U8` 0/1; NaN compares false). A row: its docs
/// (those of the `NDArray` method taking an array), then `(Variant, name, operator)`: `name` is
/// that method, the op's name in errors and the CUDA kernels' base name; `operator` is the
/// Rust comparison the CPU kernel applies.
macro_rules! compare_ops {
    ($consumer:ident) => {
        $consumer! {
            /// `self > other` elementwise, broadcasting: a `U8` array of 0 and 1 (NaN compares
            /// false).
            ///
            /// ```
            /// use ndscope::Manager;
            /// let m = Manager::new_base();
            /// let a = m.from_slice(&[1.0f32, 5.0, 3.0], [3])?;
            /// let b = m.from_slice(&[2.0f32], [1])?;
            /// assert_eq!(a.gt(&b)?.to_vec::<u8>()?, vec![0, 1, 1]);
            /// # Ok::<(), ndscope::Error>(())
            /// ```
            (Gt, gt, >),
            /// `self < other` elementwise, broadcasting: a `U8` array of 0 and 1 (NaN compares
            /// false).
            (Lt, lt, <),
            /// `self == other` elementwise, broadcasting: a `U8` array of 0 and 1 (NaN equals
            /// nothing).
            (Eq, eq, ==),
        }
    };
}
pub(crate) use compare_ops;

/// Whether a unary row's kernels exist for every dtype (`any`) or for floats only (`float`).
macro_rules! is_float_only {
    (any) => {
        false
    };
    (float) => {
        true
    };
}

macro_rules! define_unary {
    ($($(#[doc = $doc:literal])* ($variant:ident, $name:ident, $dtypes:ident)),* $(,)?) => {
        /// The unary elementwise operations (rows of `unary_ops!`).
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub(crate) enum Unary {
            $($variant,)*
        }

        impl Unary {
            /// Every unary op, in table order.
            #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
            pub(crate) const ALL: &'static [Unary] = &[$(Unary::$variant),*];

            /// The base name of the op's CUDA kernels (`<name>_<dtype>`).
            #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
            pub(crate) const fn kernel_name(self) -> &'static str {
                match self {
                    $(Unary::$variant => stringify!($name),)*
                }
            }

            /// Whether the op is defined for floats only.
            pub(crate) const fn float_only(self) -> bool {
                match self {
                    $(Unary::$variant => is_float_only!($dtypes),)*
                }
            }
        }
    };
}
unary_ops!(define_unary);

macro_rules! define_binary {
    ($($(#[doc = $doc:literal])* ($variant:ident, $name:ident)),* $(,)?) => {
        /// The binary elementwise operations (rows of `binary_ops!`).
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub(crate) enum Binary {
            $($variant,)*
        }

        impl Binary {
            /// Every binary op, in table order.
            #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
            pub(crate) const ALL: &'static [Binary] = &[$(Binary::$variant),*];

            /// The base names of the op's CUDA kernels: of two arrays (broadcasting), of an
            /// array and a scalar, and in place.
            #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
            pub(crate) const fn kernel_names(self) -> (&'static str, &'static str, &'static str) {
                match self {
                    $(Binary::$variant => (
                        stringify!($name),
                        concat!(stringify!($name), "_scalar"),
                        concat!(stringify!($name), "_inplace"),
                    ),)*
                }
            }
        }
    };
}
binary_ops!(define_binary);

macro_rules! define_compare {
    ($($(#[doc = $doc:literal])* ($variant:ident, $name:ident, $op:tt)),* $(,)?) => {
        /// The elementwise comparisons (rows of `compare_ops!`; results are `U8` 0/1, NaN
        /// compares false).
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub(crate) enum Compare {
            $($variant,)*
        }

        impl Compare {
            /// Every comparison, in table order.
            #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
            pub(crate) const ALL: &'static [Compare] = &[$(Compare::$variant),*];

            /// The base names of the op's CUDA kernels: of two arrays (broadcasting) and of an
            /// array and a scalar.
            #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
            pub(crate) const fn kernel_names(self) -> (&'static str, &'static str) {
                match self {
                    $(Compare::$variant => (
                        stringify!($name),
                        concat!(stringify!($name), "_scalar"),
                    ),)*
                }
            }
        }
    };
}
compare_ops!(define_compare);
