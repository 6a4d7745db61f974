//! Several processes, one rank each, as `torchrun` launches them: [`DistributedConfig`] (rank,
//! world size, the address of rank 0), from torchrun's environment or given in code, the TCP
//! rendezvous that hands rank 0's NCCL unique id to the other ranks, and rank 0's failure
//! board, on the same listener, through which the ranks agree on which rank stopped answering
//! (std::net only).
//!
//! The rendezvous: rank 0 listens on `MASTER_ADDR:MASTER_PORT` and serves its id to each of the
//! `world_size - 1` other ranks, then keeps the listener for the board ([`Board`]); the others
//! connect, retrying until the timeout. Frames (little-endian): the client sends `b"NDSCRDV1"`, its world size (u32)
//! and its rank (u32); rank 0 answers `b"NDSCRDV1"`, its world size (u32), a status (u32: 0
//! served, 1 refused: a rank out of range, rank 0, or a rank already served) and the 128 bytes
//! of the id. A client whose world size differs from rank 0's, or that is refused, fails with
//! `InvalidConfig`; rank 0 answers it and goes on waiting for the ranks it still needs.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crate::error::Ctx;
use crate::{Error, Result};

/// The rendezvous' default timeout: 60 s (rank 0 waits this long for every other rank; the
/// others try to reach rank 0 this long).
pub const DEFAULT_RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(60);

/// The frames' magic.
const MAGIC: &[u8; 8] = b"NDSCRDV1";
/// The client's hello: magic, world size, rank.
const HELLO: usize = 16;
/// Rank 0's answer: magic, world size, status, id.
const ANSWER: usize = 16 + 128;
const SERVED: u32 = 0;
const REFUSED: u32 = 1;

/// This process's place in a world of processes, one rank each (PyTorch's
/// `torch.distributed.init_process_group` with the `env://` method): given to
/// [`ParallelTrainerBuilder::distributed`](crate::ParallelTrainerBuilder::distributed).
///
/// ```
/// use std::time::Duration;
/// use ndscope::DistributedConfig;
/// let config = DistributedConfig::new(1, 2, "127.0.0.1", 29500)?.timeout(Duration::from_secs(5));
/// assert_eq!((config.rank, config.world_size, config.local_rank), (1, 2, 0));
/// # Ok::<(), ndscope::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DistributedConfig {
    /// This process's rank, `0..world_size` (`RANK`).
    pub rank: usize,
    /// The number of processes (`WORLD_SIZE`).
    pub world_size: usize,
    /// This process's rank on its host (`LOCAL_RANK`): its device is `cuda:local_rank` unless
    /// the builder names one.
    pub local_rank: usize,
    /// Rank 0's host (`MASTER_ADDR`): a name or an address; rank 0 listens on it.
    pub master_addr: String,
    /// Rank 0's port (`MASTER_PORT`).
    pub master_port: u16,
    /// How long rank 0 waits for the others and they try to reach it (default
    /// [`DEFAULT_RENDEZVOUS_TIMEOUT`]).
    pub timeout: Duration,
}

impl DistributedConfig {
    /// Rank `rank` of `world_size`, rank 0 at `master_addr:master_port`; local rank 0, the
    /// default timeout. `InvalidConfig` for a world size of 0, a rank out of range or an empty
    /// address.
    #[track_caller]
    pub fn new(
        rank: usize,
        world_size: usize,
        master_addr: &str,
        master_port: u16,
    ) -> Result<DistributedConfig> {
        let config = DistributedConfig {
            rank,
            world_size,
            local_rank: 0,
            master_addr: master_addr.to_string(),
            master_port,
            timeout: DEFAULT_RENDEZVOUS_TIMEOUT,
        };
        config.validate(&Ctx::new("DistributedConfig::new"))?;
        Ok(config)
    }

    /// The same with local rank `local_rank`.
    pub fn local_rank(mut self, local_rank: usize) -> Self {
        self.local_rank = local_rank;
        self
    }

