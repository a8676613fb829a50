//! cargo fuzz run codec_event (see ../README.md); the body is palisade_fuzz::codec_event.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    palisade_fuzz::codec_event(data);
});
