//! The rendezvous of a multi-process run: rank 0 hands a few bytes (the NCCL unique id) to
//! every other rank over TCP, at `MASTER_ADDR:MASTER_PORT`, as `torchrun`'s store does. Every
//! wait is bounded: a peer that never connects, or a rank 0 that never listens, is a typed
//! error after the timeout, naming the ranks, never a hang.
//!
//! The exchange: each rank `r > 0` connects (retrying until the deadline) and sends
//! `TERDZV01`, its rank and the world size (u32 little-endian each); rank 0 accepts until it has
//! heard from every rank, checks that the world sizes agree and that no rank came twice, then
//! answers each with status 0 and the payload (u32 length, bytes), or, when the rendezvous
//! fails, status 1 and the reason, so that every rank fails with the same message.

use super::DistEnv;
use crate::{Error, Result};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

const MAGIC: &[u8; 8] = b"TERDZV01";
/// The longest payload a rendezvous carries (a reply's length is checked against it).
const MAX_PAYLOAD: usize = 1 << 20;

/// The timeout of a rendezvous: `TE_DIST_TIMEOUT_S` seconds, or 300 (`torchrun`'s default is
/// longer, 900 s; a launch whose peers have not come in five minutes has usually failed).
pub fn timeout_from_env() -> Duration {
    let secs = std::env::var("TE_DIST_TIMEOUT_S").ok().and_then(|s| s.trim().parse::<f64>().ok());
    Duration::from_secs_f64(secs.filter(|s| s.is_finite() && *s > 0.0).unwrap_or(300.0))
}

fn dist(message: String) -> Error {
    Error::Dist { message }
}

/// Hands rank 0's `make()` (called on rank 0 only) to every rank of `env`: returns the same bytes
/// on every rank. A single-process run calls `make` and returns.
///
/// # Errors
/// [`Error::Dist`]: rank 0 cannot listen on `MASTER_PORT` (in use), a rank cannot reach rank 0
/// before the deadline, ranks that never connected (named), a peer of another world size or a
/// rank that came twice (every rank gets the reason), a connection lost mid-way; `make`'s error.
pub fn broadcast_bytes(env: &DistEnv, make: impl FnOnce() -> Result<Vec<u8>>, timeout: Duration) -> Result<Vec<u8>> {
    let deadline = Instant::now() + timeout;
    if env.world_size == 1 {
        return make();
    }
    if env.rank == 0 {
        serve(env, make, deadline, timeout)
    } else {
        join(env, deadline, timeout)
    }
}

/// Rank 0: accepts every other rank, then answers them.
fn serve(
    env: &DistEnv,
    make: impl FnOnce() -> Result<Vec<u8>>,
    deadline: Instant,
    timeout: Duration,
) -> Result<Vec<u8>> {
    let listener = TcpListener::bind(("0.0.0.0", env.master_port)).map_err(|e| {
        dist(format!(
            "rank 0 cannot listen on port {} ({e}): another run may hold it; choose another MASTER_PORT for every \
             process",
            env.master_port
        ))
    })?;
    listener.set_nonblocking(true).map_err(|e| dist(format!("rank 0: the listening socket: {e}")))?;
    let mut peers: BTreeMap<usize, TcpStream> = BTreeMap::new();
    let mut problem: Option<String> = None;
    while peers.len() + 1 < env.world_size && problem.is_none() {
        let now = Instant::now();
        if now >= deadline {
            let missing: Vec<usize> = (1..env.world_size).filter(|r| !peers.contains_key(r)).collect();
            problem = Some(format!(
                "ranks {missing:?} of {} did not connect to rank 0 within {:.0} s: check that every process started, \
                 with the same MASTER_ADDR and MASTER_PORT (TE_DIST_TIMEOUT_S sets the wait)",
                env.world_size,
                timeout.as_secs_f64()
            ));
            break;
        }
        match listener.accept() {
            Ok((mut stream, from)) => match hello(&mut stream, deadline) {
                // Not this protocol (a port scan, a stale client): ignored.
                Err(_) => {}
                Ok((rank, world)) if world != env.world_size => {
                    problem = Some(format!(
                        "rank {rank} (from {from}) has WORLD_SIZE = {world}, rank 0 has {}: start every process with \
                         the same WORLD_SIZE",
                        env.world_size
                    ));
                    peers.insert(usize::MAX - peers.len(), stream);
                }
                Ok((rank, _)) if rank == 0 || rank >= env.world_size || peers.contains_key(&rank) => {
                    problem = Some(format!(
                        "two processes have RANK = {rank} (or it is out of range for WORLD_SIZE = {}): give every \
                         process its own rank",
                        env.world_size
                    ));
                    peers.insert(usize::MAX - peers.len(), stream);
                }
                Ok((rank, _)) => {
                    peers.insert(rank, stream);
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => problem = Some(format!("rank 0 could not accept a connection: {e}")),
        }
    }
    let outcome = match problem {
        Some(p) => Err(p),
        None => make().map_err(|e| format!("rank 0 could not make the payload: {e}")),
    };
    for stream in peers.values_mut() {
        // A peer that went away cannot be told; the others still are.
        let _ = reply(stream, &outcome, deadline);
    }
    outcome.map_err(dist)
}

/// Reads a peer's hello: `(rank, world size)`.
fn hello(stream: &mut TcpStream, deadline: Instant) -> std::io::Result<(usize, usize)> {
    stream.set_nonblocking(false)?;
    // A rank sends its hello as soon as it connects: a connection silent for 2 s is a stranger's
    // and must not stall the others.
    let wait = remaining(deadline).min(Duration::from_secs(2)).max(Duration::from_millis(1));
    stream.set_read_timeout(Some(wait))?;
    let mut buf = [0u8; 16];
    stream.read_exact(&mut buf)?;
    if &buf[..8] != MAGIC {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "not a rendezvous hello"));
    }
    let word = |i: usize| u32::from_le_bytes([buf[i], buf[i + 1], buf[i + 2], buf[i + 3]]) as usize;
    Ok((word(8), word(12)))
}

