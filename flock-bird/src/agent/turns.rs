//! Per-pod turns: the operations on one pod (ADD, DEL, a GC removal, kube mode's
//! resync) run one at a time, in arrival order; operations on different pods proceed
//! in parallel. The queue is the core's (`flock_core::agent::AgentCore::acquire`,
//! model-checked there); this is its async side: a oneshot per waiter, and a guard
//! that gives the turn back however the operation's future ends (finished, or dropped
//! while waiting or running).

use super::Agent;
use flock_core::agent::{Acquire, OpKind, Ticket};
use flock_core::pod::PodKey;
use tokio::sync::oneshot;

/// A turn held or waited for; dropping it gives the turn back (or leaves the queue).
struct Turn<'a> {
    agent: &'a Agent,
    key: PodKey,
    kind: OpKind,
    /// Still queued with this ticket: not the holder (yet).
    waiting: Option<Ticket>,
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        if let Some(ticket) = self.waiting {
            // Still in the queue: leave it. Already handed the turn (the release that
            // passed it on ran before this cancel): it is ours to give back.
            if self.agent.core().cancel(&self.key, ticket) {
                return;
            }
        }
        let next = self.agent.core().release(&self.key, self.kind);
        if let Some(wake) = next {
            // A waiter that went away meanwhile finds, in its own drop, that its
            // ticket was taken (`cancel` is false) and gives the turn back itself.
            let _ = wake.send(());
        }
    }
}

impl Agent {
    /// Runs `op` in `key`'s turn for an operation of `kind`.
    pub(super) async fn in_turn<T>(
        &self,
        key: &PodKey,
        kind: OpKind,
        op: impl Future<Output = T>,
    ) -> T {
        let (tx, rx) = oneshot::channel();
        let acquired = self.core().acquire(key, kind, tx);
        let mut turn = Turn {
            agent: self,
            key: key.clone(),
            kind,
            waiting: match acquired {
                Acquire::Now => None,
                Acquire::Queued(ticket) => Some(ticket),
            },
        };
        if turn.waiting.is_some() {
            // Either way the ticket has left the queue: the release that popped it
            // sends (or dropped the sender after popping it), so the turn is ours.
            let _ = rx.await;
            turn.waiting = None;
        }
        let out = op.await;
        drop(turn);
        out
    }
}
