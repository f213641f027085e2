//! The master client's tests: the wire format byte for byte, split batches, deadlines
//! for whole calls, and the back-off after a reply this client does not speak.

use super::*;

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// The request the wheel 0.3.13.post1 sent for `batch_is_exist(["cap_key_a", "cap_key_b"])`,
/// captured on loopback.
#[test]
fn request_matches_the_wheel_byte_for_byte() {
    let want = hex(concat!(
        "1500000006000000b0a69fb82a00000000000000",
        "638df70004fd84800c800cff00",
        "02096361705f6b65795f61096361705f6b65795f62",
        "0764656661756c74"
    ));
    assert_eq!(encode_request(6, &["cap_key_a", "cap_key_b"]).unwrap(), want);
}

/// 300 keys need two-byte lengths everywhere (meta 0x0c), as the wheel sent them.
#[test]
fn long_batches_use_two_byte_lengths() {
    let keys: Vec<String> = (0..300).map(|i| format!("k{i:03}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let f = encode_request(1, &refs).unwrap();
    assert_eq!(&f[..8], &hex("1500000001000000")[..]);
    assert_eq!(
        u32::from_le_bytes(f[12..16].try_into().unwrap()) as usize,
        f.len() - REQ_HEAD
    );
    assert_eq!(&f[20..33], &hex("638df7000cfd84800c800cff00")[..]);
    assert_eq!(&f[33..43], &hex("2c0104006b3030300400")[..]);
    assert!(f.ends_with(&hex("070064656661756c74")));
}

#[test]
fn replies_decode_to_one_answer_per_key() {
    // The master's reply to the two-key request: present, absent.
    let body = hex("5d8c5f2a0484870b01000201010100");
    assert_eq!(decode_response(&body, 2).unwrap(), vec![Ok(true), Ok(false)]);
    // An error for the second key (OBJECT_NOT_FOUND would be -704: 0x40fdffff).
    let body = hex("5d8c5f2a0484870b01000201010040fdffff");
    assert_eq!(decode_response(&body, 2).unwrap(), vec![Ok(true), Err(-704)]);
    // Two-byte lengths: 300 answers.
    let mut body = hex("5d8c5f2a0c84870b01002c01");
    body.extend(std::iter::repeat_n([1u8, 1], 300).flatten());
    let got = decode_response(&body, 300).unwrap();
    assert_eq!(got.len(), 300);
    assert!(got.iter().all(|a| *a == Ok(true)));
}

#[test]
fn foreign_replies_are_refused() {
    let good = hex("5d8c5f2a0484870b01000201010100");
    assert!(decode_response(&good, 3).unwrap_err().contains("2 answers to 3 keys"));
    let mut other_hash = good.clone();
    other_hash[1] ^= 0x10;
    assert!(decode_response(&other_hash, 2).unwrap_err().contains("type hash"));
    let mut other_type = good.clone();
    other_type[7] = 0x02;
    assert!(decode_response(&other_type, 2).unwrap_err().contains("type string"));
    assert!(
        decode_response(&good[..good.len() - 1], 2)
            .unwrap_err()
            .contains("reply ends")
    );
    let mut trailing = good.clone();
    trailing.push(0);
    assert!(decode_response(&trailing, 2).unwrap_err().contains("after the answers"));
}

/// A master that never answers costs one timeout, not a hang; one that is not there is
/// an I/O error at once.
#[test]
fn silent_and_absent_masters_are_io_errors() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let rpc = MasterRpc::new(&addr, Duration::from_millis(200));
    let t = std::time::Instant::now();
    assert!(matches!(rpc.batch_exists(&["a"]), Err(RpcError::Io { .. })));
    assert!(t.elapsed() < Duration::from_secs(5));
    drop(l);
    let rpc = MasterRpc::new(&addr, Duration::from_millis(200));
    assert!(matches!(rpc.batch_exists(&["a"]), Err(RpcError::Io { .. })));
}

/// A `ServiceReady` reply to the request whose header is `head`, naming `v`.
fn version_reply(head: &[u8; REQ_HEAD], v: &str) -> Vec<u8> {
    let mut body = version::VERSION_HASH.to_le_bytes().to_vec();
    body.push(META_TYPE_INFO);
    body.extend_from_slice(version::VERSION_TYPE);
    body.extend_from_slice(&[1, v.len() as u8]);
    body.extend_from_slice(v.as_bytes());
    let mut reply = vec![MAGIC, 0, 0, 0];
    reply.extend_from_slice(&head[4..8]);
    reply.extend_from_slice(&(body.len() as u32).to_le_bytes());
    reply.extend_from_slice(&0u32.to_le_bytes());
    reply.extend_from_slice(&body);
    reply
}

/// The wheel 0.3.13.post1's first request on a new connection (`ServiceReady`), and its
/// master's reply, captured on loopback: version `2.0.0`.
#[test]
fn service_ready_matches_the_wheel_byte_for_byte() {
    assert_eq!(
        version::encode_request(0),
        hex("150000000000000056bb817b0000000000000000")
    );
    let reply = hex("1500000000000000110000000000000035ccb31c0487800c01000105322e302e30");
    let head: [u8; RESP_HEAD] = reply[..RESP_HEAD].try_into().unwrap();
    let body = reply_body(&head, 0, reply[RESP_HEAD..].to_vec()).unwrap();
    assert_eq!(version::decode_reply(&body).unwrap(), Ok("2.0.0".to_string()));
    let mut err = version::VERSION_HASH.to_le_bytes().to_vec();
    err.push(META_TYPE_INFO);
    err.extend_from_slice(version::VERSION_TYPE);
    err.extend_from_slice(&[0, 0x40, 0xfd, 0xff, 0xff]);
    assert_eq!(version::decode_reply(&err).unwrap(), Err(-704));
    let mut other = body.clone();
    other[5] = 0x88;
    assert!(version::decode_reply(&other).unwrap_err().contains("type string"));
    assert!(version::check("m", "2.0.0").is_ok());
}

/// A master of a version this client does not know is refused before any query goes out
/// on the connection, with a typed error that names the version; blocking and awaited.
#[test]
fn an_unknown_master_version_is_refused_by_name() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let server = std::thread::spawn(move || {
        let mut functions = Vec::new();
        for _ in 0..2 {
            let (mut s, _) = l.accept().unwrap();
            let mut head = [0u8; REQ_HEAD];
            while s.read_exact(&mut head).is_ok() {
                functions.push(u32::from_le_bytes(head[8..12].try_into().unwrap()));
                let len = u32::from_le_bytes(head[12..16].try_into().unwrap()) as usize;
                let mut body = vec![0u8; len];
                s.read_exact(&mut body).unwrap();
                s.write_all(&version_reply(&head, "9.9.9")).unwrap();
            }
        }
        functions
    });
    let rpc = MasterRpc::new(&addr, Duration::from_secs(5));
    let e = rpc.batch_exists(&["a", "b"]).unwrap_err();
    assert!(
        matches!(&e, RpcError::Version { version, .. } if version == "9.9.9"),
        "{e}"
    );
    assert!(e.to_string().contains("version 9.9.9"), "{e}");
    assert_eq!(rpc.master_version().as_deref(), Some("9.9.9"));
    #[cfg(feature = "daemon")]
    {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let e = rt.block_on(rpc.batch_exists_async(&["a"])).unwrap_err();
        assert!(
            matches!(&e, RpcError::Version { version, .. } if version == "9.9.9"),
            "{e}"
        );
    }
    #[cfg(not(feature = "daemon"))]
    drop(std::net::TcpStream::connect(&addr));
    drop(rpc);
    // Only ServiceReady was asked: no BatchExistKey reached the unknown master.
    let asked = server.join().unwrap();
    assert!(
        !asked.is_empty() && asked.iter().all(|&f| f == version::FN_SERVICE_READY),
        "{asked:x?}"
    );
}