/// Sends the outcome: status 0 and the payload, or status 1 and the reason.
fn reply(
    stream: &mut TcpStream,
    outcome: &std::result::Result<Vec<u8>, String>,
    deadline: Instant,
) -> std::io::Result<()> {
    stream.set_write_timeout(Some(remaining(deadline).max(Duration::from_secs(1))))?;
    let (status, body) = match outcome {
        Ok(payload) => (0u8, payload.as_slice()),
        Err(reason) => (1u8, reason.as_bytes()),
    };
    let mut msg = vec![status];
    msg.extend_from_slice(&(body.len() as u32).to_le_bytes());
    msg.extend_from_slice(body);
    stream.write_all(&msg)
}

fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

/// A rank other than 0: connects (retrying until the deadline), says hello, reads the outcome.
fn join(env: &DistEnv, deadline: Instant, timeout: Duration) -> Result<Vec<u8>> {
    let target = format!("{}:{}", env.master_addr, env.master_port);
    let unreachable = |why: String| {
        dist(format!(
            "rank {} could not reach rank 0 at {target} within {:.0} s ({why}): is rank 0 running, with the same \
             MASTER_ADDR and MASTER_PORT? (TE_DIST_TIMEOUT_S sets the wait)",
            env.rank,
            timeout.as_secs_f64()
        ))
    };
    let mut stream = loop {
        let attempt = resolve(&target).and_then(|addr| {
            let left = remaining(deadline).max(Duration::from_millis(1));
            TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(5))).map_err(|e| e.to_string())
        });
        match attempt {
            Ok(s) => break s,
            Err(why) if Instant::now() >= deadline => return Err(unreachable(why)),
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    };
    let lost = |e: std::io::Error| {
        dist(format!("rank {}: the rendezvous with rank 0 at {target} broke off ({e}) before it answered", env.rank))
    };
    let mut hello = Vec::with_capacity(16);
    hello.extend_from_slice(MAGIC);
    hello.extend_from_slice(&(env.rank as u32).to_le_bytes());
    hello.extend_from_slice(&(env.world_size as u32).to_le_bytes());
    stream.set_write_timeout(Some(remaining(deadline).max(Duration::from_millis(1)))).map_err(lost)?;
    stream.write_all(&hello).map_err(lost)?;
    // Rank 0 answers once every rank has come, or at its own deadline: wait a little past ours.
    stream.set_read_timeout(Some(remaining(deadline) + Duration::from_secs(5))).map_err(lost)?;
    let mut head = [0u8; 5];
    stream.read_exact(&mut head).map_err(lost)?;
    let len = u32::from_le_bytes([head[1], head[2], head[3], head[4]]) as usize;
    if len > MAX_PAYLOAD {
        return Err(dist(format!("rank {}: rank 0 sent a reply of {len} bytes: not this protocol", env.rank)));
    }
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body).map_err(lost)?;
    match head[0] {
        0 => Ok(body),
        _ => Err(dist(format!("rank 0 ended the rendezvous: {}", String::from_utf8_lossy(&body)))),
    }
}

