//! Framing: a 4-byte big-endian length N (N ≤ [`MAX_FRAME`]), then N bytes
//! of JSON. A frame is read with exact reads (no buffering past its end), so
//! that raw bytes may follow it on the same stream (the stdio port).

use std::io::{self, Read, Write};

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::MAX_FRAME;

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The length header announced (or a message serialized to) more than
    /// [`MAX_FRAME`] bytes; the body was not read.
    #[error("frame of {len} bytes is over the {MAX_FRAME}-byte limit")]
    TooLarge { len: u64 },
    /// The peer closed the stream at a frame boundary.
    #[error("connection closed")]
    Closed,
    #[error("reading a frame")]
    Read(#[source] io::Error),
    #[error("writing a frame")]
    Write(#[source] io::Error),
    /// The body is not the JSON of the expected message (the stream is still
    /// at a frame boundary).
    #[error("frame body is not a valid message")]
    Json(#[source] serde_json::Error),
}

impl FrameError {
    /// Whether the stream is still at a frame boundary after this error,
    /// i.e. whether a server may answer it and go on reading.
    pub fn recoverable(&self) -> bool {
        matches!(self, FrameError::Json(_))
    }
}

/// Reads one frame's body.
pub fn read_frame_bytes(r: &mut impl Read) -> Result<Vec<u8>, FrameError> {
    let mut head = [0u8; 4];
    let mut got = 0;
    while got < head.len() {
        match r.read(&mut head[got..]) {
            Ok(0) if got == 0 => return Err(FrameError::Closed),
            Ok(0) => {
                return Err(FrameError::Read(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "stream ended inside a frame header",
                )))
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(FrameError::Read(e)),
        }
    }
    let len = u32::from_be_bytes(head) as usize;
    if len > MAX_FRAME {
        return Err(FrameError::TooLarge { len: len as u64 });
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).map_err(FrameError::Read)?;
    Ok(body)
}

/// Reads one frame and parses it as `T`.
pub fn read_frame<T: DeserializeOwned>(r: &mut impl Read) -> Result<T, FrameError> {
    let body = read_frame_bytes(r)?;
    serde_json::from_slice(&body).map_err(FrameError::Json)
}

/// Serializes `msg` and writes it as one frame (one `write_all`).
pub fn write_frame<T: Serialize + ?Sized>(w: &mut impl Write, msg: &T) -> Result<(), FrameError> {
    let mut buf = vec![0u8; 4];
    serde_json::to_writer(&mut buf, msg).map_err(FrameError::Json)?;
    let len = buf.len() - 4;
    if len > MAX_FRAME {
        return Err(FrameError::TooLarge { len: len as u64 });
    }
    buf[..4].copy_from_slice(&(len as u32).to_be_bytes());
    w.write_all(&buf).map_err(FrameError::Write)?;
    w.flush().map_err(FrameError::Write)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::msg::{Request, StreamHello, StreamKind};

    #[test]
    fn round_trip_and_exact_reads() {
        let mut buf = Vec::new();
        write_frame(&mut buf, &Request::Hello { version: 1 }).unwrap();
        buf.extend_from_slice(b"raw bytes after the frame");
        assert_eq!(&buf[..4], &((buf.len() - 4 - 25) as u32).to_be_bytes());
        let mut r = &buf[..];
        let req: Request = read_frame(&mut r).unwrap();
        assert_eq!(req, Request::Hello { version: 1 });
        assert_eq!(r, b"raw bytes after the frame");
    }

    #[test]
    fn oversized_header_is_refused_without_reading_the_body() {
        let mut buf = ((MAX_FRAME + 1) as u32).to_be_bytes().to_vec();
        buf.extend_from_slice(b"{}");
        let mut r = &buf[..];
        match read_frame_bytes(&mut r) {
            Err(FrameError::TooLarge { len }) => assert_eq!(len, MAX_FRAME as u64 + 1),
            other => panic!("{other:?}"),
        }
        assert_eq!(r, b"{}");
        // Exactly the limit is fine.
        let mut buf = (MAX_FRAME as u32).to_be_bytes().to_vec();
        buf.resize(4 + MAX_FRAME, b' ');
        assert_eq!(read_frame_bytes(&mut &buf[..]).unwrap().len(), MAX_FRAME);
    }

    #[test]
    fn oversized_message_is_not_written() {
        let hello = StreamHello {
            id: "x".repeat(MAX_FRAME),
            stream: StreamKind::Stdout,
        };
        let mut buf = Vec::new();
        assert!(matches!(
            write_frame(&mut buf, &hello),
            Err(FrameError::TooLarge { .. })
        ));
        assert!(buf.is_empty());
    }

    #[test]
    fn end_of_stream() {
        assert!(matches!(
            read_frame_bytes(&mut &[][..]),
            Err(FrameError::Closed)
        ));
        assert!(matches!(
            read_frame_bytes(&mut &[0u8, 0][..]),
            Err(FrameError::Read(e)) if e.kind() == io::ErrorKind::UnexpectedEof
        ));
        assert!(matches!(
            read_frame_bytes(&mut &[0u8, 0, 0, 5, b'{'][..]),
            Err(FrameError::Read(e)) if e.kind() == io::ErrorKind::UnexpectedEof
        ));
    }

    #[test]
    fn garbage_json_is_recoverable() {
        let buf = [0u8, 0, 0, 3, b'a', b'b', b'c'];
        let err = read_frame::<Request>(&mut &buf[..]).unwrap_err();
        assert!(err.recoverable(), "{err:?}");
        assert!(!FrameError::TooLarge { len: 1 }.recoverable());
    }
}
