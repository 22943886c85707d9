//! What the replica machine knows of its log: the generation of every record it holds, kept
//! as runs (one per change of generation), from its base to its end. The records themselves
//! live in the real log (`felix_storage::Log`, whose commit headers carry the same
//! generations) or in the simulator's disk; the machine only compares generations (rule 6),
//! so its memory does not grow with the log.
//!
//! The base is where retention cut the log (rule 10), or where a rebuild restarted it: the
//! records below it are committed (retention never passes the mark this replica learnt, and a
//! leader rebuilds a follower only at its own base), so they agree with every later leader's
//! and are never compared. Their generations are gone with them: a position at or below the
//! base has generation 0, below every real one, so such a position never ranks ahead of
//! another (rule 8) and never moves a mark (rule 7).

use std::ops::Range;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct GenLog {
    /// `(first offset, generation)`, first offsets increasing from `base`; a run lasts until
    /// the next one's first offset, or `end`. Adjacent runs differ in generation.
    runs: Vec<(u64, u64)>,
    base: u64,
    end: u64,
}

impl GenLog {
    /// A log holding one record per generation in `gens`, from offset 0.
    #[cfg(test)]
    pub(crate) fn from_gens(gens: impl IntoIterator<Item = u64>) -> GenLog {
        Self::from_gens_at(0, gens)
    }

    /// A log holding nothing below `base`, then one record per generation in `gens`.
    pub(crate) fn from_gens_at(base: u64, gens: impl IntoIterator<Item = u64>) -> GenLog {
        let mut l = GenLog::empty_at(base);
        for g in gens {
            l.push(g);
        }
        l
    }

    /// A log holding nothing, whose next record takes `base`.
    pub(crate) fn empty_at(base: u64) -> GenLog {
        GenLog {
            runs: Vec::new(),
            base,
            end: base,
        }
    }

