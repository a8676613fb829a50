//! `palisade-fault-writer`, the fault-injection suite's writer
//! (`crates/palisade-devtools/src/fault_writer.rs`). A binary of the root
//! package so that the tests find it as `CARGO_BIN_EXE_palisade-fault-writer`.

fn main() -> anyhow::Result<()> {
    palisade_devtools::fault_writer::main()
}
