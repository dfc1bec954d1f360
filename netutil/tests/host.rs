//! netutil against the kernel, inside namespaces the tests make (run as
//! root): named netns life cycle, taps, links, addresses, routes,
//! neighbours, and an AF_PACKET wire across a veth pair.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use netutil::{
    netns, LinkKind, MacAddr, NamedNetns, Netns, PacketOptions, PacketSocket, RouteSpec, Rtnl, Tap,
    TapError, TapOptions,
};

fn ns(tag: &str) -> NamedNetns {
    NamedNetns::create(&format!("nu-{tag}-{}", std::process::id())).expect("create netns (root)")
}

/// Sends `f` on `tx` until `rx` receives a frame ending like it (bounded).
fn send_until_received(tx: &PacketSocket, rx: &PacketSocket, f: &[u8]) -> Option<Vec<u8>> {
    let mut buf = [0u8; 2048];
    for _ in 0..50 {
        tx.send(f).unwrap();
        if let Some(r) = rx.recv(&mut buf).unwrap() {
            if !r.outgoing && buf[..r.len].ends_with(&f[f.len() - 8..]) {
                return Some(buf[..r.len].to_vec());
            }
        }
    }
    None
}

#[test]
fn named_netns_life_cycle() {
    let mut a = ns("life");
    let path = a.path().to_path_buf();
    assert!(netns::list("nu-life-").contains(&a.name().to_string()));
    let inside = a
        .run(|| std::fs::read_link("/proc/thread-self/ns/net").unwrap())
        .unwrap();
    assert_ne!(inside, std::fs::read_link("/proc/self/ns/net").unwrap());
    assert!(!a.netns().is_current().unwrap());
    assert!(a.run(|| a.netns().is_current().unwrap()).unwrap());
    // lo is up in a fresh namespace.
    let lo = a
        .run(|| Rtnl::open().unwrap().link_by_name("lo").unwrap().unwrap())
        .unwrap();
    assert!(lo.up);
    // On the calling thread: inside for `f`, back home after it, and after a
    // panic in it.
    let home = std::fs::read_link("/proc/thread-self/ns/net").unwrap();
    let here = a
        .netns()
        .run_here(|| std::fs::read_link("/proc/thread-self/ns/net").unwrap())
        .unwrap();
    assert_eq!(here, inside);
    assert_eq!(
        std::fs::read_link("/proc/thread-self/ns/net").unwrap(),
        home
    );
    let panicked = std::panic::catch_unwind(|| a.netns().run_here(|| panic!("in the namespace")));
    assert!(panicked.is_err());
    assert_eq!(
        std::fs::read_link("/proc/thread-self/ns/net").unwrap(),
        home
    );
    // A thread spawned into it stays there.
    let (tx, rx) = std::sync::mpsc::channel();
    a.netns()
        .spawn("nu-spawned", move || {
            tx.send(std::fs::read_link("/proc/thread-self/ns/net").unwrap())
                .unwrap()
        })
        .unwrap()
        .join()
        .unwrap();
    assert_eq!(rx.recv().unwrap(), inside);
    a.delete().unwrap();
    assert!(!path.exists());
    assert!(matches!(
        Netns::open(&path).unwrap_err(),
        netutil::NetnsError::Gone { .. }
    ));
    netns::delete_path(&path).unwrap(); // idempotent
}