    /// The same with the rendezvous timeout `timeout`.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The configuration `torchrun` gives each process: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`
    /// (default 0), `MASTER_ADDR`, `MASTER_PORT`, and the timeout in seconds from
    /// `NDSCOPE_RENDEZVOUS_TIMEOUT` (default 60). `InvalidConfig` naming the variable for one
    /// that is missing or not a number, and for a rank out of range.
    #[track_caller]
    pub fn from_env() -> Result<DistributedConfig> {
        Self::from_lookup_at(&Ctx::new("DistributedConfig::from_env"), |name| {
            std::env::var(name).ok()
        })
    }

    /// [`from_env`](Self::from_env) reading the variables through `lookup` (a name → its
    /// value) instead of the process's environment.
    #[track_caller]
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<DistributedConfig> {
        Self::from_lookup_at(&Ctx::new("DistributedConfig::from_lookup"), lookup)
    }

    fn from_lookup_at(
        ctx: &Ctx,
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<DistributedConfig> {
        let get = |name: &str| -> Result<String> {
            match lookup(name) {
                Some(v) if !v.trim().is_empty() => Ok(v.trim().to_string()),
                _ => Err(ctx.config(format!(
                    "{name} is not set: a process of a distributed world needs RANK, \
                     WORLD_SIZE, MASTER_ADDR and MASTER_PORT (as torchrun sets them)"
                ))),
            }
        };
        let number = |name: &str, text: &str| -> Result<usize> {
            text.parse::<usize>()
                .map_err(|_| ctx.config(format!("{name}={text:?} is not a non-negative integer")))
        };
        let rank = number("RANK", &get("RANK")?)?;
        let world_size = number("WORLD_SIZE", &get("WORLD_SIZE")?)?;
        let local_rank = match lookup("LOCAL_RANK") {
            Some(v) if !v.trim().is_empty() => number("LOCAL_RANK", v.trim())?,
            _ => 0,
        };
        let master_addr = get("MASTER_ADDR")?;
        let port = get("MASTER_PORT")?;
        let master_port = port.parse::<u16>().map_err(|_| {
            ctx.config(format!(
                "MASTER_PORT={port:?} is not a port number (0 to 65535)"
            ))
        })?;
        let timeout = match lookup("NDSCOPE_RENDEZVOUS_TIMEOUT") {
            Some(v) if !v.trim().is_empty() => {
                let secs = v
                    .trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|s| s.is_finite() && *s > 0.0);
                let Some(secs) = secs else {
                    return Err(ctx.config(format!(
                        "NDSCOPE_RENDEZVOUS_TIMEOUT={v:?} is not a positive number of seconds"
                    )));
                };
                Duration::from_secs_f64(secs)
            }
            _ => DEFAULT_RENDEZVOUS_TIMEOUT,
        };
        let config = DistributedConfig {
            rank,
            world_size,
            local_rank,
            master_addr,
            master_port,
            timeout,
        };
        config.validate(ctx)?;
        Ok(config)
    }

    /// `InvalidConfig` for a world size of 0, a rank out of range or an empty address.
    pub(crate) fn validate(&self, ctx: &Ctx) -> Result<()> {
        if self.world_size == 0 {
            return Err(ctx.config("WORLD_SIZE is 0: a world has at least one process"));
        }
        if self.rank >= self.world_size {
            return Err(ctx.config(format!(
                "RANK={} is out of range for WORLD_SIZE={} (ranks are 0 to {})",
                self.rank,
                self.world_size,
                self.world_size - 1
            )));
        }
        if self.master_addr.trim().is_empty() {
            return Err(ctx.config("MASTER_ADDR is empty"));
        }
        Ok(())
    }

    /// `master_addr:master_port`, as written.
    pub fn master(&self) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("[{}]:{}", self.master_addr, self.master_port)
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
        }
    }
}

/// An I/O error of the rendezvous with rank 0 at `addr`.
fn net_error(ctx: &Ctx, addr: &str, kind: io::ErrorKind, message: String) -> Error {
    Error::Io {
        op: ctx.op,
        at: ctx.at,
        path: PathBuf::from(format!("tcp://{addr}")),
        source: io::Error::new(kind, message),
    }
}

