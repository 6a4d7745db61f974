//! Printing arrays: `Display` for [`NDArray`] in NumPy's style, with options set process-wide
//! like candle's `set_print_options` (or NumPy's `set_printoptions`).
//!
//! ```
//! use ndscope::{DType, Manager};
//! let m = Manager::new_base();
//! let a = m.from_slice(&[1.0f32, 2.5, -3.0, 4.125], [2, 2])?;
//! assert_eq!(
//!     a.to_string(),
//!     "array([[ 1.   ,  2.5  ],\n       [-3.   ,  4.125]], shape=[2, 2], dtype=f32)"
//! );
//! let big = m.arange(0.0, 2000.0, 1.0, DType::I32)?;
//! assert_eq!(
//!     big.to_string(),
//!     "array([   0,    1,    2, ..., 1997, 1998, 1999], shape=[2000], dtype=i32)"
//! );
//! a.close()?;
//! assert!(a.to_string().starts_with("array(<closed: closed by the user at "));
//! m.close()?;
//! # Ok::<(), ndscope::Error>(())
//! ```

use std::collections::HashMap;
use std::fmt::{self, Write as _};

use parking_lot::RwLock;

use crate::backend::layout::contiguous_strides;
use crate::{DType, Device, Error, NDArray};

/// How arrays print (NumPy's `printoptions`, candle's `PrinterOptions`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrintOptions {
    /// Digits after the decimal point for floats, at most (trailing zeros are dropped, as
    /// NumPy does). A precision given in the format string (`{:.2}`) overrides it.
    pub precision: usize,
    /// Arrays with more elements than this are summarised: each axis longer than
    /// `2 × edge_items` shows its first and last `edge_items` entries around `...`.
    pub threshold: usize,
    /// Entries shown at each end of a summarised axis.
    pub edge_items: usize,
    /// Characters per line before a row wraps.
    pub line_width: usize,
    /// `Some(true)` always prints floats in scientific notation, `Some(false)` never; `None`
    /// chooses as NumPy does (scientific when the largest magnitude is at least 1e8, or the
    /// smallest non-zero one below 1e-4, or they differ by more than 1000×).
    pub sci_mode: Option<bool>,
}

impl Default for PrintOptions {
    /// Precision 4, threshold 1000, 3 edge items, 75 characters a line, notation chosen by the
    /// values.
    fn default() -> Self {
        PrintOptions::DEFAULT
    }
}

impl PrintOptions {
    /// The defaults, as a constant for the process-wide options' initial value.
    const DEFAULT: PrintOptions = PrintOptions {
        precision: 4,
        threshold: 1000,
        edge_items: 3,
        line_width: 75,
        sci_mode: None,
    };

    /// Short output: precision 2, threshold 21, 2 edge items (candle's `short`).
    pub fn short() -> Self {
        PrintOptions {
            precision: 2,
            threshold: 21,
            edge_items: 2,
            ..PrintOptions::default()
        }
    }

    /// Every element, never summarised (candle's `full`).
    pub fn full() -> Self {
        PrintOptions {
            threshold: usize::MAX,
            ..PrintOptions::default()
        }
    }
}

static OPTIONS: RwLock<PrintOptions> = RwLock::new(PrintOptions::DEFAULT);

/// Sets how arrays print, for the whole process.
///
/// ```
/// use ndscope::{print_options, set_print_options, Manager, PrintOptions};
/// let m = Manager::new_base();
/// let a = m.from_slice(&[1.0f64 / 3.0], [1])?;
/// let before = print_options();
/// set_print_options(PrintOptions { precision: 2, ..before.clone() });
/// let text = a.to_string();
/// set_print_options(before);
/// assert_eq!(text, "array([0.33], shape=[1], dtype=f64)");
/// m.close()?;
/// # Ok::<(), ndscope::Error>(())
/// ```
pub fn set_print_options(options: PrintOptions) {
    *OPTIONS.write() = options;
}

/// The options arrays print with now.
pub fn print_options() -> PrintOptions {
    OPTIONS.read().clone()
}

