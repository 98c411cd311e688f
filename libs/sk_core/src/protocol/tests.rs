//! Codec tests: hand-written byte fixtures from the layout tables, and property tests
//! (round-trips, random and mutated bytes never panic, bounded allocation).

use proptest::prelude::*;

use super::*;

fn encode_pa(msg: &ProposerAcceptorMessage) -> Bytes {
    let mut buf = BytesMut::new();
    msg.encode(&mut buf).expect("test messages are encodable");
    buf.freeze()
}

fn encode_ap(msg: &AcceptorProposerMessage) -> Bytes {
    let mut buf = BytesMut::new();
    msg.encode(&mut buf).expect("test messages are encodable");
    buf.freeze()
}

fn tenant() -> TenantId {
    "de200bd42b49cc1814412c7e592dd6e9".parse().unwrap()
}

fn timeline() -> TimelineId {
    "0102030405060708090a0b0c0d0e0f10".parse().unwrap()
}

// ----- fixtures ------------------------------------------------------------------------------

#[test]
fn vote_request_matches_fixture() {
    let bytes: &[u8] = &[
        b'v', // tag
        0, 0, 0, 7, // generation
        0, 0, 0, 0, 0, 0, 0, 5, // term
    ];
    let msg = ProposerAcceptorMessage::VoteRequest(VoteRequest {
        generation: Generation(7),
        term: Term(5),
    });
    assert_eq!(&encode_pa(&msg)[..], bytes);
    assert_eq!(
        ProposerAcceptorMessage::decode(&Bytes::from_static(bytes)),
        Ok(msg)
    );
}

#[test]
fn greeting_matches_fixture() {
    let mut bytes = vec![b'g'];
    bytes.extend_from_slice(b"de200bd42b49cc1814412c7e592dd6e9\0");
    bytes.extend_from_slice(b"0102030405060708090a0b0c0d0e0f10\0");
    bytes.extend_from_slice(&[
        0, 0, 0, 1, // generation
        0, 0, 0, 1, // n_members
        0, 0, 0, 0, 0, 0, 0, 9, // node id
        b'h', b'1', 0, // host
        0x15, 0x4e, // pg_port 5454
        0, 0, 0, 0, // n_new_members
        0, 2, 0x98, 0x54, // pg_version 170068
        0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, // system_id
        0x01, 0, 0, 0, // wal_seg_size 16 MiB
    ]);
    let msg = ProposerAcceptorMessage::Greeting(ProposerGreeting {
        tenant_id: tenant(),
        timeline_id: timeline(),
        mconf: Configuration {
            generation: Generation(1),
            members: vec![SafekeeperId {
                id: NodeId(9),
                host: "h1".into(),
                pg_port: 5454,
            }],
            new_members: None,
        },
        pg_version: 170068,
        system_id: 0x1122334455667788,
        wal_seg_size: 16 << 20,
    });
    assert_eq!(&encode_pa(&msg)[..], &bytes[..]);
    assert_eq!(
        ProposerAcceptorMessage::decode(&Bytes::from(bytes)),
        Ok(msg)
    );
}

#[test]
fn elected_matches_fixture() {
    let bytes: &[u8] = &[
        b'e', //
        0, 0, 0, 0, // generation
        0, 0, 0, 0, 0, 0, 0, 3, // term
        0, 0, 0, 0, 0x01, 0x00, 0x00, 0x28, // start_streaming_at 0/1000028
        0, 0, 0, 2, // n entries
        0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0x01, 0, 0, 0, // (1, 0/1000000)
        0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0x01, 0, 0, 0x28, // (3, 0/1000028)
    ];
    let msg = ProposerAcceptorMessage::Elected(ProposerElected {
        generation: Generation(0),
        term: Term(3),
        start_streaming_at: Lsn(0x0100_0028),
        term_history: TermHistory(vec![
            TermLsn {
                term: Term(1),
                lsn: Lsn(0x0100_0000),
            },
            TermLsn {
                term: Term(3),
                lsn: Lsn(0x0100_0028),
            },
        ]),
    });
    assert_eq!(&encode_pa(&msg)[..], bytes);
    assert_eq!(
        ProposerAcceptorMessage::decode(&Bytes::from_static(bytes)),
        Ok(msg)
    );
}

