//! [`Comm::split`]: sub-communicators over subsets of the ranks.

use super::Comm;
use crate::error::{Error, Result};
use crate::ipc::{bootstrap::agree, Id};

impl Comm {
    /// Splits the ranks into sub-communicators, as `ncclCommSplit`: every
    /// rank calls it at the same time; the ranks that pass the same
    /// `color` form one communicator, ranked by `key` (ties by their rank
    /// here), on this rank's stream and with this communicator's options;
    /// a rank that passes `None` joins none and gets `Ok(None)`.
    ///
    /// Each new communicator meets through a rendezvous of its own, whose
    /// [`Id`] (with a new secret) its lowest rank makes ([`Id::new`]: the
    /// address of `CUDA_PEER_BIND_ADDR`, else this host's) and sends the
    /// others through this communicator's authenticated exchange; it has
    /// memory of its own (it does not share this one's). A failure on any
    /// rank before the new communicators meet fails every rank.
    pub fn split(&self, color: Option<u32>, key: u32) -> Result<Option<Comm>> {
        const STEP: &str = "Comm::split: colors and keys";
        let ex = self.exchange();
        let me = self.rank();
        let mine = match color {
            Some(c) => format!("{c} {key}"),
            None => format!("- {key}"),
        };
        let all = agree(ex, STEP, Ok(mine.into_bytes()))?;
        let parsed: Vec<(Option<u32>, u32)> = all.iter().enumerate().map(|(r, b)| parse(r, b)).collect::<Result<_>>()?;
        let members = members(&parsed, color);
        let leader = members.first() == Some(&me);
        let id = if leader { Id::new().map(Some) } else { Ok(None) };
        let ids = agree(
            ex,
            "Comm::split: the new rendezvous",
            id.as_ref().map(|i| i.as_ref().map(|i| i.as_bytes().to_vec()).unwrap_or_default()).map_err(Clone::clone),
        )?;
        let id = id?;
        let Some(_) = color else { return Ok(None) };
        let new_rank = members.iter().position(|&r| r == me).ok_or_else(|| Error::Internal("split: this rank is not among its color's".into()))?;
        let id = match id {
            Some(id) => id,
            None => Id::from_bytes(&ids[members[0]])?,
        };
        Comm::from_rank_with(self.stream().clone(), new_rank, members.len(), id, &self.opts).map(Some)
    }
}

/// Rank `r`'s published color and key.
fn parse(r: usize, b: &[u8]) -> Result<(Option<u32>, u32)> {
    let bad = || Error::Bootstrap { op: "Comm::split", reason: format!("rank {r} published a malformed color and key") };
    let text = std::str::from_utf8(b).map_err(|_| bad())?;
    let (c, k) = text.split_once(' ').ok_or_else(bad)?;
    let number = |s: &str| if !s.is_empty() && s.len() <= 10 && s.bytes().all(|b| b.is_ascii_digit()) { s.parse::<u32>().ok() } else { None };
    let key = number(k).ok_or_else(bad)?;
    let color = if c == "-" { None } else { Some(number(c).ok_or_else(bad)?) };
    Ok((color, key))
}

/// The ranks of `color`, in the new communicator's order (by key, then by
/// rank); none for `None`.
fn members(all: &[(Option<u32>, u32)], color: Option<u32>) -> Vec<usize> {
    let Some(c) = color else { return Vec::new() };
    let mut m: Vec<usize> = (0..all.len()).filter(|&r| all[r].0 == Some(c)).collect();
    m.sort_by_key(|&r| (all[r].1, r));
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_are_ordered_by_key_then_rank() {
        let all = [(Some(1), 5), (Some(0), 0), (Some(1), 2), (None, 0), (Some(1), 2)];
        assert_eq!(members(&all, Some(1)), vec![2, 4, 0]);
        assert_eq!(members(&all, Some(0)), vec![1]);
        assert_eq!(members(&all, None), Vec::<usize>::new());
    }

    #[test]
    fn published_colors_and_keys_parse_strictly() {
        assert_eq!(parse(0, b"3 7").unwrap(), (Some(3), 7));
        assert_eq!(parse(0, b"- 7").unwrap(), (None, 7));
        for bad in [&b""[..], b"3", b"3 ", b" 7", b"-3 7", b"3 +7", b"99999999999 1", b"3 7 8", b"\xff 1"] {
            assert!(matches!(parse(1, bad), Err(Error::Bootstrap { .. })), "{bad:?}");
        }
    }
}