fn resolve(ctx: &Ctx, config: &DistributedConfig) -> Result<Vec<SocketAddr>> {
    let addr = config.master();
    match (config.master_addr.as_str(), config.master_port).to_socket_addrs() {
        Ok(addrs) => {
            let addrs: Vec<SocketAddr> = addrs.collect();
            if addrs.is_empty() {
                Err(net_error(
                    ctx,
                    &addr,
                    io::ErrorKind::NotFound,
                    format!("MASTER_ADDR {} resolves to no address", config.master_addr),
                ))
            } else {
                Ok(addrs)
            }
        }
        Err(e) => Err(net_error(
            ctx,
            &addr,
            e.kind(),
            format!("cannot resolve MASTER_ADDR {}: {e}", config.master_addr),
        )),
    }
}

/// Rank 0's side: listens on the master address and serves `id` to each of the other ranks
/// (every rank `1..world_size` once), then closes the listener. Errors: the address cannot be
/// bound, or not every rank came within the timeout (naming the missing ones). Returns the
/// listener, for rank 0's [`Board`].
pub(crate) fn serve_id(
    ctx: &Ctx,
    config: &DistributedConfig,
    id: [u8; 128],
) -> Result<TcpListener> {
    let addr = config.master();
    let deadline = Instant::now() + config.timeout;
    let addrs = resolve(ctx, config)?;
    let listener = TcpListener::bind(&addrs[..]).map_err(|e| {
        net_error(
            ctx,
            &addr,
            e.kind(),
            format!("rank 0 cannot listen on {addr} (MASTER_ADDR:MASTER_PORT): {e}"),
        )
    })?;
    let io_error =
        |e: io::Error, what: &str| net_error(ctx, &addr, e.kind(), format!("rank 0, {what}: {e}"));
    listener
        .set_nonblocking(true)
        .map_err(|e| io_error(e, "making the listener non-blocking"))?;
    let mut served = vec![false; config.world_size];
    served[0] = true;
    while served.iter().any(|s| !s) {
        let now = Instant::now();
        if now >= deadline {
            let missing: Vec<String> = served
                .iter()
                .enumerate()
                .filter(|(_, s)| !**s)
                .map(|(r, _)| r.to_string())
                .collect();
            return Err(net_error(
                ctx,
                &addr,
                io::ErrorKind::TimedOut,
                format!(
                    "rank 0 waited {:.1} s on {addr} for every rank of {}; rank(s) {} never came",
                    config.timeout.as_secs_f64(),
                    config.world_size,
                    missing.join(", ")
                ),
            ));
        }
        match listener.accept() {
            Ok((stream, _)) => {
                // A client that misbehaves (closes early, sends garbage) is dropped: rank 0
                // goes on waiting for the ranks it needs.
                let _ = answer(stream, config, &id, &mut served, deadline - now);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                thread::sleep(Duration::from_millis(5));
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_error(e, "accepting a connection")),
        }
    }
    Ok(listener)
}

/// Reads a client's hello and answers it.
fn answer(
    mut stream: TcpStream,
    config: &DistributedConfig,
    id: &[u8; 128],
    served: &mut [bool],
    left: Duration,
) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    let wait = left.clamp(Duration::from_millis(1), Duration::from_secs(10));
    stream.set_read_timeout(Some(wait))?;
    stream.set_write_timeout(Some(wait))?;
    let mut hello = [0u8; HELLO];
    stream.read_exact(&mut hello)?;
    if &hello[..8] != MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not a rendezvous client",
        ));
    }
    let world = u32::from_le_bytes([hello[8], hello[9], hello[10], hello[11]]) as usize;
    let rank = u32::from_le_bytes([hello[12], hello[13], hello[14], hello[15]]) as usize;
    let ok = world == config.world_size && served.get(rank).is_some_and(|s| !*s);
    let mut frame = [0u8; ANSWER];
    frame[..8].copy_from_slice(MAGIC);
    let ours = u32::try_from(config.world_size).unwrap_or(u32::MAX);
    frame[8..12].copy_from_slice(&ours.to_le_bytes());
    frame[12..16].copy_from_slice(&if ok { SERVED } else { REFUSED }.to_le_bytes());
    if ok {
        frame[16..].copy_from_slice(id);
    }
    stream.write_all(&frame)?;
    stream.flush()?;
    if ok {
        if let Some(s) = served.get_mut(rank) {
            *s = true;
        }
    }
    Ok(())
}