    /// A log from its runs `(first offset, generation)`, from `base` up to `end` (what a real
    /// log's commit headers say). The first run must start at `base` and each next one later,
    /// with another generation.
    pub(crate) fn from_runs(
        runs: impl IntoIterator<Item = (u64, u64)>,
        base: u64,
        end: u64,
    ) -> Result<GenLog, String> {
        let runs: Vec<(u64, u64)> = runs.into_iter().collect();
        let starts_at_base = runs.first().map_or(end == base, |r| r.0 == base);
        let ordered = runs.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 != w[1].1);
        let inside = runs.last().is_none_or(|r| r.0 < end);
        if !(starts_at_base && ordered && inside && base <= end) {
            return Err(format!(
                "generation runs {runs:?} do not describe a log from {base} to {end}"
            ));
        }
        Ok(GenLog { runs, base, end })
    }

    /// The offset after the last record.
    pub(crate) fn end(&self) -> u64 {
        self.end
    }

    /// The first offset held: nothing below it is (see the module's docs).
    pub(crate) fn base(&self) -> u64 {
        self.base
    }

    /// The generation of the record at `offset`, which must be held (from the base, below
    /// the end).
    pub(crate) fn gen_at(&self, offset: u64) -> u64 {
        assert!(
            (self.base..self.end).contains(&offset),
            "offset {offset} outside the log {}..{}",
            self.base,
            self.end
        );
        let i = self.runs.partition_point(|r| r.0 <= offset);
        self.runs[i - 1].1
    }

    /// The generation of the record before `end`: a position's `last_gen`. 0 for an empty
    /// prefix, and for a position at or below the base (its record is gone).
    pub(crate) fn gen_before(&self, end: u64) -> u64 {
        if end <= self.base {
            return 0;
        }
        self.gen_at(end - 1)
    }

    /// The generations of the records in `r` (held).
    pub(crate) fn gens(&self, r: Range<u64>) -> Vec<u64> {
        r.map(|o| self.gen_at(o)).collect()
    }

    pub(crate) fn push(&mut self, gen: u64) {
        if self.runs.last().is_none_or(|r| r.1 != gen) {
            self.runs.push((self.end, gen));
        }
        self.end += 1;
    }

    /// Drop the records at `from` and above; `from` must not be below the base.
    pub(crate) fn truncate(&mut self, from: u64) {
        assert!(
            from >= self.base,
            "a cut at {from} below the base {}",
            self.base
        );
        if from >= self.end {
            return;
        }
        let keep = self.runs.partition_point(|r| r.0 < from);
        self.runs.truncate(keep);
        self.end = from;
    }

    /// Retention removed the records below `to` (at most the end): the base moves up to it.
    pub(crate) fn trim(&mut self, to: u64) {
        assert!(to <= self.end, "a trim to {to} past the end {}", self.end);
        if to <= self.base {
            return;
        }
        // The run holding `to` starts there now; the runs before it go.
        let k = self.runs.partition_point(|r| r.0 <= to);
        let held = (to < self.end).then(|| self.runs[k - 1].1);
        self.runs.drain(..k);
        if let Some(g) = held {
            self.runs.insert(0, (to, g));
        }
        self.base = to;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_answer_like_a_list_of_generations() {
        let gens = [1, 1, 2, 2, 2, 5, 1, 7];
        let mut l = GenLog::from_gens(gens);
        assert_eq!(l.end(), 8);
        for (o, g) in gens.iter().enumerate() {
            assert_eq!(l.gen_at(o as u64), *g);
        }
        assert_eq!(l.runs.len(), 5, "one run per change");
        assert_eq!(l.gens(2..6), vec![2, 2, 2, 5]);
        assert_eq!((l.gen_before(0), l.gen_before(3)), (0, 2));
        for cut in (0..=8).rev() {
            l.truncate(cut);
            assert_eq!(l, GenLog::from_gens(gens[..cut as usize].iter().copied()));
        }
        l.push(3);
        assert_eq!(l, GenLog::from_gens([3]));
        let l = GenLog::from_gens(gens);
        assert_eq!(GenLog::from_runs(l.runs.clone(), 0, 8), Ok(l));
        assert!(
            GenLog::from_runs([(1, 1)], 0, 3).is_err(),
            "not from the base"
        );
        assert!(
            GenLog::from_runs([(0, 1), (2, 1)], 0, 3).is_err(),
            "no change"
        );
        assert!(
            GenLog::from_runs([(0, 1), (3, 2)], 0, 3).is_err(),
            "past the end"
        );
        assert!(GenLog::from_runs([], 0, 3).is_err(), "records without runs");
        assert_eq!(GenLog::from_runs([], 0, 0), Ok(GenLog::default()));
        assert_eq!(GenLog::from_runs([], 4, 4), Ok(GenLog::empty_at(4)));
        assert!(GenLog::from_runs([], 5, 4).is_err(), "a base past the end");
    }

    /// A trimmed log answers like the same list of generations from its base on; below it,
    /// positions have generation 0, and it is never cut there.
    #[test]
    fn a_trimmed_log_holds_from_its_base() {
        let gens = [1, 1, 2, 2, 2, 5, 1, 7];
        for to in 0..=8u64 {
            let mut l = GenLog::from_gens(gens);
            l.trim(to);
            let want = GenLog::from_gens_at(to, gens[to as usize..].iter().copied());
            assert_eq!(l, want, "trimmed to {to}");
            assert_eq!((l.base(), l.end()), (to, 8));
            for o in to..8 {
                assert_eq!(l.gen_at(o), gens[o as usize]);
            }
            for e in 0..=to {
                assert_eq!(l.gen_before(e), 0, "a position at or below the base");
            }
            if to < 8 {
                assert_eq!(l.gen_before(to + 1), gens[to as usize]);
            }
            let runs = l.runs.clone();
            assert_eq!(GenLog::from_runs(runs, to, 8), Ok(l.clone()));
            l.trim(to / 2);
            assert_eq!(l.base(), to, "a trim never lowers the base");
            l.truncate(to);
            assert_eq!(l, GenLog::empty_at(to));
            l.push(9);
            assert_eq!((l.base(), l.end(), l.gen_at(to)), (to, to + 1, 9));
        }
    }
}
