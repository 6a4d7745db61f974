//! Workspace blocks and spills count in `memory_usage` and against the memory limit. Counters are
//! process-wide, so one test drives them.

use ndscope::{
    memory_usage, set_memory_limit, AllocationPolicy, DType, Device, Error, LearningPolicy,
    Manager, WorkspaceConfig,
};

fn in_use() -> usize {
    memory_usage(Device::Cpu).in_use
}

#[test]
fn workspace_blocks_and_spills_are_accounted_and_limited() {
    let base = in_use();
    let t = Manager::new_base();
    let strict = || WorkspaceConfig::builder().allocation(AllocationPolicy::Strict);

    // A block made at creation counts, and is freed by destroy.
    let ws = t
        .workspace(
            "fixed",
            strict()
                .initial_size(1 << 20)
                .learning(LearningPolicy::None)
                .build()
                .unwrap(),
        )
        .unwrap();
    assert_eq!(in_use(), base + (1 << 20));
    ws.destroy().unwrap();
    assert_eq!(in_use(), base);

    // Over the limit at creation: OutOfMemory, and no workspace exists.
    set_memory_limit(Device::Cpu, Some(base + (512 << 10)));
    let conf = strict()
        .initial_size(1 << 20)
        .learning(LearningPolicy::None)
        .build()
        .unwrap();
    let err = t.workspace("big", conf.clone()).unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { .. }), "{err}");
    assert!(
        err.to_string().contains("cannot allocate 1.00 MiB on cpu"),
        "{err}"
    );
    assert!(
        err.to_string().contains("ndscope::set_memory_limit"),
        "{err}"
    );
    assert!(t.report().workspaces.is_empty());
    assert_eq!(in_use(), base);

    // Spills count too; a spill over the limit fails and leaves the workspace as it was.
    let ws = t.workspace("learning", strict().build().unwrap()).unwrap();
    let c = ws.open().unwrap();
    let a = c.zeros([100 << 10], DType::F32).unwrap(); // 400 KiB spill
    assert_eq!(in_use(), base + (400 << 10));
    let before = ws.stats();
    let err = c.zeros([100 << 10], DType::F32).unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { .. }), "{err}");
    assert_eq!(ws.stats(), before);
    drop(a);
    drop(c);
    // Learning wants a 400 KiB block: it fits under the limit now that the spill is freed.
    assert!(ws.stats().initialized);
    assert_eq!(in_use(), base + (400 << 10));

    ws.destroy().unwrap();
    assert_eq!(in_use(), base);

    // Reallocation that would pass the limit keeps the old block and keeps spilling.
    // Default 30% overallocation: 40 KiB learned → 52 KiB block; an 80 KiB cycle spills
    // (52 + 80 = 132 KiB, under 140 KiB), then wants a 104 KiB block (52 + 104 > 140).
    set_memory_limit(Device::Cpu, Some(base + (140 << 10)));
    let ws2 = t
        .workspace(
            "realloc",
            WorkspaceConfig::builder()
                .spill(ndscope::SpillPolicy::Reallocate)
                .build()
                .unwrap(),
        )
        .unwrap();
    ws2.cycle(|c| c.zeros([10 << 10], DType::F32).map(|_| ()))
        .unwrap();
    assert_eq!(ws2.stats().capacity, 52 << 10);
    ws2.cycle(|c| c.zeros([20 << 10], DType::F32).map(|_| ()))
        .unwrap();
    let s = ws2.stats();
    assert_eq!(
        (s.capacity, s.reallocations),
        (52 << 10, 0),
        "a 104 KiB block would pass the limit"
    );
    assert_eq!(in_use(), base + (52 << 10));
    set_memory_limit(Device::Cpu, None);
    ws2.cycle(|c| c.zeros([20 << 10], DType::F32).map(|_| ()))
        .unwrap();
    let s = ws2.stats();
    assert_eq!((s.capacity, s.reallocations), (104 << 10, 1));
    assert_eq!(in_use(), base + (104 << 10), "the old block was freed");

    // Peak saw the spills; closing everything gives every byte back.
    assert!(memory_usage(Device::Cpu).peak >= base + (400 << 10));
    t.close().unwrap();
    assert_eq!(in_use(), base);
}