/// A stand-in master that answers `BatchExistKey` for real: a key exists when it ends
/// in `y`. Serves `conns` connections, each until it closes.
fn fake_master(conns: usize) -> (String, std::thread::JoinHandle<usize>) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let serve = move |mut s: TcpStream| -> usize {
        let mut asked = 0;
        loop {
            let mut head = [0u8; REQ_HEAD];
            if s.read_exact(&mut head).is_err() {
                return asked;
            }
            if u32::from_le_bytes(head[8..12].try_into().unwrap()) == version::FN_SERVICE_READY {
                s.write_all(&version_reply(&head, "2.0.0")).unwrap();
                continue;
            }
            assert_eq!(u32::from_le_bytes(head[8..12].try_into().unwrap()), FN_BATCH_EXIST_KEY);
            let len = u32::from_le_bytes(head[12..16].try_into().unwrap()) as usize;
            let mut body = vec![0u8; len];
            s.read_exact(&mut body).unwrap();
            assert_eq!(&body[..4], &ARGS_HASH.to_le_bytes());
            let width = [1, 2, 4, 8][((body[4] >> 3) & 3) as usize];
            let mut r = Reader {
                buf: &body,
                at: 5 + ARGS_TYPE.len(),
            };
            let n = r.uint(width).unwrap() as usize;
            let mut payload = vec![n as u8];
            for _ in 0..n {
                let k = r.uint(width).unwrap() as usize;
                let key = r.take(k).unwrap();
                payload.extend_from_slice(&[1, (key.last() == Some(&b'y')) as u8]);
            }
            asked += n;
            let mut reply = vec![MAGIC, 0, 0, 0];
            reply.extend_from_slice(&head[4..8]);
            reply.extend_from_slice(&((payload.len() + 10) as u32).to_le_bytes());
            reply.extend_from_slice(&0u32.to_le_bytes());
            reply.extend_from_slice(&RESULT_HASH.to_le_bytes());
            reply.push(META_TYPE_INFO);
            reply.extend_from_slice(RESULT_TYPE);
            reply.extend_from_slice(&payload);
            s.write_all(&reply).unwrap();
        }
    };
    let h = std::thread::spawn(move || {
        let workers: Vec<_> = (0..conns)
            .map(|_| {
                let (s, _) = l.accept().unwrap();
                std::thread::spawn(move || serve(s))
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).sum()
    });
    (addr, h)
}