/// A non-zero rank's side: connects to rank 0 (retrying until the timeout) and fetches the id.
/// Errors: rank 0 not reached in time (`Io`, `TimedOut`), a world size that differs from rank
/// 0's or a refusal (`InvalidConfig`), a broken exchange (`Io`).
pub(crate) fn fetch_id(ctx: &Ctx, config: &DistributedConfig) -> Result<[u8; 128]> {
    let addr = config.master();
    let start = Instant::now();
    let deadline = start + config.timeout;
    let (Ok(world), Ok(rank)) = (u32::try_from(config.world_size), u32::try_from(config.rank))
    else {
        return Err(ctx.config(format!(
            "rank {} of {} is out of the rendezvous' range",
            config.rank, config.world_size
        )));
    };
    let mut attempts = 0u32;
    let mut last = String::from("no address tried");
    let mut stream = loop {
        let now = Instant::now();
        if now >= deadline {
            return Err(net_error(
                ctx,
                &addr,
                io::ErrorKind::TimedOut,
                format!(
                    "rank {} could not reach rank 0 at {addr} (MASTER_ADDR:MASTER_PORT) after \
                     {:.1} s and {attempts} attempt(s): {last}",
                    config.rank,
                    start.elapsed().as_secs_f64()
                ),
            ));
        }
        attempts += 1;
        match resolve(ctx, config) {
            Ok(addrs) => {
                let left = (deadline - now).clamp(Duration::from_millis(1), Duration::from_secs(2));
                let mut connected = None;
                for a in &addrs {
                    match TcpStream::connect_timeout(a, left) {
                        Ok(s) => {
                            connected = Some(s);
                            break;
                        }
                        Err(e) => last = e.to_string(),
                    }
                }
                if let Some(s) = connected {
                    break s;
                }
            }
            Err(e) => last = e.to_string(),
        }
        let pause =
            Duration::from_millis(50).min(deadline.saturating_duration_since(Instant::now()));
        thread::sleep(pause);
    };
    let io_error = |e: io::Error| {
        net_error(
            ctx,
            &addr,
            e.kind(),
            format!(
                "rank {}, fetching the NCCL id from rank 0: {e}",
                config.rank
            ),
        )
    };
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(100));
    stream.set_read_timeout(Some(left)).map_err(io_error)?;
    stream.set_write_timeout(Some(left)).map_err(io_error)?;
    let mut hello = [0u8; HELLO];
    hello[..8].copy_from_slice(MAGIC);
    hello[8..12].copy_from_slice(&world.to_le_bytes());
    hello[12..16].copy_from_slice(&rank.to_le_bytes());
    stream.write_all(&hello).map_err(io_error)?;
    let mut frame = [0u8; ANSWER];
    stream.read_exact(&mut frame).map_err(io_error)?;
    if &frame[..8] != MAGIC {
        return Err(net_error(
            ctx,
            &addr,
            io::ErrorKind::InvalidData,
            format!("{addr} is not an ndscope rank 0 (the rendezvous' answer has no magic)"),
        ));
    }
    let theirs = u32::from_le_bytes([frame[8], frame[9], frame[10], frame[11]]);
    if theirs != world {
        return Err(ctx.config(format!(
            "rank {} has WORLD_SIZE={}, but rank 0 at {addr} has WORLD_SIZE={theirs}",
            config.rank, config.world_size
        )));
    }
    let status = u32::from_le_bytes([frame[12], frame[13], frame[14], frame[15]]);
    if status != SERVED {
        return Err(ctx.config(format!(
            "rank 0 at {addr} refused rank {} of {}: rank 0 cannot fetch, and each other rank \
             joins once",
            config.rank, config.world_size
        )));
    }
    let mut id = [0u8; 128];
    id.copy_from_slice(&frame[16..]);
    Ok(id)
}

