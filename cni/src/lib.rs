pub fn plugin_main() -> i32 {
    unreachable!("cni under construction")
}