#[test]
fn taps_open_create_and_refuse() {
    let a = ns("tap");
    a.run(|| {
        assert!(matches!(
            Tap::open_existing("nutap0"),
            Err(TapError::NoSuchInterface { .. })
        ));
        assert!(matches!(
            Tap::open_existing("lo"),
            Err(TapError::NotTap { .. })
        ));
        assert!(matches!(
            Tap::open_existing("bad/name"),
            Err(TapError::Name(_))
        ));
        Tap::create_persistent("nutap0").unwrap();
        let e = Tap::create_persistent("nutap0").unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EBUSY), "{e}");
        let t = Tap::open_existing("nutap0").unwrap();
        assert_eq!(t.name(), "nutap0");
        let busy = Tap::open_existing("nutap0").unwrap_err();
        assert!(busy.to_string().contains("busy"), "{busy}");
        // Non-blocking by default: nothing queued reads as WouldBlock.
        let mut buf = [0u8; 64];
        assert_eq!(
            t.read_frame(&mut buf).unwrap_err().kind(),
            std::io::ErrorKind::WouldBlock
        );
        drop(t);
        // The kernel picks the number; not persistent: gone with the fd.
        let k = Tap::open(
            "nuk%d",
            TapOptions {
                vnet_hdr: true,
                ..TapOptions::default()
            },
        )
        .unwrap();
        assert!(k.name().starts_with("nuk"), "{}", k.name());
        k.set_vnet_hdr_size(12).unwrap();
        k.set_nonblocking(false).unwrap();
        let name = k.name().to_string();
        let mut nl = Rtnl::open().unwrap();
        assert!(nl.link_by_name(&name).unwrap().unwrap().is_tun());
        drop(k);
        assert!(nl.link_by_name(&name).unwrap().is_none());
        nl.delete_link_by_name("nutap0").unwrap();
        assert!(nl.link_by_name("nutap0").unwrap().is_none());
    })
    .unwrap();
}

#[test]
fn links_addresses_routes_and_neighbours() {
    let a = ns("links");
    let b = ns("peer");
    a.run(|| {
        let mut nl = Rtnl::open().unwrap();
        let mac = MacAddr::new([2, 0x42, 0xbf, 0xff, 0, 1]);
        nl.create_bridge("nubr0", Some(mac)).unwrap();
        nl.create_veth("nuv0", "nuv1", Some(std::os::fd::AsFd::as_fd(b.netns())))
            .unwrap();
        let br = nl.link_by_name("nubr0").unwrap().unwrap();
        assert_eq!(br.mac, Some(mac));
        assert_eq!(br.kind, Some(LinkKind::Bridge));
        let v0 = nl.index_of("nuv0").unwrap();
        nl.set_master(v0, br.index).unwrap();
        nl.set_mtu(v0, 1400).unwrap();
        nl.set_alias(v0, "0000:b1:00.3").unwrap();
        nl.set_up(v0, true).unwrap();
        nl.set_up(br.index, true).unwrap();
        let l = nl.link_by_index(v0).unwrap().unwrap();
        assert_eq!(
            (l.master, l.mtu, l.alias.as_deref(), l.up, l.kind),
            (
                Some(br.index),
                1400,
                Some("0000:b1:00.3"),
                true,
                Some(LinkKind::Veth)
            )
        );
        nl.set_up(v0, false).unwrap();
        assert!(!nl.link_by_index(v0).unwrap().unwrap().up);

        nl.add_address(br.index, "10.79.0.1/16".parse().unwrap())
            .unwrap();
        assert_eq!(
            nl.addresses(br.index).unwrap(),
            vec!["10.79.0.1/16".parse().unwrap()]
        );
        let gw: IpAddr = "10.79.0.254".parse().unwrap();
        nl.add_route(
            br.index,
            &RouteSpec::to("10.80.0.0/16".parse().unwrap(), Some(gw)),
        )
        .unwrap();
        let routes = nl.routes(br.index).unwrap();
        assert!(
            routes
                .iter()
                .any(|r| r.dst.to_string() == "10.80.0.0/16" && r.gw == Some(gw) && !r.from_kernel),
            "{routes:?}"
        );

        let guest = IpAddr::V4(Ipv4Addr::new(10, 79, 9, 9));
        let gmac = MacAddr::new([2, 0, 0, 0, 9, 9]);
        nl.set_neighbour(br.index, guest, gmac).unwrap();
        assert_eq!(nl.neighbour(br.index, guest).unwrap(), Some((gmac, true)));
        nl.delete_neighbour(br.index, guest).unwrap();
        assert_eq!(nl.neighbour(br.index, guest).unwrap(), None);
        let e = nl.delete_neighbour(br.index, guest).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOENT));

        nl.delete_link(br.index).unwrap();
        assert!(nl.link_by_name("nubr0").unwrap().is_none());
    })
    .unwrap();
    // The veth peer was created straight in `b`; move it back to `a`.
    b.run(|| {
        let mut nl = Rtnl::open().unwrap();
        let v1 = nl.index_of("nuv1").unwrap();
        nl.set_mac(v1, MacAddr::new([2, 0, 0, 0, 1, 1])).unwrap();
        nl.set_netns(v1, std::os::fd::AsFd::as_fd(a.netns()))
            .unwrap();
        assert!(nl.link_by_name("nuv1").unwrap().is_none());
    })
    .unwrap();
    let names: Vec<String> = a
        .run(|| Rtnl::open().unwrap().links().unwrap())
        .unwrap()
        .into_iter()
        .map(|l| l.name)
        .collect();
    assert!(
        names.contains(&"nuv0".into()) && names.contains(&"nuv1".into()),
        "{names:?}"
    );
}

