//! Write coalescing for the server's connections: the responses a publish sends to the
//! many streams of one HTTP/2 connection leave in a few writes, not one write each.
//!
//! Two things made every response its own write. The HTTP/2 codec sends a DATA frame of
//! 256 bytes or more on a transport that reports vectored writes as its own write (it
//! chains the payload instead of copying it, and must flush before the next frame), so
//! the transport reports no vectored writes and frames under 1 KiB are copied into the
//! codec's buffer. And on tokio's multi-thread runtime a task woken by the running task
//! runs next on the same worker (the scheduler's LIFO slot): each stream task that
//! hands the connection a frame wakes the connection task, which runs at once, finds
//! that one frame and flushes it. With 10,000 streams on 100 connections that was
//! 10,000 writes (and as many loopback segments and receiver wake-ups) per publish.
//!
//! So a flush of a small amount (under [`DEFER_BELOW`]) waits until the worker has run
//! the tasks that are ready, the way `tokio::task::yield_now` waits: the runtime wakes
//! the connection after it ran out of ready tasks or, at the latest, at its next
//! maintenance pass (every 61 task polls). Until then writes are only buffered, so the
//! frames the other streams hand over meanwhile join the same write. A flush of more,
//! a buffer past [`MAX_BUFFERED`], and a shutdown write at once. A lone response waits
//! no longer than the tasks that were ready with it. An idle connection holds no
//! buffer: it is freed when it has been written.

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Wake, Waker, ready};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Buffered bytes past which a write goes out at once, deferred flush or not.
pub(crate) const MAX_BUFFERED: usize = 64 * 1024;
/// A flush of fewer buffered bytes than this waits one scheduler round; a larger one
/// (a big response) gains nothing from waiting and writes at once.
pub(crate) const DEFER_BELOW: usize = 8 * 1024;

/// A transport that buffers writes and defers small flushes (see the module docs).
pub(crate) struct Coalescing<Io> {
    io: Io,
    buf: Vec<u8>,
    /// Bytes at the front of `buf` already written.
    sent: usize,
    /// The flush waiting for the scheduler round to end, if one is.
    deferral: Option<Arc<Deferral>>,
}

/// A deferred flush: the runtime wakes it after the ready tasks have run.
struct Deferral(Mutex<DeferralState>);

struct DeferralState {
    fired: bool,
    /// The connection task to wake when it fires.
    task: Option<Waker>,
}

impl Wake for Deferral {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let task = {
            let mut state = self.0.lock().unwrap_or_else(PoisonError::into_inner);
            state.fired = true;
            state.task.take()
        };
        if let Some(task) = task {
            task.wake();
        }
    }
}

impl Deferral {
    /// Starts a deferral for the task of `cx`: it fires once the scheduler has run
    /// the other ready tasks (at once outside a runtime).
    fn start(cx: &Context<'_>) -> Arc<Self> {
        let deferral = Arc::new(Self(Mutex::new(DeferralState {
            fired: false,
            task: Some(cx.waker().clone()),
        })));
        let waker = Waker::from(Arc::clone(&deferral));
        let mut yield_cx = Context::from_waker(&waker);
        // The first poll hands `waker` to the scheduler's deferred list and returns
        // Pending; dropping the future does not take it back.
        let mut round = std::pin::pin!(tokio::task::yield_now());
        let _ = round.as_mut().poll(&mut yield_cx);
        deferral
    }

    /// Whether it fired; if not, `cx`'s task is the one it wakes.
    fn fired(&self, cx: &Context<'_>) -> bool {
        let mut state = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if !state.fired && !state.task.as_ref().is_some_and(|t| t.will_wake(cx.waker())) {
            state.task = Some(cx.waker().clone());
        }
        state.fired
    }
}

impl<Io> Coalescing<Io> {
    pub(crate) fn new(io: Io) -> Self {
        Self {
            io,
            buf: Vec::new(),
            sent: 0,
            deferral: None,
        }
    }

    pub(crate) fn get_ref(&self) -> &Io {
        &self.io
    }

    fn buffered(&self) -> usize {
        self.buf.len() - self.sent
    }
}