#[test]
fn batches_split_into_at_most_four_requests_of_64_keys_or_more() {
    let keys: Vec<String> = (0..1000).map(|i| i.to_string()).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let sizes = |n: usize| split(&refs[..n]).map(<[&str]>::len).collect::<Vec<_>>();
    assert_eq!(sizes(1), vec![1]);
    assert_eq!(sizes(127), vec![127]);
    assert_eq!(sizes(128), vec![64, 64]);
    assert_eq!(sizes(200), vec![67, 67, 66]);
    assert_eq!(sizes(256), vec![64; 4]);
    assert_eq!(sizes(1000), vec![250; 4]);
}

/// A long batch is asked as three requests on three connections; the answers come back
/// in key order, and the connections serve the next query.
#[test]
fn split_batches_answer_in_key_order() {
    let (addr, master) = fake_master(3);
    let rpc = MasterRpc::new(&addr, Duration::from_secs(5));
    let keys: Vec<String> = (0..200)
        .map(|i| format!("k{i}{}", if i % 3 == 0 { "y" } else { "n" }))
        .collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    for _ in 0..2 {
        let got = rpc.batch_exists(&refs).unwrap();
        let want: Vec<Result<bool, i64>> = (0..200).map(|i| Ok(i % 3 == 0)).collect();
        assert_eq!(got, want);
    }
    assert_eq!(
        rpc.batch_exists(&refs[..5]).unwrap(),
        vec![Ok(true), Ok(false), Ok(false), Ok(true), Ok(false)]
    );
    drop(rpc);
    assert_eq!(master.join().unwrap(), 2 * 200 + 5);
}

/// The awaited query asks and answers the same, on a single-threaded runtime like the
/// daemon's control plane, and a master that is gone is an I/O error.
#[cfg(feature = "daemon")]
#[test]
fn awaited_queries_answer_like_blocking_ones() {
    let (addr, master) = fake_master(4);
    let rpc = MasterRpc::new(&addr, Duration::from_secs(5));
    let keys: Vec<String> = (0..300)
        .map(|i| format!("key{i}{}", if i % 4 == 1 { "y" } else { "n" }))
        .collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for _ in 0..2 {
        let got = rt.block_on(rpc.batch_exists_async(&refs)).unwrap();
        assert_eq!(got, (0..300).map(|i| Ok(i % 4 == 1)).collect::<Vec<_>>());
    }
    drop(rpc);
    assert_eq!(master.join().unwrap(), 600);
    let gone = MasterRpc::new(&addr, Duration::from_millis(300));
    assert!(matches!(
        rt.block_on(gone.batch_exists_async(&refs[..3])),
        Err(RpcError::Io { .. })
    ));
}

