//! Times `[n, n] · [n, n]` products in f32, f16 and bf16 and prints each one's median time and
//! rate: `benches/peers/half_matmul.py` runs it in turns with PyTorch's products on the same
//! machine (the CPU, or with `--device cuda` the GPU, where the half products run through
//! cuBLAS `GemmEx` on tensor cores).
//!
//! ```text
//! cargo run --release --example half_matmul -- --n 1024 --reps 20
//! cargo run --release --features cuda --example half_matmul -- --n 4096 --device cuda
//! ```

use std::process::ExitCode;
use std::time::Instant;

use ndscope::{manual_seed, DType, Device, Manager, Result};

fn main() -> ExitCode {
    let mut n = 1024usize;
    let mut reps = 20usize;
    let mut device = Device::Cpu;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next();
        let number = value.as_deref().and_then(|v| v.parse::<usize>().ok());
        match (flag.as_str(), number, value.as_deref()) {
            ("--n", Some(v), _) if v > 0 => n = v,
            ("--reps", Some(v), _) if v > 0 => reps = v,
            ("--device", _, Some("cpu")) => device = Device::Cpu,
            ("--device", _, Some("cuda")) => device = Device::Cuda(0),
            _ => {
                eprintln!("usage: half_matmul [--n N] [--reps N] [--device cpu|cuda]");
                return ExitCode::from(2);
            }
        }
    }
    match run(n, reps, device) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("half_matmul: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(n: usize, reps: usize, device: Device) -> Result<()> {
    manual_seed(1);
    let m = Manager::new_base_on(device)?;
    let flops = 2.0 * (n as f64).powi(3);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let a = m.randn([n, n], DType::F32)?.to_dtype(dtype)?;
        let b = m.randn([n, n], DType::F32)?.to_dtype(dtype)?;
        let mut times = Vec::with_capacity(reps);
        for i in 0..reps + 3 {
            let start = Instant::now();
            let c = a.matmul(&b)?;
            device.synchronize()?;
            let t = start.elapsed().as_secs_f64();
            c.close()?;
            if i >= 3 {
                times.push(t);
            }
        }
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        println!(
            "{dtype} {n}x{n}: {:.4} ms/product, {:.2} TFLOP/s (median of {reps}) on {device}",
            median * 1e3,
            flops / median / 1e12
        );
        a.close()?;
        b.close()?;
    }
    m.close()
}