#[test]
fn packet_sockets_carry_frames_and_restore_vlan_tags() {
    let a = ns("wire");
    a.run(|| {
        let mut nl = Rtnl::open().unwrap();
        nl.create_veth("nuw0", "nuw1", None).unwrap();
        for n in ["nuw0", "nuw1"] {
            let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{n}/disable_ipv6"), "1");
            nl.set_up_by_name(n, true).unwrap();
        }
        let tx = PacketSocket::open("nuw0", PacketOptions::default()).unwrap();
        let rx = PacketSocket::open(
            "nuw1",
            PacketOptions {
                vlan_aux: true,
                recv_timeout: Some(Duration::from_millis(100)),
                ..PacketOptions::default()
            },
        )
        .unwrap();
        assert!(PacketSocket::open("nosuchif", PacketOptions::default()).is_err());
        // A tagged frame (VLAN 12, ethertype 0x88b5): the receiver sees the tag.
        let mut f = vec![
            2, 0, 0, 0, 0, 2, 2, 0, 0, 0, 0, 1, 0x81, 0, 0, 12, 0x88, 0xb5,
        ];
        f.extend_from_slice(b"hello over a veth");
        assert_eq!(send_until_received(&tx, &rx, &f).as_deref(), Some(&f[..]));
    })
    .unwrap();
}

#[test]
fn ingress_redirect_moves_frames_between_links() {
    // a0 -> a1 ==(tc mirred)==> b1 -> b0: what arrives on a1 leaves by b1.
    let a = ns("mirred");
    a.run(|| {
        let mut nl = Rtnl::open().unwrap();
        nl.create_veth("nua0", "nua1", None).unwrap();
        nl.create_veth("nub0", "nub1", None).unwrap();
        for n in ["nua0", "nua1", "nub0", "nub1"] {
            let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{n}/disable_ipv6"), "1");
            nl.set_up_by_name(n, true).unwrap();
        }
        let (a1, b1) = (nl.index_of("nua1").unwrap(), nl.index_of("nub1").unwrap());
        assert_eq!(nl.ingress_redirects(a1).unwrap(), Vec::<u32>::new());
        nl.redirect_ingress(a1, b1).unwrap();
        // The qdisc is shared: a second filter on the same link is fine.
        nl.add_ingress_qdisc(a1).unwrap();
        assert_eq!(nl.ingress_redirects(a1).unwrap(), vec![b1]);
        let tx = PacketSocket::open("nua0", PacketOptions::default()).unwrap();
        let rx = PacketSocket::open(
            "nub0",
            PacketOptions {
                recv_timeout: Some(Duration::from_millis(100)),
                ..PacketOptions::default()
            },
        )
        .unwrap();
        let mut f = vec![2, 0, 0, 0, 0, 2, 2, 0, 0, 0, 0, 1, 0x88, 0xb5];
        f.extend_from_slice(b"redirected by tc");
        assert_eq!(send_until_received(&tx, &rx, &f).as_deref(), Some(&f[..]));
        assert!(nl.redirect_ingress(9999, b1).is_err(), "no such link");
    })
    .unwrap();
}

