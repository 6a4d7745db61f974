//! `ParallelTrainer` over several processes, one rank each, as `torchrun` launches them: this
//! test binary runs itself twice (`RANK` 0 and 1, `WORLD_SIZE=2`, `MASTER_ADDR=127.0.0.1`, a free
//! `MASTER_PORT`), each child running [`child_rank`] on its half of fixed batches. The children
//! end with bit-identical parameters, equal to 1-device training on the whole batches; a rank
//! whose step fails (or is refused) makes both ranks report `ReplicaFailed` naming it, change
//! nothing, and go on. The parent kills its children if they take too long (a hang fails).
//!
//! Needs a GPU (or the simulator, where each process is a node of its own and both use their
//! device 0) and skips otherwise, as the other GPU tests do (`NDSCOPE_REQUIRE_GPU=1`: a failure).

mod common;
#[path = "../examples/mlp/mod.rs"]
mod mlp;

use std::fs;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use mlp::Mlp;
use ndscope::{
    gradient_collector, Device, DistributedConfig, Error, HostArray, Manager, NDArray, Optimizer,
    OptimizerKind, ParallelTrainer, Sgd, WorkspaceConfig,
};

const SIZES: [usize; 4] = [32, 64, 64, 10];
/// Set in a child: the folder its results go to.
const CHILD: &str = "NDSCOPE_PROCS_CHILD";
/// Set in a child: the step at which rank 1's step closure fails.
const FAIL_AT: &str = "NDSCOPE_PROCS_FAIL_AT";
/// Set in a child: the step at which rank 1 passes a batch the trainer refuses.
const REFUSE_AT: &str = "NDSCOPE_PROCS_REFUSE_AT";
/// Set in a child: rank 1's model closure fails.
const SETUP_FAIL: &str = "NDSCOPE_PROCS_SETUP_FAIL";
/// Set in a child: the step at which rank 1's step closure stops answering (it sleeps).
const HANG_AT: &str = "NDSCOPE_PROCS_HANG_AT";
/// Set in a child: `rank:step`, the rank whose process exits in its step closure at that step.
const EXIT_AT: &str = "NDSCOPE_PROCS_EXIT_AT";
/// The trainer's timeout in the children, in milliseconds.
const TIMEOUT_MS: u64 = 3000;
const STEPS: usize = 6;
/// Rows of each batch, split 9 + 9.
const ROWS: usize = 18;

fn source(m: &Manager) -> Vec<NDArray> {
    ndscope::manual_seed(7);
    Mlp::with_gradients(m, &SIZES)
        .expect("mlp")
        .parameters()
        .into_vec()
}

fn model(params: &[NDArray]) -> ndscope::Result<Mlp> {
    if std::env::var_os(SETUP_FAIL).is_some() && std::env::var("RANK").is_ok_and(|r| r == "1") {
        // An injected failure.
        params[0].reshape([3, 1000])?;
    }
    Ok(Mlp::from_parameters(params, SIZES[3]))
}

/// The tests seed the process-wide generator (the parameters, the data) and share the devices:
/// one at a time.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// The step closure's calls in this process.
static CALLS: AtomicUsize = AtomicUsize::new(0);

fn step(net: &Mlp, x: &NDArray, y: &NDArray) -> ndscope::Result<NDArray> {
    let call = CALLS.fetch_add(1, Ordering::SeqCst);
    let rank1 = std::env::var("RANK").is_ok_and(|r| r == "1");
    let fail_at: Option<usize> = std::env::var(FAIL_AT).ok().and_then(|v| v.parse().ok());
    if rank1 && fail_at == Some(call) {
        // An injected failure: a reshape that cannot be.
        return x.reshape([3, 1000]);
    }
    let hang_at: Option<usize> = std::env::var(HANG_AT).ok().and_then(|v| v.parse().ok());
    if rank1 && hang_at == Some(call) {
        // Stops answering: far longer than the timeout (the process ends first).
        std::thread::sleep(Duration::from_secs(120));
    }
    if let Some((r, at)) = std::env::var(EXIT_AT).ok().and_then(|v| {
        let (r, at) = v.split_once(':')?;
        Some((r.parse::<String>().ok()?, at.parse::<usize>().ok()?))
    }) {
        if std::env::var("RANK").is_ok_and(|me| me == r) && at == call {
            // The process dies in the middle of a step, its collectives never come.
            std::process::exit(0);
        }
    }
    Mlp::loss(&net.logits(x)?, y)
}

fn batches(m: &Manager) -> Vec<(NDArray, NDArray)> {
    ndscope::manual_seed(11);
    (0..3)
        .map(|_| mlp::make_data(m, ROWS, SIZES[0], SIZES[3], 2, 2.0).expect("data"))
        .collect()
}