#[test]
fn append_request_matches_fixture_and_borrows_the_frame() {
    let bytes: &[u8] = &[
        b'a', //
        0, 0, 0, 2, // generation
        0, 0, 0, 0, 0, 0, 0, 4, // term
        0, 0, 0, 0, 0, 0, 0x10, 0x00, // begin
        0, 0, 0, 0, 0, 0, 0x10, 0x03, // end
        0, 0, 0, 0, 0, 0, 0x0f, 0x00, // commit
        0, 0, 0, 0, 0, 0, 0x0e, 0x00, // truncate
        0xaa, 0xbb, 0xcc, // WAL
    ];
    let frame = Bytes::from_static(bytes);
    let msg = ProposerAcceptorMessage::decode(&frame).unwrap();
    let ProposerAcceptorMessage::AppendRequest(a) = &msg else {
        panic!("expected an append, got {msg:?}");
    };
    assert_eq!(
        a.h,
        AppendRequestHeader {
            generation: Generation(2),
            term: Term(4),
            begin_lsn: Lsn(0x1000),
            end_lsn: Lsn(0x1003),
            commit_lsn: Lsn(0xf00),
            truncate_lsn: Lsn(0xe00),
        }
    );
    assert_eq!(&a.wal_data[..], &[0xaa, 0xbb, 0xcc]);
    // Zero-copy: the payload points into the frame.
    assert_eq!(a.wal_data.as_ptr(), frame[45..].as_ptr());
    assert_eq!(&encode_pa(&msg)[..], bytes);
}

#[test]
fn acceptor_greeting_matches_fixture() {
    let bytes: &[u8] = &[
        b'g', //
        0, 0, 0, 0, 0, 0, 0, 2, // node_id
        0, 0, 0, 5, // generation
        0, 0, 0, 1, // n_members
        0, 0, 0, 0, 0, 0, 0, 2, b's', b'k', b'2', 0, 0x15, 0x4e, // (2, "sk2", 5454)
        0, 0, 0, 1, // n_new_members (joint configuration)
        0, 0, 0, 0, 0, 0, 0, 3, b's', b'k', b'3', 0, 0x15, 0x4f, // (3, "sk3", 5455)
        0, 0, 0, 0, 0, 0, 0, 9, // term
    ];
    let member = |id: u64, port: u16| SafekeeperId {
        id: NodeId(id),
        host: format!("sk{id}"),
        pg_port: port,
    };
    let msg = AcceptorProposerMessage::Greeting(AcceptorGreeting {
        node_id: NodeId(2),
        mconf: Configuration {
            generation: Generation(5),
            members: vec![member(2, 5454)],
            new_members: Some(vec![member(3, 5455)]),
        },
        term: Term(9),
    });
    assert_eq!(&encode_ap(&msg)[..], bytes);
    assert_eq!(
        AcceptorProposerMessage::decode(&Bytes::from_static(bytes)),
        Ok(msg)
    );
}

#[test]
fn vote_response_matches_fixture() {
    let bytes: &[u8] = &[
        b'v', //
        0, 0, 0, 1, // generation
        0, 0, 0, 0, 0, 0, 0, 6, // term
        1, // vote_given
        0, 0, 0, 0, 0, 0, 0x20, 0x00, // flush
        0, 0, 0, 0, 0, 0, 0x18, 0x00, // truncate
        0, 0, 0, 1, // n entries
        0, 0, 0, 0, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0x10, 0x00, // (5, 0/1000)
    ];
    let msg = AcceptorProposerMessage::VoteResponse(VoteResponse {
        generation: Generation(1),
        term: Term(6),
        vote_given: true,
        flush_lsn: Lsn(0x2000),
        truncate_lsn: Lsn(0x1800),
        term_history: TermHistory(vec![TermLsn {
            term: Term(5),
            lsn: Lsn(0x1000),
        }]),
    });
    assert_eq!(&encode_ap(&msg)[..], bytes);
    assert_eq!(
        AcceptorProposerMessage::decode(&Bytes::from_static(bytes)),
        Ok(msg)
    );
}