impl<Io: AsyncWrite + Unpin> Coalescing<Io> {
    /// Writes everything buffered; then frees the buffer and ends the deferral.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.sent < self.buf.len() {
            let n = ready!(Pin::new(&mut self.io).poll_write(cx, &self.buf[self.sent..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.sent += n;
        }
        self.buf = Vec::new();
        self.sent = 0;
        self.deferral = None;
        Poll::Ready(Ok(()))
    }

    /// Whether the buffered bytes may be written now; if not, the task is woken when
    /// they may.
    fn may_write_now(&mut self, cx: &Context<'_>) -> bool {
        match &self.deferral {
            Some(deferral) => deferral.fired(cx),
            None if self.buffered() >= DEFER_BELOW => true,
            None => {
                let deferral = Deferral::start(cx);
                let fired = deferral.fired(cx);
                self.deferral = Some(deferral);
                fired
            }
        }
    }
}

impl<Io: AsyncRead + Unpin> AsyncRead for Coalescing<Io> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl<Io: AsyncWrite + Unpin> AsyncWrite for Coalescing<Io> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.buffered() + data.len() > MAX_BUFFERED {
            ready!(this.poll_drain(cx))?;
            if data.len() >= MAX_BUFFERED {
                return Pin::new(&mut this.io).poll_write(cx, data);
            }
        }
        this.buf.extend_from_slice(data);
        Poll::Ready(Ok(data.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.buffered() > 0 {
            if !this.may_write_now(cx) {
                return Poll::Pending;
            }
            ready!(this.poll_drain(cx))?;
        }
        Pin::new(&mut this.io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        Pin::new(&mut this.io).poll_shutdown(cx)
    }

    /// False: the HTTP/2 codec then copies frames under 1 KiB into its buffer instead
    /// of sending each as its own vectored write (see the module docs).
    fn is_write_vectored(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A real pipe's write end that counts the writes reaching it.
    struct Counting<W> {
        inner: W,
        writes: Arc<AtomicUsize>,
    }

    impl<W: AsyncWrite + Unpin> AsyncWrite for Counting<W> {
        fn poll_write(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            data: &[u8],
        ) -> Poll<io::Result<usize>> {
            let this = self.get_mut();
            let n = ready!(Pin::new(&mut this.inner).poll_write(cx, data))?;
            this.writes.fetch_add(1, Ordering::Relaxed);
            Poll::Ready(Ok(n))
        }
        fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.get_mut().inner).poll_flush(cx)
        }
        fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
        }
    }

    /// The shape of an HTTP/2 connection under a fan-out: `streams` tasks wait for a
    /// publish (a watch channel, as the xDS streams do); each hands the connection
    /// task one small frame (waking it), and the connection task writes what it has
    /// and flushes. On a one-worker multi-thread runtime the scheduler's LIFO slot
    /// runs the connection task right after each stream task, so an unbuffered
    /// transport gets one write per frame. Returns the writes that reached the pipe
    /// and the bytes the far end read.
    fn fan_out(streams: usize, publishes: u8) -> (usize, Vec<u8>) {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let writes = Arc::new(AtomicUsize::new(0));
        let (near, mut far) = tokio::io::duplex(4 << 20);
        let counting = Counting {
            inner: near,
            writes: Arc::clone(&writes),
        };
        let received = rt.block_on(async move {
            let (frames_tx, mut frames) = tokio::sync::mpsc::unbounded_channel::<Vec<u8>>();
            let (publish, published) = tokio::sync::watch::channel(0u8);
            let (ready_tx, mut ready) = tokio::sync::mpsc::unbounded_channel::<()>();
            let mut stream_tasks = Vec::new();
            for _ in 0..streams {
                let frames_tx = frames_tx.clone();
                let ready_tx = ready_tx.clone();
                let mut published = published.clone();
                stream_tasks.push(tokio::spawn(async move {
                    ready_tx.send(()).unwrap();
                    while published.changed().await.is_ok() {
                        let round = *published.borrow_and_update();
                        frames_tx.send(vec![round; 400]).unwrap();
                    }
                }));
            }
            drop(frames_tx);
            let (flushed_tx, mut flushed) = tokio::sync::watch::channel(0usize);
            let conn = tokio::spawn(async move {
                let mut io = Coalescing::new(counting);
                let mut got = 0;
                while let Some(frame) = frames.recv().await {
                    io.write_all(&frame).await.unwrap();
                    got += 1;
                    while let Ok(frame) = frames.try_recv() {
                        io.write_all(&frame).await.unwrap();
                        got += 1;
                    }
                    io.flush().await.unwrap();
                    assert_eq!(io.buf.capacity(), 0, "a flushed connection holds no buffer");
                    flushed_tx.send_replace(got);
                }
                io.shutdown().await.unwrap();
                got
            });
            for _ in 0..streams {
                ready.recv().await.unwrap();
            }
            let reader = tokio::spawn(async move {
                let mut received = Vec::new();
                far.read_to_end(&mut received).await.unwrap();
                received
            });
            for round in 1..=publishes {
                publish.send(round).unwrap();
                // The next publish once the connection flushed this one's frames, so
                // every stream sends every round (a watch keeps only the newest).
                let want = streams * round as usize;
                flushed.wait_for(|got| *got >= want).await.unwrap();
            }
            drop(publish);
            for t in stream_tasks {
                t.await.unwrap();
            }
            assert_eq!(conn.await.unwrap(), streams * publishes as usize);
            reader.await.unwrap()
        });
        (writes.load(Ordering::Relaxed), received)
    }

