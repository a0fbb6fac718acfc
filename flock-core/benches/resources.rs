//! Cost of one resource change at 10,000 resources: flock's journal diff against the
//! full merge walk and against go-control-plane's approach (re-hash every resource on
//! every delta snapshot). Run: `cargo bench -p flock-core --bench resources`.

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use flock_core::ContentHash;
use flock_core::resources::{ResourceSet, diff, diff_full};
use std::hint::black_box;

const EDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
const N: usize = 10_000;

fn resource(i: usize, generation: u8) -> Vec<u8> {
    // ~256 bytes, like a small ClusterLoadAssignment.
    let mut bytes = format!("cluster-{i:05}-gen-{generation}").into_bytes();
    bytes.resize(256, generation);
    bytes
}

fn base() -> ResourceSet<Vec<u8>> {
    let mut b = ResourceSet::new().edit();
    for i in 0..N {
        let bytes = resource(i, 0);
        b.upsert(EDS, &format!("svc-{i:05}"), ContentHash::of(&bytes), bytes);
    }
    b.build()
}

fn one_change(v1: &ResourceSet<Vec<u8>>) -> ResourceSet<Vec<u8>> {
    let bytes = resource(N / 2, 1);
    v1.edit()
        .upsert(
            EDS,
            &format!("svc-{:05}", N / 2),
            ContentHash::of(&bytes),
            bytes,
        )
        .build()
}

fn bench(c: &mut Criterion) {
    let v1 = base();
    let v2 = one_change(&v1);
    let mut g = c.benchmark_group("one change among 10k resources");
    g.bench_function("flock: derive next set + journal diff", |b| {
        b.iter_batched(
            || (),
            |()| black_box(diff(&v1, &one_change(&v1))),
            BatchSize::SmallInput,
        )
    });
    g.bench_function("flock: journal diff only", |b| {
        b.iter(|| black_box(diff(&v1, &v2)))
    });
    g.bench_function("flock: full merge-walk diff", |b| {
        b.iter(|| black_box(diff_full(&v1, &v2)))
    });
    g.bench_function(
        "baseline: re-hash every resource (go-control-plane delta)",
        |b| {
            b.iter(|| {
                for (_, e) in v2.iter_type(EDS) {
                    black_box(ContentHash::of(e.value()));
                }
            })
        },
    );
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
