//! A load that fails partway (the memory limit) leaves nothing behind. Alone in its binary:
//! the limit is process-wide, and other tests allocating meanwhile would see it.

use ndscope::{memory_usage, set_memory_limit, DType, Device, Error, Manager};

#[test]
fn a_load_refused_partway_closes_what_it_created() {
    let d = std::env::temp_dir().join(format!("ndscope-persist-limit-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    let path = d.join("model.safetensors");
    let m = Manager::new_base();
    // "a" (1 MiB) loads first in name order; "b" (16 MiB) does not fit.
    m.zeros([1 << 18], DType::F32).unwrap().set_name("a");
    m.zeros([1 << 22], DType::F32).unwrap().set_name("b");
    m.save_safetensors(&path).unwrap();
    m.close().unwrap();

    let target = Manager::new_base().with_name("target");
    let before = memory_usage(Device::Cpu).in_use;
    set_memory_limit(Device::Cpu, Some(before + (4 << 20)));
    let result = target.load_safetensors(&path);
    set_memory_limit(Device::Cpu, None);
    let err = result.unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { .. }), "{err}");
    assert_eq!(target.report().total_arrays(), 0, "\"a\" was closed again");
    assert_eq!(memory_usage(Device::Cpu).in_use, before);
    target.close().unwrap();
    std::fs::remove_dir_all(&d).unwrap();
}
