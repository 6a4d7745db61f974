//! Printing values (DESIGN §8): `Display` for `NDArray` in NumPy's style, summarised past a
//! threshold, with process-wide options. The expected texts are what NumPy 2.4 prints for the
//! same values (its `shape=(…)` and `dtype=float32` spelled ndscope's way).
//!
//! The options are process-wide, so the tests that change them take turns (`TURN`).

use std::sync::Mutex;

use ndscope::{print_options, set_print_options, DType, Manager, PrintOptions, Result};

static TURN: Mutex<()> = Mutex::new(());

fn turn() -> std::sync::MutexGuard<'static, ()> {
    TURN.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn a_matrix_prints_like_numpy_with_shape_and_dtype() -> Result<()> {
    let _turn = turn();
    let m = Manager::new_base();
    let a = m.from_slice(&[1.0f32, 2.5, -3.0, 4.125], [2, 2])?;
    assert_eq!(
        a.to_string(),
        "array([[ 1.   ,  2.5  ],\n       [-3.   ,  4.125]], shape=[2, 2], dtype=f32)"
    );
    m.close()
}

#[test]
fn three_dimensions_separate_blocks_with_a_blank_line() -> Result<()> {
    let _turn = turn();
    let m = Manager::new_base();
    let a = m.arange(0.0, 24.0, 1.0, DType::F32)?.reshape([2, 3, 4])?;
    let expected = "\
array([[[ 0.,  1.,  2.,  3.],
        [ 4.,  5.,  6.,  7.],
        [ 8.,  9., 10., 11.]],

       [[12., 13., 14., 15.],
        [16., 17., 18., 19.],
        [20., 21., 22., 23.]]], shape=[2, 3, 4], dtype=f32)";
    assert_eq!(a.to_string(), expected);
    m.close()
}

#[test]
fn long_rows_wrap_at_the_line_width() -> Result<()> {
    let _turn = turn();
    let m = Manager::new_base();
    let a = m.arange(0.0, 40.0, 1.0, DType::U8)?;
    let expected = "\
array([ 0,  1,  2,  3,  4,  5,  6,  7,  8,  9, 10, 11, 12, 13, 14, 15, 16,
       17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33,
       34, 35, 36, 37, 38, 39], shape=[40], dtype=u8)";
    assert_eq!(a.to_string(), expected);
    let sevenths = m.arange(0.0, 10.0, 1.0, DType::F64)?.div_scalar(7.0)?;
    assert_eq!(
        format!("{sevenths:.8}"),
        "\
array([0.        , 0.14285714, 0.28571429, 0.42857143, 0.57142857,
       0.71428571, 0.85714286, 1.        , 1.14285714, 1.28571429],
      shape=[10], dtype=f64)",
        "`{{:.8}}` sets the precision; the suffix goes to its own line when the last is full"
    );
    m.close()
}

#[test]
fn large_arrays_are_summarised_with_edge_items() -> Result<()> {
    let _turn = turn();
    let m = Manager::new_base();
    let a = m.arange(0.0, 2000.0, 1.0, DType::I32)?;
    assert_eq!(
        a.to_string(),
        "array([   0,    1,    2, ..., 1997, 1998, 1999], shape=[2000], dtype=i32)"
    );
    let b = m.arange(0.0, 3000.0, 1.0, DType::F32)?.reshape([30, 100])?;
    let expected = "\
array([[0.000e+00, 1.000e+00, 2.000e+00, ..., 9.700e+01, 9.800e+01,
        9.900e+01],
       [1.000e+02, 1.010e+02, 1.020e+02, ..., 1.970e+02, 1.980e+02,
        1.990e+02],
       [2.000e+02, 2.010e+02, 2.020e+02, ..., 2.970e+02, 2.980e+02,
        2.990e+02],
       ...,
       [2.700e+03, 2.701e+03, 2.702e+03, ..., 2.797e+03, 2.798e+03,
        2.799e+03],
       [2.800e+03, 2.801e+03, 2.802e+03, ..., 2.897e+03, 2.898e+03,
        2.899e+03],
       [2.900e+03, 2.901e+03, 2.902e+03, ..., 2.997e+03, 2.998e+03,
        2.999e+03]], shape=[30, 100], dtype=f32)";
    assert_eq!(b.to_string(), expected);
    m.close()
}

#[test]
fn scalars_empties_and_special_values() -> Result<()> {
    let _turn = turn();
    let m = Manager::new_base();
    assert_eq!(
        m.scalar(3.5f32)?.to_string(),
        "array(3.5, shape=[], dtype=f32)"
    );
    assert_eq!(
        m.zeros([0, 3], DType::F32)?.to_string(),
        "array([], shape=[0, 3], dtype=f32)"
    );
    let special = m.from_slice(&[f64::NAN, f64::NEG_INFINITY, 1.5], [3])?;
    assert_eq!(
        special.to_string(),
        "array([ nan, -inf,  1.5], shape=[3], dtype=f64)"
    );
    let wide = m.from_slice(&[1.0f64, 123456.0], [2])?;
    assert_eq!(
        wide.to_string(),
        "array([1.0000e+00, 1.2346e+05], shape=[2], dtype=f64)"
    );
    m.close()
}

#[test]
fn a_closed_array_prints_why_instead_of_failing() -> Result<()> {
    let _turn = turn();
    let m = Manager::new_base().with_name("gone");
    let a = m.ones([2, 2], DType::F32)?;
    m.close()?;
    assert_eq!(
        a.to_string(),
        format!(
            "array(<closed: its manager 'gone' ({}) was closed>, shape=[2, 2], dtype=f32)",
            m.id()
        )
    );
    Ok(())
}

#[test]
fn options_are_process_wide_and_restorable() -> Result<()> {
    let _turn = turn();
    let m = Manager::new_base();
    let a = m.arange(0.0, 30.0, 1.0, DType::I64)?;
    let before = print_options();
    assert_eq!(before, PrintOptions::default());
    set_print_options(PrintOptions::short());
    let short = a.to_string();
    set_print_options(PrintOptions {
        sci_mode: Some(true),
        precision: 2,
        ..PrintOptions::default()
    });
    let sci = m.from_slice(&[1.5f32, 250.0], [2])?.to_string();
    set_print_options(PrintOptions {
        threshold: 10,
        ..PrintOptions::full()
    });
    let full_after_threshold = a.to_string();
    set_print_options(before.clone());
    assert_eq!(print_options(), before);
    assert_eq!(
        short, "array([ 0,  1, ..., 28, 29], shape=[30], dtype=i64)",
        "short: 2 edge items past 21 elements"
    );
    assert_eq!(sci, "array([1.5e+00, 2.5e+02], shape=[2], dtype=f32)");
    assert!(full_after_threshold.contains("..."));
    assert_eq!(PrintOptions::full().threshold, usize::MAX);
    m.close()
}
