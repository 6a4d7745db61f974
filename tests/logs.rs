//! Logs (DESIGN §8): ndscope reports through `tracing`, not by printing. Warnings for limit
//! hits and for learned cycles that spill; info for learning decisions; debug for cycles, cap
//! refusals and blocks. Each test captures the events of its own thread with a subscriber set
//! for the test's duration.
//!
//! The memory limit and the spill threshold are process-wide, so the tests take turns (`TURN`).

use std::io::Write;
use std::sync::{Arc, Mutex};

use ndscope::workspace::set_spill_warning_threshold;
use ndscope::{set_memory_limit, DType, Device, Error, Manager, Result, WorkspaceConfig};
use tracing_subscriber::fmt::MakeWriter;

static TURN: Mutex<()> = Mutex::new(());

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for Captured {
    type Writer = Captured;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

/// Runs `f` with a subscriber that records every event on this thread; returns its lines.
fn capture<R>(f: impl FnOnce() -> R) -> (R, Vec<String>) {
    let out = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(out.clone())
        .with_max_level(tracing::Level::TRACE)
        .without_time()
        .finish();
    let result = tracing::subscriber::with_default(subscriber, f);
    let text = String::from_utf8(out.0.lock().unwrap_or_else(|e| e.into_inner()).clone())
        .expect("utf-8 logs");
    (result, text.lines().map(str::to_string).collect())
}

fn lines_with<'a>(lines: &'a [String], level: &str, text: &str) -> Vec<&'a String> {
    lines
        .iter()
        .filter(|l| l.contains(level) && l.contains(text))
        .collect()
}

#[test]
fn a_memory_limit_hit_is_a_warning() -> Result<()> {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let m = Manager::new_base();
    let (refused, lines) = capture(|| {
        let in_use = ndscope::memory_usage(Device::Cpu).in_use;
        set_memory_limit(Device::Cpu, Some(in_use + 1024));
        let refused = m.zeros([1 << 20], DType::F32);
        set_memory_limit(Device::Cpu, None);
        refused
    });
    assert!(matches!(refused, Err(Error::OutOfMemory { .. })));
    let warnings = lines_with(&lines, "WARN", "cannot allocate 4.00 MiB on cpu");
    assert_eq!(warnings.len(), 1, "{lines:#?}");
    assert!(warnings[0].contains("ndscope::memory"), "{lines:#?}");
    m.close()
}

#[test]
fn learning_is_info_cycles_are_debug() -> Result<()> {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let trainer = Manager::new_base().with_name("trainer");
    let ws = trainer.workspace("batch", WorkspaceConfig::default())?;
    let (done, lines) = capture(|| -> Result<()> {
        for _ in 0..3 {
            ws.cycle(|b| b.ones([256], DType::F32).map(|_| ()))?;
        }
        Ok(())
    });
    done?;
    let learned = lines_with(&lines, "INFO", "workspace 'batch': learned its block");
    assert_eq!(learned.len(), 1, "{lines:#?}");
    assert!(
        learned[0].contains("1.30 KiB for a cycle of 1.00 KiB"),
        "{lines:#?}"
    );
    assert_eq!(lines_with(&lines, "DEBUG", "cycle 3 opened").len(), 1);
    assert_eq!(lines_with(&lines, "DEBUG", "cycle 3 ended").len(), 1);
    assert!(lines_with(&lines, "WARN", "").is_empty(), "{lines:#?}");
    trainer.close()
}

#[test]
fn a_learned_cycle_that_spills_warns_once_per_new_maximum() -> Result<()> {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    set_spill_warning_threshold(0);
    let trainer = Manager::new_base();
    let ws = trainer.workspace("grows", WorkspaceConfig::default())?; // External spills
    let step = |extra: usize| {
        ws.cycle(|b| {
            b.ones([64], DType::F32)?;
            if extra > 0 {
                b.ones([extra], DType::F32)?;
            }
            Ok(())
        })
    };
    let (done, lines) = capture(|| -> Result<()> {
        step(0)?; // learns: spills while measuring, no warning
        step(1024)?; // outgrows the block: warns
        step(1024)?; // the same again: debug only
        step(4096)?; // more: warns again
        Ok(())
    });
    done?;
    let warnings = lines_with(&lines, "WARN", "workspace 'grows'");
    assert_eq!(warnings.len(), 2, "{lines:#?}");
    assert!(
        warnings[0].contains("cycle 2 spilled 4.00 KiB"),
        "{lines:#?}"
    );
    assert!(warnings[0].contains("never grows"), "{lines:#?}");
    assert!(
        warnings[1].contains("cycle 4 spilled 16.00 KiB"),
        "{lines:#?}"
    );

    // Past a threshold only.
    set_spill_warning_threshold(1 << 20);
    let quiet = trainer.workspace("quiet", WorkspaceConfig::default())?;
    let (done, lines) = capture(|| -> Result<()> {
        quiet.cycle(|b| b.ones([64], DType::F32).map(|_| ()))?;
        quiet.cycle(|b| b.ones([4096], DType::F32).map(|_| ()))
    });
    set_spill_warning_threshold(0);
    done?;
    assert!(lines_with(&lines, "WARN", "").is_empty(), "{lines:#?}");
    trainer.close()
}

#[test]
fn cap_refusals_are_debug_events() -> Result<()> {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let model = Manager::new_base().with_name("logged model");
    let w = model.ones([4], DType::F32)?;
    model.cap();
    let (refused, lines) = capture(|| w.add(&w));
    assert!(matches!(refused, Err(Error::Capped { .. })));
    let debug = lines_with(&lines, "DEBUG", "capped manager refused an array");
    assert_eq!(debug.len(), 1, "{lines:#?}");
    assert!(debug[0].contains("logged model"), "{lines:#?}");
    model.close()
}
