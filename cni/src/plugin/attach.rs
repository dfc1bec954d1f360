//! ADD (take a VF or SG function from the NIC, the placeholder link and
//! IPAM, undone on any failure) and DEL (give everything back, idempotent).

use super::*;

/// A free device of the first of the network's PFs that has one: a PF with
/// none free is skipped; any other refusal ends the search.
fn take_device(nic: &mut Client, conf: &NetConf, cid: &str) -> Result<Vf, ClientError> {
    let mut last = None;
    for pf in &conf.pfs {
        let r = match conf.kind {
            DevKind::Vf => nic.alloc(pf, cid, conf.mac.as_deref(), conf.vlan),
            DevKind::Sg => nic.alloc_sg(pf, cid),
        };
        match r {
            Err(
                e @ ClientError::Refused {
                    code: Some(ErrorCode::NoFreeVf),
                    ..
                },
            ) => last = Some(e),
            r => return r,
        }
    }
    Err(last.expect("a network names at least one PF (config::pf_list)"))
}

pub(super) fn add(env: &Env, conf: &NetConf) -> Result<Value, PluginError> {
    let cid = env.container_id()?;
    let netns_path = env.netns()?;
    let ifname = env.ifname()?;
    let ipam = ipam_of(env, conf)?;
    let ns =
        Netns::open(netns_path).map_err(|e| PluginError::invalid_env_caused("CNI_NETNS", e))?;
    if ns
        .is_current()
        .map_err(|e| PluginError::invalid_env_caused("CNI_NETNS", e))?
    {
        return Err(PluginError::invalid_env(
            "CNI_NETNS",
            format!(
                "{} is the plugin's own network namespace",
                netns_path.display()
            ),
        ));
    }
    let mut nic = connect(conf)?;
    let vf = match take_device(&mut nic, conf, cid) {
        Ok(vf) => vf,
        Err(e) => {
            if e.is_lost() {
                // The daemon may have stored the alloc before it died; a
                // daemon already back releases it now, else the runtime's DEL does.
                if let Err(r) = connect(conf).and_then(|mut n| n.release(cid).map_err(nic_error)) {
                    eprintln!("burstvm-cni ADD cleanup: releasing the device of {cid}: {r}");
                }
            }
            return Err(nic_error(e));
        }
    };
    let result = match conf.kind {
        DevKind::Vf => add_with_vf(env, conf, &ns, ifname, &vf, ipam.as_ref()),
        DevKind::Sg => Ok(sg_result(conf, &ns, ifname, &vf)),
    };
    if result.is_err() {
        // Leave nothing behind: IPAM DEL (spec §4), then give the VF back.
        if let Some(i) = &ipam {
            if let Err(e) = i.call(env, conf, Command::Del) {
                eprintln!("burstvm-cni ADD cleanup: {e}");
            }
        }
        if let Err(e) = nic.release(cid) {
            eprintln!("burstvm-cni ADD cleanup: releasing the device of {cid}: {e}");
        }
    }
    result
}

fn add_with_vf(
    env: &Env,
    conf: &NetConf,
    ns: &Netns,
    ifname: &str,
    vf: &Vf,
    ipam: Option<&Ipam>,
) -> Result<Value, PluginError> {
    let mac = vf.mac.ok_or_else(|| {
        PluginError::new(
            code::IO_FAILURE,
            "NIC daemon sent a bad VF",
            format!("VF {} has no MAC", vf.id),
        )
    })?;
    let ipam_result = match ipam {
        None => CniResult::default(),
        Some(i) => i.add(env, conf)?,
    };
    let gateway = |v4: bool| {
        ipam_result
            .ips
            .iter()
            .filter(|i| i.address.addr.is_ipv4() == v4)
            .find_map(|i| i.gateway)
    };
    let addresses: Vec<_> = ipam_result.ips.iter().map(|i| i.address).collect();
    let routes: Vec<RouteSpec> = ipam_result
        .routes
        .iter()
        .map(|r| RouteSpec {
            dst: r.dst,
            gw: r.gw.or_else(|| gateway(r.dst.addr.is_ipv4())),
            mtu: r.mtu,
            advmss: r.advmss,
            priority: r.priority,
            table: r.table,
            scope: r.scope,
        })
        .collect();
    let (_, mtu) =
        placeholder::create(ns, ifname, &vf.id, mac, &addresses, &routes).map_err(link_error)?;

    // Chained after another plugin: extend its result (spec §2 ADD).
    let mut result = conf.prev_result.clone().unwrap_or_default();
    let index = result.interfaces.len();
    result.interfaces.push(Interface {
        name: ifname.into(),
        mac: Some(mac.to_string()),
        mtu: Some(mtu),
        sandbox: Some(ns.path().display().to_string()),
        socket_path: Some(vf.socket.display().to_string()),
        pci_id: Some(vf.id.clone()),
        kind: None,
    });
    result.ips.extend(ipam_result.ips.into_iter().map(|mut ip| {
        ip.interface = Some(index);
        ip
    }));
    result.routes.extend(ipam_result.routes);
    if ipam_result
        .dns
        .as_ref()
        .is_some_and(|d| d.as_object().is_some_and(|o| !o.is_empty()))
    {
        result.dns = ipam_result.dns;
    }
    Ok(result.to_json(conf.version))
}

/// An SG function has no link, MAC or address (config.rs refuses `ipam`
/// with it): the interface names its vhost-user socket and the SGF's id.
fn sg_result(conf: &NetConf, ns: &Netns, ifname: &str, sgf: &Vf) -> Value {
    let mut result = conf.prev_result.clone().unwrap_or_default();
    result.interfaces.push(Interface {
        name: ifname.into(),
        mac: None,
        mtu: None,
        sandbox: Some(ns.path().display().to_string()),
        socket_path: Some(sgf.socket.display().to_string()),
        pci_id: Some(sgf.id.clone()),
        kind: Some("sg".into()),
    });
    result.to_json(conf.version)
}

/// Best effort and idempotent: every step runs, the first error is returned.
pub(super) fn del(env: &Env, conf: &NetConf) -> Result<(), PluginError> {
    let cid = env.container_id()?;
    let ifname = env.ifname()?;
    let mut errors = Vec::new();
    match ipam_of(env, conf) {
        Ok(Some(i)) => {
            if let Err(e) = i.call(env, conf, Command::Del) {
                errors.push(e);
            }
        }
        Ok(None) => {}
        // Still release what is ours; the runtime retries DEL with a fixed environment.
        Err(e) => errors.push(e),
    }
    if let Err(e) = connect(conf).and_then(|mut nic| nic.release(cid).map_err(nic_error)) {
        errors.push(e);
    }
    if let Some(netns) = env.netns_opt() {
        if let Err(e) = placeholder::remove(netns, ifname) {
            errors.push(link_error(e));
        }
    }
    for e in errors.iter().skip(1) {
        eprintln!("burstvm-cni DEL: also: {e}");
    }
    errors.into_iter().next().map_or(Ok(()), Err)
}