#[test]
fn append_response_with_feedback_matches_fixture() {
    let mut bytes = vec![
        b'a', //
        0, 0, 0, 0, // generation
        0, 0, 0, 0, 0, 0, 0, 2, // term
        0, 0, 0, 0, 0, 0, 0x30, 0x00, // flush
        0, 0, 0, 0, 0, 0, 0x20, 0x00, // commit
        0, 0, 0, 0, 0, 0, 0, 0, // hs ts
        0, 0, 0, 0, 0, 0, 0, 0, // hs xmin
        0, 0, 0, 0, 0, 0, 0, 0, // hs catalog_xmin
        7, // nkeys
    ];
    let mut kv = |key: &str, val: &[u8]| {
        bytes.extend_from_slice(key.as_bytes());
        bytes.push(0);
        bytes.extend_from_slice(&(val.len() as i32).to_be_bytes());
        bytes.extend_from_slice(val);
    };
    kv("current_timeline_size", &[0, 0, 0, 0, 0, 0, 0, 1]);
    kv("ps_writelsn", &[0, 0, 0, 0, 0, 0, 0, 2]);
    kv("ps_flushlsn", &[0, 0, 0, 0, 0, 0, 0, 3]);
    kv("ps_applylsn", &[0, 0, 0, 0, 0, 0, 0, 4]);
    kv("ps_replytime", &[0, 0, 0, 0, 0, 0, 0, 5]);
    kv("shard_number", &[0, 0, 0, 6]);
    kv("corruption_detected", &[1]);
    let msg = AcceptorProposerMessage::AppendResponse(AppendResponse {
        generation: Generation(0),
        term: Term(2),
        flush_lsn: Lsn(0x3000),
        commit_lsn: Lsn(0x2000),
        hs_feedback: HotStandbyFeedback::default(),
        pageserver_feedback: Some(PageserverFeedback {
            current_timeline_size: 1,
            last_received_lsn: Lsn(2),
            disk_consistent_lsn: Lsn(3),
            remote_consistent_lsn: Lsn(4),
            replytime: 5,
            shard_number: 6,
            corruption_detected: true,
        }),
    });
    assert_eq!(&encode_ap(&msg)[..], &bytes[..]);
    assert_eq!(
        AcceptorProposerMessage::decode(&Bytes::from(bytes)),
        Ok(msg)
    );
}

#[test]
fn feedback_skips_unknown_keys() {
    let mut bytes = encode_ap(&AcceptorProposerMessage::AppendResponse(
        AppendResponse::term_only(Generation(0), Term(1)),
    ))
    .to_vec();
    bytes.push(2);
    bytes.extend_from_slice(b"future_key\0\0\0\0\x03xyz");
    bytes.extend_from_slice(b"ps_writelsn\0\0\0\0\x08\0\0\0\0\0\0\0\x09");
    let AcceptorProposerMessage::AppendResponse(r) =
        AcceptorProposerMessage::decode(&Bytes::from(bytes)).unwrap()
    else {
        panic!("expected an append response");
    };
    assert_eq!(r.pageserver_feedback.unwrap().last_received_lsn, Lsn(9));
}

// ----- structural rejections -----------------------------------------------------------------

