//! The staging chunk planner: how a staged copy is cut into chunks and
//! which pinned buffer each chunk passes through. Pure CPU logic.

/// One chunk of a staged copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    /// Byte offset in the source and destination.
    pub offset: usize,
    /// Bytes in this chunk (never 0).
    pub len: usize,
    /// Which staging buffer carries it.
    pub buffer: usize,
}

/// Cuts `bytes` into chunks of at most `chunk_bytes`, assigned round-robin
/// to `buffers` staging buffers. Zero bytes give no chunks.
///
/// # Panics
/// Never: a zero `chunk_bytes` or `buffers` is treated as 1.
pub fn plan(bytes: usize, chunk_bytes: usize, buffers: usize) -> impl Iterator<Item = Chunk> {
    let chunk_bytes = chunk_bytes.max(1);
    let buffers = buffers.max(1);
    (0..bytes.div_ceil(chunk_bytes)).map(move |i| {
        let offset = i * chunk_bytes;
        Chunk { offset, len: chunk_bytes.min(bytes - offset), buffer: i % buffers }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_every_byte_once_in_order() {
        for bytes in [0usize, 1, 7, 4095, 4096, 4097, 1 << 20, (1 << 20) + 3] {
            for chunk in [1usize, 3, 4096, 1 << 20] {
                for buffers in [1usize, 2, 3] {
                    let chunks: Vec<_> = plan(bytes, chunk, buffers).collect();
                    let mut next = 0;
                    for (i, c) in chunks.iter().enumerate() {
                        assert_eq!(c.offset, next, "{bytes} {chunk} {buffers}");
                        assert!(c.len > 0 && c.len <= chunk);
                        assert_eq!(c.buffer, i % buffers);
                        next += c.len;
                    }
                    assert_eq!(next, bytes);
                    assert_eq!(chunks.len(), bytes.div_ceil(chunk));
                }
            }
        }
    }

    #[test]
    fn degenerate_parameters_do_not_panic() {
        assert_eq!(plan(10, 0, 0).count(), 10);
        assert_eq!(plan(0, 0, 0).count(), 0);
    }
}