/// The values read for printing.
enum Values {
    Float(Vec<f64>),
    Int(Vec<i64>),
}

impl Values {
    fn read(a: &NDArray) -> crate::Result<Values> {
        Ok(match a.dtype() {
            DType::F32 => Values::Float(a.to_vec::<f32>()?.into_iter().map(f64::from).collect()),
            DType::F64 => Values::Float(a.to_vec::<f64>()?),
            DType::I32 => Values::Int(a.to_vec::<i32>()?.into_iter().map(i64::from).collect()),
            DType::I64 => Values::Int(a.to_vec::<i64>()?),
            DType::U8 => Values::Int(a.to_vec::<u8>()?.into_iter().map(i64::from).collect()),
            DType::F16 => Values::Float(
                a.to_vec::<half::f16>()?
                    .into_iter()
                    .map(f64::from)
                    .collect(),
            ),
            DType::BF16 => Values::Float(
                a.to_vec::<half::bf16>()?
                    .into_iter()
                    .map(f64::from)
                    .collect(),
            ),
        })
    }
}

/// The flat indices of the elements shown, in order.
fn shown(dims: &[usize], summarize: bool, edge: usize) -> Vec<usize> {
    fn go(dims: &[usize], strides: &[usize], base: usize, s: bool, e: usize, out: &mut Vec<usize>) {
        let Some((&n, rest)) = dims.split_first() else {
            out.push(base);
            return;
        };
        for i in axis_indices(n, s, e).into_iter().flatten() {
            go(rest, &strides[1..], base + i * strides[0], s, e, out);
        }
    }
    let strides = contiguous_strides(dims);
    let mut out = Vec::new();
    go(dims, &strides, 0, summarize, edge, &mut out);
    out
}

/// The indices shown along an axis of length `n`; `None` stands for the `...`.
fn axis_indices(n: usize, summarize: bool, edge: usize) -> Vec<Option<usize>> {
    if summarize && n > 2 * edge {
        (0..edge)
            .map(Some)
            .chain(std::iter::once(None))
            .chain((n - edge..n).map(Some))
            .collect()
    } else {
        (0..n).map(Some).collect()
    }
}

/// Formats the shown floats, all to one width, NumPy's way (`maxprec`: at most `precision`
/// digits, trailing zeros dropped and decimal points aligned; in scientific notation every
/// mantissa gets the digits of the longest).
fn format_floats(values: &[f64], precision: usize, sci_mode: Option<bool>) -> Vec<String> {
    let finite: Vec<f64> = values
        .iter()
        .copied()
        .filter(|v| v.is_finite())
        .map(f64::abs)
        .collect();
    let max = finite.iter().copied().fold(0.0, f64::max);
    let min_nonzero = finite
        .iter()
        .copied()
        .filter(|&v| v > 0.0)
        .fold(f64::INFINITY, f64::min);
    let sci = sci_mode.unwrap_or(
        max >= 1e8 || (min_nonzero.is_finite() && (min_nonzero < 1e-4 || max / min_nonzero > 1e3)),
    );
    // (sign and integer part, fraction digits, exponent) per finite value.
    let parts: Vec<Option<(String, String, String)>> = values
        .iter()
        .map(|&v| {
            if !v.is_finite() {
                return None;
            }
            let text = if sci {
                format!("{v:.precision$e}")
            } else {
                format!("{v:.precision$}")
            };
            let (mantissa, exp) = match text.split_once('e') {
                Some((m, e)) => {
                    let (sign, digits) = match e.strip_prefix('-') {
                        Some(d) => ("-", d),
                        None => ("+", e),
                    };
                    (m.to_string(), format!("e{sign}{digits:0>2}"))
                }
                None => (text, String::new()),
            };
            let (int, frac) = match mantissa.split_once('.') {
                Some((i, f)) => (i.to_string(), f.trim_end_matches('0').to_string()),
                None => (mantissa, String::new()),
            };
            Some((int, frac, exp))
        })
        .collect();
    let int_w = parts.iter().flatten().map(|p| p.0.len()).max().unwrap_or(0);
    let frac_w = parts.iter().flatten().map(|p| p.1.len()).max().unwrap_or(0);
    let exp_w = parts.iter().flatten().map(|p| p.2.len()).max().unwrap_or(0);
    let mut cells: Vec<String> = values
        .iter()
        .zip(&parts)
        .map(|(&v, p)| match p {
            Some((int, frac, exp)) => {
                let exp = if exp.len() < exp_w {
                    // e+05 and e+100 in one column: pad the digits with zeros.
                    format!("{}{:0>w$}", &exp[..2], &exp[2..], w = exp_w - 2)
                } else {
                    exp.clone()
                };
                if sci {
                    // NumPy gives every mantissa the same digits in scientific notation.
                    format!("{int:>int_w$}.{frac:0<frac_w$}{exp}")
                } else {
                    format!("{int:>int_w$}.{frac:<frac_w$}{exp}")
                }
            }
            None if v.is_nan() => "nan".to_string(),
            None if v > 0.0 => "inf".to_string(),
            None => "-inf".to_string(),
        })
        .collect();
    let width = cells.iter().map(String::len).max().unwrap_or(0);
    for c in &mut cells {
        if c.len() < width {
            *c = format!("{c:>width$}");
        }
    }
    cells
}

