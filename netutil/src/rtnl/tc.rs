//! Traffic control: an ingress qdisc and a match-all u32 filter whose mirred
//! action redirects every frame arriving on one link out of another — how
//! Kata's `tcfilter` model joins a CNI veth and the VMM's tap (both ways).

use std::io;

use netlink_packet_core::{NLM_F_CREATE, NLM_F_EXCL};
use netlink_packet_route::tc::{
    TcAction, TcActionAttribute, TcActionGeneric, TcActionMirrorOption, TcActionOption,
    TcActionType, TcAttribute, TcFilterU32Option, TcHandle, TcHeader, TcMessage, TcMirror,
    TcMirrorActionType, TcOption, TcU32Key, TcU32Selector, TcU32SelectorFlags,
};
use netlink_packet_route::RouteNetlinkMessage;

use super::Rtnl;

/// ETH_P_ALL in network byte order, as tc puts it in the low half of `info`.
const PROTO_ALL: u32 = (libc::ETH_P_ALL as u16).to_be() as u32;
/// The filter's priority (`tc filter ... prio 1`).
const PRIO: u32 = 1;

fn msg(
    index: u32,
    handle: TcHandle,
    parent: TcHandle,
    info: u32,
    attrs: Vec<TcAttribute>,
) -> TcMessage {
    let header = TcHeader {
        index: index as i32,
        handle,
        parent,
        info,
        ..Default::default()
    };
    TcMessage::from_parts(header, attrs)
}

/// The ingress qdisc's handle `ffff:`.
const INGRESS_HANDLE: TcHandle = TcHandle {
    major: 0xffff,
    minor: 0,
};

impl Rtnl {
    /// `tc qdisc add dev <index> handle ffff: ingress` (present already: fine).
    pub fn add_ingress_qdisc(&mut self, index: u32) -> io::Result<()> {
        let m = msg(
            index,
            INGRESS_HANDLE,
            TcHandle::INGRESS,
            0,
            vec![TcAttribute::Kind("ingress".into())],
        );
        match self.call(
            RouteNetlinkMessage::NewQueueDiscipline(m),
            NLM_F_CREATE | NLM_F_EXCL,
        ) {
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(()),
            r => r.map(|_| ()),
        }
    }

    /// `tc filter add dev <from> parent ffff: protocol all prio 1 u32 match
    /// u8 0 0 action mirred egress redirect dev <to>` (Kata's filter; u32
    /// rather than matchall, which not every kernel has); adds the ingress
    /// qdisc first.
    pub fn redirect_ingress(&mut self, from: u32, to: u32) -> io::Result<()> {
        self.add_ingress_qdisc(from)?;
        let mut generic = TcActionGeneric::default();
        // A redirect consumes the frame (tc's default for `redirect`).
        generic.action = TcActionType::Stolen;
        let mut mirror = TcMirror::default();
        mirror.generic = generic;
        mirror.eaction = TcMirrorActionType::EgressRedir;
        mirror.ifindex = to;
        let mut action = TcAction::default();
        action.attributes = vec![
            TcActionAttribute::Kind("mirred".into()),
            TcActionAttribute::Options(vec![TcActionOption::Mirror(TcActionMirrorOption::Parms(
                mirror,
            ))]),
        ];
        // One key with mask 0: every frame matches.
        let mut match_all = TcU32Selector::default();
        match_all.flags = TcU32SelectorFlags::Terminal;
        match_all.nkeys = 1;
        match_all.keys = vec![TcU32Key::default()];
        let m = msg(
            from,
            TcHandle::UNSPEC,
            INGRESS_HANDLE,
            (PRIO << 16) | PROTO_ALL,
            vec![
                TcAttribute::Kind("u32".into()),
                TcAttribute::Options(vec![
                    TcOption::U32(TcFilterU32Option::Selector(match_all)),
                    TcOption::U32(TcFilterU32Option::Action(vec![action])),
                ]),
            ],
        );
        self.call(
            RouteNetlinkMessage::NewTrafficFilter(m),
            NLM_F_CREATE | NLM_F_EXCL,
        )
        .map(|_| ())
    }

    /// The links frames arriving on `index` are redirected to by mirred
    /// filters under its ingress qdisc.
    pub fn ingress_redirects(&mut self, index: u32) -> io::Result<Vec<u32>> {
        let m = msg(index, TcHandle::UNSPEC, INGRESS_HANDLE, 0, Vec::new());
        let replies = self.call(
            RouteNetlinkMessage::GetTrafficFilter(m),
            netlink_packet_core::NLM_F_DUMP,
        )?;
        let mut out = Vec::new();
        for r in replies {
            let RouteNetlinkMessage::NewTrafficFilter(f) = r else {
                continue;
            };
            for a in &f.attributes {
                let TcAttribute::Options(opts) = a else {
                    continue;
                };
                for o in opts {
                    let TcOption::U32(TcFilterU32Option::Action(acts)) = o else {
                        continue;
                    };
                    for act in acts {
                        for aa in &act.attributes {
                            let TcActionAttribute::Options(ao) = aa else {
                                continue;
                            };
                            for x in ao {
                                if let TcActionOption::Mirror(TcActionMirrorOption::Parms(p)) = x {
                                    out.push(p.ifindex);
                                }
                            }
                        }
                    }
                }
            }
        }
        Ok(out)
    }
}