/// A peer that answers with an RPC error (a master of another build) is a protocol error.
#[test]
fn rpc_errors_are_protocol_errors() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let server = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut head = [0u8; REQ_HEAD];
        s.read_exact(&mut head).unwrap();
        let len = u32::from_le_bytes(head[12..16].try_into().unwrap()) as usize;
        let mut body = vec![0u8; len];
        s.read_exact(&mut body).unwrap();
        let msg = b"function not registered";
        let mut reply = vec![MAGIC, 0, 4, 0];
        reply.extend_from_slice(&head[4..8]);
        reply.extend_from_slice(&(msg.len() as u32).to_le_bytes());
        reply.extend_from_slice(&0u32.to_le_bytes());
        reply.extend_from_slice(msg);
        s.write_all(&reply).unwrap();
    });
    let rpc = MasterRpc::new(&addr, Duration::from_secs(2));
    let e = rpc.batch_exists(&["a", "b"]).unwrap_err();
    assert!(
        matches!(&e, RpcError::Protocol { why, .. } if why.contains("RPC error 4")),
        "{e}"
    );
    server.join().unwrap();
}

/// A master that reads each request and trickles a reply one byte per `every`, for ever.
fn trickling_master(every: Duration) -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            std::thread::spawn(move || {
                let mut head = [0u8; REQ_HEAD];
                if s.read_exact(&mut head).is_err() {
                    return;
                }
                // A header that announces a 1,000-byte body, then the body a byte at a time.
                let mut reply = vec![MAGIC, 0, 0, 0];
                reply.extend_from_slice(&head[4..8]);
                reply.extend_from_slice(&60u32.to_le_bytes());
                reply.extend_from_slice(&0u32.to_le_bytes());
                reply.extend(std::iter::repeat_n(0u8, 60));
                for b in reply {
                    if s.write_all(&[b]).is_err() {
                        return;
                    }
                    std::thread::sleep(every);
                }
            });
        }
    });
    addr
}

/// One deadline for the whole call: a reply trickled a byte every 50 ms (76 bytes, about
/// 4 s in all) fails at the 300 ms op timeout, not per read; blocking and awaited alike.
#[test]
fn a_trickled_reply_ends_at_the_calls_deadline() {
    let addr = trickling_master(Duration::from_millis(50));
    let rpc = MasterRpc::new(&addr, Duration::from_millis(300));
    let t = Instant::now();
    let e = rpc.batch_exists(&["a"]).unwrap_err();
    assert!(
        matches!(&e, RpcError::Io { source, .. } if source.kind() == io::ErrorKind::TimedOut),
        "{e}"
    );
    assert!(t.elapsed() < Duration::from_millis(1500), "{:?}", t.elapsed());
    #[cfg(feature = "daemon")]
    {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let t = Instant::now();
        let e = rt.block_on(rpc.batch_exists_async(&["a"])).unwrap_err();
        assert!(matches!(e, RpcError::Io { .. }), "{e}");
        assert!(t.elapsed() < Duration::from_millis(1500), "{:?}", t.elapsed());
    }
}

/// A reply this client does not speak sends queries to the helper for a back-off that
/// doubles while it repeats; once the back-off passes the master is asked again.
#[test]
fn a_bad_reply_backs_off_and_the_master_is_asked_again() {
    let mut rpc = MasterRpc::new("127.0.0.1:1", Duration::from_millis(100));
    rpc.backoff = Duration::from_millis(40);
    let e = RpcError::Protocol {
        addr: "x".into(),
        why: "garbled".into(),
    };
    assert!(!rpc.refused());
    rpc.refuse(&e);
    assert!(rpc.refused(), "backing off");
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut first = Duration::ZERO;
    let t = Instant::now();
    while rpc.refused() {
        assert!(Instant::now() < deadline, "the back-off never ended");
        std::thread::yield_now();
        first = t.elapsed();
    }
    // A second bad reply in a row: twice as long.
    let t = Instant::now();
    rpc.refuse(&e);
    while rpc.refused() {
        assert!(Instant::now() < deadline, "the back-off never ended");
        std::thread::yield_now();
    }
    assert!(
        t.elapsed() >= Duration::from_millis(80),
        "{:?} after {first:?}",
        t.elapsed()
    );
    // A good answer starts the back-off over.
    rpc.answered();
    rpc.refuse(&e);
    let t = Instant::now();
    while rpc.refused() {
        std::thread::yield_now();
    }
    assert!(t.elapsed() < Duration::from_millis(80) + Duration::from_millis(500));
    assert_eq!(rpc.refusals.load(Ordering::Relaxed), 1);
}