/// The next frame that is not our own, waiting in poll(2) for the socket to
/// say one is there (bounded).
fn recv_polled(rx: &PacketSocket, buf: &mut [u8]) -> Option<Vec<u8>> {
    for _ in 0..20 {
        let mut pfd = libc::pollfd {
            fd: std::os::fd::AsRawFd::as_raw_fd(rx),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll(2) on one pollfd on the stack, for an fd `rx` keeps open.
        if unsafe { libc::poll(&mut pfd, 1, 100) } < 1 {
            continue;
        }
        while let Some(r) = rx.recv(buf).unwrap() {
            if !r.outgoing {
                return Some(buf[..r.len].to_vec());
            }
        }
    }
    None
}

#[test]
fn rx_ring_sockets_carry_frames_around_the_ring_and_restore_vlan_tags() {
    let a = ns("ring");
    a.run(|| {
        let mut nl = Rtnl::open().unwrap();
        nl.create_veth("nur0", "nur1", None).unwrap();
        for n in ["nur0", "nur1"] {
            let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{n}/disable_ipv6"), "1");
            nl.set_up_by_name(n, true).unwrap();
        }
        let ring = PacketOptions {
            nonblocking: true,
            rx_ring: true,
            ..PacketOptions::default()
        };
        let blocking = PacketOptions {
            rx_ring: true,
            ..PacketOptions::default()
        };
        assert!(
            PacketSocket::open("nur1", blocking).is_err(),
            "a ring is for non-blocking sockets"
        );
        let tx = PacketSocket::open("nur0", PacketOptions::default()).unwrap();
        let rx = PacketSocket::open("nur1", ring).unwrap();
        // A ring socket sends as any other.
        let back = PacketSocket::open(
            "nur0",
            PacketOptions {
                recv_timeout: Some(Duration::from_millis(100)),
                ..PacketOptions::default()
            },
        )
        .unwrap();
        let mut f = vec![2, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0, 2, 0x88, 0xb5];
        f.extend_from_slice(b"sent from the ring socket");
        assert_eq!(send_until_received(&rx, &back, &f).as_deref(), Some(&f[..]));
        let mut buf = [0u8; 2048];
        // More than twice the ring's 512 slots, each in order.
        for i in 0..1100u32 {
            let mut f = vec![2, 0, 0, 0, 0, 2, 2, 0, 0, 0, 0, 1, 0x88, 0xb5];
            f.extend_from_slice(&i.to_be_bytes());
            f.extend_from_slice(b"around the ring");
            tx.send(&f).unwrap();
            assert_eq!(
                recv_polled(&rx, &mut buf).as_deref(),
                Some(&f[..]),
                "frame {i}"
            );
        }
        // A tagged frame reads as it was on the wire.
        let mut f = vec![
            2, 0, 0, 0, 0, 2, 2, 0, 0, 0, 0, 1, 0x81, 0, 0, 12, 0x88, 0xb5,
        ];
        f.extend_from_slice(b"tagged, through the ring");
        tx.send(&f).unwrap();
        assert_eq!(recv_polled(&rx, &mut buf).as_deref(), Some(&f[..]));
        // A frame larger than the reader's buffer is skipped, not cut.
        let mut big = vec![2, 0, 0, 0, 0, 2, 2, 0, 0, 0, 0, 1, 0x88, 0xb5];
        big.resize(1400, 7);
        tx.send(&big).unwrap();
        let mut small = [0u8; 1000];
        let skipped = netutil::Received {
            len: 0,
            outgoing: true,
        };
        let mut got = None;
        for _ in 0..1000 {
            got = rx.recv(&mut small).unwrap();
            if got.is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(got, Some(skipped));
        assert_eq!(rx.recv(&mut buf).unwrap(), None, "nothing pending");
    })
    .unwrap();
}