/// The first address `target` resolves to.
fn resolve(target: &str) -> std::result::Result<SocketAddr, String> {
    target
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {target}: {e}"))?
        .next()
        .ok_or_else(|| format!("{target} resolves to no address"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread;

    /// A port free now (bound and released; the tests' ranks bind it again at once).
    fn free_port() -> u16 {
        TcpListener::bind(("127.0.0.1", 0)).unwrap().local_addr().unwrap().port()
    }

    fn env(rank: usize, world_size: usize, port: u16) -> DistEnv {
        DistEnv {
            rank,
            world_size,
            local_rank: rank,
            local_world_size: world_size,
            master_addr: "127.0.0.1".into(),
            master_port: port,
        }
    }

    /// Runs `ranks` (rank, world size as that rank sees it) in threads; their results by rank.
    fn run(ranks: &[(usize, usize)], port: u16, timeout: Duration) -> Vec<Result<Vec<u8>>> {
        let handles: Vec<_> = ranks
            .iter()
            .map(|&(rank, world)| {
                thread::spawn(move || {
                    if rank == 0 {
                        // The others are already retrying: rank 0 comes last, as it may.
                        thread::sleep(Duration::from_millis(100));
                    }
                    broadcast_bytes(&env(rank, world, port), || Ok(b"the nccl id".to_vec()), timeout)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn every_rank_gets_rank_0s_bytes() {
        let port = free_port();
        let out = run(&[(1, 4), (3, 4), (0, 4), (2, 4)], port, Duration::from_secs(20));
        for r in out {
            assert_eq!(r.unwrap(), b"the nccl id");
        }
        let single = broadcast_bytes(&DistEnv::single(), || Ok(vec![7]), Duration::from_secs(1)).unwrap();
        assert_eq!(single, [7]);
    }

    /// A rank that never comes: rank 0 gives up at the deadline naming it, and tells the ranks
    /// that came; a rank whose rank 0 never listens gives up too. Neither hangs.
    #[test]
    fn missing_peers_are_named_after_the_timeout() {
        let port = free_port();
        let start = Instant::now();
        let out = run(&[(0, 3), (1, 3)], port, Duration::from_millis(800));
        assert!(start.elapsed() < Duration::from_secs(10), "bounded wait");
        let e0 = out[0].as_ref().unwrap_err().to_string();
        assert!(e0.contains("ranks [2] of 3 did not connect") && e0.contains("MASTER_PORT"), "{e0}");
        let e1 = out[1].as_ref().unwrap_err().to_string();
        assert!(e1.contains("rank 0 ended the rendezvous") && e1.contains("ranks [2]"), "{e1}");
        let alone = run(&[(1, 2)], free_port(), Duration::from_millis(300));
        let e = alone[0].as_ref().unwrap_err().to_string();
        assert!(e.contains("rank 1 could not reach rank 0") && e.contains("is rank 0 running"), "{e}");
    }

    /// Every rank fails with the reason when the world sizes differ or a rank comes twice; a
    /// stranger's connection is ignored.
    #[test]
    fn misconfigured_runs_fail_everywhere_with_the_reason() {
        let out = run(&[(0, 2), (1, 3)], free_port(), Duration::from_secs(10));
        for r in &out {
            let e = r.as_ref().unwrap_err().to_string();
            assert!(e.contains("WORLD_SIZE = 3") && e.contains("same WORLD_SIZE"), "{e}");
        }
        let out = run(&[(0, 3), (1, 3), (1, 3)], free_port(), Duration::from_secs(10));
        assert!(out.iter().all(|r| r.as_ref().is_err_and(|e| e.to_string().contains("RANK = 1"))), "{out:?}");
        let port = free_port();
        let stranger = thread::spawn(move || {
            for _ in 0..100 {
                if let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) {
                    let _ = s.write_all(b"GET / HTTP/1.1\r\n\r\n");
                    return;
                }
                thread::sleep(Duration::from_millis(20));
            }
        });
        let out = run(&[(0, 2), (1, 2)], port, Duration::from_secs(10));
        stranger.join().unwrap();
        assert!(out.iter().all(|r| r.as_ref().is_ok_and(|b| b == b"the nccl id")), "{out:?}");
    }

    #[test]
    fn a_port_in_use_is_a_typed_error() {
        let held = TcpListener::bind(("0.0.0.0", 0)).unwrap();
        let port = held.local_addr().unwrap().port();
        let e = broadcast_bytes(&env(0, 2, port), || Ok(vec![]), Duration::from_secs(1)).unwrap_err();
        assert!(e.to_string().contains("cannot listen on port") && e.to_string().contains("MASTER_PORT"), "{e}");
    }
}
