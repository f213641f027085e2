use super::*;
use crate::clock::SimClock;

fn hashes(ids: std::ops::Range<u64>) -> Vec<PageHash> {
    ids.map(PageHash::from_u64).collect()
}

fn policy(clock: &Arc<SimClock>) -> SessionPolicy {
    SessionPolicy::new(SessionPolicyConfig::default(), clock.clone()).unwrap()
}

const NS: NamespaceId = NamespaceId(0);

fn class(id: &str, class: SessionClass) -> ClassChange {
    ClassChange {
        session_id: id.into(),
        class,
    }
}

fn usage(used: u64) -> Usage {
    Usage {
        used_pages: used,
        capacity_pages: 100,
        pool: true,
    }
}

#[test]
fn an_acting_child_loses_its_private_pages_under_pressure_and_gets_them_back_on_resume() {
    let clock = SimClock::new();
    let mut p = policy(&clock);
    let prefix = hashes(0..4);
    let child: Vec<PageHash> = prefix.iter().copied().chain(hashes(100..104)).collect();
    p.page_stored("parent", NS, &prefix).unwrap();
    p.phase_changed("child", Some("parent"), Phase::Reasoning, usage(10))
        .unwrap();
    p.page_stored("child", NS, &child).unwrap();
    let d = p.phase_changed("child", None, Phase::Acting, usage(10)).unwrap();
    assert!(
        d.moves.is_empty() && d.advice.is_empty(),
        "nothing moves without pressure: {d:?}"
    );
    assert_eq!(
        d.classes,
        vec![class("child", SessionClass::Idle)],
        "a pool takes them: idle first"
    );
    assert!(p.tick(usage(10)).is_empty());
    // Host in the early band: the child's private pages go to the pool, the prefix stays.
    let d = p.tick(usage(90));
    assert_eq!(
        d.moves,
        vec![Move::Demote {
            ns: NS,
            hashes: hashes(100..104)
        }]
    );
    assert!(p.tick(usage(90)).moves.is_empty(), "demoted once");
    let d = p.phase_changed("child", None, Phase::Reasoning, usage(86)).unwrap();
    assert_eq!(
        d.moves,
        vec![Move::Stage {
            ns: NS,
            hashes: child.clone()
        }]
    );
    assert_eq!(p.stats().demoted_pages, 4);
    assert_eq!(p.stats().staged_pages, 8);
    let v = p.sessions();
    assert_eq!(v.len(), 2);
    assert_eq!(v[0].session_id, "child");
    assert_eq!(v[0].parent_session_id.as_deref(), Some("parent"));
    assert_eq!((v[0].phase, v[0].pages), (Phase::Reasoning, 8));
}

#[test]
fn above_the_high_watermark_acting_sessions_pause_largest_first_and_resume_below() {
    let clock = SimClock::new();
    let mut p = policy(&clock);
    p.page_stored("small", NS, &hashes(0..5)).unwrap();
    p.page_stored("big", NS, &hashes(10..30)).unwrap();
    p.phase_changed("small", None, Phase::Acting, usage(0)).unwrap();
    p.phase_changed("big", None, Phase::Acting, usage(0)).unwrap();
    let d = p.tick(usage(96));
    assert_eq!(
        d.advice,
        vec![Advice::Pause {
            session_id: "big".into()
        }]
    );
    assert_eq!(
        d.moves,
        vec![Move::Demote {
            ns: NS,
            hashes: hashes(10..30)
        }]
    );
    assert_eq!(p.phase("big"), Some(Phase::Paused));
    clock.advance(700);
    assert!(
        p.tick(usage(60)).advice.is_empty(),
        "20 pages and a 16-page buffer need 36 below 0.85"
    );
    let d = p.tick(usage(40));
    assert_eq!(
        d.advice,
        vec![Advice::Resume {
            session_id: "big".into(),
            forced: false,
            paused_ms: 700
        }]
    );
    assert_eq!(
        d.moves,
        vec![Move::Stage {
            ns: NS,
            hashes: hashes(10..30)
        }]
    );
    assert_eq!(p.stats().paused_ms_total, 700);
}

