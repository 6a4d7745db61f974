//! Seeing memory (DESIGN §6): `report()`, its totals and `diff`, `Growth`, `debug_dump`, and the
//! leak check `testing::assert_no_growth`.

use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};

use ndscope::testing::{assert_no_growth, measure_growth};
use ndscope::{DType, Device, Error, Manager, Result, Shape};

/// `tests/report.rs:LINE:` — a location in this file, as reports print it.
fn here(line: u32) -> String {
    format!("{}:{line}:", file!())
}

// ---------------------------------------------------------------------------------------------
// ManagerReport
// ---------------------------------------------------------------------------------------------

#[test]
fn report_describes_the_manager_and_its_arrays() -> Result<()> {
    let m = Manager::new_base().with_name("model");
    let (w, line) = (m.zeros([2, 3], DType::F64)?, line!());
    w.set_name("w");
    let report = m.report();
    assert_eq!(report.id, m.id());
    assert_eq!(report.name, "model");
    assert_eq!(report.device, Device::Cpu);
    assert!(report.open);
    assert!(!report.capped);
    assert!(report.borrowed.is_empty());
    assert!(
        report.detached.is_empty(),
        "only the system manager lists detached arrays"
    );
    assert!(report.children.is_empty());
    assert_eq!(report.arrays.len(), 1);
    let a = &report.arrays[0];
    assert_eq!(a.id, w.id());
    assert_eq!(a.name.as_deref(), Some("w"));
    assert_eq!(a.shape, Shape::from([2, 3]));
    assert_eq!(a.dtype, DType::F64);
    assert_eq!(a.device, Device::Cpu);
    assert_eq!(a.bytes, 48);
    assert_eq!((a.created_at.file(), a.created_at.line()), (file!(), line));
    assert_eq!(a.lent_by, None);
    assert!(!a.in_workspace);

    m.cap();
    assert!(m.report().capped);
    m.close()?;
    let closed = m.report();
    assert!(!closed.open);
    assert!(!closed.capped);
    assert_eq!(closed.name, "model");
    assert_eq!(closed.id, m.id());
    assert!(closed.arrays.is_empty() && closed.children.is_empty());
    Ok(())
}

#[test]
fn unnamed_manager_is_reported_by_its_id() {
    let m = Manager::new_base();
    assert_eq!(m.report().name, m.id().to_string());
    m.close().unwrap();
}

#[test]
fn report_arrays_are_owned_by_this_manager_only() -> Result<()> {
    let parent = Manager::new_base();
    let child = parent.new_sub_manager()?;
    let lender = Manager::new_base();
    let own = parent.ones([2], DType::F32)?;
    let in_child = child.ones([3], DType::F32)?;
    let borrowed = lender.ones([4], DType::F32)?;
    borrowed.temp_attach(&parent)?;

    let report = parent.report();
    let ids: Vec<_> = report.arrays.iter().map(|a| a.id).collect();
    assert_eq!(ids, vec![own.id()], "not the child's, not the borrowed one");
    assert_eq!(report.borrowed.len(), 1);
    assert_eq!(report.borrowed[0].id, borrowed.id());
    assert_eq!(report.borrowed[0].lent_by, Some(lender.id()));
    assert_eq!(report.children.len(), 1);
    assert_eq!(report.children[0].id, child.id());
    assert_eq!(report.children[0].arrays[0].id, in_child.id());
    assert!(report.find(child.id()).is_some());
    assert!(report.find(lender.id()).is_none());
    assert!(lender.report().arrays.is_empty(), "lent out");
    parent.close()?;
    lender.close()
}

#[test]
fn report_children_are_newest_first() -> Result<()> {
    let parent = Manager::new_base();
    let a = parent.new_sub_manager()?;
    let b = parent.new_sub_manager()?;
    let ids: Vec<_> = parent.report().children.iter().map(|c| c.id).collect();
    assert_eq!(ids, vec![b.id(), a.id()]);
    parent.close()
}

#[test]
fn totals_cover_the_subtree() -> Result<()> {
    let root = Manager::new_base();
    let child = root.new_sub_manager()?;
    let grandchild = child.new_sub_manager()?;
    root.zeros([4], DType::F32)?; // 16 B
    child.zeros([2], DType::F64)?; // 16 B
    grandchild.zeros([10], DType::U8)?; // 10 B
    grandchild.zeros([3], DType::I64)?; // 24 B
    let report = root.report();
    assert_eq!(report.total_arrays(), 4);
    assert_eq!(report.total_bytes(), 66);
    assert_eq!(child.report().total_arrays(), 3);
    assert_eq!(child.report().total_bytes(), 50);
    assert_eq!(grandchild.report().total_arrays(), 2);
    root.close()?;
    assert_eq!(root.report().total_arrays(), 0);
    assert_eq!(root.report().total_bytes(), 0);
    Ok(())
}

