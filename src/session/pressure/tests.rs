use std::sync::Arc;

use super::*;
use crate::clock::SimClock;
use crate::layout::LayoutSpec;
use crate::page::Namespace;
use crate::policy::select_victims;

fn setup(cap_sessions: usize) -> (Arc<SimClock>, SessionTable, PressureController) {
    let clock = SimClock::new();
    let table = SessionTable::new(clock.clone(), cap_sessions, u64::MAX);
    (clock, table, PressureController::default())
}

fn open(t: &mut SessionTable, id: &str, tokens: u64, activity: Activity) -> u32 {
    let i = t.open(id, None).unwrap();
    t.record_tokens(i, tokens, 0).unwrap();
    t.set_activity(i, activity).unwrap();
    i
}

#[test]
fn paused_pages_are_demoted_not_dropped_and_prefetched_before_the_next_turn() {
    let (clock, mut t, _) = setup(8);
    let pc = PressureController::new(PressureConfig {
        resume_buffer_tokens: 16,
        ..PressureConfig::default()
    })
    .unwrap();
    let mut dir = Directory::new(1024);
    let layout = LayoutSpec::mha(2, 2, 64, 2, 16).build().unwrap();
    let ns = dir.register(Namespace::model("m"), layout).unwrap();
    // Device of 10 pages x 16 tokens; a (acting) holds 6 pages, b (reasoning) holds 4.
    let a = open(&mut t, "a", 96, Activity::Acting);
    let b = open(&mut t, "b", 64, Activity::Reasoning);
    let chain_a: Vec<PageHash> = (0..6).map(PageHash::from_u64).collect();
    for (i, h) in (0..10u32).map(|i| PageHash::from_u64(i.into())).enumerate().rev() {
        let id = dir.find_or_insert(ns, &h).unwrap();
        dir.set_page(id, TierKind::Device, true);
        dir.set_session(id, if i < 6 { a } else { b });
        dir.touch(id, false);
    }
    let actions = pc.step(&mut t, 160).unwrap();
    assert_eq!(actions, vec![Action::Pause { session: a }]);
    let demoted = demote_session_pages(&mut dir, a, TierKind::Device, TierKind::Host);
    assert_eq!((demoted.pages.len(), demoted.copied), (6, 6));
    // The engine evicts six pages from the device: the paused session's go first.
    let victims = select_victims(dir.eviction_candidates(TierKind::Device), 6, |s| t.is_idle(s));
    for id in &victims {
        assert_eq!(dir.info(*id).session, a);
        dir.set_page(*id, TierKind::Device, false);
    }
    let hit = dir.lookup_prefix(ns, &chain_a);
    assert_eq!((hit.device, hit.host), (0, 6), "demoted, not dropped");
    // b finishes; demand falls below the resume watermark and a comes back.
    t.end(b).unwrap();
    clock.advance(5_000);
    let actions = pc.step(&mut t, 160).unwrap();
    assert_eq!(
        actions,
        vec![Action::Resume {
            session: a,
            forced: false,
            paused_ms: 5_000
        }]
    );
    let back = prefetch_chain(&mut dir, ns, &chain_a, TierKind::Device);
    assert_eq!(back.len(), 6);
    assert!(back.iter().all(|(_, src)| *src == TierKind::Host));
    // Its next turn finds the whole prefix on the device.
    t.set_activity(a, Activity::Reasoning).unwrap();
    assert_eq!(dir.lookup_prefix(ns, &chain_a).device, 6);
    assert!(t.is_boosted(a));
}

#[test]
fn nothing_is_paused_below_the_high_watermark() {
    let (_, mut t, pc) = setup(8);
    open(&mut t, "a", 500, Activity::Acting);
    open(&mut t, "b", 440, Activity::Acting);
    assert_eq!(pc.demand(&t), 940);
    assert!(pc.step(&mut t, 1000).unwrap().is_empty());
    assert!(t.iter().all(|(_, s)| !s.paused && !s.pause_pending));
    // At the watermark it acts: the largest acting session goes first.
    let c = open(&mut t, "c", 10, Activity::Reasoning);
    let acts = pc.step(&mut t, 1000).unwrap();
    assert_eq!(acts, vec![Action::Pause { session: 1 }]);
    assert!(!t.get(c).unwrap().paused, "reasoning sessions are never preempted");
}

#[test]
fn without_acting_sessions_the_smallest_reasoning_one_pauses_at_its_tool_boundary() {
    let (_, mut t, pc) = setup(8);
    open(&mut t, "a", 600, Activity::Reasoning);
    let b = open(&mut t, "b", 400, Activity::Reasoning);
    assert_eq!(pc.step(&mut t, 1000).unwrap(), vec![Action::MarkPause { session: b }]);
    assert!(!t.get(b).unwrap().paused);
    assert!(t.set_activity(b, Activity::Acting).unwrap());
    assert!(t.get(b).unwrap().paused);
}

#[test]
fn resumption_packs_the_smallest_sessions_first() {
    let (clock, mut t, pc) = setup(8);
    let big = open(&mut t, "big", 300, Activity::Acting);
    let small = open(&mut t, "small", 100, Activity::Acting);
    let mid = open(&mut t, "mid", 200, Activity::Acting);
    for s in [big, small, mid] {
        t.pause(s).unwrap();
    }
    clock.advance(10);
    // Resume budget: 0.85 * 6000 = 5100 tokens; each costs its context + 2048.
    let acts = pc.step(&mut t, 6000).unwrap();
    let order: Vec<u32> = acts
        .iter()
        .map(|a| match a {
            Action::Resume { session, forced, .. } => {
                assert!(!forced);
                *session
            }
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_eq!(order, vec![small, mid], "big does not fit the remaining budget");
    assert!(t.get(big).unwrap().paused);
}

#[test]
fn the_forced_resume_cap_ends_long_pauses_under_pressure() {
    let (clock, mut t, pc) = setup(8);
    let a = open(&mut t, "a", 100, Activity::Acting);
    open(&mut t, "hog", 990, Activity::Reasoning);
    t.pause(a).unwrap();
    clock.advance(29 * 60 * 1000);
    assert!(
        !pc.step(&mut t, 1000)
            .unwrap()
            .iter()
            .any(|x| matches!(x, Action::Resume { .. }))
    );
    clock.advance(60 * 1000);
    let acts = pc.step(&mut t, 1000).unwrap();
    assert!(acts.contains(&Action::Resume {
        session: a,
        forced: true,
        paused_ms: 30 * 60 * 1000
    }));
    assert!(!t.get(a).unwrap().paused);
    assert_eq!(t.get(a).unwrap().pauses_ms, vec![30 * 60 * 1000]);
}
