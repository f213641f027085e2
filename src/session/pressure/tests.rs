use std::sync::Arc;

use super::*;
use crate::clock::SimClock;

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
