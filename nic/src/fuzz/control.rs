//! Fuzz body (d): control requests from local clients, answered as the
//! control server answers them, and their seeds.

use super::scratch_dir;
use crate::control::server::answer;
use crate::daemon::Nic;
use crate::devset::LockPolicy;
use nic_api::{parse_request, Request, Response};

/// Request lines, each answered by a fresh daemon state (two PFs, four VFs),
/// exactly as the control server answers them. Every answer serializes and
/// parses back; every accepted request round-trips and is valid; the devset
/// invariants hold after each request.
pub fn fuzz_control_request(data: &[u8]) {
    let dir = scratch_dir("ctl");
    if std::fs::create_dir_all(&dir).is_err() {
        return;
    }
    let nic = Nic::new(
        &[("pf0".into(), 3), ("pf1".into(), 1)],
        LockPolicy::Hierarchical,
        &dir,
        dir.join("nic-state.json"),
        // SG functions too, so `alloc` of kind sg is fuzzed beside VFs.
        &crate::sg::SgConfig {
            sgfs: 1,
            ..Default::default()
        },
    )
    .expect("a fresh daemon state");
    let mut handle = |r: Request| nic.handle(r);
    for line in data.split(|&b| b == b'\n').take(64) {
        if let Some(resp) = answer(line, &mut handle) {
            assert!(resp.ok != resp.code.is_some(), "{resp:?}");
            let text = serde_json::to_string(&resp).expect("responses serialize");
            assert!(!text.contains('\n'), "a response spans lines: {text}");
            let back: Response = serde_json::from_str(&text).expect("responses parse");
            assert_eq!(back, resp);
        }
        if let Ok(req) = parse_request(line.trim_ascii()) {
            req.validate().expect("parse_request validates");
            let again = serde_json::to_vec(&req).expect("requests serialize");
            assert_eq!(parse_request(&again).ok(), Some(req));
        }
        for pf in &nic.pfs {
            pf.devset.check_invariants().expect("devset invariants");
            for (_, sb) in pf.devset.snapshot() {
                if let Some(id) = sb {
                    assert_eq!(nic_api::sandbox_id_problem(&id), None);
                }
            }
        }
    }
    drop(nic);
    let _ = std::fs::remove_dir_all(&dir);
}

pub fn control_seeds() -> Vec<Vec<u8>> {
    let lines: &[&[u8]] = &[
        br#"{"op":"list"}"#,
        br#"{"op":"alloc","pf":"pf0","sandbox":"a"}"#,
        b"{\"op\":\"alloc\",\"pf\":\"pf0\",\"sandbox\":\"a\"}\n{\"op\":\"alloc\",\"pf\":\"pf0\",\"sandbox\":\"a\"}\n{\"op\":\"get\",\"sandbox\":\"a\"}\n{\"op\":\"release\",\"sandbox\":\"a\"}\n{\"op\":\"list\"}",
        br#"{"op":"alloc","pf":"pf0","sandbox":"b","mac":"02:11:22:33:44:55","vlan":12}"#,
        br#"{"op":"alloc","pf":"pf0","sandbox":"b","mac":"01:11:22:33:44:55"}"#,
        br#"{"op":"alloc","pf":"pf0","sandbox":"b","vlan":4095}"#,
        br#"{"op":"alloc","pf":"pf9","sandbox":"b"}"#,
        br#"{"op":"get","vf":"0000:b1:00.1"}"#,
        br#"{"op":"get","vf":"0000:b2:00.0","sandbox":"x"}"#,
        br#"{"op":"get"}"#,
        br#"{"op":"release","sandbox":"nobody"}"#,
        br#"{"op":"list","extra":1}"#,
        br#"{"op":"alloc","pf":"pf0","sandbox":"a\u0000b"}"#,
        br#"{"op":"alloc","pf":"pf0","sandbox":"a/b"}"#,
        br#"{"op":"alloc","pf":"pf0","sandbox":"a\nb"}"#,
        b"{\"op\":\"alloc\",\"pf\":\"pf0\",\"sandbox\":\"\xff\"}",
        b"{\"op\":\"list\"}\r\n\r\n   \n{",
        br#"{"op":"explode"}"#,
        br#"[1,2,3]"#,
        br#"{"op":"alloc","pf":"pf0","sandbox":"s1"}
{"op":"alloc","pf":"pf0","sandbox":"s2"}
{"op":"alloc","pf":"pf0","sandbox":"s3"}
{"op":"alloc","pf":"pf0","sandbox":"s4"}
{"op":"alloc","pf":"pf1","sandbox":"s4","mac":"02:00:00:00:00:09"}
{"op":"release","sandbox":"s2"}
{"op":"alloc","pf":"pf0","sandbox":"s5","mac":"02:42:bf:00:00:00"}"#,
        br#"{"op":"alloc","pf":"pf0","sandbox":"sss","mac":"02:42:bf:00:00:00"}"#,
        br#"{"op":"alloc","pf":"pf0","sandbox":"\u00e4\u00f6\u00fc"}"#,
        br#"{"op":"alloc","pf":"","sandbox":"x"}"#,
        br#"{"op":"alloc","pf":"pf0","sandbox":"x","vlan":-1}"#,
        br#"{"op":"alloc","pf":"pf0","sandbox":"x","vlan":1e3}"#,
        br#"{"op":"alloc","pf":"pf0","sandbox":"x","mac":null}"#,
        br#"{"op":"release"}"#,
        br#"{"op":"release","sandbox":1}"#,
        br#"{"sandbox":"x"}"#,
        br#"{"op":"list","op":"get"}"#,
    ];
    lines.iter().map(|l| l.to_vec()).collect()
}
