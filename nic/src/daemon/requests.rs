//! The control API's requests (docs/nic.md): alloc/release/get/list/attach
//! of VFs and SG functions, SG links and scheduling, each answered with a
//! `Response`.

use super::*;

impl Nic {
    pub fn handle(&self, req: Request) -> Response {
        // Also for requests that did not come through `parse_request`.
        if let Err(e) = req.validate() {
            return Response::err(ErrorCode::BadRequest, e);
        }
        let _g = lock(&self.control);
        match req {
            Request::Alloc {
                pf,
                sandbox,
                kind: DevKind::Vf,
                mac,
                vlan,
            } => self.alloc(&pf, &sandbox, mac.as_deref(), vlan),
            Request::Alloc {
                pf,
                sandbox,
                kind: DevKind::Sg,
                mac,
                vlan,
            } => self.alloc_sg(&pf, &sandbox, mac.is_some() || vlan.is_some()),
            Request::Release { sandbox } => {
                // A sandbox may hold a VF and an SG function: both go.
                if let Some((_, sg, i)) = self.find_sg(&sandbox) {
                    sg.links.unlink_all(crate::sg::tenant_of(i));
                    if let Err(e) = sg.devset.release(i) {
                        return Response::err(ErrorCode::Internal, e.to_string());
                    }
                }
                if let Some((pf, i)) = self.find_sandbox(&sandbox) {
                    if let Err(e) = pf.devset.release(i) {
                        return Response::err(ErrorCode::Internal, e.to_string());
                    }
                    if pf.devset.snapshot()[i].0 == VfState::Free {
                        pf.ports[i].set_config(PortConfig {
                            mac: pf.ports[i].default_mac,
                            vlan: None,
                        });
                    }
                }
                match self.save() {
                    Ok(()) => Response::ok(),
                    Err(e) => Response::err(ErrorCode::Internal, e.to_string()),
                }
            }
            Request::SgLink { a, b } => self.sg_link(&a, &b),
            Request::SgSched {
                pf,
                policy,
                capacity,
            } => self.sg_sched(&pf, policy.as_deref(), capacity.as_deref()),
            Request::Get { sandbox, vf } => {
                let (found, what) = match (sandbox, vf) {
                    (Some(sb), None) => (
                        self.find_sandbox(&sb)
                            .map(|(pf, i)| {
                                let (st, owner) = pf.devset.snapshot().swap_remove(i);
                                self.info(pf, i, st, owner)
                            })
                            .or_else(|| {
                                self.find_sg(&sb).map(|(pf, sg, i)| {
                                    let (st, owner) = sg.devset.snapshot().swap_remove(i);
                                    self.sg_info(pf, sg, i, st, owner)
                                })
                            }),
                        format!("sandbox {sb:?} has no VF or SG function"),
                    ),
                    (None, Some(id)) => (
                        self.all().into_iter().find(|v| v.id == id),
                        format!("no VF {id:?}"),
                    ),
                    _ => {
                        return Response::err(
                            ErrorCode::BadRequest,
                            "get: give exactly one of \"sandbox\" or \"vf\"",
                        )
                    }
                };
                match found {
                    Some(v) => Response::with_vf(v),
                    None => Response::err(ErrorCode::NotFound, format!("get: {what}")),
                }
            }
            Request::List {} => Response::with_vfs(self.all()),
        }
    }

    /// The PF a request `op` names.
    pub(super) fn pf(&self, op: &str, pf_name: &str) -> Result<&Pf, Box<Response>> {
        self.pfs.iter().find(|p| p.name == pf_name).ok_or_else(|| {
            Box::new(Response::err(
                ErrorCode::UnknownPf,
                format!("{op}: unknown PF {pf_name:?}"),
            ))
        })
    }

    /// Links two sandboxes' SG functions (same PF) so they may connect.
    pub(super) fn sg_link(&self, a: &str, b: &str) -> Response {
        let ((pa, sg, ia), (pb, _, ib)) = match (self.find_sg(a), self.find_sg(b)) {
            (Some(x), Some(y)) => (x, y),
            (x, _) => {
                let sb = if x.is_none() { a } else { b };
                return Response::err(
                    ErrorCode::NotFound,
                    format!("sg_link: sandbox {sb:?} has no SG function"),
                );
            }
        };
        if pa.name != pb.name {
            return Response::err(
                ErrorCode::BadRequest,
                format!(
                    "sg_link: {a:?} is on PF {}, {b:?} on PF {}: a chain stays on one PF",
                    pa.name, pb.name
                ),
            );
        }
        sg.links
            .link(crate::sg::tenant_of(ia), crate::sg::tenant_of(ib));
        tracing::info!(
            "SG link {} <-> {} ({a} <-> {b})",
            sg.ports[ia].id,
            sg.ports[ib].id
        );
        Response::ok()
    }

