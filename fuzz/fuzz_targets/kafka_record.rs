//! cargo fuzz run kafka_record (see ../README.md); the body is palisade_fuzz::kafka_record.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    palisade_fuzz::kafka_record(data);
});