fn format_ints(values: &[i64]) -> Vec<String> {
    let cells: Vec<String> = values.iter().map(i64::to_string).collect();
    let width = cells.iter().map(String::len).max().unwrap_or(0);
    cells.into_iter().map(|c| format!("{c:>width$}")).collect()
}

/// Lays out the nested brackets, NumPy's way.
struct Layout<'a> {
    cells: &'a HashMap<usize, String>,
    summarize: bool,
    edge: usize,
    line_width: usize,
    /// Columns taken by `array(`.
    prefix: usize,
}

impl Layout<'_> {
    fn block(
        &self,
        out: &mut String,
        dims: &[usize],
        strides: &[usize],
        base: usize,
        depth: usize,
    ) {
        let indent = self.prefix + depth + 1;
        out.push('[');
        if dims.len() == 1 {
            let mut line = self.prefix + depth + 1;
            let items = axis_indices(dims[0], self.summarize, self.edge);
            let count = items.len();
            for (k, i) in items.into_iter().enumerate() {
                let cell = match i {
                    Some(i) => self.cells.get(&(base + i)).map_or("?", String::as_str),
                    None => "...",
                };
                let last = k + 1 == count;
                // The cell, its separator, and on the last one the closing brackets.
                let need = cell.len() + if last { depth + 1 } else { 1 };
                if k > 0 {
                    if line + 1 + need > self.line_width {
                        out.push('\n');
                        out.extend(std::iter::repeat_n(' ', indent));
                        line = indent;
                    } else {
                        out.push(' ');
                        line += 1;
                    }
                }
                out.push_str(cell);
                line += cell.len();
                if !last {
                    out.push(',');
                    line += 1;
                }
            }
        } else {
            let items = axis_indices(dims[0], self.summarize, self.edge);
            for (k, i) in items.into_iter().enumerate() {
                if k > 0 {
                    out.push(',');
                    // One newline per row, plus a blank line per extra dimension below.
                    for _ in 0..dims.len() - 1 {
                        out.push('\n');
                    }
                    out.extend(std::iter::repeat_n(' ', indent));
                }
                match i {
                    Some(i) => self.block(
                        out,
                        &dims[1..],
                        &strides[1..],
                        base + i * strides[0],
                        depth + 1,
                    ),
                    None => out.push_str("..."),
                }
            }
        }
        out.push(']');
    }
}