fn append_bytes(begin: u64, end: u64, wal_len: usize) -> Vec<u8> {
    let mut b = vec![b'a', 0, 0, 0, 0];
    for v in [1u64, begin, end, 0, 0] {
        b.extend_from_slice(&v.to_be_bytes());
    }
    b.extend(std::iter::repeat_n(0x55, wal_len));
    b
}

#[test]
fn append_with_trailing_garbage_is_rejected() {
    let b = append_bytes(100, 104, 5);
    assert_eq!(
        ProposerAcceptorMessage::decode(&Bytes::from(b)),
        Err(DecodeError::Read(ReadError::TrailingBytes(1)))
    );
}

#[test]
fn append_with_end_before_begin_is_rejected() {
    let b = append_bytes(100, 99, 0);
    assert!(matches!(
        ProposerAcceptorMessage::decode(&Bytes::from(b)),
        Err(DecodeError::EndBeforeBegin { .. })
    ));
}

#[test]
fn append_larger_than_max_send_size_is_rejected_before_reading() {
    let b = append_bytes(0, MAX_SEND_SIZE as u64 + 1, 0);
    assert!(matches!(
        ProposerAcceptorMessage::decode(&Bytes::from(b)),
        Err(DecodeError::AppendTooLarge { .. })
    ));
    let b = append_bytes(0, MAX_SEND_SIZE as u64, MAX_SEND_SIZE);
    assert!(ProposerAcceptorMessage::decode(&Bytes::from(b)).is_ok());
}

#[test]
fn short_append_payload_is_truncated_error() {
    let b = append_bytes(0, 10, 9);
    assert!(matches!(
        ProposerAcceptorMessage::decode(&Bytes::from(b)),
        Err(DecodeError::Read(ReadError::Truncated { .. }))
    ));
}

#[test]
fn unknown_tag_and_empty_frame_are_rejected() {
    assert_eq!(
        ProposerAcceptorMessage::decode(&Bytes::from_static(b"z")),
        Err(DecodeError::UnknownTag(b'z'))
    );
    assert_eq!(
        ProposerAcceptorMessage::decode(&Bytes::new()),
        Err(DecodeError::Empty)
    );
    assert_eq!(
        AcceptorProposerMessage::decode(&Bytes::from_static(b"e")),
        Err(DecodeError::UnknownTag(b'e'))
    );
}

fn greeting_with(mconf_bytes: &[u8]) -> Bytes {
    let mut b = vec![b'g'];
    b.extend_from_slice(b"de200bd42b49cc1814412c7e592dd6e9\0");
    b.extend_from_slice(b"0102030405060708090a0b0c0d0e0f10\0");
    b.extend_from_slice(mconf_bytes);
    b.extend_from_slice(&[0; 16]);
    Bytes::from(b)
}

#[test]
fn membership_with_generation_but_no_members_is_rejected() {
    let b = greeting_with(&[0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0, 0]);
    assert_eq!(
        ProposerAcceptorMessage::decode(&b),
        Err(DecodeError::EmptyMembership(Generation(3)))
    );
}

#[test]
fn duplicate_member_ids_are_rejected() {
    let mut m = vec![0, 0, 0, 1, 0, 0, 0, 2];
    for _ in 0..2 {
        m.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 4, b'x', 0, 0, 1]);
    }
    m.extend_from_slice(&[0, 0, 0, 0]);
    assert_eq!(
        ProposerAcceptorMessage::decode(&greeting_with(&m)),
        Err(DecodeError::DuplicateMember(NodeId(4)))
    );
}

#[test]
fn huge_member_count_is_rejected_before_allocating() {
    let b = greeting_with(&[0, 0, 0, 1, 0xff, 0xff, 0xff, 0xff]);
    assert!(matches!(
        ProposerAcceptorMessage::decode(&b),
        Err(DecodeError::Read(ReadError::TooMany { .. }))
    ));
}

