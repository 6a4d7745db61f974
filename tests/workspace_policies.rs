//! The scenarios of ND4J's own workspace tests (`BasicWorkspaceTests`, `CyclicWorkspaceTests`,
//! `SpecialWorkspaceTests`), with their figures re-derived for ndscope's 64-byte alignment:
//! 100 f64 = 800 B → 832 B; 100 f32 = 400 B → 448 B; 5 f64 = 40 B → 64 B.
//!
//! Each scenario runs with a CPU owner and with a CUDA owner (`device_tests!`): a CUDA
//! workspace is one device allocation carved the same way, so every figure is the same. Where
//! the devices differ by design (memory-mapped blocks, mirroring) the tests say so.

use ndscope::{
    AllocationPolicy, DType, Device, Error, LearningPolicy, Manager, ResetPolicy, SpillPolicy,
    Workspace, WorkspaceConfig,
};

mod common;
use common::device_tests;

/// The workspaces' owner, on `dev`.
fn trainer(dev: Device) -> Manager {
    Manager::new_base_on(dev).unwrap().with_name("trainer")
}

fn strict() -> ndscope::WorkspaceConfigBuilder {
    WorkspaceConfig::builder().allocation(AllocationPolicy::Strict)
}

fn ws(owner: &Manager, conf: WorkspaceConfig) -> Workspace {
    owner.workspace("ws", conf).unwrap()
}

device_tests!(first_loop_strict_learns_the_first_cycle);
fn first_loop_strict_learns_the_first_cycle(dev: Device) {
    let t = trainer(dev);
    let ws = ws(
        &t,
        strict()
            .learning(LearningPolicy::FirstLoop)
            .build()
            .unwrap(),
    );
    {
        let c = ws.open().unwrap();
        c.zeros([100], DType::F64).unwrap();
        c.zeros([100], DType::F64).unwrap();
        // Cold: the first cycle spills while it is measured.
        assert_eq!(ws.stats().used, 0);
        assert_eq!(ws.stats().capacity, 0);
        assert_eq!(ws.stats().spilled_count, 2);
    }
    let s = ws.stats();
    assert!(s.initialized);
    assert_eq!(s.capacity, 2 * 832);
    assert_eq!(s.used, 0);
    assert_eq!(s.last_cycle_bytes, 1664);
    {
        let c = ws.open().unwrap();
        c.zeros([100], DType::F64).unwrap();
        assert_eq!(ws.stats().used, 832);
    }
    assert_eq!(
        ws.stats().used,
        0,
        "BlockLeft resets the offset at the end of a cycle"
    );
    assert_eq!(ws.stats().spilled_count, 2);
    t.close().unwrap();
}

device_tests!(first_loop_overallocation_with_limit_one_doubles_the_block);
fn first_loop_overallocation_with_limit_one_doubles_the_block(dev: Device) {
    let t = trainer(dev);
    let conf = WorkspaceConfig::builder()
        .allocation(AllocationPolicy::Overallocate)
        .overallocation_limit(1.0)
        .build()
        .unwrap();
    let ws = ws(&t, conf);
    ws.cycle(|c| c.zeros([100], DType::F64).map(|_| ()))
        .unwrap();
    assert_eq!(ws.stats().capacity, 2 * 832);
    t.close().unwrap();
}

device_tests!(default_config_overallocates_thirty_percent);
fn default_config_overallocates_thirty_percent(dev: Device) {
    let t = trainer(dev);
    let conf = WorkspaceConfig::default();
    assert_eq!(conf.allocation(), AllocationPolicy::Overallocate);
    assert_eq!(conf.overallocation_limit(), 0.3);
    assert_eq!(conf.learning(), LearningPolicy::FirstLoop);
    assert_eq!(conf.spill(), SpillPolicy::External);
    assert_eq!(conf.reset(), ResetPolicy::BlockLeft);
    let ws = ws(&t, conf);
    ws.cycle(|c| c.zeros([1000], DType::F32).map(|_| ()))
        .unwrap();
    // 4000 B → 4032 B aligned; + floor(4032 × 0.3) = 1209.
    assert_eq!(ws.stats().capacity, 4032 + 1209);
    t.close().unwrap();
}

