//! The staging chunk planner: how a staged copy is cut into chunks and
//! which pinned buffer each chunk passes through. Pure CPU logic.
//!
//! A staged copy is a two-stage pipeline (device to host on the source's
//! PCIe link, host to device on the destination's), so the first chunk's
//! first stage and the last chunk's second stage run alone. Every chunk also
//! costs a fixed amount: copy-engine time each way and a cross-device event
//! wait. A copy is therefore cut into nearly equal chunks of at most the
//! chunk size, and into at least [`MIN_CHUNKS`] where each can be
//! [`MIN_SPLIT`] bytes or more, so that a copy of a few chunks still overlaps
//! its two stages. (Chunks ramping up and back down cost more in their small
//! chunks than the ends they shortened.) Measured; see docs/measurements.md
//! and docs/experiments.md.

/// One chunk of a staged copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    /// Byte offset in the source and destination.
    pub offset: usize,
    /// Bytes in this chunk (never 0).
    pub len: usize,
    /// Which staging buffer carries it, counted from the transfer's first
    /// buffer (the caller rotates that start from transfer to transfer).
    pub buffer: usize,
}

/// Chunk boundaries fall on multiples of this (for chunks of at least 4 KiB):
/// a staged reduction launches a kernel per chunk on element pointers.
const ALIGN: usize = 256;

/// A copy is cut into at least this many chunks, where each can be at least
/// [`MIN_SPLIT`] bytes.
pub const MIN_CHUNKS: usize = 4;

/// No copy is cut into chunks smaller than this on purpose: the host's
/// enqueue of a chunk (two copies, two events, two waits) costs more than
/// smaller chunks save, and left smaller copies bound by the host (measured;
/// see docs/measurements.md).
pub const MIN_SPLIT: usize = 512 << 10;

/// Chunk lengths for `bytes`: nearly equal chunks of whole [`ALIGN`] units
/// (for chunks of at least 4 KiB), each at most `chunk_bytes`, at least
/// [`MIN_CHUNKS`] of them where each can be [`MIN_SPLIT`] bytes; the last
/// takes the remainder below one unit.
fn lengths(bytes: usize, chunk_bytes: usize) -> Vec<usize> {
    let unit = if chunk_bytes >= 4096 { ALIGN } else { 1 };
    let (units, rest) = (bytes / unit, bytes % unit);
    // The fewest pieces of whole units, as even as can be, of which none
    // is longer than `chunk_bytes`: the longest holds `ceil(units / pieces)`
    // units, at most `per`.
    let per = (chunk_bytes / unit).max(1);
    let pieces = bytes.div_ceil(chunk_bytes).max((bytes / MIN_SPLIT).min(MIN_CHUNKS)).max(units.div_ceil(per)).clamp(1, units.max(1));
    let v: Vec<usize> = (0..pieces).map(|i| (units / pieces + usize::from(i < units % pieces)) * unit).filter(|&l| l > 0).collect();
    with_rest(v, rest, chunk_bytes)
}

/// `pieces` with the `rest` below one unit added: onto the last piece
/// where it fits within `chunk_bytes`, else as a piece of its own.
fn with_rest(mut pieces: Vec<usize>, rest: usize, chunk_bytes: usize) -> Vec<usize> {
    match pieces.last_mut() {
        Some(last) if *last + rest <= chunk_bytes => *last += rest,
        _ if rest > 0 => pieces.push(rest),
        _ => {}
    }
    pieces
}

