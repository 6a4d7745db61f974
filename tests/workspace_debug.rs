//! The workspace debug switch (ND4J's `DebugMode`), process-wide: one test drives it.

use ndscope::workspace::{debug_mode, set_debug_mode, DebugMode};
use ndscope::{DType, Manager, WorkspaceConfig};

const CHILD: &str = "NDSCOPE_TEST_DEBUG_CHILD";

#[test]
fn debug_modes_spill_everything_or_bypass_the_workspace() {
    if std::env::var_os(CHILD).is_some() {
        return;
    }
    assert_eq!(debug_mode(), None);
    let t = Manager::new_base();
    let ws = t.workspace("batch", WorkspaceConfig::default()).unwrap();
    let step = || ws.cycle(|c| c.ones([100], DType::F32).map(|_| ())).unwrap();
    step();
    step();
    assert_eq!(ws.stats().spilled_count, 1, "learned after one cycle");

    set_debug_mode(Some(DebugMode::SpillEverything));
    step();
    let s = ws.stats();
    assert_eq!(s.spilled_count, 2, "spills although the block has room");
    assert_eq!(s.last_cycle_bytes, 448, "still counted");

    set_debug_mode(Some(DebugMode::Bypass));
    let before = ws.stats();
    ws.cycle(|c| {
        c.ones([100], DType::F32)?;
        assert!(!c.report().arrays[0].in_workspace);
        Ok(())
    })
    .unwrap();
    let after = ws.stats();
    assert_eq!(after.spilled_count, before.spilled_count);
    assert_eq!(
        after.last_cycle_bytes, 0,
        "bypassed allocations are not counted"
    );

    set_debug_mode(None);
    ws.cycle(|c| {
        c.ones([100], DType::F32)?;
        assert!(c.report().arrays[0].in_workspace);
        Ok(())
    })
    .unwrap();
    t.close().unwrap();

    // The environment variable sets the initial mode.
    for (value, expect) in [
        ("bypass", "Bypass"),
        ("spill_everything", "SpillEverything"),
    ] {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "env_child_reports_debug_mode", "--nocapture"])
            .env(CHILD, "1")
            .env("NDSCOPE_WORKSPACE_DEBUG", value)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{text}");
        assert!(text.contains(&format!("mode=Some({expect})")), "{text}");
    }
}

#[test]
fn env_child_reports_debug_mode() {
    if std::env::var_os(CHILD).is_some() {
        println!("mode={:?}", debug_mode());
    }
}
