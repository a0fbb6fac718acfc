//! Subscription budgets: how many resource names, and how many bytes of names, a
//! client may hold subscribed at once — per connection, per client identity across its
//! connections, and in total across every client of a pool of listeners.
//!
//! A stream's own cap ([`max_subscribed_names_per_stream`](super::Limits)) does not
//! bound a client: one connection carries up to 100 streams, a certificate opens as
//! many connections as the connection cap allows, and every subscribed name is kept
//! for as long as its stream lives (10,000 names of 4 KiB are 40 MiB per stream). So
//! every request is also checked, before anything of it is kept, against what the
//! stream's connection, its client (the authorizer's [`Principal`](super::Principal)
//! name, a SPIFFE ID on mTLS) and the pool already hold. A request over any of them
//! ends its stream with `RESOURCE_EXHAUSTED` naming the level, the usage it would reach
//! and the budget; the refusal is counted in
//! `flock_xds_streams_refused_total{reason="subscription_budget"}` and logged at `warn`
//! once per client and level. Other streams, and the client's other streams, keep what
//! they hold. A stream gives its share back when it ends.
//!
//! The total is kept per pool like the connection slots: the unix socket's clients
//! (the node's Envoy) and the TCP/TLS clients each have their own, so remote clients
//! cannot spend the budget the node's Envoy needs.

use super::conn::Pool;
use flock_core::sync::Mutex;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::Arc;
use tonic::Status;

/// Resource names and the bytes of those names (their lengths summed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Names subscribed.
    pub names: usize,
    /// Bytes of those names.
    pub bytes: usize,
}

impl Usage {
    fn fits(self, budget: Usage) -> bool {
        self.names <= budget.names && self.bytes <= budget.bytes
    }

    fn plus(self, add: Usage, sub: Usage) -> Usage {
        Usage {
            names: (self.names + add.names).saturating_sub(sub.names),
            bytes: (self.bytes + add.bytes).saturating_sub(sub.bytes),
        }
    }
}

impl fmt::Display for Usage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} names / {} bytes", self.names, self.bytes)
    }
}

/// The three levels of the budget (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SubscriptionBudget {
    /// What the streams of one connection may hold together.
    pub per_connection: Usage,
    /// What one client identity may hold across its connections.
    pub per_client: Usage,
    /// What every client of a pool (the unix socket's, or the TCP/TLS listeners')
    /// may hold together.
    pub total: Usage,
}

impl Default for SubscriptionBudget {
    /// 10,000 names / 512 KiB per connection, 20,000 / 1 MiB per client, 250,000 / 32
    /// MiB per pool: a proxyless gRPC client names a few hundred services of about 100
    /// bytes, the node's Envoy a few thousand clusters (a stream holds at most 10,000
    /// names anyway); 50 clients each holding their whole byte budget (5,000 names of
    /// 100 bytes) peaked the agent at 188 MiB in a debug build (the `xds_quotas` bench
    /// of flock-agent).
    fn default() -> Self {
        Self {
            per_connection: Usage {
                names: 10_000,
                bytes: 512 << 10,
            },
            per_client: Usage {
                names: 20_000,
                bytes: 1 << 20,
            },
            total: Usage {
                names: 250_000,
                bytes: 32 << 20,
            },
        }
    }
}

/// The level a refusal names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Level {
    Connection,
    Client,
    Total,
}

impl Level {
    fn field(self) -> &'static str {
        match self {
            Level::Connection => "per_connection",
            Level::Client => "per_client",
            Level::Total => "total",
        }
    }

    fn what(self) -> &'static str {
        match self {
            Level::Connection => "on this connection",
            Level::Client => "across this client's connections",
            Level::Total => "across every client of this listener",
        }
    }
}

/// How many (client, level) pairs are remembered for "log once" before the memory is
/// cleared.
const MAX_WARNED: usize = 4096;

#[derive(Debug, Default)]
struct Held {
    conns: HashMap<u64, Usage>,
    clients: HashMap<(Pool, String), Usage>,
    totals: [Usage; 2],
}

/// Every stream's share of the budget, server-wide.
#[derive(Debug)]
pub(crate) struct Budgets {
    budget: SubscriptionBudget,
    held: Mutex<Held>,
    warned: Mutex<HashSet<(String, Level)>>,
}

impl Budgets {
    pub(crate) fn new(budget: SubscriptionBudget) -> Arc<Self> {
        Arc::new(Self {
            budget,
            held: Mutex::new(Held::default()),
            warned: Mutex::new(HashSet::new()),
        })
    }

    #[cfg(test)]
    fn held_total(&self, pool: Pool) -> Usage {
        self.held.lock().totals[pool as usize]
    }
}

/// One stream's share: what it holds, and where it is counted.
#[derive(Debug)]
pub(crate) struct StreamBudget {
    budgets: Arc<Budgets>,
    conn: Option<u64>,
    pool: Pool,
    client: String,
    held: Usage,
}

impl StreamBudget {
    pub(crate) fn new(budgets: &Arc<Budgets>, conn: Option<u64>, pool: Pool, client: &str) -> Self {
        Self {
            budgets: Arc::clone(budgets),
            conn,
            pool,
            client: client.to_string(),
            held: Usage::default(),
        }
    }