device_tests!(initial_size_is_allocated_at_creation_with_overallocation);
fn initial_size_is_allocated_at_creation_with_overallocation(dev: Device) {
    let t = trainer(dev);
    let conf = WorkspaceConfig::builder()
        .initial_size(1024)
        .overallocation_limit(1.0)
        .learning(LearningPolicy::None)
        .build()
        .unwrap();
    let ws = ws(&t, conf);
    let s = ws.stats();
    assert!(s.initialized);
    assert_eq!(s.capacity, 2048);
    t.close().unwrap();
}

device_tests!(min_size_raises_the_learned_block);
fn min_size_raises_the_learned_block(dev: Device) {
    let t = trainer(dev);
    let conf = WorkspaceConfig::builder()
        .min_size(10 << 20)
        .overallocation_limit(1.0)
        .build()
        .unwrap();
    let ws = ws(&t, conf);
    ws.cycle(|c| c.zeros([100], DType::F64).map(|_| ()))
        .unwrap();
    assert_eq!(ws.stats().capacity, 10 << 20);
    t.close().unwrap();
}

device_tests!(max_size_caps_the_learned_block_and_the_rest_spills);
fn max_size_caps_the_learned_block_and_the_rest_spills(dev: Device) {
    let t = trainer(dev);
    let ws = ws(&t, strict().max_size(1000).build().unwrap());
    ws.cycle(|c| c.zeros([500], DType::F32).map(|_| ()))
        .unwrap();
    assert_eq!(ws.stats().capacity, 1000);
    ws.cycle(|c| {
        c.zeros([200], DType::F32)?; // 800 → 832 B: fits
        assert_eq!(ws.stats().used, 832);
        c.zeros([100], DType::F32)?; // 448 B more does not fit in 1000
        assert_eq!(ws.stats().used, 832);
        Ok(())
    })
    .unwrap();
    assert_eq!(ws.stats().spilled_count, 2);
    t.close().unwrap();
}

device_tests!(fail_spill_leaves_the_offset_unchanged);
fn fail_spill_leaves_the_offset_unchanged(dev: Device) {
    let t = trainer(dev);
    let conf = strict()
        .initial_size(1 << 20)
        .max_size(1 << 20)
        .spill(SpillPolicy::Fail)
        .build()
        .unwrap();
    let ws = ws(&t, conf);
    let c = ws.open().unwrap();
    let a = c.ones([1, 5], DType::F64).unwrap();
    assert_eq!(ws.stats().used, 64);
    let before = ws.stats();
    let err = c.zeros([10_000_000], DType::F64).unwrap_err();
    assert!(matches!(err, Error::WorkspaceFull { .. }), "{err}");
    assert!(err.to_string().contains("workspace 'ws' is full"), "{err}");
    assert_eq!(ws.stats(), before, "a refused allocation changes nothing");
    assert_eq!(c.report().arrays.len(), 1);
    let b = c.ones([1, 5], DType::F64).unwrap();
    assert_eq!(ws.stats().used, 128);
    assert_eq!(
        a.add(&b)
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap(),
        10.0
    );
    drop(c);
    t.close().unwrap();
}

device_tests!(fail_spill_still_learns_from_a_spilled_first_cycle);
fn fail_spill_still_learns_from_a_spilled_first_cycle(dev: Device) {
    let t = trainer(dev);
    let ws = ws(&t, strict().spill(SpillPolicy::Fail).build().unwrap());
    ws.cycle(|c| c.zeros([100], DType::F32).map(|_| ()))
        .unwrap();
    assert_eq!(ws.stats().capacity, 448);
    let err = ws
        .cycle(|c| c.zeros([200], DType::F32).map(|_| ()))
        .unwrap_err();
    assert!(matches!(err, Error::WorkspaceFull { .. }));
    t.close().unwrap();
}

fn spill_scenario(dev: Device, spill: SpillPolicy) -> (Workspace, Manager) {
    let t = trainer(dev);
    let ws = ws(&t, strict().spill(spill).build().unwrap());
    ws.cycle(|c| c.zeros([100], DType::F32).map(|_| ()))
        .unwrap();
    assert_eq!(ws.stats().capacity, 448);
    ws.cycle(|c| {
        c.zeros([1000], DType::F32)?;
        assert_eq!(ws.stats().used, 0, "does not fit: spilled");
        Ok(())
    })
    .unwrap();
    (ws, t)
}

