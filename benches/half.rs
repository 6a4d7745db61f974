//! Half precision on the CPU: products `[n, n] · [n, n]` in f16 and bf16 against the same
//! product in f32 (the baseline, same run), at n = 256 and 1024, and the conversion of 1M
//! elements f32 → bf16 against a memcpy of the same f32 bytes.
//!
//! Products of halves compute in f32: the operands are widened (exactly) as they are read, the
//! product runs through the f32 kernel, and each result is rounded once; so a half product
//! costs the f32 one plus two passes of conversion over its operands and one over its result.

// criterion's macros generate undocumented public functions.
#![allow(missing_docs)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use ndscope::{DType, Manager};

fn products(c: &mut Criterion) {
    let m = Manager::new_base();
    let mut g = c.benchmark_group("half_products");
    for n in [256usize, 1024] {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let a = m
                .randn([n, n], DType::F32)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let b = m
                .randn([n, n], DType::F32)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            g.bench_function(format!("matmul {n}x{n} {dtype}"), |bench| {
                bench.iter(|| a.matmul(black_box(&b)).unwrap().close().unwrap())
            });
        }
    }
    g.finish();
    m.close().unwrap();
}

fn conversion(c: &mut Criterion) {
    let m = Manager::new_base();
    let x = m.randn([1 << 20], DType::F32).unwrap();
    let mut g = c.benchmark_group("half_conversion");
    g.bench_function("to_dtype 1M f32 -> bf16", |b| {
        b.iter(|| x.to_dtype(DType::BF16).unwrap().close().unwrap())
    });
    g.bench_function("duplicate 1M f32 (baseline)", |b| {
        b.iter(|| x.duplicate().unwrap().close().unwrap())
    });
    g.finish();
    m.close().unwrap();
}

criterion_group!(
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = products, conversion
);
criterion_main!(benches);
