#![no_main]
// The body is a library function so that stable tests replay the corpus too.
libfuzzer_sys::fuzz_target!(|data: &[u8]| cni::fuzz::fuzz_server_request(data));
