//! Ring schedules: which segment or chunk each rank pulls from its ring
//! predecessor at each step. Pure CPU logic, shared by every collective and
//! checked against a plain simulation in the tests.
//!
//! Every step is "rank r pulls from rank r-1 (mod N)" and either reduces the
//! pulled data into its own buffer or copies it. Ranks advance in lockstep
//! with their two ring neighbours, so a schedule is valid when, within one
//! step, no rank writes a region that its successor reads from it in the
//! same step (the tests check this).

use std::ops::Range;

/// What a rank does in one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// `own[part] = pulled[part] op own[part]` (pulled operand first).
    Reduce(usize),
    /// `own[part] = pulled[part]`.
    Copy(usize),
}

impl Action {
    /// The segment or chunk the action touches.
    pub fn part(self) -> usize {
        match self {
            Action::Reduce(p) | Action::Copy(p) => p,
        }
    }
}

/// Splits `count` elements into `parts` contiguous ranges, each start a
/// multiple of `align` elements (so 16-byte vector loads stay aligned).
/// Later parts may be empty when `count` is small.
pub fn partition(count: usize, parts: usize, align: usize) -> Vec<Range<usize>> {
    let parts = parts.max(1);
    let align = align.max(1);
    let per = count.div_ceil(parts).div_ceil(align) * align;
    (0..parts)
        .map(|i| {
            let start = (i * per).min(count);
            start..((i + 1) * per).min(count)
        })
        .collect()
}

fn wrap(x: isize, n: usize) -> usize {
    x.rem_euclid(n as isize) as usize
}

/// Ring all-reduce on `n` ranks over `n` segments: `n-1` reduce-scatter
/// steps, then `n-1` all-gather steps. `steps[k][r]` is rank r's action.
/// After the reduce-scatter, rank r holds the full reduction of segment
/// (r+1) mod n, combined in ring order starting at rank (r+1) mod n. Every
/// segment is reduced exactly once and then copied, so every rank ends
/// bitwise equal.
pub fn all_reduce(n: usize) -> Vec<Vec<Action>> {
    let mut steps = Vec::new();
    for s in 0..n.saturating_sub(1) {
        steps.push((0..n).map(|r| Action::Reduce(wrap(r as isize - 1 - s as isize, n))).collect());
    }
    for t in 0..n.saturating_sub(1) {
        steps.push((0..n).map(|r| Action::Copy(wrap(r as isize - t as isize, n))).collect());
    }
    steps
}

/// Ring all-gather on `n` ranks: rank r starts with block r and pulls block
/// (r-1-t) mod n at step t.
pub fn all_gather(n: usize) -> Vec<Vec<Action>> {
    (0..n.saturating_sub(1)).map(|t| (0..n).map(|r| Action::Copy(wrap(r as isize - 1 - t as isize, n))).collect()).collect()
}

/// Ring reduce-scatter on `n` ranks ending with block r on rank r: at step
/// s rank r reduces block (r-2-s) mod n. Out of place: the partial results
/// alternate between two buffers per rank (see [`partial_buffer`]).
pub fn reduce_scatter(n: usize) -> Vec<Vec<Action>> {
    (0..n.saturating_sub(1)).map(|s| (0..n).map(|r| Action::Reduce(wrap(r as isize - 2 - s as isize, n))).collect()).collect()
}

/// For [`reduce_scatter`] on `n` ranks: which of a rank's two partial
/// buffers step `s` writes (0: the output, 1: scratch), such that the last
/// step writes the output and no step writes the buffer its successor reads.
pub fn partial_buffer(n: usize, s: usize) -> usize {
    (n.saturating_sub(2) - s.min(n.saturating_sub(2))) % 2
}

/// Pipelined chain broadcast from `root` over `chunks` chunks: the rank at
/// chain position k >= 1 copies chunk g-(k-1) at step g.
/// `None` means the rank idles at that step.
pub fn broadcast(n: usize, root: usize, chunks: usize) -> Vec<Vec<Option<Action>>> {
    chain(n, chunks, |r| wrap(r as isize - root as isize, n), Action::Copy)
}

