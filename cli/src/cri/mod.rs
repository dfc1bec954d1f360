//! `burstvm cri`: a CRI client (k8s-cri, CRI v1 over gRPC on containerd's
//! socket) doing what `crictl` does for pod sandboxes and their containers.
//! crictl itself cannot be installed here (docs/shim.md).

mod client;
pub mod container;
mod exec;
mod logs;
mod pod;

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use k8s_cri::v1::{ContainerFilter, ContainerState, ContainerStateValue, ExecRequest};

pub use client::CriClient;
use container::{ContainerOpts, CreateArgs};
pub use pod::PodArgs;

/// `burstvm cri`.
#[derive(Debug, clap::Args)]
pub struct CriArgs {
    /// containerd's CRI socket.
    #[arg(long, default_value = "/run/containerd/containerd.sock")]
    pub endpoint: PathBuf,
    /// Seconds any one call may take.
    #[arg(long, default_value_t = 120)]
    pub timeout: u64,
    #[command(subcommand)]
    pub command: CriCommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum CriCommand {
    /// Create and start a pod sandbox (RunPodSandbox); prints its id.
    Runp(PodArgs),
    /// Stop pod sandboxes (StopPodSandbox).
    Stopp { ids: Vec<String> },
    /// Remove pod sandboxes (RemovePodSandbox).
    Rmp { ids: Vec<String> },
    /// List pod sandboxes (ListPodSandbox).
    Pods {
        /// One JSON object per pod instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// A pod sandbox's status as JSON (PodSandboxStatus), e.g. its IP.
    Inspectp { id: String },
    /// Create a container in a pod (CreateContainer); prints its id.
    Create(CreateArgs),
    /// Start created containers (StartContainer).
    Start {
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// Stop containers (StopContainer).
    Stop {
        /// Seconds between SIGTERM (the image's stop signal) and SIGKILL.
        #[arg(long, default_value_t = 0)]
        timeout: u64,
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// Remove containers (RemoveContainer).
    Rm {
        /// Stop a running container first (without it a running one is refused).
        #[arg(long, short = 'f')]
        force: bool,
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// List containers (ListContainers): running ones, all with -a.
    Ps {
        /// Exited and created containers too.
        #[arg(long, short = 'a')]
        all: bool,
        /// Only the containers of this pod (id or id prefix).
        #[arg(long)]
        pod: Option<String>,
        /// One JSON object per container instead of a table.
        #[arg(long)]
        json: bool,
        /// Whole ids in the table.
        #[arg(long)]
        no_trunc: bool,
    },
    /// A container's status as JSON (ContainerStatus).
    Inspect { id: String },
    /// Run a command in a running container (ExecSync; with -i/-t, Exec and
    /// the streaming server); exits with the command's status.
    Exec {
        /// A terminal for the command (stdout and stderr become one).
        #[arg(long, short = 't')]
        tty: bool,
        /// Pass stdin to the command (its end is not passed on: docs/shim.md).
        #[arg(long, short = 'i')]
        stdin: bool,
        /// Seconds the command may run, without -i/-t (0: no limit but the
        /// call's --timeout).
        #[arg(long, default_value_t = 0)]
        timeout: u64,
        id: String,
        #[arg(last = true, required = true)]
        cmd: Vec<String>,
    },
    /// Print a container's log (the CRI log file containerd writes).
    Logs {
        /// Keep printing what is appended until the container exits.
        #[arg(long, short = 'f')]
        follow: bool,
        /// Only the last N lines.
        #[arg(long)]
        tail: Option<usize>,
        id: String,
    },
    /// Run a pod and one container in it (RunPodSandbox, CreateContainer,
    /// StartContainer); prints the pod id, then the container id.
    Run(RunArgs),
    /// List images (ListImages).
    Images,
}

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub pod: PodArgs,
    #[command(flatten)]
    pub opts: ContainerOpts,
    /// An image ref containerd has (k8s.io namespace); nothing is pulled.
    pub image: String,
    /// The command and its arguments (default: the image's).
    #[arg(last = true)]
    pub cmd: Vec<String>,
}

/// The pod config CreateContainer wants, from the pod's verbose status.
fn pod_config(c: &CriClient, pod_id: &str) -> Result<k8s_cri::v1::PodSandboxConfig> {
    let (status, info) = c.inspectp_verbose(pod_id, true)?;
    Ok(pod::config_from_status(&status, &info))
}

/// RunPodSandbox, CreateContainer, StartContainer; what was made is
/// removed again when a later step fails.
fn run(c: &CriClient, a: &RunArgs) -> Result<(String, String)> {
    let pod_id = c.runp(&a.pod)?;
    let create = CreateArgs {
        pod: pod_id.clone(),
        image: a.image.clone(),
        cmd: a.cmd.clone(),
        name: Some(a.pod.name.clone()),
        annotations: Vec::new(),
        labels: Vec::new(),
        opts: a.opts.clone(),
    };
    let made = pod_config(c, &pod_id).and_then(|pc| {
        let id = c.create(&pod_id, create.config(&pc), pc)?;
        c.start(&id).map(|_| id)
    });
    match made {
        Ok(id) => Ok((pod_id, id)),
        Err(e) => {
            // Stopping the pod stops its containers; removing it removes them.
            let undo = c.stopp(&pod_id).and_then(|_| c.rmp(&pod_id));
            match undo {
                Ok(()) => Err(e.context(format!("run: pod {pod_id} removed again"))),
                Err(u) => Err(e.context(format!("run: pod {pod_id} left: {u:#}"))),
            }
        }
    }
}

fn print_json_lines<T: serde::Serialize>(items: &[T]) -> Result<()> {
    for i in items {
        println!("{}", serde_json::to_string(i).context("as JSON")?);
    }
    Ok(())
}

fn pod_state_name(s: i32) -> &'static str {
    match s {
        0 => "Ready",
        1 => "NotReady",
        _ => "?",
    }
}

/// Runs one `burstvm cri` command; returns the process's exit status
/// (an exec'd command's own).
pub fn run_cli(a: &CriArgs) -> Result<u8> {
    let c = CriClient::connect(&a.endpoint, Duration::from_secs(a.timeout))?;
    match &a.command {
        CriCommand::Runp(p) => println!("{}", c.runp(p)?),
        CriCommand::Stopp { ids } => {
            for id in ids {
                c.stopp(id)?;
                println!("Stopped sandbox {id}");
            }
        }
        CriCommand::Rmp { ids } => {
            for id in ids {
                c.rmp(id)?;
                println!("Removed sandbox {id}");
            }
        }
        CriCommand::Pods { json } => {
            let pods = c.pods()?;
            if *json {
                print_json_lines(&pods)?;
            } else {
                println!(
                    "{:<64}  {:<8}  {:<20}  {:<12}  RUNTIME",
                    "POD ID", "STATE", "NAME", "NAMESPACE"
                );
                for p in &pods {
                    let m = p.metadata.clone().unwrap_or_default();
                    println!(
                        "{:<64}  {:<8}  {:<20}  {:<12}  {}",
                        p.id,
                        pod_state_name(p.state),
                        m.name,
                        m.namespace,
                        p.runtime_handler
                    );
                }
            }
        }
        CriCommand::Inspectp { id } => {
            println!(
                "{}",
                serde_json::to_string_pretty(&c.inspectp(id)?).context("status as JSON")?
            );
        }
        CriCommand::Create(ca) => {
            let pc = pod_config(&c, &ca.pod)?;
            println!("{}", c.create(&ca.pod, ca.config(&pc), pc)?);
        }
        CriCommand::Start { ids } => {
            for id in ids {
                c.start(id)?;
                println!("{id}");
            }
        }
        CriCommand::Stop { timeout, ids } => {
            for id in ids {
                c.stop(id, *timeout)?;
                println!("{id}");
            }
        }
        CriCommand::Rm { force, ids } => {
            for id in ids {
                // containerd would stop a running container itself; crictl
                // refuses without -f, and so do we.
                if *force {
                    c.stop(id, 0)?;
                    c.wait_not_running(id)?;
                } else if c.inspect(id)?.state == ContainerState::ContainerRunning as i32 {
                    anyhow::bail!("container {id} is running: stop it first, or rm -f");
                }
                c.rm(id)?;
                println!("{id}");
            }
        }
        CriCommand::Ps {
            all,
            pod,
            json,
            no_trunc,
        } => {
            let filter = (!*all).then(|| ContainerFilter {
                state: Some(ContainerStateValue {
                    state: ContainerState::ContainerRunning as i32,
                }),
                ..Default::default()
            });
            let mut cs = c.containers(filter)?;
            // A prefix as crictl takes it (the CRI filter wants the whole id).
            if let Some(p) = pod {
                cs.retain(|x| x.pod_sandbox_id.starts_with(p.as_str()));
            }
            cs.sort_by_key(|x| std::cmp::Reverse(x.created_at));
            if *json {
                print_json_lines(&cs)?;
            } else {
                print!("{}", container::ps_table(&cs, !*no_trunc));
            }
        }
        CriCommand::Inspect { id } => {
            println!(
                "{}",
                serde_json::to_string_pretty(&c.inspect(id)?).context("status as JSON")?
            );
        }
        CriCommand::Exec {
            tty,
            stdin,
            timeout,
            id,
            cmd,
        } => {
            if *tty || *stdin {
                // A terminal or stdin needs the streaming server (Exec).
                let url = c.exec(ExecRequest {
                    container_id: id.clone(),
                    cmd: cmd.clone(),
                    tty: *tty,
                    // A terminal's stdin is the terminal either way; without
                    // it on the stream, containerd 1.6 often sends none of a
                    // `-t` command's output (seen 13 times in 20 here).
                    stdin: *stdin || *tty,
                    stdout: true,
                    // A terminal has one output stream.
                    stderr: !*tty,
                })?;
                return exec::stream(&url, *stdin, *tty)
                    .with_context(|| format!("exec {cmd:?} in container {id}"));
            }
            let r = c.exec_sync(id, cmd, *timeout)?;
            std::io::stdout()
                .write_all(&r.stdout)
                .and_then(|_| std::io::stdout().flush())
                .context("write stdout")?;
            std::io::stderr()
                .write_all(&r.stderr)
                .context("write stderr")?;
            return Ok(r.exit_code.clamp(0, 255) as u8);
        }
        CriCommand::Logs { follow, tail, id } => logs::logs(&c, id, *tail, *follow)?,
        CriCommand::Run(ra) => {
            let (pod, id) = run(&c, ra)?;
            println!("{pod}\n{id}");
        }
        CriCommand::Images => {
            println!("{:<40}  {:<12}  {:<13}  SIZE", "IMAGE", "TAG", "IMAGE ID");
            for i in c.images()? {
                let id = i.id.trim_start_matches("sha256:");
                let tags = if i.repo_tags.is_empty() {
                    vec!["<none>:<none>".to_string()]
                } else {
                    i.repo_tags.clone()
                };
                for t in tags {
                    let (repo, tag) = t.rsplit_once(':').unwrap_or((&t, "<none>"));
                    println!(
                        "{:<40}  {:<12}  {:<13}  {:.1}MB",
                        repo,
                        tag,
                        &id[..id.len().min(13)],
                        i.size as f64 / 1e6
                    );
                }
            }
        }
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, Parser};

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        a: CriArgs,
    }

    #[test]
    fn flags_do_not_clash() {
        // `run` flattens the pod's and the container's flags together.
        T::command().debug_assert();
        let t = T::try_parse_from([
            "t",
            "run",
            "--name",
            "p",
            "--runtime",
            "runc",
            "-e",
            "A=1",
            "-t",
            "img",
            "--",
            "sh",
        ])
        .unwrap();
        let CriCommand::Run(r) = t.a.command else {
            panic!("not run");
        };
        assert_eq!((r.pod.name.as_str(), r.image.as_str()), ("p", "img"));
        assert!(r.opts.tty && r.cmd == ["sh"]);
    }
}