/// Cuts `bytes` into chunks of at most `chunk_bytes` (see the module docs),
/// assigned round-robin to `buffers` staging buffers from buffer 0. Zero
/// bytes give no chunks.
///
/// # Panics
/// Never: a zero `chunk_bytes` or `buffers` is treated as 1.
pub fn plan(bytes: usize, chunk_bytes: usize, buffers: usize) -> impl Iterator<Item = Chunk> {
    let chunk_bytes = chunk_bytes.max(1);
    let buffers = buffers.max(1);
    let lens = if bytes == 0 { Vec::new() } else { lengths(bytes, chunk_bytes) };
    let mut offset = 0;
    lens.into_iter().enumerate().map(move |(i, len)| {
        let c = Chunk { offset, len, buffer: i % buffers };
        offset += len;
        c
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cut as it was first written: one more piece at a time until
    /// none is too long (quadratic where `chunk_bytes` is not whole units).
    fn lengths_by_search(bytes: usize, chunk_bytes: usize) -> Vec<usize> {
        let unit = if chunk_bytes >= 4096 { ALIGN } else { 1 };
        let (units, rest) = (bytes / unit, bytes % unit);
        let mut pieces = bytes.div_ceil(chunk_bytes).max((bytes / MIN_SPLIT).min(MIN_CHUNKS)).clamp(1, units.max(1));
        let v = loop {
            let v: Vec<usize> = (0..pieces).map(|i| (units / pieces + usize::from(i < units % pieces)) * unit).collect();
            if v.iter().all(|&l| l <= chunk_bytes) || pieces >= units {
                break v.into_iter().filter(|&l| l > 0).collect::<Vec<_>>();
            }
            pieces += 1;
        };
        with_rest(v, rest, chunk_bytes)
    }

    #[test]
    fn the_cut_is_the_searched_one_without_the_search() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % m) as usize
        };
        for chunk in [1, 7, 255, 256, 4095, 4096, 4351, 5000, 65_537, 1 << 20, (4 << 20) + 1] {
            let most = if chunk < 4096 { 1 << 16 } else { 64 << 20 };
            for bytes in (0..300).chain((0..100).map(|_| next(most) + 1)) {
                assert_eq!(lengths(bytes, chunk), lengths_by_search(bytes, chunk), "{bytes} bytes in chunks of {chunk}");
            }
        }
        // A size the search took minutes for: whole, none too long.
        let v = lengths(8 << 30, 4351);
        assert_eq!(v.iter().sum::<usize>(), 8 << 30);
        assert!(v.iter().all(|&l| l <= 4351));
    }

    #[test]
    fn chunks_cover_every_byte_once_in_order() {
        for bytes in [0usize, 1, 7, 4095, 4096, 4097, 1 << 20, (1 << 20) + 3, 4_000_012, 16 << 20, (64 << 20) + 5, 100_000_007] {
            for chunk in [1usize, 3, 4096, 5000, 100_000, 1 << 20, 4 << 20] {
                if chunk < 4096 && bytes > 1 << 20 {
                    continue;
                }
                for buffers in [1usize, 2, 3] {
                    let chunks: Vec<_> = plan(bytes, chunk, buffers).collect();
                    let mut next = 0;
                    for (i, c) in chunks.iter().enumerate() {
                        assert_eq!(c.offset, next, "{bytes} {chunk} {buffers}");
                        if chunk >= 4096 {
                            assert_eq!(c.offset % ALIGN, 0, "{bytes} {chunk}: chunk {i} at {}", c.offset);
                        }
                        assert!(c.len > 0 && c.len <= chunk, "{bytes} {chunk}: chunk of {}", c.len);
                        assert_eq!(c.buffer, i % buffers);
                        next += c.len;
                    }
                    assert_eq!(next, bytes);
                    // Never more chunks than full-size ones would need, or
                    // MIN_CHUNKS, plus one for a remainder below 256 bytes.
                    let whole = if chunk >= 4096 { chunk & !(ALIGN - 1) } else { chunk };
                    assert!(chunks.len() <= bytes.div_ceil(whole).max(MIN_CHUNKS) + 1, "{bytes} {chunk}: {} chunks", chunks.len());
                }
            }
        }
    }

    #[test]
    fn copies_are_cut_in_nearly_equal_chunks() {
        let lens = |bytes: usize| plan(bytes, 4 << 20, 3).map(|c| c.len).collect::<Vec<_>>();
        assert_eq!(lens(16 << 20), vec![4 << 20; 4]);
        assert_eq!(lens(64 << 20), vec![4 << 20; 16]);
        // 17 chunks of whole 256-byte units, the remainder in the last.
        let v = lens((64 << 20) + 5);
        assert_eq!(v.len(), 17);
        assert!(v.iter().all(|l| ((64 << 20) / 17 - 256..=4 << 20).contains(l)), "{v:?}");
        assert_eq!(v.iter().sum::<usize>(), (64 << 20) + 5);
    }

    #[test]
    fn short_copies_are_cut_in_a_few_equal_chunks() {
        let lens = |bytes: usize| plan(bytes, 4 << 20, 3).map(|c| c.len).collect::<Vec<_>>();
        assert_eq!(lens(4 << 20), vec![1 << 20; 4]);
        assert_eq!(lens(2 << 20), vec![MIN_SPLIT; 4]);
        assert_eq!(lens(1 << 20), vec![MIN_SPLIT; 2]);
        assert_eq!(lens(MIN_SPLIT), vec![MIN_SPLIT]);
        assert_eq!(lens(100), vec![100]);
        assert_eq!(lens(900 << 10), vec![900 << 10]);
    }

    #[test]
    fn degenerate_parameters_do_not_panic() {
        assert_eq!(plan(10, 0, 0).count(), 10);
        assert_eq!(plan(0, 0, 0).count(), 0);
    }
}