device_tests!(external_spill_never_grows_the_block);
fn external_spill_never_grows_the_block(dev: Device) {
    let (ws, t) = spill_scenario(dev, SpillPolicy::External);
    let s = ws.stats();
    assert_eq!(s.capacity, 448);
    assert_eq!(s.reallocations, 0);
    assert_eq!(s.spilled_count, 2);
    assert_eq!(s.spilled_bytes, 448 + 4032);
    t.close().unwrap();
}

device_tests!(reallocate_grows_the_block_to_the_largest_cycle);
fn reallocate_grows_the_block_to_the_largest_cycle(dev: Device) {
    let (ws, t) = spill_scenario(dev, SpillPolicy::Reallocate);
    let s = ws.stats();
    assert_eq!(s.capacity, 4032);
    assert_eq!(s.reallocations, 1);
    ws.cycle(|c| {
        c.zeros([1000], DType::F32)?;
        assert_eq!(ws.stats().used, 4032, "fits after growing");
        Ok(())
    })
    .unwrap();
    assert_eq!(ws.stats().spilled_count, 2);
    t.close().unwrap();
}

device_tests!(over_time_learns_after_the_given_cycles_from_the_largest);
fn over_time_learns_after_the_given_cycles_from_the_largest(dev: Device) {
    let t = trainer(dev);
    let conf = strict()
        .learning(LearningPolicy::OverTime)
        .cycles_before_initialization(3)
        .build()
        .unwrap();
    let ws = ws(&t, conf);
    let figures = [448, 832, 1216];
    for (i, bytes) in figures.iter().enumerate() {
        assert!(!ws.stats().initialized, "not before cycle {}", i + 1);
        ws.cycle(|c| c.zeros([100 * (i + 1)], DType::F32).map(|_| ()))
            .unwrap();
        assert_eq!(ws.stats().last_cycle_bytes, *bytes);
    }
    let s = ws.stats();
    assert!(s.initialized);
    assert_eq!(s.capacity, 1216);
    assert_eq!(s.max_cycle_bytes, 1216);
    t.close().unwrap();
}

#[test]
fn over_time_with_zero_cycles_is_rejected() {
    let err = WorkspaceConfig::builder()
        .learning(LearningPolicy::OverTime)
        .build()
        .unwrap_err();
    assert!(matches!(err, Error::InvalidConfig { .. }));
    assert!(err.to_string().contains("never learn"), "{err}");
}

device_tests!(initialize_sizes_the_block_from_the_largest_cycle);
fn initialize_sizes_the_block_from_the_largest_cycle(dev: Device) {
    let t = trainer(dev);
    let conf = WorkspaceConfig::builder()
        .learning(LearningPolicy::OverTime)
        .cycles_before_initialization(1000)
        .overallocation_limit(1.0)
        .build()
        .unwrap();
    let ws = ws(&t, conf);
    for x in (10..=100).step_by(10) {
        ws.cycle(|c| c.zeros([x], DType::F64).map(|_| ())).unwrap();
    }
    assert_eq!(ws.stats().capacity, 0);
    ws.initialize().unwrap();
    assert_eq!(ws.stats().capacity, 2 * 832);
    ws.initialize().unwrap();
    assert_eq!(ws.stats().capacity, 2 * 832, "initialize is idempotent");
    t.close().unwrap();
}

