//! Counters like `torch.cuda.memory_stats` (DESIGN §8): allocations, frees, bytes allocated,
//! spills, reallocations, out-of-memory refusals and the peak, per device, with a reset.
//!
//! The counters are per process and a reset clears them for everyone, so this file holds one
//! test, run alone in its own process.

use ndscope::{
    memory_usage, reset_memory_stats, set_memory_limit, DType, Device, Manager, Result,
    SpillPolicy, WorkspaceConfig,
};

#[test]
fn counters_count_each_kind_of_event_and_reset_to_zero() -> Result<()> {
    let m = Manager::new_base();
    m.zeros([1000], DType::F32)?; // something live across the reset
    let driver_before = memory_usage(Device::Cpu).driver_allocations;
    reset_memory_stats(Device::Cpu);
    let zero = memory_usage(Device::Cpu);
    assert_eq!(
        (
            zero.allocations,
            zero.frees,
            zero.allocated_bytes,
            zero.freed_bytes
        ),
        (0, 0, 0, 0)
    );
    assert_eq!((zero.spills, zero.reallocations, zero.ooms), (0, 0, 0));
    assert_eq!(
        zero.peak, zero.in_use,
        "the peak restarts from what is in use"
    );
    assert!(zero.arrays >= 1, "live arrays are not a counter: {zero:?}");
    assert_eq!(
        zero.driver_allocations, driver_before,
        "driver allocations are since the process started"
    );

    // Three arrays, two freed.
    let a = m.zeros([10], DType::F32)?;
    let b = m.zeros([20], DType::F64)?;
    m.zeros([5], DType::U8)?;
    a.close()?;
    b.close()?;
    let u = memory_usage(Device::Cpu);
    assert_eq!((u.allocations, u.frees), (3, 2));
    assert_eq!((u.allocated_bytes, u.freed_bytes), (40 + 160 + 5, 40 + 160));
    assert!(u.peak >= zero.in_use + 205);

    // A workspace that learns, then outgrows its block twice: spills and one reallocation per
    // growth.
    let ws = m.workspace(
        "growing",
        WorkspaceConfig::builder()
            .spill(SpillPolicy::Reallocate)
            .build()?,
    )?;
    ws.cycle(|s| s.ones([16], DType::F32).map(|_| ()))?; // learning: 1 spill
    ws.cycle(|s| s.ones([4096], DType::F32).map(|_| ()))?; // outgrows: 1 spill, grows
    let u = memory_usage(Device::Cpu);
    assert_eq!((u.spills, u.reallocations), (2, 1), "{u:?}");
    assert_eq!(
        (u.spills, u.reallocations),
        (ws.stats().spilled_count, ws.stats().reallocations)
    );

    // A refused allocation.
    set_memory_limit(Device::Cpu, Some(u.in_use + 64));
    let refused = m.zeros([1 << 16], DType::F32);
    set_memory_limit(Device::Cpu, None);
    assert!(refused.is_err());
    assert_eq!(memory_usage(Device::Cpu).ooms, 1);

    // Another device's reset leaves the CPU's counters alone; the CPU's clears them.
    reset_memory_stats(Device::Cuda(5));
    assert_eq!(memory_usage(Device::Cpu).ooms, 1);
    reset_memory_stats(Device::Cpu);
    let after = memory_usage(Device::Cpu);
    assert_eq!((after.allocations, after.ooms, after.spills), (0, 0, 0));
    m.close()?;
    let closed = memory_usage(Device::Cpu);
    assert!(closed.frees >= 2 && closed.freed_bytes >= 4000 + 5);
    Ok(())
}
