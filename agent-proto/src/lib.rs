//! The guest agent's API over virtio-vsock (docs/design.md, "Guest agent protocol").
