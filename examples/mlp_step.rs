//! Times the MLP training step of `benches/training.rs` (784→1024→1024→10, softmax
//! cross-entropy, SGD with momentum 0.9, one workspace cycle per step) and prints the median
//! milliseconds per step. `benches/peers/mlp_step.py` runs it in turns with the same step in
//! PyTorch, so both are timed under the same machine conditions.
//!
//! ```text
//! cargo run --release --example mlp_step -- --batch 16 --steps 300
//! ```

#[path = "mlp/mod.rs"]
mod mlp;

use std::process::ExitCode;
use std::time::Instant;

use ndscope::{manual_seed, DType, Manager, Result, WorkspaceConfig};

fn main() -> ExitCode {
    let mut batch = 16usize;
    let mut steps = 300usize;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().and_then(|v| v.parse::<usize>().ok());
        match (flag.as_str(), value) {
            ("--batch", Some(v)) if v > 0 => batch = v,
            ("--steps", Some(v)) if v > 0 => steps = v,
            _ => {
                eprintln!("usage: mlp_step [--batch N] [--steps N] (positive numbers)");
                return ExitCode::from(2);
            }
        }
    }
    match run(batch, steps) {
        Ok(ms) => {
            println!("batch {batch}: {ms:.4} ms/step (median of {steps} steps)");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("mlp_step: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The median milliseconds of `steps` training steps at `batch`, after 10 warm-up steps.
fn run(batch: usize, steps: usize) -> Result<f64> {
    let trainer = Manager::new_base().with_name("trainer");
    let ws = trainer.workspace("batch", WorkspaceConfig::default())?;
    manual_seed(2);
    let model = Manager::new_base().with_name("model");
    let net = mlp::Mlp::new(&model, &[784, 1024, 1024, 10])?;
    model.cap();
    let x = trainer.randn([batch, 784], DType::F32)?;
    let labels: Vec<i64> = (0..batch as i64).map(|i| i % 10).collect();
    let y = trainer.from_vec(labels, [batch])?;
    let mut times = Vec::with_capacity(steps);
    for i in 0..steps + 10 {
        let start = Instant::now();
        ws.cycle(|_| net.train_step(&x, &y, 0.01, 0.9).map(|_| ()))?;
        if i >= 10 {
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    times.sort_by(f64::total_cmp);
    model.close()?;
    trainer.close()?;
    Ok(times[times.len() / 2])
}