device_tests!(initialize_with_nothing_to_learn_from_is_an_error);
fn initialize_with_nothing_to_learn_from_is_an_error(dev: Device) {
    let t = trainer(dev);
    let ws = ws(&t, WorkspaceConfig::default());
    assert!(matches!(
        ws.initialize(),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(!ws.stats().initialized);
    t.close().unwrap();
}

device_tests!(every_allocation_rounds_up_to_the_alignment);
fn every_allocation_rounds_up_to_the_alignment(dev: Device) {
    assert_eq!(ndscope::workspace::ALIGNMENT, 64);
    let t = trainer(dev);
    let ws = ws(&t, strict().initial_size(4096).build().unwrap());
    ws.cycle(|c| {
        c.zeros([1], DType::F32)?;
        assert_eq!(ws.stats().used, 64);
        c.zeros([65], DType::U8)?;
        assert_eq!(ws.stats().used, 64 + 128);
        c.zeros([0], DType::F64)?;
        assert_eq!(ws.stats().used, 192, "empty arrays take nothing");
        c.zeros([8], DType::F64)?;
        assert_eq!(ws.stats().used, 256);
        Ok(())
    })
    .unwrap();
    t.close().unwrap();
}

device_tests!(same_name_and_config_is_the_same_workspace_another_config_is_refused);
fn same_name_and_config_is_the_same_workspace_another_config_is_refused(dev: Device) {
    let t = trainer(dev);
    let a = t.workspace("batch", WorkspaceConfig::default()).unwrap();
    let b = t.workspace("batch", WorkspaceConfig::default()).unwrap();
    let c = a.open().unwrap();
    assert!(
        matches!(b.open(), Err(Error::WorkspaceBusy { .. })),
        "b is a"
    );
    drop(c);
    let err = t.workspace("batch", strict().build().unwrap()).unwrap_err();
    assert!(matches!(err, Error::InvalidConfig { .. }), "{err}");
    assert!(err.to_string().contains("another configuration"), "{err}");
    // Another name is another workspace.
    let other = t.workspace("eval", strict().build().unwrap()).unwrap();
    let _c1 = a.open().unwrap();
    let _c2 = other.open().unwrap();
    t.close().unwrap();
}

device_tests!(a_second_open_cycle_is_workspace_busy);
fn a_second_open_cycle_is_workspace_busy(dev: Device) {
    let t = trainer(dev);
    let ws = t.workspace("batch", WorkspaceConfig::default()).unwrap();
    let first = ws.open().unwrap();
    let err = ws.open().unwrap_err();
    assert!(matches!(err, Error::WorkspaceBusy { .. }));
    assert!(err.to_string().contains("batch#1"), "{err}");
    first.close().unwrap();
    let _again = ws.open().unwrap();
    t.close().unwrap();
}

device_tests!(cycles_are_named_and_counted);
fn cycles_are_named_and_counted(dev: Device) {
    let t = trainer(dev);
    let ws = t.workspace("batch", WorkspaceConfig::default()).unwrap();
    for i in 1..=3u64 {
        let c = ws.open().unwrap();
        assert_eq!(c.name(), format!("batch#{i}"));
        assert_eq!(c.parent().unwrap(), t);
        assert_eq!(ws.stats().generation, i);
        assert_eq!(ws.stats().cycles, i - 1);
    }
    assert_eq!(ws.stats().cycles, 3);
    assert_eq!(ws.name(), "batch");
    assert_eq!(ws.owner(), t);
    t.close().unwrap();
}

device_tests!(arrays_of_a_cycle_are_closed_when_it_ends);
fn arrays_of_a_cycle_are_closed_when_it_ends(dev: Device) {
    let t = trainer(dev);
    let ws = t.workspace("batch", WorkspaceConfig::default()).unwrap();
    let kept = {
        let c = ws.open().unwrap();
        let x = c.ones([16], DType::F32).unwrap().with_name("x");
        let sub = c.new_sub_manager().unwrap();
        let y = sub.ones([16], DType::F32).unwrap();
        (x, y)
    };
    for a in [&kept.0, &kept.1] {
        assert!(!a.is_open());
        let err = a.to_vec::<f32>().unwrap_err();
        assert!(matches!(err, Error::ArrayClosed { .. }));
    }
    let msg = kept.0.to_vec::<f32>().unwrap_err().to_string();
    assert!(msg.contains("workspace cycle ended"), "{msg}");
    assert!(msg.contains("'x'"), "{msg}");
    t.close().unwrap();
}

device_tests!(sub_managers_of_a_cycle_allocate_from_its_block);
fn sub_managers_of_a_cycle_allocate_from_its_block(dev: Device) {
    let t = trainer(dev);
    let ws = t
        .workspace("batch", strict().initial_size(4096).build().unwrap())
        .unwrap();
    ws.cycle(|c| {
        let inner = c.new_sub_manager()?;
        inner.zeros([16], DType::F32)?;
        assert_eq!(ws.stats().used, 64);
        c.scope(|s| s.zeros([16], DType::F32).map(|_| ()))?;
        assert_eq!(ws.stats().used, 128);
        Ok(())
    })
    .unwrap();
    t.close().unwrap();
}

device_tests!(cycle_makes_the_scope_active_and_factories_outside_are_untouched);
fn cycle_makes_the_scope_active_and_factories_outside_are_untouched(dev: Device) {
    let t = trainer(dev);
    let model = Manager::new_base_on(dev).unwrap();
    let w = model.ones([4], DType::F32).unwrap();
    model.cap();
    let ws = t
        .workspace("batch", strict().initial_size(4096).build().unwrap())
        .unwrap();
    let y = ws
        .cycle(|c| {
            let y = w.mul_scalar(2.0)?; // first input in the capped model: lands in the cycle
            assert_eq!(y.manager()?, *c);
            assert_eq!(ws.stats().used, 64);
            c.ret(&y)
        })
        .unwrap();
    assert_eq!(y.manager().unwrap(), t);
    assert_eq!(y.to_vec::<f32>().unwrap(), vec![2.0; 4]);
    t.close().unwrap();
    model.close().unwrap();
}

device_tests!(nested_workspaces_keep_their_own_offsets);
fn nested_workspaces_keep_their_own_offsets(dev: Device) {
    let t = trainer(dev);
    let conf = strict().initial_size(1 << 16).build().unwrap();
    let outer = t.workspace("outer", conf.clone()).unwrap();
    let a = outer.open().unwrap();
    let inner = a.workspace("inner", conf).unwrap();
    a.zeros([5], DType::F64).unwrap();
    assert_eq!(outer.stats().used, 64);
    {
        let b = inner.open().unwrap();
        b.zeros([100], DType::F64).unwrap();
        assert_eq!(inner.stats().used, 832);
        assert_eq!(outer.stats().used, 64, "the outer offset did not move");
        a.zeros([5], DType::F64).unwrap();
        assert_eq!(outer.stats().used, 128);
        assert_eq!(inner.stats().used, 832);
    }
    assert_eq!(inner.stats().used, 0);
    assert_eq!(outer.stats().used, 128);
    drop(a);
    assert!(
        inner.is_destroyed(),
        "owned by the outer cycle, freed with it"
    );
    t.close().unwrap();
}

device_tests!(leverage_copies_into_the_outer_workspace_and_keeps_the_handle);
fn leverage_copies_into_the_outer_workspace_and_keeps_the_handle(dev: Device) {
    let t = trainer(dev);
    let conf = strict().initial_size(1 << 16).build().unwrap();
    let outer = t.workspace("EXT", conf.clone()).unwrap();
    let a = outer.open().unwrap();
    a.zeros([5], DType::F64).unwrap();
    let inner = t.workspace("INT", conf).unwrap();
    let x = {
        let b = inner.open().unwrap();
        let x = b.from_slice(&[1.0f64, 2.0, 3.0, 4.0, 5.0], [5]).unwrap();
        assert_eq!(inner.stats().used, 64);
        x.attach(&a).unwrap(); // leverageTo("EXT")
        assert_eq!(outer.stats().used, 128, "copied into the outer block");
        assert_eq!(x.manager().unwrap(), *a);
        x
    };
    assert!(x.is_open(), "survives the inner cycle");
    // A new inner cycle writes where x was; x no longer lives there.
    inner
        .cycle(|b| b.full([5], 9.0, DType::F64).map(|_| ()))
        .unwrap();
    assert_eq!(x.sum_all().unwrap().to_scalar::<f64>().unwrap(), 15.0);
    drop(a);
    assert!(!x.is_open(), "and dies with the outer one");
    t.close().unwrap();
}

device_tests!(ret_out_of_a_cycle_copies_the_data_out);
fn ret_out_of_a_cycle_copies_the_data_out(dev: Device) {
    let t = trainer(dev);
    let ws = t
        .workspace("batch", strict().initial_size(4096).build().unwrap())
        .unwrap();
    let y = ws
        .cycle(|c| {
            let y = c.from_slice(&[1.0f32, 2.0, 3.0], [3])?;
            c.ret(&y)
        })
        .unwrap();
    // The next cycle writes over the block where y was.
    ws.cycle(|c| c.full([64], 7.0, DType::F32).map(|_| ()))
        .unwrap();
    assert_eq!(y.to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0]);
    assert_eq!(y.manager().unwrap(), t);
    assert!(!t.report().arrays[0].in_workspace);
    t.close().unwrap();
}

device_tests!(detach_copies_out_and_the_caller_closes);
fn detach_copies_out_and_the_caller_closes(dev: Device) {
    let t = trainer(dev);
    let ws = t
        .workspace("ITER", strict().initial_size(4096).build().unwrap())
        .unwrap();
    let copy = ws
        .cycle(|c| {
            let a = c.from_slice(&[1.0f64, 2.0, 3.0, 4.0, 5.0], [5])?;
            a.detach()?;
            assert_eq!(ws.stats().used, 64, "the copy is not in the workspace");
            Ok(a)
        })
        .unwrap();
    ws.cycle(|c| c.full([100], 3.0, DType::F64).map(|_| ()))
        .unwrap();
    assert!(copy.is_detached());
    assert_eq!(copy.sum_all().unwrap().to_scalar::<f64>().unwrap(), 15.0);
    copy.close().unwrap();
    t.close().unwrap();
}

device_tests!(temp_attach_out_of_a_cycle_copies_and_returns_after_it);
fn temp_attach_out_of_a_cycle_copies_and_returns_after_it(dev: Device) {
    let t = trainer(dev);
    let ws = t
        .workspace("batch", strict().initial_size(4096).build().unwrap())
        .unwrap();
    let c = ws.open().unwrap();
    let x = c.from_slice(&[4.0f32, 5.0], [2]).unwrap();
    {
        let borrower = t.sub_scope().unwrap();
        x.temp_attach(&borrower).unwrap();
    }
    assert_eq!(x.manager().unwrap(), *c, "went back to the cycle");
    drop(c);
    assert!(!x.is_open());
    t.close().unwrap();
}

fn circular(dev: Device, capacity: usize) -> (Manager, Workspace) {
    let t = trainer(dev);
    let conf = strict()
        .initial_size(capacity)
        .learning(LearningPolicy::None)
        .reset(ResetPolicy::EndOfBuffer)
        .build()
        .unwrap();
    let ws = t.workspace("prefetch", conf).unwrap();
    (t, ws)
}

device_tests!(circular_ret_is_zero_copy_until_the_buffer_wraps_over_it);
fn circular_ret_is_zero_copy_until_the_buffer_wraps_over_it(dev: Device) {
    let (t, ws) = circular(dev, 1024);
    let x = ws
        .cycle(|c| c.ret(&c.full([64], 1.0, DType::F32)?.with_name("prefetched")))
        .unwrap();
    assert_eq!(ws.stats().used, 256, "the offset carries on across cycles");
    assert!(
        t.report().arrays[0].in_workspace,
        "zero-copy: still in the block"
    );
    for _ in 0..3 {
        ws.cycle(|c| c.full([64], 2.0, DType::F32).map(|_| ()))
            .unwrap();
        assert_eq!(x.sum_all().unwrap().to_scalar::<f32>().unwrap(), 64.0);
    }
    assert_eq!(ws.stats().used, 1024);
    // The next allocation wraps to offset 0, over x.
    ws.cycle(|c| c.full([64], 3.0, DType::F32).map(|_| ()))
        .unwrap();
    assert!(!x.is_open());
    let err = x.to_vec::<f32>().unwrap_err();
    assert!(matches!(err, Error::ArrayClosed { .. }));
    let msg = err.to_string();
    assert!(
        msg.contains("overwritten by circular workspace 'prefetch'"),
        "{msg}"
    );
    assert!(msg.contains("'prefetched'"), "{msg}");
    t.close().unwrap();
}

device_tests!(circular_workspace_never_overwrites_the_open_cycle);
fn circular_workspace_never_overwrites_the_open_cycle(dev: Device) {
    let (t, ws) = circular(dev, 1024);
    ws.cycle(|c| {
        let arrays: Vec<_> = (0..6)
            .map(|i| c.full([64], i as f64, DType::F32))
            .collect::<Result<_, _>>()?;
        // 4 fit; the 5th and 6th would wrap onto this cycle's own arrays: they spill.
        assert_eq!(ws.stats().spilled_count, 2);
        for (i, a) in arrays.iter().enumerate() {
            assert_eq!(a.sum_all()?.to_scalar::<f32>()?, 64.0 * i as f32);
        }
        Ok(())
    })
    .unwrap();
    t.close().unwrap();
}

device_tests!(circular_attach_copies_like_block_left);
fn circular_attach_copies_like_block_left(dev: Device) {
    let (t, ws) = circular(dev, 1024);
    let other = Manager::new_base_on(dev).unwrap();
    let x = ws
        .cycle(|c| {
            let x = c.full([64], 5.0, DType::F32)?;
            x.attach(&other)?;
            Ok(x)
        })
        .unwrap();
    assert!(!other.report().arrays[0].in_workspace);
    for _ in 0..8 {
        ws.cycle(|c| c.full([64], 1.0, DType::F32).map(|_| ()))
            .unwrap();
    }
    assert_eq!(x.sum_all().unwrap().to_scalar::<f32>().unwrap(), 320.0);
    other.close().unwrap();
    t.close().unwrap();
}

device_tests!(destroy_ends_the_cycle_and_later_calls_say_so);
fn destroy_ends_the_cycle_and_later_calls_say_so(dev: Device) {
    let t = trainer(dev);
    let ws = t.workspace("batch", WorkspaceConfig::default()).unwrap();
    let c = ws.open().unwrap();
    let x = c.ones([4], DType::F32).unwrap();
    ws.destroy().unwrap();
    assert!(!x.is_open());
    assert!(!c.is_open());
    assert!(ws.is_destroyed());
    ws.destroy().unwrap();
    let err = ws.open().unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }));
    assert!(err.to_string().contains("destroyed"), "{err}");
    assert_eq!(
        ws.stats().cycles,
        1,
        "the figures at destruction remain readable"
    );
    // The name is free again.
    t.workspace("batch", strict().build().unwrap()).unwrap();
    t.close().unwrap();
}