/// An array borrowed inside the subtree is still in the subtree: lending it from one sub-manager
/// to another must not make it vanish from the totals, nor count it twice.
#[test]
fn borrowed_arrays_are_counted_once_in_totals() -> Result<()> {
    let root = Manager::new_base();
    let a = root.new_sub_manager()?;
    let b = root.new_sub_manager()?;
    let x = a.zeros([4], DType::F32)?;
    assert_eq!(
        (root.report().total_arrays(), root.report().total_bytes()),
        (1, 16)
    );
    x.temp_attach(&b)?;
    assert_eq!(
        (root.report().total_arrays(), root.report().total_bytes()),
        (1, 16)
    );
    // Counted with its current holder (the borrower), as `manager()` says.
    assert_eq!(b.report().total_arrays(), 1);
    assert_eq!(a.report().total_arrays(), 0);
    b.close()?;
    assert_eq!(
        (root.report().total_arrays(), root.report().total_bytes()),
        (1, 16)
    );
    root.close()
}

#[test]
fn detached_arrays_are_listed_under_the_system_manager() -> Result<()> {
    let m = Manager::new_base();
    let (x, line) = (m.zeros([5], DType::F32)?, line!());
    x.set_name("loose-in-report-test");
    x.detach()?;
    m.close()?;
    let system = Manager::system().report();
    let listed = system
        .detached
        .iter()
        .find(|a| a.id == x.id())
        .expect("the detached array is listed");
    assert_eq!(listed.bytes, 20);
    assert_eq!(listed.created_at.line(), line);
    assert!(system.total_arrays() >= 1);
    let dump = Manager::system().debug_dump(1);
    let entry = dump
        .lines()
        .find(|l| l.contains("'loose-in-report-test'"))
        .expect("listed in the dump");
    assert!(entry.contains("detached"), "{entry}");
    assert!(entry.contains(&here(line)), "{entry}");
    x.close()?;
    assert!(!Manager::system()
        .report()
        .detached
        .iter()
        .any(|a| a.id == x.id()));
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// diff and Growth
// ---------------------------------------------------------------------------------------------

#[test]
fn diff_is_empty_when_nothing_grew() -> Result<()> {
    let m = Manager::new_base();
    m.ones([4], DType::F32)?;
    let before = m.report();
    let tmp = m.ones([8], DType::F32)?;
    tmp.close()?;
    let growth = m.report().diff(&before);
    assert!(growth.is_empty(), "{growth}");
    assert_eq!(growth.to_string(), "no growth");
    m.close()
}

#[test]
fn diff_names_growing_creation_sites() -> Result<()> {
    let m = Manager::new_base().with_name("trainer");
    let w = m.ones([4], DType::F32)?;
    let before = m.report();
    let mut line = 0;
    for _ in 0..3 {
        let (_leak, l) = (w.mul_scalar(2.0)?, line!());
        line = l;
    }
    let growth = m.report().diff(&before);
    assert!(!growth.is_empty());
    assert_eq!(growth.sites.len(), 1, "{growth}");
    let site = &growth.sites[0];
    assert_eq!(site.manager, m.id());
    assert_eq!(site.manager_name, "trainer");
    assert_eq!((site.site.file(), site.site.line()), (file!(), line));
    assert_eq!((site.count_before, site.count_after), (0, 3));
    assert_eq!((site.bytes_before, site.bytes_after), (0, 48));
    assert!(growth.new_managers.is_empty());
    let text = growth.to_string();
    assert!(text.contains(&here(line)), "{text}");
    assert!(text.contains("'trainer'"), "{text}");
    assert!(text.contains('3'), "{text}");
    m.close()
}

#[test]
fn diff_sees_bytes_growing_at_one_site() -> Result<()> {
    let m = Manager::new_base();
    let make = |n: usize| m.zeros([n], DType::F32);
    let small = make(4)?;
    let before = m.report();
    small.close()?;
    make(400)?;
    let growth = m.report().diff(&before);
    assert_eq!(growth.sites.len(), 1, "{growth}");
    assert_eq!(growth.sites[0].count_after, growth.sites[0].count_before);
    assert_eq!(growth.sites[0].bytes_after, 1600);
    m.close()
}

#[test]
fn diff_reports_new_managers_and_sites_per_manager() -> Result<()> {
    let root = Manager::new_base();
    let before = root.report();
    let child = root.new_sub_manager()?.with_name("forgotten");
    let (_x, line) = (child.ones([2], DType::F32)?, line!());
    let growth = root.report().diff(&before);
    assert_eq!(
        growth.new_managers,
        vec![(child.id(), "forgotten".to_string())]
    );
    assert_eq!(growth.sites.len(), 1);
    assert_eq!(growth.sites[0].manager, child.id());
    assert_eq!(growth.sites[0].site.line(), line);
    let text = growth.to_string();
    assert!(text.contains("'forgotten'"), "{text}");
    root.close()
}

#[test]
fn diff_ignores_shrinking() -> Result<()> {
    let m = Manager::new_base();
    let a = m.ones([4], DType::F32)?;
    let before = m.report();
    a.close()?;
    assert!(m.report().diff(&before).is_empty());
    m.close()
}

// ---------------------------------------------------------------------------------------------
// debug_dump
// ---------------------------------------------------------------------------------------------

/// The dump's tree, without its closing `memory on <device>:` lines.
fn tree_lines(dump: &str) -> Vec<&str> {
    dump.lines()
        .filter(|l| !l.starts_with("memory on "))
        .collect()
}

#[test]
fn debug_dump_ends_with_the_memory_counters_of_each_device() -> Result<()> {
    let m = Manager::new_base().with_name("counted");
    m.zeros([16], DType::F32)?;
    let dump = m.debug_dump(0);
    let last = dump.lines().last().unwrap_or_default();
    assert!(last.starts_with("memory on cpu: "), "{dump}");
    for part in [
        "in use by",
        "peak",
        "allocations (",
        "frees (",
        "spills",
        "reallocations",
        "out-of-memory",
        "driver allocations",
    ] {
        assert!(last.contains(part), "{part} missing: {dump}");
    }
    m.close()
}

#[test]
fn debug_dump_level_0_is_one_line_per_manager() -> Result<()> {
    let root = Manager::new_base().with_name("root");
    let child = root.new_sub_manager()?.with_name("child");
    let grandchild = child.new_sub_manager()?.with_name("grandchild");
    root.ones([256], DType::F32)?; // 1 KiB
    grandchild.ones([4], DType::F32)?;
    grandchild.ones([4], DType::F32)?;
    let lender = Manager::new_base();
    let borrowed = lender.ones([2], DType::F32)?;
    borrowed.temp_attach(&child)?;
    child.cap();

    let dump = root.debug_dump(0);
    let lines: Vec<&str> = tree_lines(&dump);
    assert_eq!(lines.len(), 3, "{dump}");
    assert!(lines[0].starts_with("root"), "{dump}");
    assert!(lines[0].contains(&root.id().to_string()), "{dump}");
    assert!(lines[0].contains("cpu"), "{dump}");
    assert!(
        lines[0].contains("1 arrays") && lines[0].contains("1.00 KiB"),
        "{dump}"
    );
    assert!(lines[1].starts_with("  child"), "indented by depth: {dump}");
    assert!(
        lines[1].contains("0 arrays") && lines[1].contains("1 borrowed"),
        "{dump}"
    );
    assert!(lines[1].contains("capped"), "{dump}");
    assert!(!lines[0].contains("capped"), "{dump}");
    assert!(lines[2].starts_with("    grandchild"), "{dump}");
    assert!(
        lines[2].contains("2 arrays") && lines[2].contains("32 B"),
        "{dump}"
    );
    // Level 0 lists no arrays.
    assert!(!dump.contains(file!()), "{dump}");
    root.close()?;
    lender.close()
}

#[test]
fn debug_dump_level_1_lists_arrays_largest_first_with_creation_sites() -> Result<()> {
    let m = Manager::new_base().with_name("dumped");
    let (_small, small_line) = (m.zeros([2], DType::F32)?, line!());
    let (big, big_line) = (m.zeros([1000], DType::F32)?, line!());
    big.set_name("big");
    let (_mid, mid_line) = (m.zeros([100], DType::F32)?, line!());
    let child = m.new_sub_manager()?.with_name("kid");
    let (_in_child, child_line) = (child.zeros([5000], DType::U8)?, line!());

    let dump = m.debug_dump(1);
    let lines: Vec<&str> = tree_lines(&dump);
    assert_eq!(lines.len(), 6, "two managers, four arrays:\n{dump}");
    assert!(lines[0].starts_with("dumped"), "{dump}");
    assert!(
        lines[1].contains("'big'") && lines[1].contains(&here(big_line)),
        "{dump}"
    );
    assert!(lines[1].contains(&big.id().to_string()), "{dump}");
    assert!(lines[1].contains("3.91 KiB"), "{dump}");
    assert!(lines[2].contains(&here(mid_line)), "{dump}");
    assert!(lines[3].contains(&here(small_line)), "{dump}");
    assert!(lines[4].trim_start().starts_with("kid"), "{dump}");
    assert!(lines[5].contains(&here(child_line)), "{dump}");
    m.close()
}

#[test]
fn debug_dump_marks_a_closed_manager() {
    let m = Manager::new_base().with_name("gone");
    m.close().unwrap();
    let dump = m.debug_dump(1);
    assert_eq!(tree_lines(&dump).len(), 1, "{dump}");
    assert!(dump.contains("gone") && dump.contains("closed"), "{dump}");
}

// ---------------------------------------------------------------------------------------------
// testing::assert_no_growth
// ---------------------------------------------------------------------------------------------

#[test]
fn assert_no_growth_passes_on_a_clean_step() -> Result<()> {
    let trainer = Manager::new_base();
    let w = trainer.ones([4, 4], DType::F32)?;
    let mut steps = 0;
    assert_no_growth(&trainer, 2, 5, |_| {
        steps += 1;
        trainer.scope(|batch| {
            let x = batch.ones([4, 4], DType::F32)?;
            let _y = w.matmul(&x)?.relu()?;
            Ok(())
        })
    });
    assert_eq!(steps, 7, "warm-up plus measured steps");
    trainer.close()
}

#[test]
fn assert_no_growth_panics_with_the_growth_report_on_a_leaking_step() -> Result<()> {
    let trainer = Manager::new_base().with_name("leaky");
    let w = trainer.ones([4], DType::F32)?;
    let line = Cell::new(0);
    let caught = catch_unwind(AssertUnwindSafe(|| {
        assert_no_growth(&trainer, 1, 4, |_| {
            // The DJL leak: a parameter as first input puts the result in the trainer.
            let (_y, l) = (w.add(&w)?, line!());
            line.set(l);
            Ok(())
        })
    }));
    let payload = caught.expect_err("a leaking step must fail the check");
    let message = payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .expect("a text panic message");
    assert!(message.contains("'leaky'"), "{message}");
    assert!(message.contains(&here(line.get())), "{message}");
    assert!(message.contains("5 live arrays"), "{message}");
    trainer.close()
}

#[test]
fn assert_no_growth_panics_when_a_step_fails() {
    let m = Manager::new_base();
    let caught = catch_unwind(AssertUnwindSafe(|| {
        assert_no_growth(&m, 0, 2, |_| {
            let a = m.ones([2], DType::F32)?;
            a.close()?;
            a.to_vec::<f32>().map(|_| ())
        })
    }));
    assert!(caught.is_err());
    m.close().unwrap();
}

#[test]
fn measure_growth_returns_the_growth_or_the_steps_error() -> Result<()> {
    let m = Manager::new_base();
    let growth = measure_growth(&m, 1, 3, |_| {
        m.ones([1], DType::F32)?;
        Ok(())
    })?;
    assert_eq!(growth.sites.len(), 1);
    assert_eq!(
        (growth.sites[0].count_before, growth.sites[0].count_after),
        (1, 4)
    );
    let failed = measure_growth(&m, 0, 1, |_| {
        let a = m.ones([1], DType::F32)?;
        a.close()?;
        a.to_vec::<f32>().map(|_| ())
    });
    assert!(matches!(failed, Err(Error::ArrayClosed { .. })));
    m.close()
}

/// Capping the long-lived manager catches the same leak at the line that causes it.
#[test]
fn capping_catches_the_leak_at_its_line() -> Result<()> {
    let trainer = Manager::new_base().with_name("trainer");
    let w = trainer.ones([4], DType::F32)?;
    trainer.cap();
    let (err, line) = (w.add(&w).unwrap_err(), line!());
    assert!(matches!(err, Error::Capped { .. }));
    assert!(err.to_string().contains(&here(line)), "{err}");
    trainer.close()
}
