//! Per-thread cleanup: destroying the workspaces a thread created (ND4J's
//! `destroyAllWorkspacesForCurrentThread`), and freeing that does not depend on the thread.

use std::sync::mpsc;

use ndscope::{destroy_all_workspaces_for_current_thread, DType, Manager, WorkspaceConfig};

fn learned(ws: &ndscope::Workspace) {
    for _ in 0..2 {
        ws.cycle(|c| c.ones([256], DType::F32).map(drop)).unwrap();
    }
    assert!(ws.stats().capacity > 0);
}

#[test]
fn only_the_calling_threads_workspaces_are_destroyed() {
    let owner = Manager::new_base().with_name("owner");
    let mine = owner.workspace("mine", WorkspaceConfig::default()).unwrap();
    learned(&mine);
    let (made_tx, made) = mpsc::channel();
    let (go_tx, go) = mpsc::channel::<()>();
    let other = std::thread::spawn({
        let owner = owner.clone();
        move || {
            let theirs = owner
                .workspace("theirs", WorkspaceConfig::default())
                .unwrap();
            learned(&theirs);
            made_tx.send(theirs.clone()).unwrap();
            go.recv().unwrap();
            // Their own cleanup, later.
            let n = destroy_all_workspaces_for_current_thread();
            (n, theirs.is_destroyed())
        }
    });
    let theirs = made.recv().unwrap();
    // Used from this thread too: the creator decides whose it is.
    theirs
        .cycle(|c| c.zeros([4], DType::F32).map(drop))
        .unwrap();
    let destroyed = destroy_all_workspaces_for_current_thread();
    assert!(destroyed >= 1);
    assert!(mine.is_destroyed());
    assert_eq!(mine.stats().capacity, 0, "its block is freed");
    assert!(!theirs.is_destroyed(), "another thread's workspace stays");
    go_tx.send(()).unwrap();
    let (n, gone) = other.join().unwrap();
    assert_eq!(n, 1);
    assert!(gone);
    assert!(owner.report().workspaces.is_empty());
    owner.close().unwrap();
}

#[test]
fn destroying_ends_an_open_cycle_and_later_calls_say_so() {
    let owner = Manager::new_base();
    let ws = owner.workspace("eval", WorkspaceConfig::default()).unwrap();
    let cycle = ws.open().unwrap();
    let x = cycle.ones([8], DType::F32).unwrap();
    assert!(destroy_all_workspaces_for_current_thread() >= 1);
    assert!(!x.is_open() && !cycle.is_open());
    let err = ws.open().unwrap_err();
    assert!(err.to_string().contains("destroyed"), "{err}");
    // The name can be used again: a fresh workspace.
    let again = owner.workspace("eval", WorkspaceConfig::default()).unwrap();
    learned(&again);
    drop(cycle);
    owner.close().unwrap();
}

#[test]
fn a_workspace_of_a_finished_thread_is_freed_from_another() {
    let owner = Manager::new_base();
    let ws = std::thread::spawn({
        let owner = owner.clone();
        move || {
            let ws = owner
                .workspace("short-lived", WorkspaceConfig::default())
                .unwrap();
            learned(&ws);
            ws
        }
    })
    .join()
    .unwrap();
    // The creating thread is gone; its workspace still works and is freed from here.
    ws.cycle(|c| c.ones([16], DType::F32).map(drop)).unwrap();
    let handle = ws.clone();
    std::thread::spawn(move || handle.destroy().unwrap())
        .join()
        .unwrap();
    assert!(ws.is_destroyed());
    // And one that is never destroyed explicitly goes with its owner, on any thread.
    let ws2 = owner
        .workspace("other", WorkspaceConfig::default())
        .unwrap();
    learned(&ws2);
    let closer = owner.clone();
    std::thread::spawn(move || closer.close().unwrap())
        .join()
        .unwrap();
    assert!(ws2.is_destroyed());
}