    /// New policy and/or capacities for the SG device of `pf_name`, applied
    /// by its SG thread (woken here) before it serves the next event.
    pub(super) fn sg_sched(
        &self,
        pf_name: &str,
        policy: Option<&str>,
        capacity: Option<&str>,
    ) -> Response {
        let bad = |m: String| Response::err(ErrorCode::BadRequest, m);
        let pf = match self.pf("sg_sched", pf_name) {
            Ok(pf) => pf,
            Err(r) => return *r,
        };
        let Some(sg) = &pf.sg else {
            return bad(format!(
                "sg_sched: PF {pf_name} has no SG functions (--sgfs)"
            ));
        };
        let mut s = sg.sched();
        let (mut p, mut c) = s.want.unwrap_or(s.now);
        // Validated by `Request::validate`; parsed again here.
        if let Some(x) = policy {
            match x.parse() {
                Ok(v) => p = v,
                Err(e) => return bad(e),
            }
        }
        if let Some(x) = capacity {
            match x.parse() {
                Ok(v) => c = v,
                Err(e) => return bad(e),
            }
        }
        s.want = Some((p, c));
        drop(s);
        if let Err(e) = sg.wake.write(1) {
            return Response::err(
                ErrorCode::Internal,
                format!("sg_sched: wake PF {pf_name}: {e}"),
            );
        }
        Response::ok()
    }

    pub(super) fn alloc_sg(&self, pf_name: &str, sandbox: &str, net_fields: bool) -> Response {
        let bad = |m: String| Response::err(ErrorCode::BadRequest, m);
        let pf = match self.pf("alloc", pf_name) {
            Ok(pf) => pf,
            Err(r) => return *r,
        };
        if net_fields {
            return bad("alloc: an SG function has no \"mac\" or \"vlan\"".into());
        }
        let Some(sg) = &pf.sg else {
            return Response::err(
                ErrorCode::NoFreeVf,
                format!("alloc: PF {pf_name} has no SG functions (--sgfs)"),
            );
        };
        if let Some((_, sg, i)) = self.find_sg(sandbox) {
            return Response::err(
                ErrorCode::AlreadyAssigned,
                format!(
                    "alloc: sandbox {sandbox} already has SG function {}",
                    sg.ports[i].id
                ),
            );
        }
        let Some(i) = sg.devset.assign_any(sandbox) else {
            return Response::err(
                ErrorCode::NoFreeVf,
                format!("alloc: no free SG function on PF {pf_name}"),
            );
        };
        if let Err(e) = self.save() {
            let _ = sg.devset.release(i);
            return Response::err(ErrorCode::Internal, e.to_string());
        }
        let (st, sb) = sg.devset.snapshot().swap_remove(i);
        Response::with_vf(self.sg_info(pf, sg, i, st, sb))
    }

    pub(super) fn alloc(
        &self,
        pf_name: &str,
        sandbox: &str,
        mac: Option<&str>,
        vlan: Option<u16>,
    ) -> Response {
        let bad = |m: String| Response::err(ErrorCode::BadRequest, m);
        let pf = match self.pf("alloc", pf_name) {
            Ok(pf) => pf,
            Err(r) => return *r,
        };
        if let Some((p, i)) = self.find_sandbox(sandbox) {
            return Response::err(
                ErrorCode::AlreadyAssigned,
                format!("alloc: sandbox {sandbox} already has VF {}", p.ports[i].id),
            );
        }
        if let Some(v) = vlan {
            if !(1..=4094).contains(&v) {
                return bad(format!("alloc: vlan {v} out of range 1..4094"));
            }
        }
        let mac = match mac {
            None => None,
            Some(s) => match parse_mac(s) {
                Some(m) if m[0] & 1 == 0 && m != [0; 6] => Some(m),
                _ => {
                    return bad(format!(
                        "alloc: mac {s:?} is not a unicast MAC aa:bb:cc:dd:ee:ff"
                    ))
                }
            },
        };
        if let Some(m) = mac {
            let snap = pf.devset.snapshot();
            if pf
                .ports
                .iter()
                .enumerate()
                .any(|(i, p)| snap[i].1.is_some() && p.config().mac == m)
            {
                return bad(format!(
                    "alloc: mac {} already used by another VF of {pf_name}",
                    MacAddr::from(m)
                ));
            }
        }
        let Some(i) = pf.devset.assign_any(sandbox) else {
            return Response::err(
                ErrorCode::NoFreeVf,
                format!("alloc: no free VF on PF {pf_name}"),
            );
        };
        let port = &pf.ports[i];
        port.set_config(PortConfig {
            mac: mac.unwrap_or(port.default_mac),
            vlan,
        });
        if let Err(e) = self.save() {
            let _ = pf.devset.release(i);
            return Response::err(ErrorCode::Internal, e.to_string());
        }
        let (st, sb) = pf.devset.snapshot().swap_remove(i);
        Response::with_vf(self.info(pf, i, st, sb))
    }
}
