//! The layer workspace manager: array kinds mapped to workspaces, scopes or managers by one
//! configuration, and the MLP example's step under both layouts.

#[path = "../examples/mlp/mod.rs"]
mod mlp;

use ndscope::{
    manual_seed, ArrayKind, DType, Error, LayerWorkspaceMgr, Manager, Placement, WorkspaceConfig,
};

fn two_workspaces(owner: &Manager) -> LayerWorkspaceMgr {
    LayerWorkspaceMgr::builder(owner)
        .workspace(ArrayKind::Activations, "act", WorkspaceConfig::default())
        .workspace(
            ArrayKind::FfWorkingMem,
            "working",
            WorkspaceConfig::default(),
        )
        .workspace(
            ArrayKind::BpWorkingMem,
            "working",
            WorkspaceConfig::default(),
        )
        .build()
        .unwrap()
}

#[test]
fn create_and_leverage_put_arrays_where_the_configuration_says() {
    let owner = Manager::new_base().with_name("trainer");
    let mgr = two_workspaces(&owner);
    let acts = mgr.open(ArrayKind::Activations).unwrap();
    assert_eq!(acts.kind(), ArrayKind::Activations);
    for _ in 0..3 {
        let kept = mgr
            .scope(ArrayKind::FfWorkingMem, |working| {
                let a = mgr.create(ArrayKind::FfWorkingMem, [8], DType::F32)?;
                assert_eq!(a.manager()?, *working);
                let b = a.add_scalar(2.0)?; // an op result: the active scope
                assert_eq!(b.manager()?, *working);
                assert!(working.name().starts_with("working#"));
                mgr.leverage_to(ArrayKind::Activations, &b)
            })
            .unwrap();
        assert_eq!(kept.manager().unwrap(), *acts);
        assert_eq!(kept.to_vec::<f32>().unwrap(), vec![2.0; 8]);
    }
    assert_eq!(acts.report().total_arrays(), 3);
    assert!(acts.name().starts_with("act#"));
    let act_ws = mgr.workspace(ArrayKind::Activations).unwrap().clone();
    drop(acts);
    assert_eq!(act_ws.stats().cycles, 1);
    assert_eq!(
        mgr.workspace(ArrayKind::FfWorkingMem)
            .unwrap()
            .stats()
            .cycles,
        3
    );
    assert!(matches!(mgr.placement(ArrayKind::Input), Placement::Scope));
    owner.close().unwrap();
}

#[test]
fn a_kind_that_is_not_open_is_named_in_the_error() {
    let owner = Manager::new_base();
    let mgr = two_workspaces(&owner);
    let err = mgr
        .create(ArrayKind::Activations, [2], DType::F32)
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("Activations is not open") && msg.contains("'act'"),
        "{msg}"
    );
    let x = owner.ones([2], DType::F32).unwrap();
    assert!(mgr.leverage_to(ArrayKind::ActivationGrad, &x).is_err());
    assert_eq!(
        x.manager().unwrap(),
        owner,
        "a refused leverage moves nothing"
    );
    let first = mgr.open(ArrayKind::Activations).unwrap();
    let err = mgr.open(ArrayKind::Activations).unwrap_err();
    assert!(err.to_string().contains("open already"), "{err}");
    drop(first);
    owner.close().unwrap();
}

#[test]
fn kinds_placed_in_one_workspace_share_its_cycle() {
    let owner = Manager::new_base();
    let mgr = two_workspaces(&owner);
    let ff = mgr.open(ArrayKind::FfWorkingMem).unwrap();
    let bp = mgr.open(ArrayKind::BpWorkingMem).unwrap();
    assert_eq!(*ff, *bp, "one cycle of 'working'");
    let x = mgr
        .create(ArrayKind::BpWorkingMem, [4], DType::F32)
        .unwrap();
    drop(bp); // shares: closes nothing
    assert!(x.is_open() && ff.is_open());
    drop(ff); // the cycle's opener: ends it
    assert!(!x.is_open());
    assert!(
        mgr.manager(ArrayKind::BpWorkingMem).is_err(),
        "forgotten too"
    );
    owner.close().unwrap();
}

#[test]
fn scoped_out_kinds_go_straight_to_their_manager() {
    let owner = Manager::new_base();
    let out = Manager::new_base().with_name("out");
    let mgr = LayerWorkspaceMgr::builder(&owner)
        .scoped_out(ArrayKind::Input, &out)
        .workspace(
            ArrayKind::FfWorkingMem,
            "working",
            WorkspaceConfig::default(),
        )
        .build()
        .unwrap();
    assert!(mgr.is_scoped_out(ArrayKind::Input));
    let x = mgr.create(ArrayKind::Input, [3], DType::F32).unwrap();
    assert_eq!(x.manager().unwrap(), out);
    let y = mgr
        .scope(ArrayKind::FfWorkingMem, |_| {
            let y = x.add_scalar(1.0)?;
            mgr.leverage_to(ArrayKind::Input, &y) // copied out of the working memory
        })
        .unwrap();
    assert_eq!(y.to_vec::<f32>().unwrap(), vec![1.0; 3]);
    assert!(!out.report().arrays.iter().any(|a| a.in_workspace));
    out.close().unwrap();
    owner.close().unwrap();
}