device_tests!(open_after_the_owner_closed_is_manager_closed);
fn open_after_the_owner_closed_is_manager_closed(dev: Device) {
    let t = trainer(dev);
    let ws = t.workspace("batch", WorkspaceConfig::default()).unwrap();
    t.close().unwrap();
    assert!(ws.is_destroyed());
    assert!(matches!(ws.open(), Err(Error::ManagerClosed { .. })));
    assert!(matches!(
        t.workspace("batch", WorkspaceConfig::default()),
        Err(Error::ManagerClosed { .. })
    ));
}

device_tests!(closing_the_owner_ends_an_open_cycle);
fn closing_the_owner_ends_an_open_cycle(dev: Device) {
    let t = trainer(dev);
    let ws = t.workspace("batch", WorkspaceConfig::default()).unwrap();
    let c = ws.open().unwrap();
    let x = c.ones([4], DType::F32).unwrap();
    t.close().unwrap();
    assert!(!c.is_open());
    assert!(!x.is_open());
}

#[test]
fn contradictory_configs_are_rejected() {
    use ndscope::LocationPolicy;
    let cases = [
        WorkspaceConfig::builder().overallocation_limit(-0.1),
        WorkspaceConfig::builder().overallocation_limit(f64::NAN),
        WorkspaceConfig::builder().min_size(100).max_size(10),
        WorkspaceConfig::builder().initial_size(100).max_size(10),
        WorkspaceConfig::builder().learning(LearningPolicy::OverTime),
        WorkspaceConfig::builder().cycles_before_initialization(3),
        WorkspaceConfig::builder().learning(LearningPolicy::None),
        WorkspaceConfig::builder()
            .learning(LearningPolicy::None)
            .spill(SpillPolicy::Fail),
        WorkspaceConfig::builder()
            .location(LocationPolicy::Mmap)
            .initial_size(4096),
        WorkspaceConfig::builder()
            .location(LocationPolicy::Mmap)
            .learning(LearningPolicy::None),
        WorkspaceConfig::builder()
            .location(LocationPolicy::Mmap)
            .learning(LearningPolicy::None)
            .initial_size(4096)
            .spill(SpillPolicy::Reallocate),
        WorkspaceConfig::builder().mmap_path("/tmp/x"),
    ];
    for (i, b) in cases.into_iter().enumerate() {
        let err = b.build().unwrap_err();
        assert!(
            matches!(err, Error::InvalidConfig { .. }),
            "case {i}: {err}"
        );
    }
    // And the sensible neighbours are fine.
    WorkspaceConfig::builder()
        .learning(LearningPolicy::None)
        .spill(SpillPolicy::Reallocate)
        .build()
        .unwrap();
    WorkspaceConfig::builder()
        .learning(LearningPolicy::None)
        .initial_size(4096)
        .spill(SpillPolicy::Fail)
        .build()
        .unwrap();
}