/// Pipelined chain reduce to `root` over `chunks` chunks: the chain starts
/// at root+1 and ends at root; the rank at chain position k >= 1 reduces
/// chunk g-(k-1) at step g into its partial buffer.
pub fn reduce(n: usize, root: usize, chunks: usize) -> Vec<Vec<Option<Action>>> {
    chain(n, chunks, |r| wrap(r as isize - root as isize - 1, n), Action::Reduce)
}

fn chain(n: usize, chunks: usize, position: impl Fn(usize) -> usize, act: fn(usize) -> Action) -> Vec<Vec<Option<Action>>> {
    if n < 2 || chunks == 0 {
        return Vec::new();
    }
    (0..chunks + n - 2)
        .map(|g| {
            (0..n)
                .map(|r| {
                    let k = position(r);
                    (k >= 1 && g + 1 >= k && g + 1 - k < chunks).then(|| act(g + 1 - k))
                })
                .collect()
        })
        .collect()
}

#[cfg(test)]
#[allow(clippy::needless_range_loop, clippy::type_complexity)] // simulations index ranks and parts
mod tests {
    use super::*;

    /// Each buffer part holds the ordered list of ranks whose inputs it sums.
    type Sym = Vec<Vec<usize>>;

    fn no_same_step_hazard(n: usize, step: &[Option<Action>], reads_from: impl Fn(usize, Action) -> usize) {
        for r in 0..n {
            let succ = (r + 1) % n;
            if let (Some(w), Some(a)) = (step[r], step[succ]) {
                if n > 1 && succ != r {
                    assert_ne!(w.part(), reads_from(succ, a), "rank {r} writes part its successor reads in the same step");
                }
            }
        }
    }

    fn simulate_all_reduce(n: usize) -> Vec<Sym> {
        let mut bufs: Vec<Sym> = (0..n).map(|r| vec![vec![r]; n]).collect();
        for step in all_reduce(n) {
            let opt: Vec<Option<Action>> = step.iter().copied().map(Some).collect();
            no_same_step_hazard(n, &opt, |_, a| a.part());
            let before = bufs.clone();
            for r in 0..n {
                let pred = (r + n - 1) % n;
                match step[r] {
                    Action::Reduce(p) => {
                        let mut v = before[pred][p].clone();
                        v.extend(&before[r][p]);
                        bufs[r][p] = v;
                    }
                    Action::Copy(p) => bufs[r][p] = before[pred][p].clone(),
                }
            }
        }
        bufs
    }

    #[test]
    fn all_reduce_reduces_every_segment_once_and_agrees() {
        for n in 1..=16 {
            let bufs = simulate_all_reduce(n);
            for p in 0..n {
                let mut seen = bufs[0][p].clone();
                seen.sort();
                assert_eq!(seen, (0..n).collect::<Vec<_>>(), "n={n} part {p}: {:?}", bufs[0][p]);
                for r in 1..n {
                    assert_eq!(bufs[r][p], bufs[0][p], "n={n}: ranks disagree on part {p} order");
                }
            }
            assert_eq!(all_reduce(n).len(), 2 * (n - 1));
        }
    }

    #[test]
    fn all_gather_delivers_every_block() {
        for n in 1..=16 {
            let mut have: Vec<Vec<Option<usize>>> = (0..n).map(|r| (0..n).map(|b| (b == r).then_some(r)).collect()).collect();
            for step in all_gather(n) {
                let opt: Vec<Option<Action>> = step.iter().copied().map(Some).collect();
                no_same_step_hazard(n, &opt, |_, a| a.part());
                let before = have.clone();
                for r in 0..n {
                    let p = step[r].part();
                    let got = before[(r + n - 1) % n][p];
                    assert!(got.is_some(), "n={n}: rank {r} pulls block {p} before its predecessor has it");
                    have[r][p] = got;
                }
            }
            for r in 0..n {
                assert_eq!(have[r], (0..n).map(Some).collect::<Vec<_>>());
            }
        }
    }

