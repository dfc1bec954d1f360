//! `burstvm-cni-thin`: the CNI plugin executable that forwards its call to
//! burstvm's CNI server (`cni::server`). The executable is the freestanding
//! C program `cli/cni-thin/thin.c`, linked here without libc or std's
//! start-up (`build.rs`); this crate contributes no code to it.

#![no_main]