device_tests!(reports_and_dumps_show_each_workspace);
fn reports_and_dumps_show_each_workspace(dev: Device) {
    let t = trainer(dev);
    let ws = t.workspace("batch", WorkspaceConfig::default()).unwrap();
    ws.cycle(|c| c.zeros([1000], DType::F32).map(|_| ()))
        .unwrap();
    let report = t.report();
    assert_eq!(report.workspaces.len(), 1);
    assert_eq!(report.workspaces[0].name, "batch");
    assert_eq!(report.workspaces[0].stats, ws.stats());
    let c = ws.open().unwrap();
    c.zeros([10], DType::F32).unwrap();
    let dump = t.debug_dump(1);
    assert!(
        dump.contains(
            "workspace 'batch' [capacity 5.12 KiB, used 64 B, cycles 1, spilled 3.94 KiB in 1"
        ),
        "{dump}"
    );
    assert!(dump.contains("batch#2"), "{dump}");
    assert!(dump.contains("[workspace]"), "{dump}");
    drop(c);
    t.close().unwrap();
}

device_tests!(mmap_location_is_cpu_only);
/// `LocationPolicy::Mmap` maps a host file: a CPU owner gets it, a CUDA owner `Unsupported`,
/// with nothing created.
fn mmap_location_is_cpu_only(dev: Device) {
    use ndscope::LocationPolicy;
    let t = trainer(dev);
    let conf = strict()
        .location(LocationPolicy::Mmap)
        .learning(LearningPolicy::None)
        .initial_size(4096)
        .build()
        .unwrap();
    match dev {
        Device::Cpu => {
            let ws = t.workspace("mapped", conf).unwrap();
            assert_eq!(ws.stats().capacity, 4096);
            ws.cycle(|c| {
                let a = c.full([16], 2.0, DType::F32)?;
                assert_eq!(a.device(), Device::Cpu);
                assert_eq!(a.sum_all()?.to_scalar::<f32>()?, 32.0);
                Ok(())
            })
            .unwrap();
        }
        Device::Cuda(_) => {
            let err = t.workspace("mapped", conf).unwrap_err();
            assert!(matches!(err, Error::Unsupported { .. }), "{err}");
            let text = err.to_string();
            assert!(
                text.contains("Mmap") && text.contains(&dev.to_string()),
                "{text}"
            );
            assert!(t.report().workspaces.is_empty(), "nothing was created");
            // The same name is still free for a workspace the device can hold.
            t.workspace("mapped", strict().build().unwrap()).unwrap();
        }
    }
    t.close().unwrap();
}

