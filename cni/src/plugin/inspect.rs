//! CHECK (the container's VF, link and addresses still match the previous
//! result), STATUS (the NIC can take an ADD) and GC (release what no valid
//! attachment names).

use super::*;

pub(super) fn check(env: &Env, conf: &NetConf) -> Result<(), PluginError> {
    let cid = env.container_id()?;
    let netns = env.netns()?;
    let ifname = env.ifname()?;
    let ipam = ipam_of(env, conf)?;
    let prev = conf.prev_result.as_ref().ok_or_else(|| {
        PluginError::invalid_config("prevResult", "CHECK needs the result of ADD")
    })?;
    let netns_str = netns.display().to_string();
    let (index, iface) = prev
        .interfaces
        .iter()
        .enumerate()
        .find(|(_, i)| i.name == ifname && i.sandbox.as_deref() == Some(netns_str.as_str()))
        .ok_or_else(|| {
            check_failed(format!(
                "prevResult has no interface {ifname} in {netns_str}"
            ))
        })?;

    if let Some(i) = &ipam {
        i.call(env, conf, Command::Check)?;
    }

    let vf = assigned_vf(&mut connect(conf)?, cid)
        .map_err(nic_error)?
        .ok_or_else(|| check_failed(format!("the NIC has no VF assigned to container {cid}")))?;
    if vf.state == VfState::Free || vf.sandbox.as_deref() != Some(cid) {
        return Err(check_failed(format!(
            "the NIC says VF {} is {:?} for {:?}, not assigned to {cid}",
            vf.id, vf.state, vf.sandbox
        )));
    }
    if vf.kind != conf.kind {
        return Err(check_failed(format!(
            "the NIC assigned {} of kind {:?} to {cid}, the config asks for {:?}",
            vf.id, vf.kind, conf.kind
        )));
    }
    if conf.kind == DevKind::Sg {
        // No link and no address to compare: the socket is the attachment.
        return match iface.socket_path.as_deref() {
            Some(s) if Path::new(s) == vf.socket && iface.pci_id.as_deref() == Some(&vf.id) => {
                Ok(())
            }
            s => Err(check_failed(format!(
                "prevResult has socketPath {s:?} and pciID {:?}, the NIC has {} for SG function {}",
                iface.pci_id,
                vf.socket.display(),
                vf.id
            ))),
        };
    }
    let vf_mac = vf
        .mac
        .ok_or_else(|| check_failed(format!("the NIC reports no MAC for VF {}", vf.id)))?;
    if iface.pci_id.as_deref().is_some_and(|p| p != vf.id) {
        return Err(check_failed(format!(
            "prevResult has pciID {:?}, the NIC has VF {}",
            iface.pci_id, vf.id
        )));
    }
    if iface
        .socket_path
        .as_deref()
        .is_some_and(|s| Path::new(s) != vf.socket)
    {
        return Err(check_failed(format!(
            "prevResult has socketPath {:?}, the NIC has {}",
            iface.socket_path,
            vf.socket.display()
        )));
    }
    if iface
        .mac
        .as_deref()
        .is_some_and(|m| parse_mac(m) != Some(vf_mac))
    {
        return Err(check_failed(format!(
            "prevResult has MAC {:?}, VF {} has {}",
            iface.mac, vf.id, vf_mac
        )));
    }

    let ph = placeholder::read_placeholder(netns, ifname)
        .map_err(|e| PluginError::caused(code::CHECK_FAILED, CHECK_FAILED_MSG, e))?;
    if ph.vf_id != vf.id {
        return Err(check_failed(format!(
            "{ifname} in {netns_str} names VF {:?}, the NIC assigned {}",
            ph.vf_id, vf.id
        )));
    }
    if ph.mac != vf_mac {
        return Err(check_failed(format!(
            "{ifname} in {netns_str} has MAC {}, VF {} has {}",
            ph.mac_string(),
            vf.id,
            vf_mac
        )));
    }
    for ip in prev.ips.iter().filter(|ip| ip.interface == Some(index)) {
        if !ph.addresses.contains(&ip.address) {
            return Err(check_failed(format!(
                "{ifname} in {netns_str} lacks address {}",
                ip.address
            )));
        }
    }
    Ok(())
}

pub(super) fn status(env: &Env, conf: &NetConf) -> Result<(), PluginError> {
    const UNAVAILABLE: &str = "burstvm-cni cannot serve ADD";
    let unavailable = |details: String| PluginError::new(code::NOT_AVAILABLE, UNAVAILABLE, details);
    let vfs = Client::connect_with_timeout(&conf.nic_socket, conf.nic_timeout)
        .and_then(|mut n| n.list())
        .map_err(|e| PluginError::caused(code::NOT_AVAILABLE, UNAVAILABLE, e))?;
    let of_pf: Vec<&Vf> = vfs
        .iter()
        .filter(|v| conf.pfs.contains(&v.pf) && v.kind == conf.kind)
        .collect();
    let pfs = conf.pfs.join(", ");
    if of_pf.is_empty() {
        return Err(unavailable(format!(
            "the NIC at {} has no PF of {pfs} with {:?} devices",
            conf.nic_socket.display(),
            conf.kind
        )));
    }
    if !of_pf.iter().any(|v| v.state == VfState::Free) {
        return Err(unavailable(format!(
            "all {} VFs of {pfs} are assigned",
            of_pf.len(),
        )));
    }
    if let Some(i) = ipam_of(env, conf)? {
        i.call(env, conf, Command::Status)?;
    }
    Ok(())
}

/// Releases every VF of the network's PFs whose container is not in the valid
/// attachments (a PF belongs to one network), then GCs the IPAM plugin.
pub(super) fn gc(env: &Env, conf: &NetConf) -> Result<(), PluginError> {
    let ipam = ipam_of(env, conf)?;
    let valid: HashSet<&str> = conf
        .valid_attachments
        .iter()
        .map(|a| a.container_id.as_str())
        .collect();
    let mut errors = Vec::new();
    match connect(conf).and_then(|mut nic| Ok((nic.list().map_err(nic_error)?, nic))) {
        Err(e) => errors.push(e),
        Ok((vfs, mut nic)) => {
            for vf in vfs.iter().filter(|v| conf.pfs.contains(&v.pf)) {
                if let Some(s) = vf.sandbox.as_deref().filter(|s| !valid.contains(s)) {
                    if let Err(e) = nic.release(s) {
                        errors.push(nic_error(e));
                    }
                }
            }
        }
    }
    if let Some(i) = &ipam {
        if let Err(e) = i.call(env, conf, Command::Gc) {
            errors.push(e);
        }
    }
    for e in errors.iter().skip(1) {
        eprintln!("burstvm-cni GC: also: {e}");
    }
    errors.into_iter().next().map_or(Ok(()), Err)
}