/// The whole `array(...)` text.
fn render(a: &NDArray, precision: Option<usize>) -> String {
    let options = print_options();
    let precision = precision.unwrap_or(options.precision);
    let mut out = String::from("array(");
    let dims = a.dims().to_vec();
    let line_width = options.line_width.max(10);
    // `shape=…, dtype=…` on the last line if it fits, else on a line of its own (as NumPy).
    let suffix = |out: &mut String| {
        let mut tail = format!("shape={}, dtype={}", a.shape(), a.dtype());
        if a.device() != Device::Cpu {
            let _ = write!(tail, ", device={}", a.device());
        }
        let last_line = out.rsplit('\n').next().map_or(0, str::len);
        if last_line + 2 + tail.len() + 1 > line_width && out.contains('[') {
            out.push_str(",\n      ");
        } else {
            out.push_str(", ");
        }
        out.push_str(&tail);
        out.push(')');
    };
    let values = match Values::read(a) {
        Ok(values) => values,
        Err(Error::ArrayClosed { reason, .. }) => {
            let _ = write!(out, "<closed: {reason}>");
            suffix(&mut out);
            return out;
        }
        Err(e) => {
            let _ = write!(out, "<unreadable: {e}>");
            suffix(&mut out);
            return out;
        }
    };
    let size: usize = dims.iter().product();
    let summarize = size > options.threshold;
    let edge = options.edge_items.max(1);
    let index = shown(&dims, summarize, edge);
    let texts = match &values {
        Values::Float(v) => {
            let picked: Vec<f64> = index.iter().filter_map(|&i| v.get(i).copied()).collect();
            format_floats(&picked, precision, options.sci_mode)
        }
        Values::Int(v) => {
            let picked: Vec<i64> = index.iter().filter_map(|&i| v.get(i).copied()).collect();
            format_ints(&picked)
        }
    };
    if dims.is_empty() {
        out.push_str(texts.first().map_or("?", |t| t.trim_start()));
        suffix(&mut out);
        return out;
    }
    if size == 0 {
        out.push_str("[]");
        suffix(&mut out);
        return out;
    }
    let cells: HashMap<usize, String> = index.into_iter().zip(texts).collect();
    let layout = Layout {
        cells: &cells,
        summarize,
        edge,
        line_width,
        prefix: "array(".len(),
    };
    layout.block(&mut out, &dims, &contiguous_strides(&dims), 0, 0);
    suffix(&mut out);
    out
}

impl fmt::Display for NDArray {
    /// NumPy's `repr`: `array([[1., 2.], [3., 4.]], shape=[2, 2], dtype=f32)` over several
    /// lines, summarised past [`PrintOptions::threshold`] elements, with the options of
    /// [`set_print_options`]; `{:.2}` sets the precision for one call. The values are read as
    /// [`NDArray::to_vec`] reads them (from the device, for a CUDA array). A closed array
    /// prints `array(<closed: why>, shape=…, dtype=…)` instead of failing.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&render(self, f.precision()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_align_their_decimal_points_and_drop_trailing_zeros() {
        assert_eq!(
            format_floats(&[1.0, 0.12345, -10.5], 4, None),
            vec!["  1.    ", "  0.1235", "-10.5   "]
        );
    }

    #[test]
    fn wide_ranges_switch_to_scientific_notation() {
        assert_eq!(
            format_floats(&[1.0, 123456.0], 4, None),
            vec!["1.0000e+00", "1.2346e+05"]
        );
        assert_eq!(format_floats(&[1e-5], 2, None), vec!["1.e-05"]);
        assert_eq!(format_floats(&[100.0], 2, Some(true)), vec!["1.e+02"]);
    }

    #[test]
    fn non_finite_values_print_like_numpy() {
        assert_eq!(
            format_floats(&[f64::NAN, f64::NEG_INFINITY, 1.5], 4, None),
            vec![" nan", "-inf", " 1.5"]
        );
    }

    #[test]
    fn summarised_axes_keep_their_edges() {
        assert_eq!(
            axis_indices(10, true, 2),
            vec![Some(0), Some(1), None, Some(8), Some(9)]
        );
        assert_eq!(axis_indices(4, true, 2).len(), 4);
        assert_eq!(
            shown(&[3, 10], true, 2),
            vec![0, 1, 8, 9, 10, 11, 18, 19, 20, 21, 28, 29]
        );
    }
}