// ---- rank 0's failure board ----

/// The board frames' magic.
const BOARD_MAGIC: &[u8; 8] = b"NDSCBRD1";
/// A post: magic, world size, rank, step (u64), what the rank saw (u32), its device ordinal.
const POST: usize = 8 + 4 + 4 + 8 + 4 + 4;
/// The steps the board remembers.
const BOARD_STEPS: usize = 16;

/// What a rank posts on the [`Board`] about a step it could not finish.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Seen {
    /// It waited in a collective for the other ranks (or its collective failed).
    Waited,
    /// Its own step failed or did not return in time (the step closure, forward and backward,
    /// or its update).
    Culprit,
}

impl Seen {
    fn code(self) -> u32 {
        match self {
            Seen::Waited => 1,
            Seen::Culprit => 2,
        }
    }

    fn from_code(code: u32) -> Option<Seen> {
        match code {
            1 => Some(Seen::Waited),
            2 => Some(Seen::Culprit),
            _ => None,
        }
    }
}

/// One rank's post: its rank, what it saw, its device ordinal.
pub(crate) type Post = (usize, Seen, usize);

/// Rank 0's failure board: after the rendezvous, rank 0 keeps its listener for the trainer's
/// life. A rank whose step failed in a way it cannot attribute (a collective that failed or
/// timed out, its own step closure that did not return) posts what it saw for that step and
/// reads every post for it, so that every rank names the same culprit: the ranks whose own
/// step failed or hung, else the ranks that never posted (a process that died or froze). Nothing goes
/// over it while steps succeed. Frames (little-endian): a post is `b"NDSCBRD1"`, the world size
/// (u32), the rank (u32), the step (u64), what it saw (u32: 1 waited, 2 its own step failed) and its device
/// ordinal (u32); the answer is `b"NDSCBRD1"`, a count (u32) and that many (rank, seen,
/// ordinal) triples of u32. A late rendezvous hello is answered refused.
pub(crate) struct Board {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl Board {
    /// Serves `listener` (non-blocking, from [`serve_id`]) on a thread of its own until dropped.
    pub(crate) fn serve(listener: TcpListener, world: usize) -> io::Result<Board> {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let handle = thread::Builder::new()
            .name("ndscope-board".to_string())
            .spawn(move || {
                let mut posts: BTreeMap<u64, Vec<Post>> = BTreeMap::new();
                while !stopped.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((stream, _)) => {
                            // A client that misbehaves is dropped; the board goes on.
                            let _ = board_answer(stream, world, &mut posts);
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            thread::sleep(Duration::from_millis(10));
                        }
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(_) => thread::sleep(Duration::from_millis(10)),
                    }
                }
            })?;
        Ok(Board {
            stop,
            handle: Some(handle),
        })
    }
}

impl Drop for Board {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// Reads a post (or a late rendezvous hello) and answers it.
fn board_answer(
    mut stream: TcpStream,
    world: usize,
    posts: &mut BTreeMap<u64, Vec<Post>>,
) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    stream.set_write_timeout(Some(Duration::from_secs(2)))?;
    let mut magic = [0u8; 8];
    stream.read_exact(&mut magic)?;
    if &magic == MAGIC {
        // A rank that comes after the rendezvous: refused (each rank joins once).
        let mut rest = [0u8; HELLO - 8];
        stream.read_exact(&mut rest)?;
        let mut frame = [0u8; ANSWER];
        frame[..8].copy_from_slice(MAGIC);
        let ours = u32::try_from(world).unwrap_or(u32::MAX);
        frame[8..12].copy_from_slice(&ours.to_le_bytes());
        frame[12..16].copy_from_slice(&REFUSED.to_le_bytes());
        return stream.write_all(&frame);
    }
    if &magic != BOARD_MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not a board client",
        ));
    }
    let mut post = [0u8; POST - 8];
    stream.read_exact(&mut post)?;
    let word = |at: usize| u32::from_le_bytes([post[at], post[at + 1], post[at + 2], post[at + 3]]);
    let (theirs, rank) = (word(0) as usize, word(4) as usize);
    let mut step = [0u8; 8];
    step.copy_from_slice(&post[8..16]);
    let step = u64::from_le_bytes(step);
    let (seen, ordinal) = (Seen::from_code(word(16)), word(20) as usize);
    let (Some(seen), true) = (seen, theirs == world && rank < world) else {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "a bad post"));
    };
    let list = posts.entry(step).or_default();
    list.retain(|p| p.0 != rank);
    list.push((rank, seen, ordinal));
    while posts.len() > BOARD_STEPS {
        posts.pop_first();
    }
    let list = posts.get(&step).map(Vec::as_slice).unwrap_or_default();
    let mut frame = Vec::with_capacity(12 + 12 * list.len());
    frame.extend_from_slice(BOARD_MAGIC);
    frame.extend_from_slice(&u32::try_from(list.len()).unwrap_or(0).to_le_bytes());
    for &(r, s, o) in list {
        for v in [r, s.code() as usize, o] {
            frame.extend_from_slice(&u32::try_from(v).unwrap_or(u32::MAX).to_le_bytes());
        }
    }
    stream.write_all(&frame)?;
    stream.flush()
}