#[test]
fn bad_tenant_id_is_rejected() {
    let mut b = vec![b'g'];
    b.extend_from_slice(b"not-hex\0");
    assert!(matches!(
        ProposerAcceptorMessage::decode(&Bytes::from(b)),
        Err(DecodeError::InvalidId { .. })
    ));
}

#[test]
fn disordered_term_history_is_rejected() {
    let mut b = vec![b'e', 0, 0, 0, 0];
    b.extend_from_slice(&[0; 16]);
    b.extend_from_slice(&[0, 0, 0, 2]);
    for (t, l) in [(3u64, 10u64), (2, 20)] {
        b.extend_from_slice(&t.to_be_bytes());
        b.extend_from_slice(&l.to_be_bytes());
    }
    assert!(matches!(
        ProposerAcceptorMessage::decode(&Bytes::from(b)),
        Err(DecodeError::TermHistory(_))
    ));
}

#[test]
fn internal_messages_are_never_encoded() {
    let mut buf = BytesMut::new();
    assert!(ProposerAcceptorMessage::FlushWAL.encode(&mut buf).is_err());
    let a = AppendRequest {
        h: AppendRequestHeader {
            generation: Generation(0),
            term: Term(1),
            begin_lsn: Lsn(1),
            end_lsn: Lsn(1),
            commit_lsn: Lsn(0),
            truncate_lsn: Lsn(0),
        },
        wal_data: Bytes::new(),
    };
    assert!(
        ProposerAcceptorMessage::NoFlushAppendRequest(a)
            .encode(&mut buf)
            .is_err()
    );
    assert!(buf.is_empty());
}

// ----- property tests ------------------------------------------------------------------------

fn arb_history() -> impl Strategy<Value = TermHistory> {
    prop::collection::vec((1u64..1000, 0u64..1 << 20), 0..8).prop_map(|steps| {
        let (mut term, mut lsn) = (0u64, 0u64);
        TermHistory(
            steps
                .into_iter()
                .map(|(dt, dl)| {
                    term += dt;
                    lsn += dl;
                    TermLsn {
                        term: Term(term),
                        lsn: Lsn(lsn),
                    }
                })
                .collect(),
        )
    })
}

fn arb_members() -> impl Strategy<Value = Vec<SafekeeperId>> {
    prop::collection::btree_map(any::<u64>(), ("[a-z0-9.-]{0,20}", any::<u16>()), 0..5).prop_map(
        |m| {
            m.into_iter()
                .map(|(id, (host, pg_port))| SafekeeperId {
                    id: NodeId(id),
                    host,
                    pg_port,
                })
                .collect()
        },
    )
}

fn arb_mconf() -> impl Strategy<Value = Configuration> {
    (any::<u32>(), arb_members(), arb_members()).prop_map(|(g, mut members, new)| {
        if members.is_empty() && g != 0 {
            members.push(SafekeeperId {
                id: NodeId(1),
                host: "h".into(),
                pg_port: 1,
            });
        }
        Configuration {
            generation: Generation(g),
            members,
            new_members: (!new.is_empty()).then_some(new),
        }
    })
}

fn arb_append() -> impl Strategy<Value = AppendRequest> {
    (
        any::<(u32, u64, u64, u64, u64)>(),
        prop::collection::vec(any::<u8>(), 0..300),
    )
        .prop_map(|((g, t, begin, c, tr), data)| {
            let begin = begin % (u64::MAX / 2);
            AppendRequest {
                h: AppendRequestHeader {
                    generation: Generation(g),
                    term: Term(t),
                    begin_lsn: Lsn(begin),
                    end_lsn: Lsn(begin + data.len() as u64),
                    commit_lsn: Lsn(c),
                    truncate_lsn: Lsn(tr),
                },
                wal_data: Bytes::from(data),
            }
        })
}