fn momentum() -> OptimizerKind {
    Sgd {
        momentum: 0.9,
        ..Sgd::new(0.05)
    }
    .into()
}

/// One rank's half of a batch.
fn half(m: &Manager, a: &NDArray, rank: usize) -> NDArray {
    let parts = a
        .to_host()
        .expect("host")
        .split_rows(&[ROWS / 2, ROWS / 2])
        .expect("split");
    m.from_host(&parts[rank]).expect("from host")
}

/// The worker body: runs only in a child (`NDSCOPE_PROCS_CHILD` set), trains on its half of
/// each batch and writes what each step gave (`<rank>.log`) and its parameters' bits
/// (`<rank>.bin`, little-endian u32s).
#[test]
fn child_rank() {
    let Some(dir) = std::env::var_os(CHILD).map(PathBuf::from) else {
        return;
    };
    let config = DistributedConfig::from_env()
        .expect("torchrun's variables")
        .timeout(Duration::from_secs(30));
    let broken_world = std::env::var_os(HANG_AT).is_some() || std::env::var_os(EXIT_AT).is_some();
    let rank = config.rank;
    let refuse_at: Option<usize> = std::env::var(REFUSE_AT).ok().and_then(|v| v.parse().ok());
    let host = Manager::new_base();
    let src = source(&host);
    let data = batches(&host);
    let built = ParallelTrainer::builder()
        .name("ddp")
        .distributed(config)
        .optimizer(momentum())
        .timeout(Duration::from_millis(TIMEOUT_MS))
        .build(&src, model, step);
    let mut t = match built {
        Ok(t) => t,
        Err(Error::ReplicaFailed {
            rank: r, source, ..
        }) if std::env::var_os(SETUP_FAIL).is_some() => {
            println!("rank {rank}: the build failed: {source}");
            let line = match *source {
                Error::ShapeMismatch { .. } => format!("setup failed here (rank {r})"),
                Error::Backend { reason, .. } if reason.contains("rank(s) 1 of 2") => {
                    format!("setup failed elsewhere (rank {r})")
                }
                other => panic!("rank {rank}: unexpected setup failure: {other}"),
            };
            host.close().expect("close");
            fs::write(dir.join(format!("{rank}.log")), line + "\n").expect("write the log");
            return;
        }
        Err(e) => panic!("rank {rank}: {e}"),
    };
    assert_eq!(t.devices().len(), 1);
    let mut log = String::new();
    for i in 0..STEPS {
        let (x, y) = &data[i % data.len()];
        let x = half(&host, x, rank);
        let mut y = half(&host, y, rank);
        if rank == 1 && refuse_at == Some(i) {
            // Labels with fewer rows than the inputs: refused before anything runs.
            y = host
                .from_host(&HostArray::from_vec(vec![0i64; 2], [2]).expect("host"))
                .expect("y");
        }
        let line = match t.step(&x, &y) {
            Ok(s) => {
                assert_eq!(s.rows, vec![ROWS / 2, ROWS / 2]);
                assert_eq!(s.shard_losses.len(), 2);
                "ok".to_string()
            }
            Err(Error::ReplicaFailed {
                rank: failed,
                step,
                source,
                ..
            }) if broken_world => {
                // A rank stopped answering: every rank names it, and the trainer is broken.
                println!("rank {rank}, step {i}: rank {failed} stopped: {source}");
                let kind = match *source {
                    Error::TimedOut { waited, .. } => {
                        assert_eq!(waited, Duration::from_millis(TIMEOUT_MS));
                        "timed out"
                    }
                    _ => "stopped",
                };
                assert!(t.stats().broken);
                assert!(matches!(t.step(&x, &y), Err(Error::ShutDown { .. })));
                let closing = Instant::now();
                t.close().expect("close");
                // A thread still in the hung closure is not waited for.
                assert!(closing.elapsed() < Duration::from_secs(10), "close waited");
                assert_eq!(ndscope::memory_usage(t.devices()[0]).in_use, 0);
                host.close().expect("close");
                log.push_str(&format!("{kind} rank {failed} step {step}\n"));
                fs::write(dir.join(format!("{rank}.log")), log).expect("write the log");
                return;
            }
            Err(Error::ReplicaFailed {
                rank: failed,
                step,
                after_all_reduce,
                source,
                ..
            }) => {
                assert!(!after_all_reduce);
                println!("rank {rank}, step {i}: rank {failed} failed: {source}");
                format!("failed rank {failed} step {step}")
            }
            Err(e @ Error::InvalidArgument { .. }) => {
                println!("rank {rank}, step {i}: refused: {e}");
                "refused".to_string()
            }
            Err(e) => panic!("rank {rank}, step {i}: {e}"),
        };
        log.push_str(&line);
        log.push('\n');
    }
    let stats = t.stats();
    assert!(!stats.broken);
    let mut bits = Vec::new();
    for p in t.parameters(0).expect("parameters") {
        for v in p.to_vec::<f32>().expect("read") {
            bits.extend_from_slice(&v.to_bits().to_le_bytes());
        }
    }
    t.close().expect("close");
    host.close().expect("close");
    fs::write(dir.join(format!("{rank}.bin")), bits).expect("write the parameters");
    fs::write(dir.join(format!("{rank}.log")), log).expect("write the log");
}