#[test]
fn no_workspaces_uses_plain_scopes_that_still_free_their_arrays() {
    let owner = Manager::new_base();
    let mgr = LayerWorkspaceMgr::no_workspaces(&owner);
    assert!(ArrayKind::ALL
        .iter()
        .all(|&k| mgr.workspace(k).is_none() && *mgr.placement(k) == Placement::Scope));
    let inner = mgr
        .scope(ArrayKind::FfWorkingMem, |m| {
            let x = m.ones([5], DType::F32)?;
            assert!(!m.report().arrays[0].in_workspace);
            Ok(x)
        })
        .unwrap();
    assert!(!inner.is_open());
    assert!(owner.report().workspaces.is_empty());
    assert!(owner.children().is_empty());
    owner.close().unwrap();
}

#[test]
fn one_workspace_name_with_two_configurations_is_refused() {
    let owner = Manager::new_base();
    let strict = WorkspaceConfig::builder()
        .allocation(ndscope::AllocationPolicy::Strict)
        .build()
        .unwrap();
    let err = LayerWorkspaceMgr::builder(&owner)
        .workspace(
            ArrayKind::FfWorkingMem,
            "working",
            WorkspaceConfig::default(),
        )
        .workspace(ArrayKind::BpWorkingMem, "working", strict)
        .build()
        .unwrap_err();
    assert!(matches!(err, Error::InvalidConfig { .. }), "{err}");
    owner.close().unwrap();
}

/// One training step of the example MLP with `layers`, from the same seed.
/// The random generator is one per process: tests that seed it and draw from it take turns, or
/// one test's draws would land between another's seed and its own draws.
static SEEDED: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn step_with(layout: impl Fn(&Manager) -> LayerWorkspaceMgr) -> (Vec<f32>, Vec<f32>, Manager) {
    let _turn = SEEDED.lock().unwrap_or_else(|e| e.into_inner());
    manual_seed(3);
    let model = Manager::new_base();
    let net = mlp::Mlp::new(&model, &[12, 16, 8, 3]).unwrap();
    model.cap();
    let trainer = model.new_sub_manager().unwrap();
    let layers = layout(&trainer);
    let x = trainer.randn([5, 12], DType::F32).unwrap();
    let y = trainer.from_slice(&[0i64, 1, 2, 1, 0], [5]).unwrap();
    let ws = trainer
        .workspace("batch", WorkspaceConfig::default())
        .unwrap();
    let mut losses = Vec::new();
    for _ in 0..4 {
        losses.push(
            ws.cycle(|_| {
                net.train_step(&layers, &x, &y, 0.1, 0.9)?
                    .loss
                    .to_scalar::<f32>()
            })
            .unwrap(),
        );
    }
    let w1 = net.layers[0].w.to_vec::<f32>().unwrap();
    (losses, w1, model)
}

#[test]
fn the_mlp_step_computes_the_same_under_workspaces_and_without() {
    let (with, w_with, m1) = step_with(|t| LayerWorkspaceMgr::training(t).unwrap());
    let (without, w_without, m2) = step_with(LayerWorkspaceMgr::no_workspaces);
    assert_eq!(with, without, "losses");
    assert_eq!(w_with, w_without, "updated weights");
    assert!(with[3] < with[0], "it learns: {with:?}");
    // Between steps the trainer holds its batch (x, y) and nothing else.
    for m in [&m1, &m2] {
        let trainer = &m.report().children[0];
        assert_eq!(trainer.total_arrays(), 2);
        assert!(trainer.children.is_empty());
    }
    m1.close().unwrap();
    m2.close().unwrap();
}

#[test]
fn the_training_layout_stops_spilling_once_every_layer_was_seen() {
    let _turn = SEEDED.lock().unwrap_or_else(|e| e.into_inner());
    manual_seed(4);
    let model = Manager::new_base();
    let net = mlp::Mlp::new(&model, &[20, 64, 8, 3]).unwrap();
    let trainer = model.new_sub_manager().unwrap();
    let layers = LayerWorkspaceMgr::training(&trainer).unwrap();
    let x = trainer.randn([6, 20], DType::F32).unwrap();
    let y = trainer.from_slice(&[0i64, 1, 2, 0, 1, 2], [6]).unwrap();
    let spills = || {
        ArrayKind::ALL
            .iter()
            .filter_map(|&k| layers.workspace(k))
            .map(|ws| ws.stats().spilled_count)
            .sum::<u64>()
    };
    for _ in 0..2 {
        trainer
            .scope(|_| net.train_step(&layers, &x, &y, 0.1, 0.9).map(drop))
            .unwrap();
    }
    let learned = spills();
    for _ in 0..5 {
        trainer
            .scope(|_| net.train_step(&layers, &x, &y, 0.1, 0.9).map(drop))
            .unwrap();
    }
    assert_eq!(
        spills(),
        learned,
        "each workspace grew to its largest cycle once"
    );
    model.close().unwrap();
}
