//! What one learned training step asks of the GPU, counted on the simulated GPU: the MLP step
//! of `examples/mlp_step.rs` (784→1024→1024→10, batch 16, softmax cross-entropy, autograd and
//! SGD with momentum, one workspace cycle per step) makes at most 16 launches, cuBLAS products
//! included, and no synchronisation, copy, memset or allocation. On a real GPU the counters do
//! not exist and the test only runs the steps.

mod common;
#[path = "../examples/mlp/mod.rs"]
mod mlp;

use ndscope::WorkspaceConfig;

use common::sim;

/// The most launches (kernels and cuBLAS products) of one learned step.
const MAX_LAUNCHES: u64 = 16;

#[test]
fn a_learned_mlp_step_is_at_most_16_launches_and_never_waits() {
    let Some(dev) = common::cuda_device() else {
        return;
    };
    let mut fixture = mlp::AutogradStep::new(dev, 16, WorkspaceConfig::default()).unwrap();
    let mut step = || fixture.run().unwrap();
    // Learning: the workspace sizes its block, the gradients and momenta are made.
    for _ in 0..3 {
        step();
    }
    dev.synchronize().unwrap();
    let Some(before) = sim::stats() else {
        println!("not the simulator: nothing to count");
        step();
        return;
    };
    let steps = 10;
    for _ in 0..steps {
        step();
    }
    let d = sim::diff(&before, &sim::stats().unwrap());
    let per_step = |name: &str| d[name] as f64 / steps as f64;
    let launches = (d["launches"] + d["cublas"]) as f64 / steps as f64;
    println!(
        "per learned step: {} kernel launches + {} cuBLAS products; {:?} over {steps} steps",
        per_step("launches"),
        per_step("cublas"),
        sim::calls(&d)
    );
    assert!(
        launches <= MAX_LAUNCHES as f64,
        "{launches} launches per step, more than {MAX_LAUNCHES}: {:?}",
        sim::calls(&d)
    );
    for name in [
        "blocking_syncs",
        "d2d",
        "h2d",
        "d2h",
        "memsets",
        "allocs",
        "async_allocs",
        "host_allocs",
    ] {
        assert_eq!(
            d[name],
            0,
            "{name} in {steps} learned steps: {:?}",
            sim::calls(&d)
        );
    }
    fixture.close().unwrap();
}