#[test]
fn ended_sessions_are_freed_and_their_private_pages_go_first() {
    let clock = SimClock::new();
    let mut p = policy(&clock);
    p.page_stored("a", NS, &hashes(0..3)).unwrap();
    let end = RequestEnd {
        session_id: "b".into(),
        parent_session_id: Some("a".into()),
        ns: NS,
        input_length: 60,
        output_length: 5,
        hashes: hashes(0..2).into_iter().chain(hashes(50..52)).collect(),
    };
    let d = p.request_ended(&end).unwrap();
    assert_eq!(
        d.moves,
        vec![Move::Retain {
            ns: NS,
            hashes: hashes(0..2),
            priority: SHARED_PRIORITY,
            disown: true
        }]
    );
    let d = p.phase_changed("b", None, Phase::Ended, usage(0)).unwrap();
    assert_eq!(
        d.moves,
        vec![Move::Retain {
            ns: NS,
            hashes: hashes(50..52),
            priority: ENDED_PRIORITY,
            disown: false
        }]
    );
    assert_eq!(p.sessions().len(), 1, "the ended session is freed");
    assert_eq!(p.phase("b"), None);
}

#[test]
fn bad_ids_and_parent_cycles_are_refused_and_change_nothing() {
    let clock = SimClock::new();
    let mut p = policy(&clock);
    let long = "x".repeat(MAX_SESSION_ID_BYTES + 1);
    assert_eq!(
        p.phase_changed(&long, None, Phase::Acting, usage(0)),
        Err(SessionPolicyError::Table(SessionError::IdTooLong {
            len: MAX_SESSION_ID_BYTES + 1,
            max: MAX_SESSION_ID_BYTES
        }))
    );
    assert!(matches!(p.page_stored("a", NS, &[]), Ok(())));
    p.phase_changed("b", Some("a"), Phase::Reasoning, usage(0)).unwrap();
    p.phase_changed("c", Some("b"), Phase::Reasoning, usage(0)).unwrap();
    assert!(matches!(
        p.phase_changed("a2", Some("a2"), Phase::Reasoning, usage(0)),
        Err(SessionPolicyError::ParentCycle { .. })
    ));
    // "a" exists without a parent; giving it "c" as parent would close a -> c -> b -> a.
    assert!(matches!(
        p.phase_changed("a", Some("c"), Phase::Reasoning, usage(0)),
        Err(SessionPolicyError::ParentCycle { .. })
    ));
    assert_eq!(p.sessions().len(), 3);
    assert_eq!(p.sessions()[0].parent_session_id, None);
}

#[test]
fn exclusive_tiers_drop_the_host_copy_of_what_was_loaded() {
    let clock = SimClock::new();
    let mut p = SessionPolicy::new(
        SessionPolicyConfig {
            exclusive: true,
            ..SessionPolicyConfig::default()
        },
        clock,
    )
    .unwrap();
    let d = p.page_hit(Some("a"), NS, &hashes(0..4), 3);
    assert_eq!(
        d.moves,
        vec![Move::DropHost {
            ns: NS,
            hashes: hashes(0..3)
        }]
    );
    assert!(policy(&SimClock::new()).page_hit(None, NS, &hashes(0..4), 3).is_empty());
}

