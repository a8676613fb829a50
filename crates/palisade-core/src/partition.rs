use crate::{PartitionId, TwinId};

/// Kafka's murmur2 hash (the Java client's `Utils.murmur2`), so that an HTTP
/// write and a Kafka record keyed by the same twin id land in one partition.
pub fn murmur2(data: &[u8]) -> u32 {
    const SEED: u32 = 0x9747_b28c;
    const M: u32 = 0x5bd1_e995;
    const R: u32 = 24;
    let len = data.len();
    // Kafka computes in Java's signed 32-bit ints; wrapping u32 arithmetic
    // gives the same bits. `len as u32` only truncates past 4 GiB, which no
    // twin id (bounded at 256 bytes) reaches.
    #[allow(clippy::cast_possible_truncation)]
    let mut h: u32 = SEED ^ (len as u32);
    let mut chunks = data.chunks_exact(4);
    for c in &mut chunks {
        let mut k = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> R;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let rest = chunks.remainder();
    if rest.len() == 3 {
        h ^= u32::from(rest[2]) << 16;
    }
    if rest.len() >= 2 {
        h ^= u32::from(rest[1]) << 8;
    }
    if !rest.is_empty() {
        h ^= u32::from(rest[0]);
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h
}

/// The partition of a twin: `toPositive(murmur2(key)) % partitions`, exactly
/// as Kafka's default partitioner places a record keyed by the twin id.
///
/// # Panics
/// If `partitions` is zero (the store refuses to be created with zero).
pub fn partition_for(twin: &TwinId, partitions: u32) -> PartitionId {
    assert!(partitions > 0, "a store has at least one partition");
    PartitionId((murmur2(twin.as_bytes()) & 0x7fff_ffff) % partitions)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reference values from the Java client's `UtilsTest.testMurmur2`
    /// (`Utils.murmur2(key.getBytes())`, as signed ints).
    #[test]
    fn murmur2_matches_kafka() {
        let cases: [(&str, i32); 6] = [
            ("21", -973_932_308),
            ("foobar", -790_332_482),
            ("a-little-bit-long-string", -985_981_536),
            ("a-little-bit-longer-string", -1_486_304_829),
            (
                "lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8",
                -58_897_971,
            ),
            ("abc", 479_470_107),
        ];
        for (key, want) in cases {
            #[allow(clippy::cast_possible_wrap)]
            let got = murmur2(key.as_bytes()) as i32;
            assert_eq!(got, want, "murmur2({key:?})");
        }
    }

    #[test]
    fn partition_is_stable_and_in_range() {
        let t = TwinId::new("device-7").unwrap();
        for n in [1, 2, 16, 64, 1000] {
            let p = partition_for(&t, n);
            assert!(p.0 < n);
            assert_eq!(p, partition_for(&t, n));
        }
    }
}