fn arb_pa() -> impl Strategy<Value = ProposerAcceptorMessage> {
    prop_oneof![
        (
            any::<[u8; 16]>(),
            any::<[u8; 16]>(),
            arb_mconf(),
            any::<(u32, u64, u32)>()
        )
            .prop_map(|(t, tl, mconf, (pg_version, system_id, wal_seg_size))| {
                ProposerAcceptorMessage::Greeting(ProposerGreeting {
                    tenant_id: TenantId(t),
                    timeline_id: TimelineId(tl),
                    mconf,
                    pg_version,
                    system_id,
                    wal_seg_size,
                })
            }),
        any::<(u32, u64)>().prop_map(|(g, t)| ProposerAcceptorMessage::VoteRequest(VoteRequest {
            generation: Generation(g),
            term: Term(t),
        })),
        (any::<(u32, u64, u64)>(), arb_history()).prop_map(|((g, t, s), term_history)| {
            ProposerAcceptorMessage::Elected(ProposerElected {
                generation: Generation(g),
                term: Term(t),
                start_streaming_at: Lsn(s),
                term_history,
            })
        }),
        arb_append().prop_map(ProposerAcceptorMessage::AppendRequest),
    ]
}

fn arb_feedback() -> impl Strategy<Value = PageserverFeedback> {
    any::<(u64, u64, u64, u64, i64, u32, bool)>().prop_map(|(s, w, f, a, t, shard, c)| {
        PageserverFeedback {
            current_timeline_size: s,
            last_received_lsn: Lsn(w),
            disk_consistent_lsn: Lsn(f),
            remote_consistent_lsn: Lsn(a),
            replytime: t,
            shard_number: shard,
            corruption_detected: c,
        }
    })
}

fn arb_ap() -> impl Strategy<Value = AcceptorProposerMessage> {
    prop_oneof![
        (any::<u64>(), arb_mconf(), any::<u64>()).prop_map(|(n, mconf, t)| {
            AcceptorProposerMessage::Greeting(AcceptorGreeting {
                node_id: NodeId(n),
                mconf,
                term: Term(t),
            })
        }),
        (any::<(u32, u64, bool, u64, u64)>(), arb_history()).prop_map(
            |((g, t, v, f, tr), term_history)| {
                AcceptorProposerMessage::VoteResponse(VoteResponse {
                    generation: Generation(g),
                    term: Term(t),
                    vote_given: v,
                    flush_lsn: Lsn(f),
                    truncate_lsn: Lsn(tr),
                    term_history,
                })
            }
        ),
        (
            any::<(u32, u64, u64, u64, i64, u64, u64)>(),
            prop::option::of(arb_feedback())
        )
            .prop_map(|((g, t, f, c, ts, x, cx), pageserver_feedback)| {
                AcceptorProposerMessage::AppendResponse(AppendResponse {
                    generation: Generation(g),
                    term: Term(t),
                    flush_lsn: Lsn(f),
                    commit_lsn: Lsn(c),
                    hs_feedback: HotStandbyFeedback {
                        ts,
                        xmin: x,
                        catalog_xmin: cx,
                    },
                    pageserver_feedback,
                })
            }),
    ]
}

/// Heap bytes a decoded message holds (capacities, not lengths), excluding a zero-copy WAL
/// slice, which shares the input frame.
fn heap_of_mconf(c: &Configuration) -> usize {
    let members = |m: &Vec<SafekeeperId>| {
        m.capacity() * std::mem::size_of::<SafekeeperId>()
            + m.iter().map(|s| s.host.capacity()).sum::<usize>()
    };
    members(&c.members) + c.new_members.as_ref().map(members).unwrap_or(0)
}

fn heap_of_history(h: &TermHistory) -> usize {
    h.0.capacity() * std::mem::size_of::<TermLsn>()
}

fn heap_of_pa(m: &ProposerAcceptorMessage) -> usize {
    match m {
        ProposerAcceptorMessage::Greeting(g) => heap_of_mconf(&g.mconf),
        ProposerAcceptorMessage::Elected(e) => heap_of_history(&e.term_history),
        _ => 0,
    }
}

