//! Eviction through the manager: pages a prefetch staged survive the next rounds until a
//! load takes them or their protection runs out, and a session's idle class decides who
//! goes first, with victims taken from the directory's lists.

use super::tests::{WAIT, fixture, hashes};
use super::*;
use crate::hints::{Hint, HintOutcome, HintTarget};
use crate::policy::Phase;
use crate::tier::TierKind;

fn host(f: &super::tests::Fixture, hs: &[PageHash]) -> Vec<bool> {
    hs.iter()
        .map(|h| {
            f.m.page_status(f.ns, h)
                .unwrap()
                .is_some_and(|s| s.tiers[TierKind::Host.index()].complete)
        })
        .collect()
}

#[test]
fn staged_pages_are_protected_until_loaded_or_their_ttl_ends() {
    // 40 host pages; 20 pages go to the pool and leave host.
    let f = fixture(1, 40, Some(128));
    let staged = hashes(0..20);
    let slots: Vec<u32> = (0..20).collect();
    f.store_all(&staged, &slots);
    let share = Hint::Share {
        target: HintTarget::Pages(staged.clone()),
    };
    assert_eq!(f.m.hint(f.ns, share).unwrap(), HintOutcome::Accepted { pages: 20 });
    assert!(f.m.quiesce(WAIT));
    f.m.removed(f.ns, 0, 0, &staged).unwrap();
    f.m.mover().make_host_room(usize::MAX);
    assert!(host(&f, &staged).iter().all(|&h| !h));
    // A prefetch stages them back, then newer stores fill host past its high watermark.
    let prefetch = Hint::Prefetch {
        target: HintTarget::Pages(staged.clone()),
        to: TierKind::Host,
        deadline_ms: None,
    };
    assert_eq!(f.m.hint(f.ns, prefetch).unwrap(), HintOutcome::Accepted { pages: 20 });
    let newer = hashes(100..120);
    for (i, chunk) in newer.chunks(10).enumerate() {
        let s: Vec<u32> = (20 + 10 * i as u32..30 + 10 * i as u32).collect();
        f.store_all(chunk, &s);
    }
    f.m.tick().unwrap();
    // The staged pages were the least recently used, yet all of them are still there;
    // the round took newer pages instead.
    assert!(host(&f, &staged).iter().all(|&h| h), "a staged page was evicted");
    let newer_left = host(&f, &newer).iter().filter(|&&h| h).count();
    assert!(
        newer_left < newer.len(),
        "nothing was evicted ({newer_left} newer pages left)"
    );
    // A load takes the first five: no longer protected, and just used.
    let t =
        f.m.load(f.ns, 0, 0, &staged[..5], &[60, 61, 62, 63, 59], LoadWait::WaitComplete)
            .unwrap();
    assert_eq!(f.m.wait(t, WAIT).unwrap().pages, 5);
    // The TTL ends for the rest: they were staged and never loaded, so they go first.
    f.clock.advance(f.m.tunables().stage_protect_ms + 1);
    f.m.mover().make_host_room(30);
    let after = host(&f, &staged);
    assert!(
        after[..5].iter().all(|&h| h),
        "loaded pages went before unloaded ones: {after:?}"
    );
    assert!(
        after[5..].iter().all(|&h| !h),
        "unloaded pages outlived their TTL: {after:?}"
    );
}

#[test]
fn an_idle_sessions_pages_go_first_and_come_back_to_normal_when_it_resumes() {
    let f = fixture(1, 40, None);
    let a = f.m.session_registry().index("agent-a").unwrap();
    let b = f.m.session_registry().index("agent-b").unwrap();
    let (ha, hb) = (hashes(0..8), hashes(8..16));
    for (hs, s, first) in [(&ha, a, 0u32), (&hb, b, 8)] {
        let slots: Vec<u32> = (first..first + 8).collect();
        let t = f.m.store(f.ns, 0, 0, hs, &slots, s).unwrap();
        assert_eq!(f.m.wait(t, WAIT).unwrap().pages, 8);
    }
    // b stored last, so by recency a's pages go first; b going idle puts b's first.
    f.m.session_registry()
        .changed(f.m.pages(), "agent-b", true, false)
        .unwrap();
    f.m.mover().make_host_room(2 * 4);
    assert_eq!(host(&f, &hb)[..4], [false; 4]);
    assert!(host(&f, &ha).iter().all(|&h| h));
    // Resumed: back to recency, where a's older pages lead.
    f.m.session_registry()
        .changed(f.m.pages(), "agent-b", false, false)
        .unwrap();
    f.m.mover().make_host_room(2 * 2);
    assert_eq!(host(&f, &ha)[..2], [false; 2]);
    assert!(host(&f, &hb)[4..].iter().all(|&h| h));
    // Ended: its pages are first again, and the table lists it as ended.
    f.m.session_registry()
        .changed(f.m.pages(), "agent-b", false, true)
        .unwrap();
    f.m.mover().make_host_room(2);
    assert!(!host(&f, &hb)[4]);
    let (rows, total) = f.m.session_registry().page(None, 0, 10);
    assert_eq!(total, 2);
    assert_eq!(
        rows,
        vec![("agent-a".to_owned(), false, false), ("agent-b".to_owned(), true, true)]
    );
    let long = "x".repeat(f.m.tunables().max_session_id_bytes + 1);
    assert!(matches!(
        f.m.session_registry().changed(f.m.pages(), &long, false, false),
        Err(ManagerError::Session(SessionError::IdTooLong { .. }))
    ));
}

#[test]
fn with_no_pool_the_policy_keeps_an_acting_sessions_pages_in_place_and_ended_ones_go_first() {
    // The session policy decides the class (the rule `kvtier replay` runs too): with no
    // pool, leaving host drops a page, so an acting session's pages keep their place by
    // recency; an ended session's go first.
    let f = fixture(1, 40, None);
    assert!(
        f.m.session_policy().stats().is_some(),
        "the fixture runs the session policy"
    );
    let a = f.m.session_registry().index("agent-a").unwrap();
    let b = f.m.session_registry().index("agent-b").unwrap();
    let (ha, hb) = (hashes(0..8), hashes(8..16));
    for (hs, s, first) in [(&ha, a, 0u32), (&hb, b, 8)] {
        let slots: Vec<u32> = (first..first + 8).collect();
        let t = f.m.store(f.ns, 0, 0, hs, &slots, s).unwrap();
        assert_eq!(f.m.wait(t, WAIT).unwrap().pages, 8);
    }
    // b waits on a tool: a's older pages still go first.
    f.m.session_policy()
        .phase(&f.m, "agent-b", None, Phase::Acting)
        .unwrap();
    assert_eq!(
        f.m.session_registry().page(None, 0, 10).0[1],
        ("agent-b".to_owned(), true, false)
    );
    f.m.mover().make_host_room(2 * 2);
    assert_eq!(host(&f, &ha)[..2], [false; 2]);
    assert!(host(&f, &hb).iter().all(|&h| h));
    // Ended: b's newer pages go before a's.
    f.m.session_policy().phase(&f.m, "agent-b", None, Phase::Ended).unwrap();
    f.m.mover().make_host_room(2 * 3);
    assert_eq!(host(&f, &hb)[..3], [false; 3]);
    assert!(host(&f, &ha)[2..].iter().all(|&h| h));
}
