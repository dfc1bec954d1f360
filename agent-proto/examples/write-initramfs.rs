//! `cargo run -p agent-proto --example write-initramfs -- AGENT OUT`: the
//! guest's initramfs (docs/guest.md) from a built agent; scripts/build-agent.sh
//! `--initramfs OUT` runs it.

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [agent, out] = args.as_slice() else {
        eprintln!("usage: write-initramfs AGENT_BINARY OUT");
        std::process::exit(2);
    };
    if let Err(e) = agent_proto::write_initramfs(agent.as_ref(), out.as_ref()) {
        let mut msg = e.to_string();
        let mut src = std::error::Error::source(&e);
        while let Some(s) = src {
            msg += &format!(": {s}");
            src = s.source();
        }
        eprintln!("write-initramfs: {msg}");
        std::process::exit(1);
    }
}