/// Whether the loaded CUDA driver is the simulator (each process a node of its own, so two
/// processes may both use their device 0).
fn simulated() -> bool {
    let Ok(maps) = fs::read_to_string("/proc/self/maps") else {
        return false;
    };
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .filter(|p| {
            Path::new(p)
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("libcuda.so"))
        })
        .any(|p| fs::read(p).is_ok_and(|b| b.windows(13).any(|w| w == b"cudasim_stats")))
}

/// The local ranks of the two children: their own GPUs, or both device 0 on the simulator;
/// `None` (after saying why) where the test skips.
fn local_ranks() -> Option<[usize; 2]> {
    common::cuda_device()?;
    if Device::cuda_count() >= 2 {
        Some([0, 1])
    } else if simulated() {
        Some([0, 0])
    } else {
        println!("skipped: two ranks need two GPUs (NCCL refuses two ranks on one device)");
        None
    }
}

/// Kills the children if the parent leaves early (a failed assertion, a timeout).
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Runs two children with `env` on top of torchrun's variables; returns their folder, once
/// both exited successfully (the test fails otherwise, with their output).
fn run_world(name: &str, locals: [usize; 2], env: &[(&str, &str)]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ndscope-procs-{}-{name}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).expect("a temp folder");
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let exe = std::env::current_exe().expect("the test binary");
    let mut children = Children(Vec::new());
    for (rank, local) in locals.iter().enumerate() {
        let out = fs::File::create(dir.join(format!("{rank}.out"))).expect("output file");
        let err = out.try_clone().expect("output file");
        let mut cmd = Command::new(&exe);
        cmd.args(["child_rank", "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD, &dir)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", "2")
            .env("LOCAL_RANK", local.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        for (k, v) in env {
            cmd.env(k, v);
        }
        children.0.push(cmd.spawn().expect("start a child"));
    }
    let deadline = Instant::now() + Duration::from_secs(180);
    let output =
        |rank: usize| fs::read_to_string(dir.join(format!("{rank}.out"))).unwrap_or_default();
    let mut done = [false, false];
    while done.iter().any(|d| !d) {
        for (rank, c) in children.0.iter_mut().enumerate() {
            if done[rank] {
                continue;
            }
            if let Some(status) = c.try_wait().expect("wait") {
                assert!(
                    status.success(),
                    "rank {rank} failed ({status}):\n{}\n--- rank {}:\n{}",
                    output(rank),
                    1 - rank,
                    output(1 - rank)
                );
                done[rank] = true;
            }
        }
        assert!(
            Instant::now() < deadline,
            "the children did not finish within 180 s (a hang?); killed:\n--- rank 0:\n{}\n--- rank 1:\n{}",
            output(0),
            output(1)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    dir
}

fn params_of(dir: &Path, rank: usize) -> Vec<u32> {
    fs::read(dir.join(format!("{rank}.bin")))
        .expect("a child's parameters")
        .chunks(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn log_of(dir: &Path, rank: usize) -> Vec<String> {
    fs::read_to_string(dir.join(format!("{rank}.log")))
        .expect("a child's log")
        .lines()
        .map(str::to_string)
        .collect()
}

/// Plain 1-device training on the whole batches (each step's gradient the mean over 18 rows),
/// `skip`: the steps no rank applied.
fn reference(dev: Device, skip: &[usize]) -> Vec<f32> {
    let host = Manager::new_base();
    let src = source(&host);
    let data = batches(&host);
    let m = Manager::new_base_on(dev).expect("manager");
    let params: Vec<NDArray> = src
        .iter()
        .map(|p| {
            let c = p.to_device(dev).expect("copy");
            c.attach(&m).expect("attach");
            c.set_requires_gradient(true).expect("grad");
            c
        })
        .collect();
    let net = model(&params).expect("model");
    let mut opt = Optimizer::new(&params, momentum()).expect("optimizer");
    let ws = m
        .workspace("step", WorkspaceConfig::default())
        .expect("workspace");
    for i in (0..STEPS).filter(|i| !skip.contains(i)) {
        let (x, y) = &data[i % data.len()];
        ws.cycle(|_| {
            let x = x.to_device(dev)?;
            let y = y.to_device(dev)?;
            let collector = gradient_collector()?;
            let loss = Mlp::loss(&net.logits(&x)?, &y)?;
            collector.backward(&loss)?;
            collector.close();
            opt.step()
        })
        .expect("reference step");
    }
    let out = params
        .iter()
        .flat_map(|p| p.to_vec::<f32>().expect("read"))
        .collect();
    opt.close();
    m.close().expect("close");
    host.close().expect("close");
    out
}

fn assert_matches_reference(dir: &Path, skip: &[usize]) {
    let got = params_of(dir, 0);
    assert!(got == params_of(dir, 1), "the two ranks' parameters differ");
    let want = reference(Device::Cuda(0), skip);
    assert_eq!(got.len(), want.len());
    let mut worst = 0.0f32;
    for (g, w) in got.iter().map(|b| f32::from_bits(*b)).zip(&want) {
        worst = worst.max((g - w).abs() / w.abs().max(1e-2));
    }
    println!("2 processes vs 1 device: largest relative difference {worst:e}");
    assert!(worst < 1e-5, "2 processes vs 1 device: {worst:e}");
}

#[test]
fn two_processes_train_as_one_device() {
    if std::env::var_os(CHILD).is_some() {
        return;
    }
    let _serial = serial();
    let Some(locals) = local_ranks() else { return };
    let dir = run_world("train", locals, &[]);
    for rank in 0..2 {
        assert_eq!(log_of(&dir, rank), vec!["ok"; STEPS], "rank {rank}");
    }
    assert_matches_reference(&dir, &[]);
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn a_failing_rank_fails_every_rank_and_changes_nothing() {
    if std::env::var_os(CHILD).is_some() {
        return;
    }
    let _serial = serial();
    let Some(locals) = local_ranks() else { return };
    // Rank 1's step closure fails at step 2; at step 4 rank 1 passes a batch the trainer
    // refuses before running anything.
    let dir = run_world("fail", locals, &[(FAIL_AT, "2"), (REFUSE_AT, "4")]);
    let mut want0 = vec!["ok".to_string(); STEPS];
    want0[2] = "failed rank 1 step 2".into();
    want0[4] = "failed rank 1 step 4".into();
    let mut want1 = want0.clone();
    want1[4] = "refused".into();
    assert_eq!(log_of(&dir, 0), want0);
    assert_eq!(log_of(&dir, 1), want1);
    assert_matches_reference(&dir, &[2, 4]);
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn a_rank_failing_its_setup_fails_every_build() {
    if std::env::var_os(CHILD).is_some() {
        return;
    }
    let _serial = serial();
    let Some(locals) = local_ranks() else { return };
    let dir = run_world("setup", locals, &[(SETUP_FAIL, "1")]);
    assert_eq!(log_of(&dir, 0), vec!["setup failed elsewhere (rank 0)"]);
    assert_eq!(log_of(&dir, 1), vec!["setup failed here (rank 1)"]);
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn a_rank_that_stops_answering_is_named_by_every_rank() {
    if std::env::var_os(CHILD).is_some() {
        return;
    }
    let _serial = serial();
    let Some(locals) = local_ranks() else { return };
    // Rank 1's step closure hangs at step 2: both ranks fail that step after the timeout,
    // naming rank 1 (rank 1 from its own timeout, rank 0 from rank 1's post on its board).
    let start = Instant::now();
    let dir = run_world("hang", locals, &[(HANG_AT, "2")]);
    let took = start.elapsed();
    for rank in 0..2 {
        assert_eq!(
            log_of(&dir, rank),
            vec!["ok", "ok", "timed out rank 1 step 2"],
            "rank {rank}"
        );
    }
    assert!(took < Duration::from_secs(60), "took {took:?}");
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn a_rank_whose_process_dies_is_named_by_the_others() {
    if std::env::var_os(CHILD).is_some() {
        return;
    }
    let _serial = serial();
    let Some(locals) = local_ranks() else { return };
    // Rank 1's process exits inside its step closure at step 3: rank 0's exchange fails (or
    // times out), rank 1 never reports, and rank 0 names it.
    let dir = run_world("exit1", locals, &[(EXIT_AT, "1:3")]);
    let log = log_of(&dir, 0);
    assert_eq!(log[..3], ["ok", "ok", "ok"]);
    assert!(
        log[3] == "stopped rank 1 step 3" || log[3] == "timed out rank 1 step 3",
        "{log:?}"
    );
    assert!(!dir.join("1.log").exists());
    // And when rank 0 (whose board the others post on) dies, rank 1 names it.
    let dir0 = run_world("exit0", locals, &[(EXIT_AT, "0:1")]);
    let log = log_of(&dir0, 1);
    assert_eq!(log[0], "ok");
    assert!(
        log[1] == "stopped rank 0 step 1" || log[1] == "timed out rank 0 step 1",
        "{log:?}"
    );
    let _ = fs::remove_dir_all(&dir);
    let _ = fs::remove_dir_all(&dir0);
}
