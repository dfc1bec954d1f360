//! The agent's configuration: `burstvm_*` words of the kernel command line,
//! which the kernel hands to init as environment variables (a word whose
//! name has no dot and that the kernel does not know).

use std::net::IpAddr;
use std::path::PathBuf;

use super::BootError;

/// What the kernel command line configures.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootConfig {
    /// `burstvm_ro=/dev/vda`: the container image (EROFS, read-only).
    pub ro: Option<PathBuf>,
    /// `burstvm_rw=/dev/vdb`: the writable layer (ext4); None: a tmpfs.
    pub rw: Option<PathBuf>,
    /// `burstvm_net=ADDR/PREFIX`: the address of the first ethernet link.
    pub net: Option<(IpAddr, u8)>,
    /// `burstvm_gw=IP`: the default route's gateway.
    pub gw: Option<IpAddr>,
    /// `burstvm_dns=IP[,IP]`: /etc/resolv.conf's name servers.
    pub dns: Vec<IpAddr>,
    /// `burstvm_hostname=NAME`.
    pub hostname: Option<String>,
    /// `burstvm_vsock_port=N`: the control port (default 1024).
    pub vsock_port: u32,
    /// `burstvm_stdio_port=N`: the stdio port (default 1025).
    pub stdio_port: u32,
    /// `burstvm_pod=1`: a pod sandbox (stays up until `Shutdown`).
    pub pod: bool,
    /// `burstvm_unix_dir=/DIR`: serve on Unix sockets `DIR/control.sock` and
    /// `DIR/stdio.sock` (in the container root) instead of vsock: the host
    /// test that runs the agent as PID 1 of a PID namespace.
    pub unix_dir: Option<PathBuf>,
}

impl Default for BootConfig {
    fn default() -> BootConfig {
        BootConfig {
            ro: None,
            rw: None,
            net: None,
            gw: None,
            dns: Vec::new(),
            hostname: None,
            vsock_port: agent_proto::CONTROL_PORT,
            stdio_port: agent_proto::STDIO_PORT,
            pod: false,
            unix_dir: None,
        }
    }
}

fn valid_hostname(h: &str) -> bool {
    !h.is_empty()
        && h.len() <= 64
        && h.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
        && !h.starts_with(['-', '.'])
}

impl BootConfig {
    /// From the process's environment.
    pub fn from_env() -> Result<BootConfig, BootError> {
        BootConfig::parse(std::env::vars())
    }

    /// From `key=value` pairs; keys other than the `burstvm_*` ones above are
    /// ignored (`burstvm_check` is the test init's, `TERM` and `HOME` the
    /// kernel's).
    pub fn parse(
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<BootConfig, BootError> {
        let mut c = BootConfig::default();
        for (key, value) in vars {
            let bad = |what| BootError::Config {
                key: key.clone(),
                value: value.clone(),
                what,
            };
            let ip = |s: &str| s.parse::<IpAddr>().map_err(|_| bad("not an IP address"));
            let path = |s: &str| match s.starts_with('/') {
                true => Ok(PathBuf::from(s)),
                false => Err(bad("not an absolute path")),
            };
            let port = |s: &str| s.parse::<u32>().map_err(|_| bad("not a port number"));
            match key.as_str() {
                "burstvm_ro" => c.ro = Some(path(&value)?),
                "burstvm_rw" => c.rw = Some(path(&value)?),
                "burstvm_net" => {
                    let (a, p) = value
                        .split_once('/')
                        .ok_or_else(|| bad("not ADDR/PREFIX"))?;
                    let addr = ip(a)?;
                    let max = if addr.is_ipv4() { 32 } else { 128 };
                    let prefix = p
                        .parse::<u8>()
                        .ok()
                        .filter(|&p| p <= max)
                        .ok_or_else(|| bad("prefix out of range"))?;
                    c.net = Some((addr, prefix));
                }
                "burstvm_gw" => c.gw = Some(ip(&value)?),
                "burstvm_dns" => {
                    c.dns = value
                        .split(',')
                        .filter(|s| !s.is_empty())
                        .map(ip)
                        .collect::<Result<_, _>>()?
                }
                "burstvm_hostname" => {
                    if !valid_hostname(&value) {
                        return Err(bad("not a host name"));
                    }
                    c.hostname = Some(value.clone());
                }
                "burstvm_vsock_port" => c.vsock_port = port(&value)?,
                "burstvm_stdio_port" => c.stdio_port = port(&value)?,
                "burstvm_unix_dir" => c.unix_dir = Some(path(&value)?),
                "burstvm_pod" => {
                    c.pod = match value.as_str() {
                        "1" | "true" | "yes" => true,
                        "0" | "false" | "no" => false,
                        _ => return Err(bad("not 0 or 1")),
                    }
                }
                _ => {}
            }
        }
        if c.gw.is_some() && c.net.is_none() {
            return Err(BootError::Config {
                key: "burstvm_gw".into(),
                value: c.gw.map(|g| g.to_string()).unwrap_or_default(),
                what: "a gateway without burstvm_net",
            });
        }
        if c.vsock_port == c.stdio_port {
            return Err(BootError::Config {
                key: "burstvm_stdio_port".into(),
                value: c.stdio_port.to_string(),
                what: "the same as the control port",
            });
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(pairs: &[(&str, &str)]) -> Result<BootConfig, BootError> {
        BootConfig::parse(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())))
    }

    #[test]
    fn full_config() {
        let c = parse(&[
            ("HOME", "/"),
            ("TERM", "linux"),
            ("burstvm_ro", "/dev/vda"),
            ("burstvm_rw", "/dev/vdb"),
            ("burstvm_net", "192.0.2.5/24"),
            ("burstvm_gw", "192.0.2.1"),
            ("burstvm_dns", "192.0.2.53,2001:db8::53"),
            ("burstvm_hostname", "sb-1.example"),
            ("burstvm_vsock_port", "2000"),
            ("burstvm_pod", "1"),
            ("burstvm_check", "/etc/os-release"),
        ])
        .unwrap();
        assert_eq!(c.ro, Some("/dev/vda".into()));
        assert_eq!(c.rw, Some("/dev/vdb".into()));
        assert_eq!(c.net, Some(("192.0.2.5".parse().unwrap(), 24)));
        assert_eq!(c.gw, Some("192.0.2.1".parse().unwrap()));
        assert_eq!(c.dns.len(), 2);
        assert_eq!(c.hostname.as_deref(), Some("sb-1.example"));
        assert_eq!((c.vsock_port, c.stdio_port), (2000, 1025));
        assert!(c.pod);
    }

    #[test]
    fn defaults_and_errors() {
        assert_eq!(parse(&[]).unwrap(), BootConfig::default());
        assert_eq!(BootConfig::default().vsock_port, 1024);
        for bad in [
            ("burstvm_net", "192.0.2.5"),
            ("burstvm_net", "192.0.2.5/33"),
            ("burstvm_gw", "192.0.2.1"),
            ("burstvm_dns", "x"),
            ("burstvm_hostname", "a b"),
            ("burstvm_ro", "vda"),
            ("burstvm_vsock_port", "1025"),
            ("burstvm_pod", "maybe"),
        ] {
            let e = parse(&[bad]).unwrap_err();
            assert!(e.to_string().contains("burstvm_"), "{e}");
        }
    }
}
