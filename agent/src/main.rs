//! burstvm's guest agent (docs/guest.md, "The guest agent").
fn main() {}
