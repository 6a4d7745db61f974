//! Helpers shared by the integration tests: `device_tests!`, which runs a test on the CPU and
//! on a CUDA device, deterministic test data, and reading arrays back as f64.

#![allow(dead_code)] // each test binary uses a different subset

use ndscope::{DType, Device, Error, Manager, NDArray};

pub mod sim;

/// Registers tests that take the device they run on: for each `name` listed, a module `name`
/// with two tests, `name::cpu`, which calls `name(Device::Cpu)`, and `name::cuda`, which calls
/// `name(Device::Cuda(0))` when that device is usable and otherwise prints why it skipped (see
/// [`cuda_device`]). Put it above the function, like an attribute; the function stays plain Rust
/// (a module and a function may share a name), takes `dev: Device` and makes its managers with
/// `Manager::new_base_on(dev)`.
///
/// ```ignore
/// device_tests!(add_broadcasts);
/// fn add_broadcasts(dev: Device) {
///     let m = Manager::new_base_on(dev).unwrap();
///     // ...
/// }
/// ```
#[allow(unused_macros)]
macro_rules! device_tests {
    ($($name:ident),+ $(,)?) => {$(
        mod $name {
            #[test]
            fn cpu() {
                super::$name(::ndscope::Device::Cpu);
            }

            #[test]
            fn cuda() {
                if let Some(dev) = $crate::common::cuda_device() {
                    super::$name(dev);
                }
            }
        }
    )+};
}
#[allow(unused_imports)]
pub(crate) use device_tests;

/// `Some(Device::Cuda(0))` when a manager can be made on it. Otherwise `None`, after printing
/// `skipped on cuda: ` and the `DeviceUnavailable` error of `Manager::new_base_on`, which says
/// why (no `cuda` feature, no driver, no GPU, a missing library). With `NDSCOPE_REQUIRE_GPU=1`
/// (set by the GPU suite, `scripts/gpu-run.sh`) a missing GPU fails the test instead.
pub fn cuda_device() -> Option<Device> {
    let dev = Device::Cuda(0);
    match Manager::new_base_on(dev) {
        Ok(probe) => {
            probe.close().unwrap();
            Some(dev)
        }
        Err(err @ Error::DeviceUnavailable { .. }) => {
            if std::env::var_os("NDSCOPE_REQUIRE_GPU").is_some_and(|v| v == "1") {
                panic!("NDSCOPE_REQUIRE_GPU=1, but there is no usable GPU: {err}");
            }
            println!("skipped on cuda: {err}");
            None
        }
        Err(err) => panic!("Manager::new_base_on({dev}) failed unexpectedly: {err}"),
    }
}

/// The error of an op refused for input that only the device sees (an index out of range, an
/// integer divisor of 0): the CPU refuses at the call; on a CUDA device the op is queued (it
/// succeeds) and the next wait on the device, here `Device::synchronize`, gives the error.
#[allow(dead_code)]
pub fn refused(dev: Device, result: ndscope::Result<ndscope::NDArray>) -> Error {
    match (dev, result) {
        (Device::Cpu, Err(e)) => e,
        (Device::Cpu, Ok(a)) => panic!("the CPU accepted {a:?}"),
        (_, Err(e)) => panic!("{dev} refused at the call, not at the next wait: {e}"),
        (_, Ok(a)) => {
            let e = dev
                .synchronize()
                .expect_err("the next wait reports the bad input");
            a.close().unwrap();
            e
        }
    }
}

/// The number of elements of a shape.
pub fn size(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// `n` deterministic integers in `-span..=span`, different for each `seed`.
pub fn values(n: usize, seed: u64, span: i64) -> Vec<i64> {
    let mut s = seed ^ 0x9E37_79B9_7F4A_7C15;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) % (2 * span as u64 + 1)) as i64 - span
        })
        .collect()
}

/// An array of `dtype` holding `vals`: floats scaled by `scale` (a power of two keeps every
/// sum exact), unsigned bytes as absolute values.
pub fn array(m: &Manager, dtype: DType, shape: &[usize], vals: &[i64], scale: f64) -> NDArray {
    match dtype {
        DType::F32 => m.from_vec(
            vals.iter().map(|&v| (v as f64 * scale) as f32).collect(),
            shape,
        ),
        DType::F64 => m.from_vec(vals.iter().map(|&v| v as f64 * scale).collect(), shape),
        DType::I32 => m.from_vec(vals.iter().map(|&v| v as i32).collect(), shape),
        DType::I64 => m.from_vec(vals.to_vec(), shape),
        DType::U8 => m.from_vec(
            vals.iter().map(|&v| v.unsigned_abs() as u8).collect(),
            shape,
        ),
        DType::F16 => m.from_vec(
            vals.iter()
                .map(|&v| ndscope::f16::from_f64(v as f64 * scale))
                .collect(),
            shape,
        ),
        DType::BF16 => m.from_vec(
            vals.iter()
                .map(|&v| ndscope::bf16::from_f64(v as f64 * scale))
                .collect(),
            shape,
        ),
    }
    .unwrap()
}

/// `v` rounded to `dtype`'s precision when it is a half type (once, to nearest even, as the
/// half dtypes store every result), else `v`.
pub fn round_to(dtype: DType, v: f64) -> f64 {
    match dtype {
        DType::F16 => <ndscope::f16 as ndscope::Element>::from_f64(v).to_f64(),
        DType::BF16 => <ndscope::bf16 as ndscope::Element>::from_f64(v).to_f64(),
        _ => v,
    }
}

/// The elements of any array as f64.
pub fn as_f64(a: &NDArray) -> Vec<f64> {
    match a.dtype() {
        DType::F32 => a
            .to_vec::<f32>()
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect(),
        DType::F64 => a.to_vec::<f64>().unwrap(),
        DType::I32 => a
            .to_vec::<i32>()
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect(),
        DType::I64 => a
            .to_vec::<i64>()
            .unwrap()
            .into_iter()
            .map(|v| v as f64)
            .collect(),
        DType::U8 => a
            .to_vec::<u8>()
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect(),
        DType::F16 => a
            .to_vec::<ndscope::f16>()
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect(),
        DType::BF16 => a
            .to_vec::<ndscope::bf16>()
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect(),
    }
}