device_tests!(mirroring_decides_where_workspace_arrays_live);
/// `MirroringPolicy::Full` puts a CUDA owner's block on its device; `HostOnly` in (page-locked)
/// host memory, so its arrays are on the CPU. A CPU owner's arrays are on the CPU either way.
/// The figures are the same in both cases.
fn mirroring_decides_where_workspace_arrays_live(dev: Device) {
    use ndscope::MirroringPolicy;
    let t = trainer(dev);
    for (mirroring, want) in [
        (MirroringPolicy::Full, dev),
        (MirroringPolicy::HostOnly, Device::Cpu),
    ] {
        let conf = strict().mirroring(mirroring).build().unwrap();
        let ws = t.workspace(&format!("{mirroring:?}"), conf).unwrap();
        for _ in 0..2 {
            ws.cycle(|c| {
                let a = c.full([100], 1.5, DType::F64)?;
                assert_eq!(a.device(), want, "{mirroring:?}");
                let b = a.mul_scalar(2.0)?;
                assert_eq!(b.device(), want, "{mirroring:?}");
                assert_eq!(b.sum_all()?.to_scalar::<f64>()?, 300.0);
                Ok(())
            })
            .unwrap();
        }
        let s = ws.stats();
        assert_eq!(s.capacity, 2 * 832 + 64, "{mirroring:?}: a, b and the sum");
        assert_eq!(
            s.spilled_count, 3,
            "{mirroring:?}: only the first cycle spilled"
        );
        assert_eq!(s.cycles, 2);
    }
    t.close().unwrap();
}