#[test]
fn idle_pages_go_first_only_where_a_pool_takes_them_and_ended_pages_always() {
    let clock = SimClock::new();
    let mut p = policy(&clock);
    let no_pool = Usage {
        pool: false,
        ..usage(10)
    };
    p.page_stored("a", NS, &hashes(0..4)).unwrap();
    // No pool: leaving host would drop what the agent's next turn reuses, so its pages
    // keep their place while it waits on a tool or is paused.
    let d = p.phase_changed("a", None, Phase::Acting, no_pool).unwrap();
    assert_eq!(d.classes, vec![class("a", SessionClass::Normal)]);
    let d = p.phase_changed("a", None, Phase::Paused, no_pool).unwrap();
    assert_eq!(d.classes, vec![class("a", SessionClass::Normal)]);
    let d = p.phase_changed("a", None, Phase::Reasoning, no_pool).unwrap();
    assert_eq!(d.classes, vec![class("a", SessionClass::Normal)]);
    // With a pool below host, idle pages go first (to the pool).
    let d = p.phase_changed("a", None, Phase::Acting, usage(10)).unwrap();
    assert_eq!(d.classes, vec![class("a", SessionClass::Idle)]);
    let d = p.phase_changed("a", None, Phase::Reasoning, usage(10)).unwrap();
    assert_eq!(d.classes, vec![class("a", SessionClass::Normal)]);
    // Ended: first, pool or not.
    let d = p.phase_changed("a", None, Phase::Ended, no_pool).unwrap();
    assert_eq!(d.classes, vec![class("a", SessionClass::Ended)]);
    // An idle timeout ends a session too, with the same class change.
    p.page_stored("b", NS, &hashes(10..12)).unwrap();
    clock.advance(SessionPolicyConfig::default().idle_timeout_ms);
    assert_eq!(p.tick(no_pool).classes, vec![class("b", SessionClass::Ended)]);
    // With the phases signal off, idle sessions' pages stay in the normal class; with
    // the ended signal off, so do ended ones'.
    let mut q = SessionPolicy::new(
        SessionPolicyConfig {
            signals: Signals {
                phases: false,
                ended: false,
                ..Signals::ALL
            },
            ..SessionPolicyConfig::default()
        },
        clock.clone(),
    )
    .unwrap();
    let d = q.phase_changed("c", None, Phase::Acting, usage(10)).unwrap();
    assert_eq!(d.classes, vec![class("c", SessionClass::Normal)]);
    let d = q.phase_changed("c", None, Phase::Ended, usage(10)).unwrap();
    assert_eq!(d.classes, vec![class("c", SessionClass::Normal)]);
}

/// A full table of idle (acting, paused) sessions frees the one idle longest for a new
/// session, and its pages go to the ended class; only when every session is active is
/// the new one refused with `Full`. Both are counted.
#[test]
fn a_full_table_frees_the_oldest_idle_session_and_refuses_only_when_all_are_active() {
    let clock = SimClock::new();
    let cfg = SessionPolicyConfig {
        max_sessions: 3,
        ..SessionPolicyConfig::default()
    };
    let mut p = SessionPolicy::new(cfg, clock.clone()).unwrap();
    for (i, id) in ["a", "b", "c"].into_iter().enumerate() {
        p.page_stored(id, NS, &hashes(i as u64 * 10..i as u64 * 10 + 2))
            .unwrap();
        clock.advance(10);
    }
    // "b" then "a" go idle: "b" is the one idle longest.
    p.phase_changed("b", None, Phase::Acting, usage(10)).unwrap();
    clock.advance(10);
    p.phase_changed("a", None, Phase::Paused, usage(10)).unwrap();
    clock.advance(10);
    let d = p.phase_changed("d", None, Phase::Reasoning, usage(10)).unwrap();
    assert_eq!(p.phase("b"), None, "the oldest idle session is freed");
    assert_eq!(p.phase("a"), Some(Phase::Paused));
    assert_eq!(p.phase("d"), Some(Phase::Reasoning));
    assert!(d.classes.contains(&class("b", SessionClass::Ended)), "{d:?}");
    assert_eq!(p.stats().sessions_freed_full, 1);
    // "a" idle, "c" and "d" active: "a" goes for "e"; then all are active.
    p.phase_changed("e", None, Phase::Reasoning, usage(10)).unwrap();
    assert_eq!(p.phase("a"), None);
    let refused = p.phase_changed("f", None, Phase::Reasoning, usage(10));
    assert!(
        matches!(refused, Err(SessionPolicyError::Table(SessionError::Full(3)))),
        "{refused:?}"
    );
    assert_eq!((p.stats().sessions_freed_full, p.stats().sessions_refused_full), (2, 1));
    assert_eq!(p.sessions().len(), 3);
}

#[test]
fn a_chain_that_never_branches_stops_at_its_bound_and_keeps_its_head() {
    let clock = SimClock::new();
    let mut p = policy(&clock);
    let batch = 4096u64;
    let n = MAX_CHAIN_PAGES as u64 / batch + 3;
    for i in 0..n {
        p.page_stored("long", NS, &hashes(i * batch..(i + 1) * batch)).unwrap();
    }
    assert_eq!(p.session("long").unwrap().pages, MAX_CHAIN_PAGES);
    // The head is what it was: a store from its second page on branches there.
    p.page_stored("long", NS, &hashes(1..3)).unwrap();
    assert_eq!(p.session("long").unwrap().pages, 3);
}
