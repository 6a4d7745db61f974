//! After learning, workspace cycles take no new pages: zero minor page faults per cycle, where
//! the same cycles without a workspace fault on every large temporary. Process-wide counters:
//! one test in this binary.

#[cfg(target_os = "linux")]
#[test]
fn learned_cycles_take_no_page_faults() {
    use ndscope::{DType, Manager, WorkspaceConfig};

    fn minor_faults() -> i64 {
        // SAFETY: `getrusage` fills the zeroed struct we pass; RUSAGE_SELF is always valid.
        unsafe {
            let mut usage: libc::rusage = std::mem::zeroed();
            libc::getrusage(libc::RUSAGE_SELF, &mut usage);
            usage.ru_minflt
        }
    }
    fn step(m: &Manager) -> ndscope::Result<()> {
        let a = m.full([1 << 20], 1.0, DType::F32)?; // 4 MiB
        let b = m.full([1 << 20], 2.0, DType::F32)?;
        let c = a.add(&b)?.relu()?;
        let total = c.sum_all()?.to_scalar::<f32>()?;
        assert_eq!(total, 3.0 * (1 << 20) as f32);
        Ok(())
    }

    let trainer = Manager::new_base();
    let ws = trainer
        .workspace("batch", WorkspaceConfig::default())
        .unwrap();
    let cycles = 300;
    // Learning, then the allocator's and the thread pool's own one-time warm-up.
    for _ in 0..50 {
        ws.cycle(step).unwrap();
    }
    let before = minor_faults();
    for _ in 0..cycles {
        ws.cycle(step).unwrap();
    }
    let with_workspace = minor_faults() - before;

    let control = 20;
    let before = minor_faults();
    for _ in 0..control {
        trainer.scope(step).unwrap();
    }
    let without = minor_faults() - before;
    println!(
        "minor faults: workspace {with_workspace} over {cycles} cycles, no workspace {without} over {control}"
    );
    assert_eq!(with_workspace, 0, "a learned cycle must reuse its pages");
    assert!(
        without > 0,
        "the control must fault, or this test proves nothing"
    );
    trainer.close().unwrap();
}