    #[test]
    fn reduce_scatter_ends_with_own_block_and_never_overwrites_a_read_buffer() {
        for n in 1..=16 {
            // partial[r][buffer] = (block, contributors)
            let mut partial: Vec<[Option<(usize, Vec<usize>)>; 2]> = vec![[None, None]; n];
            let steps = reduce_scatter(n);
            for (s, step) in steps.iter().enumerate() {
                let before = partial.clone();
                for r in 0..n {
                    let pred = (r + n - 1) % n;
                    let p = step[r].part();
                    let pulled = if s == 0 {
                        vec![pred] // the predecessor's untouched input
                    } else {
                        let (blk, v) = before[pred][partial_buffer(n, s - 1)].clone().expect("partial exists");
                        assert_eq!(blk, p, "n={n} s={s}: pulled the wrong block");
                        v
                    };
                    // The successor reads our buffer partial_buffer(s-1) at step s+1... and
                    // at this step reads partial_buffer(s-1) of ours: we must write the other one.
                    if s > 0 {
                        assert_ne!(partial_buffer(n, s), partial_buffer(n, s - 1));
                    }
                    let mut v = pulled;
                    v.push(r);
                    partial[r][partial_buffer(n, s)] = Some((p, v));
                }
            }
            if n >= 2 {
                assert_eq!(partial_buffer(n, n - 2), 0, "last step writes the output");
                for r in 0..n {
                    let (blk, mut v) = partial[r][0].clone().unwrap();
                    assert_eq!(blk, r);
                    v.sort();
                    assert_eq!(v, (0..n).collect::<Vec<_>>());
                }
            }
        }
    }

    #[test]
    fn chains_move_every_chunk_in_order() {
        for n in 1..=16 {
            for root in 0..n {
                for chunks in [1usize, 2, 5, 17] {
                    // broadcast: who has which chunk
                    let mut have: Vec<Vec<bool>> = (0..n).map(|r| vec![r == root; chunks]).collect();
                    for step in broadcast(n, root, chunks) {
                        no_same_step_hazard(n, &step, |_, a| a.part());
                        let before = have.clone();
                        for r in 0..n {
                            if let Some(a) = step[r] {
                                assert!(before[(r + n - 1) % n][a.part()], "n={n} root={root}: early pull");
                                have[r][a.part()] = true;
                            }
                        }
                    }
                    assert!(have.iter().all(|h| h.iter().all(|&x| x)), "n={n} root={root} chunks={chunks}");
                    // reduce: contributors per chunk
                    let mut acc: Vec<Vec<Vec<usize>>> = (0..n).map(|r| vec![vec![r]; chunks]).collect();
                    for step in reduce(n, root, chunks) {
                        no_same_step_hazard(n, &step, |_, a| a.part());
                        let before = acc.clone();
                        for r in 0..n {
                            if let Some(a) = step[r] {
                                let mut v = before[(r + n - 1) % n][a.part()].clone();
                                v.push(r);
                                acc[r][a.part()] = v;
                            }
                        }
                    }
                    for c in 0..chunks {
                        let mut v = acc[root][c].clone();
                        v.sort();
                        assert_eq!(v, (0..n).collect::<Vec<_>>(), "n={n} root={root} chunk {c}");
                    }
                }
            }
        }
    }

    #[test]
    fn partition_covers_counts_with_aligned_starts() {
        for n in 1..=16 {
            for count in (0..1000).chain([1 << 20, (1 << 24) + 3, 1_000_003]) {
                for align in [1usize, 4, 8, 16] {
                    let parts = partition(count, n, align);
                    assert_eq!(parts.len(), n);
                    let mut next = 0;
                    for p in &parts {
                        assert_eq!(p.start, next);
                        assert!(p.start % align == 0 || p.start == count);
                        next = p.end;
                    }
                    assert_eq!(next, count);
                }
            }
        }
    }
}
