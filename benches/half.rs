//! Half precision on the CPU: products `[n, n] · [n, n]` in f16 and bf16 against the same
//! product in f32 (the baseline, same run), at n = 256, 512 and 1024, a dense layer's product
//! `[128, 784] · [784, 1024]` and a transposed one `[1024, 512]ᵀ · [1024, 512]` in bf16 against
//! f32, and the conversion of 1M elements f32 → bf16 against a memcpy of the same f32 bytes.
//!
//! Products of halves compute in f32. f16 operands are widened (exactly), the product runs
//! through the f32 kernel, and each result is rounded once; so an f16 product costs the f32 one
//! plus two passes of conversion over its operands and one over its result. bf16 products run
//! `vdpbf16ps` on the bf16 operands where the CPU has AVX512-BF16 (`cpu/bf16.rs`), about twice
//! the multiply-adds per instruction of the f32 kernel; elsewhere they widen as f16 does.

// criterion's macros generate undocumented public functions.
#![allow(missing_docs)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use ndscope::{DType, Manager, Transpose};

fn products(c: &mut Criterion) {
    let m = Manager::new_base();
    let mut g = c.benchmark_group("half_products");
    let operands = |shape: [usize; 2], dtype: DType| {
        m.randn(shape, DType::F32).unwrap().to_dtype(dtype).unwrap()
    };
    for n in [256usize, 512, 1024] {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let (a, b) = (operands([n, n], dtype), operands([n, n], dtype));
            g.bench_function(format!("matmul {n}x{n} {dtype}"), |bench| {
                bench.iter(|| a.matmul(black_box(&b)).unwrap().close().unwrap())
            });
        }
    }
    // A dense layer's shape: a batch of 128 flattened 28×28 images times a 784→1024 weight.
    for dtype in [DType::F32, DType::BF16] {
        let (a, b) = (operands([128, 784], dtype), operands([784, 1024], dtype));
        g.bench_function(format!("matmul 128x784x1024 {dtype}"), |bench| {
            bench.iter(|| a.matmul(black_box(&b)).unwrap().close().unwrap())
        });
    }
    // A weight gradient's shape, aᵀ · b read through strides: [1024, 512]ᵀ · [1024, 512].
    for dtype in [DType::F32, DType::BF16] {
        let (a, b) = (operands([1024, 512], dtype), operands([1024, 512], dtype));
        g.bench_function(format!("matmul_t left 512x1024x512 {dtype}"), |bench| {
            bench.iter(|| {
                a.matmul_t(black_box(&b), Transpose::Left)
                    .unwrap()
                    .close()
                    .unwrap()
            })
        });
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
