//! cargo fuzz run http_events_json (see ../README.md); the body is palisade_fuzz::http_events_json.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    palisade_fuzz::http_events_json(data);
});