/// Posts what this rank saw at `step` on rank 0's board and returns every post for that step,
/// once every rank has posted or `grace` has passed (re-posting every 50 ms: a post is
/// idempotent). `Err` with the last error when rank 0's board could not be reached at all
/// within `grace`.
pub(crate) fn post_and_read(
    config: &DistributedConfig,
    step: u64,
    seen: Seen,
    ordinal: usize,
    grace: Duration,
) -> std::result::Result<Vec<Post>, String> {
    let deadline = Instant::now() + grace;
    let mut last: std::result::Result<Vec<Post>, String> = Err("no attempt was made".to_string());
    loop {
        let got = post_once(config, step, seen, ordinal, deadline);
        match got {
            Ok(posts) => {
                let complete = posts.len() >= config.world_size;
                last = Ok(posts);
                if complete {
                    return last;
                }
            }
            Err(e) => {
                // Once the board answered, a later failure keeps the posts seen.
                if last.is_err() {
                    last = Err(e);
                }
            }
        }
        if Instant::now() >= deadline {
            return last;
        }
        thread::sleep(Duration::from_millis(50).min(deadline - Instant::now()));
    }
}

fn post_once(
    config: &DistributedConfig,
    step: u64,
    seen: Seen,
    ordinal: usize,
    deadline: Instant,
) -> std::result::Result<Vec<Post>, String> {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .clamp(Duration::from_millis(100), Duration::from_secs(2));
    let addrs = (config.master_addr.as_str(), config.master_port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve MASTER_ADDR {}: {e}", config.master_addr))?;
    let mut last = format!("MASTER_ADDR {} resolves to no address", config.master_addr);
    for a in addrs {
        let exchange = || -> io::Result<Vec<Post>> {
            let mut stream = TcpStream::connect_timeout(&a, left)?;
            stream.set_read_timeout(Some(left))?;
            stream.set_write_timeout(Some(left))?;
            let number = |v: usize| u32::try_from(v).unwrap_or(u32::MAX).to_le_bytes();
            let mut frame = Vec::with_capacity(POST);
            frame.extend_from_slice(BOARD_MAGIC);
            frame.extend_from_slice(&number(config.world_size));
            frame.extend_from_slice(&number(config.rank));
            frame.extend_from_slice(&step.to_le_bytes());
            frame.extend_from_slice(&seen.code().to_le_bytes());
            frame.extend_from_slice(&number(ordinal));
            stream.write_all(&frame)?;
            let mut head = [0u8; 12];
            stream.read_exact(&mut head)?;
            if &head[..8] != BOARD_MAGIC {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "not rank 0's board",
                ));
            }
            let n = u32::from_le_bytes([head[8], head[9], head[10], head[11]]) as usize;
            let mut body = vec![0u8; 12 * n.min(1 << 16)];
            stream.read_exact(&mut body)?;
            Ok(body
                .chunks(12)
                .filter_map(|c| {
                    let w = |i: usize| u32::from_le_bytes([c[i], c[i + 1], c[i + 2], c[i + 3]]);
                    Some((w(0) as usize, Seen::from_code(w(4))?, w(8) as usize))
                })
                .collect())
        };
        match exchange() {
            Ok(posts) => return Ok(posts),
            Err(e) => last = format!("{a}: {e}"),
        }
    }
    Err(last)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    const TORCHRUN: [(&str, &str); 5] = [
        ("RANK", "3"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "1"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "29500"),
    ];

    #[test]
    fn torchrun_variables_are_read() {
        let c = DistributedConfig::from_lookup(lookup(&TORCHRUN)).expect("config");
        assert_eq!(
            c,
            DistributedConfig {
                rank: 3,
                world_size: 4,
                local_rank: 1,
                master_addr: "node0".into(),
                master_port: 29500,
                timeout: DEFAULT_RENDEZVOUS_TIMEOUT,
            }
        );
        let mut vars = TORCHRUN.to_vec();
        vars.retain(|(k, _)| *k != "LOCAL_RANK");
        vars.push(("NDSCOPE_RENDEZVOUS_TIMEOUT", "2.5"));
        let c = DistributedConfig::from_lookup(lookup(&vars)).expect("config");
        assert_eq!((c.local_rank, c.timeout), (0, Duration::from_millis(2500)));
    }

    fn refused(vars: &[(&str, &str)]) -> String {
        match DistributedConfig::from_lookup(lookup(vars)) {
            Err(e @ Error::InvalidConfig { .. }) => e.to_string(),
            other => panic!("expected InvalidConfig for {vars:?}, got {other:?}"),
        }
    }

    #[test]
    fn bad_variables_are_named() {
        for missing in ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"] {
            let vars: Vec<_> = TORCHRUN
                .iter()
                .copied()
                .filter(|(k, _)| *k != missing)
                .collect();
            let e = refused(&vars);
            assert!(e.contains(&format!("{missing} is not set")), "{e}");
        }
        for (name, bad, says) in [
            ("RANK", "-1", "RANK=\"-1\""),
            ("WORLD_SIZE", "two", "WORLD_SIZE=\"two\""),
            ("LOCAL_RANK", "x", "LOCAL_RANK=\"x\""),
            ("MASTER_PORT", "70000", "MASTER_PORT=\"70000\""),
            ("RANK", "4", "RANK=4 is out of range for WORLD_SIZE=4"),
            ("WORLD_SIZE", "0", "WORLD_SIZE is 0"),
            (
                "NDSCOPE_RENDEZVOUS_TIMEOUT",
                "0",
                "NDSCOPE_RENDEZVOUS_TIMEOUT",
            ),
        ] {
            let mut vars: Vec<_> = TORCHRUN
                .iter()
                .copied()
                .filter(|(k, _)| *k != name)
                .collect();
            vars.push((name, bad));
            let e = refused(&vars);
            assert!(e.contains(says), "{name}={bad}: {e}");
        }
        assert!(matches!(
            DistributedConfig::new(2, 2, "127.0.0.1", 1),
            Err(Error::InvalidConfig { .. })
        ));
    }

    /// A port that was free a moment ago.
    fn free_port() -> u16 {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    }

    fn config(rank: usize, world: usize, port: u16, timeout_ms: u64) -> DistributedConfig {
        DistributedConfig::new(rank, world, "127.0.0.1", port)
            .expect("config")
            .timeout(Duration::from_millis(timeout_ms))
    }

    #[test]
    fn the_id_reaches_every_rank() {
        let port = free_port();
        let id: [u8; 128] = std::array::from_fn(|i| (i * 7 + 3) as u8);
        let world = 4;
        let clients: Vec<_> = (1..world)
            .map(|rank| {
                thread::spawn(move || {
                    let ctx = Ctx::new("test");
                    fetch_id(&ctx, &config(rank, world, port, 10_000))
                })
            })
            .collect();
        // The clients start first: they retry until rank 0 listens.
        thread::sleep(Duration::from_millis(200));
        serve_id(&Ctx::new("test"), &config(0, world, port, 10_000), id).expect("serve");
        for c in clients {
            assert_eq!(c.join().expect("thread").expect("fetch"), id);
        }
    }

    #[test]
    fn a_wrong_world_size_is_refused() {
        let port = free_port();
        let id = [9u8; 128];
        let server =
            thread::spawn(move || serve_id(&Ctx::new("test"), &config(0, 2, port, 10_000), id));
        let ctx = Ctx::new("test");
        match fetch_id(&ctx, &config(1, 3, port, 10_000)) {
            Err(e @ Error::InvalidConfig { .. }) => {
                let text = e.to_string();
                assert!(
                    text.contains("WORLD_SIZE=3") && text.contains("WORLD_SIZE=2"),
                    "{text}"
                );
            }
            other => panic!("expected InvalidConfig, got {other:?}"),
        }
        // Rank 0 still waits for its rank 1.
        assert_eq!(
            fetch_id(&ctx, &config(1, 2, port, 10_000)).expect("fetch"),
            id
        );
        // A rank served twice is refused (rank 0 has closed by then, or refuses it).
        server.join().expect("thread").expect("serve");
        assert!(fetch_id(&ctx, &config(1, 2, port, 300)).is_err());
    }

    #[test]
    fn an_absent_rank_0_times_out_clearly() {
        let port = free_port();
        let start = Instant::now();
        let e = fetch_id(&Ctx::new("test"), &config(1, 2, port, 300)).expect_err("no rank 0");
        let took = start.elapsed();
        let text = e.to_string();
        assert!(
            text.contains(&format!("could not reach rank 0 at 127.0.0.1:{port}")),
            "{text}"
        );
        assert!(matches!(&e, Error::Io { source, .. } if source.kind() == io::ErrorKind::TimedOut));
        assert!(took < Duration::from_secs(3), "took {took:?}");
        // And rank 0 with nobody coming names the missing ranks.
        let e = serve_id(&Ctx::new("test"), &config(0, 3, free_port(), 200), [0; 128])
            .expect_err("nobody came");
        assert!(e.to_string().contains("rank(s) 1, 2 never came"), "{e}");
    }
    #[test]
    fn the_board_collects_every_rank_post_per_step() {
        let port = free_port();
        let listener = TcpListener::bind(("127.0.0.1", port)).expect("bind");
        listener.set_nonblocking(true).expect("non-blocking");
        let board = Board::serve(listener, 3).expect("board");
        let grace = Duration::from_millis(400);
        // Ranks 1 and 2 post on step 5; rank 0 never does: the wait ends after the grace.
        let r2 = thread::spawn(move || {
            post_and_read(
                &config(2, 3, port, 1000),
                5,
                Seen::Culprit,
                7,
                Duration::ZERO,
            )
        });
        let start = Instant::now();
        let posts = post_and_read(&config(1, 3, port, 1000), 5, Seen::Waited, 3, grace)
            .expect("the board answers");
        assert!(
            start.elapsed() >= grace,
            "returned before every rank posted"
        );
        r2.join().expect("thread").expect("rank 2 posts");
        let mut posts = posts;
        posts.sort_by_key(|p| p.0);
        assert_eq!(posts, vec![(1, Seen::Waited, 3), (2, Seen::Culprit, 7)]);
        // Another step is a list of its own; a complete list returns at once.
        for rank in 0..2 {
            post_and_read(
                &config(rank, 3, port, 1000),
                6,
                Seen::Waited,
                rank,
                Duration::ZERO,
            )
            .expect("post");
        }
        let start = Instant::now();
        let posts =
            post_and_read(&config(2, 3, port, 1000), 6, Seen::Waited, 2, grace).expect("post");
        assert_eq!(posts.len(), 3);
        assert!(start.elapsed() < grace);
        // A late rendezvous client is refused, not served.
        assert!(fetch_id(&Ctx::new("test"), &config(1, 3, port, 1000)).is_err());
        // Without rank 0 the post fails after the grace, saying why.
        drop(board);
        let e = post_and_read(&config(1, 3, port, 1000), 7, Seen::Waited, 0, grace)
            .expect_err("no board");
        assert!(!e.is_empty());
    }
}
