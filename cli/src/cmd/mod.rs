//! The `burstvm` binary's command families: clap structs and their
//! conversion into the library crates' typed configs (`into_config`).

pub mod nic;
pub mod runtime;
pub mod sgiov;

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use clap::{CommandFactory, Parser};
    use nic::dataplane::uplink::UplinkSpec;

    use crate::{BenchCommand, Cli, Command, SgiovBench};

    fn parse(argv: &[&str]) -> Command {
        Cli::try_parse_from([&["burstvm"], argv].concat())
            .unwrap_or_else(|e| panic!("{argv:?}: {e}"))
            .command
    }

    #[test]
    fn the_command_tree_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn vmm_flags_parse_into_params() {
        let Command::Vmm(a) = parse(&[
            "vmm",
            "--sandbox",
            "sb1",
            "--memory",
            "128M",
            "--net",
            "sg:/sg.sock",
            "--agent-mode",
            "sg-echo",
            "--vf-init",
            "async",
            "--dma-ram",
            "true",
        ]) else {
            panic!("not vmm")
        };
        let p = a.into_params();
        assert_eq!((p.sandbox.as_str(), p.memory), ("sb1", 128 << 20));
        assert_eq!(p.agent_mode, vmm::AgentMode::SgEcho);
        assert_eq!(p.vf_init, vmm::VfInit::Async);
        assert_eq!(p.sg_xf, vmm::SgXf::Crypto);
        assert!(p.dma_ram && !p.dma_image);
        assert_eq!(p.net, vec![vmm::NetBackend::Sg("/sg.sock".into())]);
        let e = Cli::try_parse_from(["burstvm", "vmm", "--sandbox", "s", "--agent-mode", "x"])
            .err()
            .expect("an unknown agent mode")
            .to_string();
        assert!(e.contains("sg-recv"), "the choices are listed: {e}");
    }

    #[test]
    fn nic_flags_parse_into_a_typed_config() {
        let Command::Nic(a) = parse(&[
            "nic",
            "--pf",
            "pf0",
            "--pf",
            "pf1",
            "--uplink",
            "tap:up0",
            "--uplink",
            "none",
            "--devset-lock",
            "global",
            "--control-idle-timeout",
            "1.5",
            "--sgfs",
            "2",
            "--sg-policy",
            "prio",
        ]) else {
            panic!("not nic")
        };
        let c = a.into_config().unwrap();
        assert_eq!(c.pf, ["pf0", "pf1"]);
        assert_eq!(c.vfs, [8]);
        assert_eq!(c.uplink, [Some(UplinkSpec::Tap("up0".into())), None]);
        assert_eq!(c.devset_lock, nic::LockPolicy::Global);
        assert_eq!(c.control_idle_timeout, Duration::from_millis(1500));
        assert_eq!(
            (c.sg.sgfs, c.sg.policy),
            (2, sgiov::sched::Policy::Priority)
        );
        assert_eq!(c.pf_list().unwrap(), [("pf0".into(), 8), ("pf1".into(), 8)]);
        let Command::Nic(a) = parse(&["nic", "--pf", "p", "--control-idle-timeout=-1"]) else {
            panic!("not nic")
        };
        let e = a.into_config().unwrap_err().to_string();
        assert!(e.contains("--control-idle-timeout"), "{e}");
    }

    #[test]
    fn run_flags_parse_into_a_typed_config() {
        let Command::Run(a) = parse(&[
            "run",
            "--variant",
            "tap",
            "--memory",
            "128M",
            "--app-size",
            "4K",
            "--rootfs",
            "/img",
            "--rootfs-image",
            "pmem",
            "--net-kind",
            "sg",
        ]) else {
            panic!("not run")
        };
        let c = a.into_config();
        assert_eq!(c.variant, runtime::Variant::Tap);
        assert_eq!((c.sandbox.memory, c.sandbox.app_size), (128 << 20, 4096));
        assert_eq!(
            c.rootfs.rootfs_image,
            runtime::sandbox::rootfs::ImageMode::Pmem
        );
        assert_eq!(c.rootfs.rootfs_layer_size, 64 << 20);
        assert_eq!(c.net_kind, runtime::NetKindArg::Sg);
        // --rootfs-image needs --rootfs; a bad size names its flag.
        assert!(Cli::try_parse_from(["burstvm", "run", "--rootfs-image", "pmem"]).is_err());
        let e = Cli::try_parse_from(["burstvm", "run", "--memory", "12Q"])
            .err()
            .expect("a bad size")
            .to_string();
        assert!(e.contains("--memory"), "{e}");
    }

    #[test]
    fn sgiov_bench_flags_parse_into_typed_configs() {
        let Command::Bench(BenchCommand::Sgiov(SgiovBench::Latency(a))) = parse(&[
            "bench", "sgiov", "latency", "--modes", "xfifo", "--pipes", "4,32", "--policy", "rr",
        ]) else {
            panic!("not latency")
        };
        let c = a.into_config();
        assert_eq!(c.modes, [bench::sg::latency::Mode::Xfifo]);
        assert_eq!(c.pipes, [4, 32]);
        assert_eq!(c.policy, sgiov::sched::Policy::RoundRobin);
        assert_eq!((c.common.threads, c.common.ring), (2, 4096));
        let e = Cli::try_parse_from(["burstvm", "bench", "sgiov", "latency", "--modes", "x"])
            .err()
            .expect("an unknown mode")
            .to_string();
        assert!(e.contains("xfifo"), "the choices are listed: {e}");
        let Command::Bench(BenchCommand::Sgiov(SgiovBench::Jobgen(a))) = parse(&[
            "bench",
            "sgiov",
            "jobgen",
            "--msg",
            "1K..16K",
            "--max-job",
            "16K",
        ]) else {
            panic!("not jobgen")
        };
        let c = a.into_config();
        assert_eq!(c.msg, [1 << 10, 4 << 10, 16 << 10]);
        assert_eq!((c.bytes, c.max_job), (32 << 20, 16 << 10));
        let Command::Bench(BenchCommand::Sgiov(SgiovBench::Path(a))) =
            parse(&["bench", "sgiov", "path"])
        else {
            panic!("not path")
        };
        let c = a.into_config();
        let d = bench::sgiov::path::PathBenchConfig::default();
        assert_eq!((c.path, c.mode, c.msg), (d.path, d.mode, d.msg));
        assert_eq!((c.bytes, c.staging_ring), (d.bytes, d.staging_ring));
    }

    #[test]
    fn bench_defaults_match_the_library_defaults() {
        let Command::Bench(BenchCommand::Dataplane(a)) = parse(&["bench", "dataplane"]) else {
            panic!("not dataplane")
        };
        let c = a.into_config().unwrap();
        assert_eq!(c.topology, bench::dataplane::Topology::ALL);
        assert_eq!(c.duration, Duration::from_secs(2));
        let Command::Bench(BenchCommand::Chaos(a)) = parse(&["bench", "chaos"]) else {
            panic!("not chaos")
        };
        let c = a.into_config();
        assert_eq!(c.memory, 32 << 20);
        assert_eq!(c.faults.len(), 3);
        let Command::Bench(BenchCommand::Sgiov(SgiovBench::Throughput(a))) =
            parse(&["bench", "sgiov", "throughput"])
        else {
            panic!("not throughput")
        };
        let c = a.into_config().unwrap();
        let d = bench::sg::throughput::ThroughputConfig::default();
        assert_eq!(
            (c.pipes, c.duration, c.policy),
            (d.pipes, d.duration, d.policy)
        );
    }
}
