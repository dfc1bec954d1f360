//! `logs`: the CRI log file containerd writes for a container
//! (`<RFC3339Nano> <stdout|stderr> <P|F> <text>` per line; P is a partial
//! line continued by the next entry of the same stream).

use std::collections::VecDeque;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use k8s_cri::v1::ContainerState;

use super::client::CriClient;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

/// Turns the bytes of a CRI log into whole lines of text, across reads:
/// bytes after the last newline wait for the next read, P entries for
/// their F.
#[derive(Default)]
pub struct Parser {
    pending: Vec<u8>,
    partial: [String; 2],
}

impl Parser {
    pub fn feed(&mut self, bytes: &[u8], out: &mut Vec<(Stream, String)>) {
        self.pending.extend_from_slice(bytes);
        let Some(end) = self.pending.iter().rposition(|&b| b == b'\n') else {
            return;
        };
        let rest = self.pending.split_off(end + 1);
        let whole = std::mem::replace(&mut self.pending, rest);
        for line in whole.split(|&b| b == b'\n') {
            self.entry(&String::from_utf8_lossy(line), out);
        }
    }

    fn entry(&mut self, line: &str, out: &mut Vec<(Stream, String)>) {
        let mut f = line.splitn(4, ' ');
        let (Some(_time), Some(stream), Some(tags)) = (f.next(), f.next(), f.next()) else {
            return;
        };
        let text = f.next().unwrap_or("");
        let (stream, i) = match stream {
            "stdout" => (Stream::Stdout, 0),
            "stderr" => (Stream::Stderr, 1),
            _ => return,
        };
        self.partial[i].push_str(text);
        if !tags.split(':').any(|t| t == "P") {
            out.push((stream, std::mem::take(&mut self.partial[i])));
        }
    }
}

fn print(lines: impl IntoIterator<Item = (Stream, String)>) -> Result<()> {
    let (mut o, mut e) = (std::io::stdout().lock(), std::io::stderr().lock());
    for (s, l) in lines {
        match s {
            Stream::Stdout => writeln!(o, "{l}"),
            Stream::Stderr => writeln!(e, "{l}"),
        }
        .context("write log line")?;
    }
    o.flush().context("flush stdout")
}

/// How often `-f` looks for more and for the container's end.
const POLL: Duration = Duration::from_millis(200);

/// Prints container `id`'s log (the last `tail` lines, if given); with
/// `follow`, then what is appended until the container has exited.
pub fn logs(c: &CriClient, id: &str, tail: Option<usize>, follow: bool) -> Result<()> {
    let status = c.inspect(id)?;
    let path = Path::new(&status.log_path);
    if status.log_path.is_empty() {
        anyhow::bail!("container {id} has no log path (created without one)");
    }
    let mut parser = Parser::default();
    let mut offset = 0u64;
    let mut read_more = |parser: &mut Parser, out: &mut Vec<(Stream, String)>| -> Result<()> {
        let mut f = match std::fs::File::open(path) {
            Ok(f) => f,
            // Not started yet: containerd makes the file at StartContainer.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => {
                return Err(e).with_context(|| format!("container {id}: log {}", path.display()))
            }
        };
        f.seek(SeekFrom::Start(offset))
            .and_then(|_| {
                let mut b = Vec::new();
                f.read_to_end(&mut b)?;
                offset += b.len() as u64;
                parser.feed(&b, out);
                Ok(())
            })
            .with_context(|| format!("container {id}: read log {}", path.display()))
    };
    let mut first = Vec::new();
    read_more(&mut parser, &mut first)?;
    if let Some(n) = tail {
        let mut last: VecDeque<_> = first.into_iter().collect();
        while last.len() > n {
            last.pop_front();
        }
        first = last.into();
    }
    print(first)?;
    if !follow {
        return Ok(());
    }
    let mut last_check = Instant::now();
    let mut exited = status.state == ContainerState::ContainerExited as i32;
    loop {
        let mut more = Vec::new();
        read_more(&mut parser, &mut more)?;
        print(more)?;
        // One more read after the exit was seen: what it wrote last.
        if exited {
            return Ok(());
        }
        std::thread::sleep(POLL);
        if last_check.elapsed() >= Duration::from_secs(1) {
            last_check = Instant::now();
            exited = c.inspect(id)?.state == ContainerState::ContainerExited as i32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_entries_join_and_streams_stay_apart() {
        let mut p = Parser::default();
        let mut out = Vec::new();
        p.feed(
            b"2024-01-01T00:00:00.1Z stdout P hel\n\
              2024-01-01T00:00:00.2Z stderr F oops\n\
              2024-01-01T00:00:00.3Z stdout F lo world\n\
              2024-01-01T00:00:00.4Z stdout F \n",
            &mut out,
        );
        assert_eq!(
            out,
            [
                (Stream::Stderr, "oops".to_string()),
                (Stream::Stdout, "hello world".to_string()),
                (Stream::Stdout, String::new()),
            ]
        );
    }

    #[test]
    fn a_line_split_across_reads_waits_for_its_newline() {
        let mut p = Parser::default();
        let mut out = Vec::new();
        p.feed(b"2024-01-01T00:00:00Z stdout F hello-fr", &mut out);
        assert!(out.is_empty());
        p.feed(b"om-c1\n2024-01-01T00:00:01Z stdout F x", &mut out);
        assert_eq!(out, [(Stream::Stdout, "hello-from-c1".to_string())]);
    }
}
