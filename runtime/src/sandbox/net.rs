//! The sandbox's network attach, one way per source of the attachment: an
//! engine's netns (the shim), a pooled attachment (`net-claim`), its own CNI
//! ADD on the VF or SG network, or the `tap` software CNI. Every VF and tap
//! path ends in `attach_link`: the guest's address is recorded and its
//! neighbour entry added on the server (a pooled attachment's is there
//! already), and `neighbor` is set only once the entry exists, so teardown
//! deletes exactly what was added. `cni_added` /
//! `tap_added` are set before the ADD runs: a half-done ADD is undone by DEL.

use std::net::SocketAddrV4;
use std::path::{Path, PathBuf};

use vmm::{NetBackend, VmParams};

use super::{Sandbox, StageError};
use crate::guestnet::GuestLink;

/// The interface name the CNI plugin creates in the sandbox netns.
pub const IFNAME: &str = "eth0";

impl<'rt> Sandbox<'rt> {
    /// The netns the sandbox runs in: the engine's or its own.
    pub(super) fn netns_path(&self) -> &Path {
        match &self.attach.netns {
            Some(p) => p,
            None => self.netns.as_ref().expect("netns stage ran").path(),
        }
    }

    /// The CNI network of the spec's attachment: the SG network for an SG
    /// spec, else the VF network (None: the host has none).
    pub(super) fn network(&self) -> Option<&'rt crate::cni_exec::CniNetwork> {
        match self.spec.sg {
            Some(_) => self.rt.sg_cni(),
            None => self.rt.cni(),
        }
    }

    /// After the engine's CNI ADD: the placeholder link in its netns names the VF.
    pub(super) fn attach_given_vf(&mut self, vm: &mut VmParams) -> Result<(), StageError> {
        if let Some(cni) = self.rt.cni() {
            cni.require_vf("an engine-made attachment (the shim's attach path)")?;
        }
        let ns = self.netns_path().to_path_buf();
        let att = crate::cni_exec::Attachment {
            ifname: IFNAME.to_string(),
            mac: None,
            ip_cidr: None,
            gateway: None,
            vf_id: None,
            vf_socket: None,
            kind: nic_api::DevKind::Vf,
        };
        let link = crate::guestnet::read_link(&ns, IFNAME, &att)?;
        self.attach_vf(None, &link, vm)
    }

    /// A pooled attachment (CNI ADD done while idle): the sandbox owns its
    /// netns and DELs it at teardown like its own.
    pub(super) fn attach_pooled(
        &mut self,
        p: crate::netpool::Pooled,
        vm: &mut VmParams,
    ) -> Result<(), StageError> {
        self.netns = Some(p.netns);
        self.pooled_id = Some(p.id);
        self.cni_added = true;
        // The pool added the server's neighbour entry; the teardown removes it.
        self.neighbor = Some(p.link.ip);
        self.attach_vf(p.vf_socket, &p.link, vm)
    }

    /// CNI ADD through burstvm-cni; the placeholder link gives VF, MAC and IP.
    pub(super) fn cni_add_vf(&mut self, vm: &mut VmParams) -> Result<(), StageError> {
        let ns = self
            .netns
            .as_ref()
            .expect("netns stage ran")
            .path()
            .to_path_buf();
        let cni = self.network().ok_or(match self.spec.sg {
            Some(_) => "no SG network configured (the runtime serves no SG functions: sgfs 0)",
            None => "no CNI network configured",
        })?;
        // Marked before the call: a half-done ADD is undone by DEL too.
        self.cni_added = true;
        let att = cni.add(&self.spec.id, &ns, IFNAME)?;
        if att.kind == nic_api::DevKind::Sg {
            // No link, MAC or address: the SG function's socket is all there is.
            let socket = att
                .vf_socket
                .ok_or("the CNI result's SG function has no socketPath")?;
            self.sg = true;
            vm.net.push(NetBackend::Sg(socket));
            return Ok(());
        }
        let link = crate::guestnet::read_link(&ns, IFNAME, &att)?;
        self.attach_vf(att.vf_socket.clone(), &link, vm)
    }

    /// Software CNI baseline, as Kata runs it: CNI ADD of the reference
    /// `bridge` plugin (executed as an engine executes it), then the VMM's
    /// tap joined to its veth by tc (`guestnet::tap_join`).
    pub(super) fn tap_add(&mut self, vm: &mut VmParams) -> Result<(), StageError> {
        let cni = self.rt.tap_cni()?;
        let ns = self.netns.as_ref().expect("netns stage ran");
        // Marked before the call: a half-done ADD is undone by DEL too.
        self.tap_added = true;
        let att = cni.add(&self.spec.id, ns.path(), IFNAME)?;
        let link = crate::guestnet::tap_join(&self.spec.id, ns.netns(), &att)?;
        self.attach_link(NetBackend::Tap(crate::instance::TAP_IF.into()), &link, vm)
    }

    /// A VF link: its vhost-user socket (from the CNI result, else asked from
    /// the NIC daemon by the link's VF id), then `attach_link`.
    fn attach_vf(
        &mut self,
        socket: Option<PathBuf>,
        link: &GuestLink,
        vm: &mut VmParams,
    ) -> Result<(), StageError> {
        let socket = match socket {
            Some(s) => s,
            None => self.rt.vf_socket(&link.vf_id)?,
        };
        self.attach_link(NetBackend::VhostUser(socket), link, vm)
    }

    /// The guest's address and its neighbour entry on the server; the VMM's
    /// network parameters for `backend`.
    fn attach_link(
        &mut self,
        backend: NetBackend,
        link: &GuestLink,
        vm: &mut VmParams,
    ) -> Result<(), StageError> {
        self.guest_ip = Some(link.ip);
        if self.neighbor != Some(link.ip) {
            self.rt.add_neighbor(link.ip, link.mac)?;
            self.neighbor = Some(link.ip);
        }
        let a = self.rt.addressing();
        vm.net.push(backend);
        vm.mac = Some(link.mac);
        vm.ip = Some((link.ip, link.netmask()));
        vm.gateway = Some(link.gateway.unwrap_or(a.server_ip));
        vm.server = Some(SocketAddrV4::new(
            a.server_ip,
            crate::server_netns::ECHO_PORT,
        ));
        vm.server_mac = Some(a.server_mac);
        Ok(())
    }
}