    /// Moves the stream's share to `after` if every level has room for it (a share
    /// that does not grow always fits); otherwise keeps it and returns the status the
    /// stream ends with.
    pub(crate) fn adjust(&mut self, after: Usage) -> Result<(), Status> {
        let budget = self.budgets.budget;
        let budgets = Arc::clone(&self.budgets);
        let mut guard = budgets.held.lock();
        let held = &mut *guard;
        let key = (self.pool, self.client.clone());
        let conn_now = self
            .conn
            .map(|c| held.conns.get(&c).copied().unwrap_or_default());
        let client_now = held.clients.get(&key).copied().unwrap_or_default();
        let total_now = held.totals[self.pool as usize];
        let grows = after.names > self.held.names || after.bytes > self.held.bytes;
        let levels = [
            conn_now.map(|now| (Level::Connection, now, budget.per_connection)),
            Some((Level::Client, client_now, budget.per_client)),
            Some((Level::Total, total_now, budget.total)),
        ];
        if grows && !flock_core::reintroduced!("xds-unbudgeted-subscriptions") {
            for (level, now, limit) in levels.into_iter().flatten() {
                let would = now.plus(after, self.held);
                if !would.fits(limit) {
                    return Err(self.refuse(level, would, limit));
                }
            }
        }
        if let (Some(c), Some(now)) = (self.conn, conn_now) {
            set(&mut held.conns, c, now.plus(after, self.held));
        }
        set(&mut held.clients, key, client_now.plus(after, self.held));
        held.totals[self.pool as usize] = total_now.plus(after, self.held);
        self.held = after;
        Ok(())
    }

    fn refuse(&self, level: Level, would: Usage, limit: Usage) -> Status {
        let status = Status::resource_exhausted(format!(
            "xDS subscription budget: this request would hold {would} subscribed {} for {}, \
             over the budget of {limit} (subscription_budget.{}); the stream ends and the \
             client's other streams keep what they hold",
            level.what(),
            self.client,
            level.field()
        ));
        let first = {
            let mut warned = self.budgets.warned.lock();
            if warned.len() >= MAX_WARNED {
                warned.clear();
            }
            warned.insert((self.client.clone(), level))
        };
        if first {
            tracing::warn!(client = %self.client, level = level.field(), %would, %limit, "xDS subscription over budget: request refused");
        } else {
            tracing::debug!(client = %self.client, level = level.field(), %would, %limit, "xDS subscription over budget: request refused");
        }
        status
    }
}

fn set<K: std::hash::Hash + Eq>(map: &mut HashMap<K, Usage>, key: K, usage: Usage) {
    if usage == Usage::default() {
        map.remove(&key);
    } else {
        map.insert(key, usage);
    }
}

impl Drop for StreamBudget {
    fn drop(&mut self) {
        let _ = self.adjust(Usage::default());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn u(names: usize, bytes: usize) -> Usage {
        Usage { names, bytes }
    }

    fn budgets() -> Arc<Budgets> {
        Budgets::new(SubscriptionBudget {
            per_connection: u(10, 1000),
            per_client: u(15, 1500),
            total: u(20, 2000),
        })
    }

    #[test]
    fn each_level_refuses_and_a_stream_gives_its_share_back() {
        let b = budgets();
        let mut s1 = StreamBudget::new(&b, Some(1), Pool::Tcp, "a");
        s1.adjust(u(10, 100)).unwrap();
        let mut s2 = StreamBudget::new(&b, Some(1), Pool::Tcp, "a");
        let e = s2.adjust(u(1, 1)).unwrap_err();
        assert!(e.message().contains("per_connection"), "{e:?}");
        let mut s3 = StreamBudget::new(&b, Some(2), Pool::Tcp, "a");
        s3.adjust(u(5, 5)).unwrap();
        let e = s3.adjust(u(6, 5)).unwrap_err();
        assert!(e.message().contains("per_client"), "{e:?}");
        let mut s4 = StreamBudget::new(&b, Some(3), Pool::Tcp, "b");
        s4.adjust(u(5, 5)).unwrap();
        let e = s4.adjust(u(6, 5)).unwrap_err();
        assert!(e.message().contains("subscription_budget.total"), "{e:?}");
        // Another pool has its own total.
        let mut unix = StreamBudget::new(&b, Some(4), Pool::Unix, "envoy");
        unix.adjust(u(10, 10)).unwrap();
        // Shrinking always fits; ending gives everything back.
        s1.adjust(u(2, 2)).unwrap();
        drop((s1, s2, s3, s4));
        assert_eq!(b.held_total(Pool::Tcp), Usage::default());
        assert_eq!(b.held_total(Pool::Unix), u(10, 10));
    }

    #[test]
    fn bytes_are_budgeted_like_names() {
        let b = budgets();
        let mut s = StreamBudget::new(&b, Some(1), Pool::Tcp, "a");
        let e = s.adjust(u(1, 1001)).unwrap_err();
        assert!(e.message().contains("1001 bytes"), "{e:?}");
    }
}