    #[test]
    fn a_fan_out_of_small_frames_leaves_in_few_writes_and_whole() {
        let (streams, publishes) = (200, 5u8);
        let frames = streams * publishes as usize;
        let (writes, received) = fan_out(streams, publishes);
        assert_eq!(received.len(), frames * 400, "every frame arrives");
        let mut per_round = vec![0usize; publishes as usize + 1];
        for chunk in received.chunks(400) {
            assert!(chunk.iter().all(|b| *b == chunk[0]), "frames arrive whole");
            per_round[chunk[0] as usize] += 1;
        }
        assert!(
            per_round[1..].iter().all(|n| *n == streams),
            "{per_round:?}"
        );
        assert!(
            writes <= frames / 10,
            "{writes} writes for {frames} frames of 400 bytes: flushes were not coalesced"
        );
    }

    #[derive(Debug, Clone)]
    enum Step {
        Write(usize),
        Flush,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => (1usize..3 * MAX_BUFFERED / 2).prop_map(Step::Write),
            4 => (1usize..2048).prop_map(Step::Write),
            2 => Just(Step::Flush),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
        /// Whatever the sizes and flushes, the reader gets exactly the bytes written,
        /// in order, and every flush completes (on both runtime flavours).
        #[test]
        fn every_byte_arrives_in_order_and_every_flush_completes(
            steps in proptest::collection::vec(step(), 1..24),
            multi in any::<bool>(),
        ) {
            let rt = if multi {
                tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()
            } else {
                tokio::runtime::Builder::new_current_thread().enable_all().build()
            }
            .unwrap();
            let mut expected = Vec::new();
            let mut seed = 0u8;
            for s in &steps {
                if let Step::Write(n) = s {
                    for _ in 0..*n {
                        seed = seed.wrapping_mul(31).wrapping_add(7);
                        expected.push(seed);
                    }
                }
            }
            let sent = expected.clone();
            let received = rt.block_on(async move {
                let (near, mut far) = tokio::io::duplex(16 * 1024);
                let reader = tokio::spawn(async move {
                    let mut all = Vec::new();
                    far.read_to_end(&mut all).await.unwrap();
                    all
                });
                let mut io = Coalescing::new(near);
                let mut at = 0;
                for s in &steps {
                    match s {
                        Step::Write(n) => {
                            io.write_all(&sent[at..at + n]).await.unwrap();
                            at += n;
                        }
                        Step::Flush => {
                            io.flush().await.unwrap();
                            assert_eq!(io.buffered(), 0);
                        }
                    }
                }
                io.shutdown().await.unwrap();
                reader.await.unwrap()
            });
            prop_assert_eq!(received.len(), expected.len());
            prop_assert!(received == expected, "bytes differ");
        }
    }
}
