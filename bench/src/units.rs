//! Sizes: the binary units and how they are written for people.

/// One KiB.
pub(crate) const KIB: usize = 1 << 10;
/// One MiB.
pub(crate) const MIB: usize = 1 << 20;
/// One GiB.
pub(crate) const GIB: usize = 1 << 30;

/// `bytes` for people: 4 KiB, 16 MiB, 1 GiB.
pub(crate) fn human(bytes: usize) -> String {
    match bytes {
        b if b >= GIB && b % GIB == 0 => format!("{} GiB", b / GIB),
        b if b >= MIB && b % MIB == 0 => format!("{} MiB", b / MIB),
        b if b >= KIB && b % KIB == 0 => format!("{} KiB", b / KIB),
        b => format!("{b} B"),
    }
}