fn heap_of_ap(m: &AcceptorProposerMessage) -> usize {
    match m {
        AcceptorProposerMessage::Greeting(g) => heap_of_mconf(&g.mconf),
        AcceptorProposerMessage::VoteResponse(v) => heap_of_history(&v.term_history),
        AcceptorProposerMessage::AppendResponse(_) => 0,
    }
}

/// The most heap a decoded message may hold per input byte: a member is ≥ 11 bytes on the wire
/// and `size_of::<SafekeeperId>()` in memory; a history entry is 16 bytes in both.
fn allowed_heap(input_len: usize) -> usize {
    let per_member = std::mem::size_of::<SafekeeperId>().div_ceil(MIN_MEMBER_BYTES) + 1;
    input_len * per_member.max(1)
}

proptest! {
    #[test]
    fn proposer_messages_round_trip(msg in arb_pa()) {
        let bytes = encode_pa(&msg);
        let decoded = ProposerAcceptorMessage::decode(&bytes);
        prop_assert_eq!(decoded, Ok(msg));
    }

    #[test]
    fn acceptor_messages_round_trip(msg in arb_ap()) {
        let bytes = encode_ap(&msg);
        let decoded = AcceptorProposerMessage::decode(&bytes);
        prop_assert_eq!(decoded, Ok(msg));
    }

    #[test]
    fn random_bytes_never_panic_and_allocate_in_proportion(
        tag in prop::sample::select(b"gvaez\0".to_vec()),
        body in prop::collection::vec(any::<u8>(), 0..400),
    ) {
        let mut frame = vec![tag];
        frame.extend_from_slice(&body);
        let frame = Bytes::from(frame);
        if let Ok(m) = ProposerAcceptorMessage::decode(&frame) {
            prop_assert!(heap_of_pa(&m) <= allowed_heap(frame.len()));
        }
        if let Ok(m) = AcceptorProposerMessage::decode(&frame) {
            prop_assert!(heap_of_ap(&m) <= allowed_heap(frame.len()));
        }
    }

    #[test]
    fn mutated_valid_frames_never_panic(
        msg in arb_pa(),
        reply in arb_ap(),
        cut in any::<prop::sample::Index>(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
    ) {
        for mut bytes in [encode_pa(&msg).to_vec(), encode_ap(&reply).to_vec()] {
            for (at, v) in &flips {
                let i = at.index(bytes.len());
                bytes[i] ^= v;
            }
            // Every prefix (truncation) and the mutated frame itself.
            let len = bytes.len();
            for frame in [bytes.clone(), bytes[..cut.index(len)].to_vec()] {
                let frame = Bytes::from(frame);
                if let Ok(m) = ProposerAcceptorMessage::decode(&frame) {
                    prop_assert!(heap_of_pa(&m) <= allowed_heap(frame.len()));
                }
                if let Ok(m) = AcceptorProposerMessage::decode(&frame) {
                    prop_assert!(heap_of_ap(&m) <= allowed_heap(frame.len()));
                }
            }
        }
    }
}

#[test]
fn every_prefix_of_a_valid_frame_is_a_clean_error() {
    let msg = ProposerAcceptorMessage::Greeting(ProposerGreeting {
        tenant_id: tenant(),
        timeline_id: timeline(),
        mconf: Configuration {
            generation: Generation(2),
            members: vec![SafekeeperId {
                id: NodeId(1),
                host: "a".into(),
                pg_port: 1,
            }],
            new_members: Some(vec![SafekeeperId {
                id: NodeId(2),
                host: "b".into(),
                pg_port: 2,
            }]),
        },
        pg_version: 150000,
        system_id: 1,
        wal_seg_size: 1 << 24,
    });
    let bytes = encode_pa(&msg);
    for n in 0..bytes.len() {
        assert!(ProposerAcceptorMessage::decode(&bytes.slice(..n)).is_err());
    }
}
