//! SVID issuance rate of the builtin CA: one ECDSA P-256 key pair, one leaf signed by
//! the node CA, both PEM-encoded — the work of a first subscriber or of one rotation.
//! Criterion's `thrpt` line is the issuance rate (issuances/s).
//!
//! * `issue`: [`BuiltinCa::issue`] alone.
//! * `subscribe_unsubscribe`: a pod subscribes (issues and publishes the view) and
//!   unsubscribes (drops the SVID, publishes again), with 100 other identities held.
//!
//! Run: `cargo bench -p flock-bird --bench identity -- --warm-up-time 1 --measurement-time 3`.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use flock_bird::identity::{BuiltinCa, IdentityProvider, PodIdentity};
use flock_core::gc::PodKey;
use std::hint::black_box;
use std::time::Duration;

fn pod(i: usize) -> PodIdentity {
    PodIdentity {
        key: PodKey::new(format!("c{i}"), "eth0"),
        namespace: "shop".to_string(),
        service_account: format!("sa-{i}"),
        pod_name: format!("p{i}"),
        pod_uid: String::new(),
    }
}

fn issuance(c: &mut Criterion) {
    let ca = BuiltinCa::new(
        "cluster.local",
        Duration::from_secs(3600),
        flock_clock::unix_now,
    )
    .expect("CA");
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    rt.block_on(async {
        for i in 0..100 {
            ca.subscribe(&pod(i)).await.expect("subscribe");
        }
    });
    let mut g = c.benchmark_group("svid");
    g.throughput(Throughput::Elements(1));
    g.bench_function("issue", |b| {
        b.iter(|| {
            black_box(
                ca.issue("spiffe://cluster.local/ns/shop/sa/bench")
                    .expect("issue"),
            )
        })
    });
    let p = pod(1_000);
    g.bench_function("subscribe_unsubscribe", |b| {
        b.iter(|| {
            rt.block_on(async {
                black_box(ca.subscribe(&p).await.expect("subscribe"));
                ca.unsubscribe(&p.key).await;
            })
        })
    });
    g.finish();
}

criterion_group!(benches, issuance);
criterion_main!(benches);
